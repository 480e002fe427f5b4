// Determinism mode in the runtime (diststrat/determinism.h): the virtual
// shards of each real replica, the context of a shard's call, and the
// reductions of run()'s per-shard values. Every reduction here combines the
// V values in shard order after gathering them, so its rounding does not
// depend on how the shards were spread over replicas and workers.
#include "runtime/determinism.h"

#include <algorithm>
#include <cstring>

#include "allreduce/reduce_kernels.h"
#include "core/user_text.h"

namespace diststrat {

void even_part(int64_t total, int64_t parts, int64_t part, int64_t* begin, int64_t* len) {
  const int64_t base = total / parts, extra = total % parts;
  *begin = part * base + std::min(part, extra);
  *len = base + (part < extra ? 1 : 0);
}

ShardRange shards_of_replica(int replica, int replicas, int shards) {
  int64_t first = 0, count = 0;
  even_part(shards, replicas, replica, &first, &count);
  ShardRange r;
  r.first = static_cast<int>(first);
  r.count = static_cast<int>(count);
  return r;
}

void shard_rows(int64_t rows, int shards, int shard, int64_t* begin, int64_t* len) {
  even_part(rows, shards, shard, begin, len);
}

namespace {
[[noreturn]] void refuse_collective(const char* call, int shard) {
  throw_error(ErrorCode::kFailedPrecondition,
              std::string("ReplicaContext::") + call + " from virtual shard " +
                  std::to_string(shard) +
                  " (determinism mode): the shards of a replica run one after another, so a "
                  "collective cannot meet its peers; return the value from the step function "
                  "and reduce it with Strategy::reduce, and apply gradients with "
                  "Optimizer::apply_gradients");
}
}  // namespace

void ShardContext::all_reduce(ReduceOp, std::vector<Tensor>&, const std::vector<std::string>&) {
  refuse_collective("all_reduce", shard_);
}
Tensor ShardContext::all_gather(const Tensor&, const std::string&) {
  refuse_collective("all_gather", shard_);
}
void ShardContext::barrier(const std::string&) { refuse_collective("barrier", shard_); }
std::shared_ptr<void> ShardContext::merge_call_impl(
    const std::function<std::shared_ptr<void>(Strategy&)>&) {
  refuse_collective("merge_call", shard_);
}

void SummedContext::all_reduce(ReduceOp op, std::vector<Tensor>& tensors,
                               const std::vector<std::string>& names) {
  if (op == ReduceOp::kSum) return;  // every replica holds the sum already
  real_.all_reduce(op, tensors, names);
}

bool sums_gradients_on_context(const Strategy& s) {
  return s.name() == "mirrored" || s.name() == "multi_worker";
}

void run_shards(ReplicaContext& real, int shards, const std::function<void(ReplicaContext&)>& fn) {
  const int replicas = real.strategy().num_replicas_in_sync();
  // An elastic group may grow past the shards after its strategy was made.
  DISTSTRAT_CHECK(replicas <= shards, kFailedPrecondition, "determinism.virtual_shards ", shards,
                  " is fewer than the ", replicas,
                  " replicas in sync now (each replica computes at least one shard; an elastic "
                  "group must stay at or below ",
                  shards, " replicas: ElasticOptions::max_workers)");
  const ShardRange r = shards_of_replica(real.replica_id(), replicas, shards);
  for (int s = r.first; s < r.first + r.count; ++s) {
    ShardContext ctx(real, s, shards, r);
    fn(ctx);
  }
}

void check_determinism_options(const DeterminismOptions& determinism,
                               const CommunicationOptions& communication, const std::string& who) {
  if (!determinism.enabled()) return;
  DISTSTRAT_CHECK(communication.compression == Compression::kNone, kInvalidArgument, who,
                  ": determinism.virtual_shards ", determinism.virtual_shards, " with ",
                  communication.compression == Compression::kFloat16 ? "float16" : "bfloat16",
                  " wire compression: the exact sum of the shards would be rounded to 16 bits on "
                  "the wire, differently for each split; turn one of them off");
}

// ---- Strategy's part -------------------------------------------------------

void Strategy::enable_determinism(const DeterminismOptions& options, const std::string& who) {
  if (!options.enabled()) {
    DISTSTRAT_CHECK(options.virtual_shards == 0, kInvalidArgument, who,
                    ": determinism.virtual_shards ", options.virtual_shards,
                    " must be 0 (off) or positive");
    return;
  }
  DISTSTRAT_CHECK(options.virtual_shards >= num_replicas_in_sync(), kInvalidArgument, who,
                  ": determinism.virtual_shards ", options.virtual_shards, " is fewer than the ",
                  num_replicas_in_sync(),
                  " replicas in sync (each replica computes at least one shard)");
  for (const Device& d : devices()) {
    DISTSTRAT_CHECK(d.is_cpu(), kUnimplemented, who, ": determinism mode on ", d.to_string(),
                    " (CPU replicas only so far: docs/determinism.md)");
  }
  determinism_ = options;
}

int Strategy::num_local_values() const {
  if (!determinism_.enabled()) return num_local_replicas();
  int n = 0;
  for (int l = 0; l < num_local_replicas(); ++l)
    n += shards_of_replica(first_local_replica() + l, num_replicas_in_sync(),
                           determinism_.virtual_shards)
             .count;
  return n;
}

size_t Strategy::value_slot(const ReplicaContext& ctx) const {
  if (ctx.virtual_shard() < 0) return static_cast<size_t>(ctx.local_replica_id());
  const ShardRange first =
      shards_of_replica(first_local_replica(), num_replicas_in_sync(), determinism_.virtual_shards);
  return static_cast<size_t>(ctx.virtual_shard() - first.first);
}

void Strategy::check_value_count(const std::string& what, size_t n) const {
  const size_t want = static_cast<size_t>(num_local_values());
  DISTSTRAT_CHECK(n == want, kInvalidArgument, what, ": the PerReplica values hold ", n,
                  n == 1 ? " value" : " values", ", but this ", name(), " strategy has ", want,
                  determinism_.enabled() ? " local virtual shards (one value per shard"
                                         : " local replicas (one value per local replica",
                  ", as run() returns)");
}

namespace {
// Each local replica's values (per shard, in order) as one tensor [count, ...]
// so that gather_across returns all V in shard order.
std::vector<Tensor> per_replica_rows(const Strategy& s, const std::vector<Tensor>& shard_values) {
  std::vector<Tensor> out;
  size_t k = 0;
  const int V = s.determinism().virtual_shards;
  for (int l = 0; l < s.num_local_replicas(); ++l) {
    const ShardRange r =
        shards_of_replica(s.first_local_replica() + l, s.num_replicas_in_sync(), V);
    const Tensor& proto = shard_values[k];
    std::vector<int64_t> dims{r.count};
    for (int64_t d : proto.shape().dims()) dims.push_back(d);
    Tensor t{Shape(dims), proto.dtype()};
    for (int i = 0; i < r.count; ++i, ++k) {
      const Tensor& v = shard_values[k];
      DISTSTRAT_CHECK(v.shape() == proto.shape() && v.dtype() == proto.dtype(), kInvalidArgument,
                      "reduce in determinism mode: shard values differ: ", v.debug_string(), " vs ",
                      proto.debug_string());
      std::memcpy(static_cast<char*>(t.data()) + i * v.nbytes(), v.data(), v.nbytes());
    }
    out.push_back(t);
  }
  return out;
}

// Folds the rows of `all` [V, ...] in order: ((v0 op v1) op v2) ...
Tensor fold_rows(const Tensor& all, ReduceOp op, int V) {
  std::vector<int64_t> dims(all.shape().dims().begin() + 1, all.shape().dims().end());
  Tensor out{Shape(dims), all.dtype()};
  const size_t bytes = out.nbytes(), count = static_cast<size_t>(out.num_elements());
  std::memcpy(out.data(), all.data(), bytes);
  const ReduceOp step = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  for (int i = 1; i < V; ++i)
    kernels::accumulate(out.data(), static_cast<const char*>(all.data()) + i * bytes, count,
                        out.dtype(), step);
  if (op == ReduceOp::kMean) kernels::scale_mean(out.data(), count, out.dtype(), V);
  return out;
}
}  // namespace

Tensor Strategy::reduce_shard_tensors(ReduceOp op, const std::vector<Tensor>& values) {
  const Tensor all = gather_across(per_replica_rows(*this, values));
  return fold_rows(all, op, determinism_.virtual_shards);
}

double Strategy::reduce_shard_values(ReduceOp op, const std::vector<double>& values) {
  return reduce_shard_tensors(op, scalar_tensors(values)).data<double>()[0];
}

int64_t Strategy::reduce_shard_ints(ReduceOp op, const std::vector<int64_t>& values) {
  return reduce_shard_tensors(op, scalar_tensors(values)).data<int64_t>()[0];
}

}  // namespace diststrat
