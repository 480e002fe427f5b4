#include "diststrat/data.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "core/fnv1a.h"
#include "runtime/data_digest.h"
#include "runtime/data_source.h"
#include "runtime/determinism.h"
#include "diststrat/strategy.h"

namespace diststrat {

Dataset::Dataset(Tensor features, Tensor labels)
    : features_(std::move(features)), labels_(std::move(labels)) {
  DISTSTRAT_CHECK(features_.defined() && labels_.defined(), kInvalidArgument,
                  "Dataset: features and labels must both be given");
  DISTSTRAT_CHECK(features_.shape().rank() >= 1 && labels_.shape().rank() >= 1, kInvalidArgument,
                  "Dataset: features ", features_.debug_string(), " and labels ",
                  labels_.debug_string(), " need a row dimension");
  DISTSTRAT_CHECK_EQ(features_.shape()[0], labels_.shape()[0],
                     "Dataset rows of features vs labels");
}

Dataset Dataset::slice(int64_t begin, int64_t end) const {
  return Dataset(features_.slice_rows(begin, end), labels_.slice_rows(begin, end));
}

namespace {

// Four independent lanes of rotate-xor-multiply over 8-byte words (so that
// the multiplications overlap), each folded into the next. A rotate, unlike
// word-wise FNV, carries a change in a word's top bit into the low bits:
// two flipped signs do not cancel.
uint64_t digest_bytes(uint64_t seed, const unsigned char* p, size_t n) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  auto step = [](uint64_t h, uint64_t w) { return ((h << 23 | h >> 41) ^ w) * kMul; };
  uint64_t lane[4] = {seed, seed ^ 1, seed ^ 2, seed ^ 3};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, 32);
    for (int k = 0; k < 4; ++k) lane[k] = step(lane[k], w[k]);
  }
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    lane[0] = step(lane[0], w);
  }
  uint64_t tail = 0;
  std::memcpy(&tail, p + i, n - i);
  uint64_t h = step(step(step(step(lane[0], tail), lane[1]), lane[2]), lane[3]);
  // splitmix64's finaliser.
  h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
  h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
  return h ^ (h >> 31);
}

uint64_t tensor_digest(const Tensor& t) {
  Fnv1a seed;
  seed.text(dtype_name(t.dtype()));
  for (int64_t d : t.shape().dims()) seed.value<int64_t>(d);
  seed.value<uint64_t>(t.nbytes());
  if (!t.device().is_cpu() || t.nbytes() == 0) return seed.get();
  return digest_bytes(seed.get(), static_cast<const unsigned char*>(t.data()), t.nbytes());
}

}  // namespace

DatasetDigest dataset_digest(const Dataset& dataset) {
  DatasetDigest d;
  if (dataset.features().defined()) d.features = tensor_digest(dataset.features());
  if (dataset.labels().defined()) d.labels = tensor_digest(dataset.labels());
  return d;
}

int64_t InputContext::per_replica_batch_size() const {
  DISTSTRAT_CHECK(num_replicas_in_sync > 0, kInvalidArgument, "InputContext without replicas");
  DISTSTRAT_CHECK(global_batch_size % num_replicas_in_sync == 0, kInvalidArgument, "global batch ",
                  global_batch_size, " is not divisible by ", num_replicas_in_sync, " replicas");
  return global_batch_size / num_replicas_in_sync;
}

namespace {
// The host slice, or its copy on the replica's device (made once; each
// replica touches only its own entry, so no lock is needed); with input on
// the device, the slice there.
const Tensor& replica_slice(const std::vector<Tensor>& host, std::vector<Tensor>& cache,
                            DeviceBatch* device_batch, bool labels, const ReplicaContext& ctx,
                            int first_local_shard, const char* what) {
  const bool sharded = first_local_shard >= 0;
  DISTSTRAT_CHECK(sharded == (ctx.virtual_shard() >= 0), kInvalidArgument, what,
                  ": a batch distributed ", sharded ? "with" : "without",
                  " determinism mode's virtual shards read from a replica ",
                  sharded ? "without" : "with", " them");
  // A batch of another strategy's dataset would hand this replica a slice
  // cut for another number of replicas (rows lost or counted twice).
  const int local = ctx.strategy().num_local_replicas();
  DISTSTRAT_CHECK(sharded || host.empty() || host.size() == static_cast<size_t>(local),
                  kInvalidArgument, what, ": the batch holds slices for ", host.size(),
                  " local replicas, but replica ", ctx.replica_id(), "'s strategy has ", local,
                  " (a batch of another strategy's dataset?)");
  const size_t i = static_cast<size_t>(sharded ? ctx.virtual_shard() - first_local_shard
                                               : ctx.local_replica_id());
  if (device_batch) return device_batch->get(i, ctx, labels, what);
  DISTSTRAT_CHECK_LT(i, host.size(), what, ": local replica");
  if (ctx.device().is_cpu() || host[i].device() == ctx.device()) return host[i];
  DISTSTRAT_CHECK_EQ(cache.size(), host.size(), what, ": device cache");
  if (!cache[i].defined()) {
    // Overwritten whole by the copy (no memset); the copy is staged
    // through pinned memory and does not wait for the device.
    Tensor t = Tensor::uninitialized(host[i].shape(), host[i].dtype(), ctx.device());
    t.copy_from(host[i]);
    cache[i] = t;
  }
  return cache[i];
}
}  // namespace

const Tensor& DistributedBatch::features(const ReplicaContext& ctx) const {
  return replica_slice(features_, device_features_, device_batch_.get(), false, ctx,
                       first_local_shard_, "DistributedBatch::features");
}
const Tensor& DistributedBatch::labels(const ReplicaContext& ctx) const {
  return replica_slice(labels_, device_labels_, device_batch_.get(), true, ctx, first_local_shard_,
                       "DistributedBatch::labels");
}

DistributedDataset::DistributedDataset(std::shared_ptr<Source> source)
    : source_(std::move(source)) {
  reshuffle();
}

int64_t DistributedDataset::num_batches() const {
  if (!source_) return 0;
  const int64_t rows = source_->total_rows();
  const int64_t b = source_->batch_rows();
  // Not (rows + b - 1) / b: a batch near INT64_MAX (a user's --batch) would
  // overflow it into 0 batches.
  return rows / b + (!source_->options.drop_remainder && rows % b != 0 ? 1 : 0);
}

int64_t DistributedDataset::global_batch_size() const {
  return source_ ? source_->global_batch : 0;
}
int64_t DistributedDataset::num_rows() const { return source_ ? source_->total_rows() : 0; }
DistributeOptions DistributedDataset::options() const {
  return source_ ? source_->options : DistributeOptions{};
}

void DistributedDataset::set_epoch(int64_t epoch) {
  epoch_ = epoch;
  reshuffle();
}

void DistributedDataset::reshuffle() {
  if (!source_) return;  // empty
  // A new vector, not the old one changed: batches (and input on the
  // device) may still hold the old order.
  auto order = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(source_->total_rows()));
  std::iota(order->begin(), order->end(), 0);
  if (source_->options.shuffle) {
    std::mt19937_64 g(source_->options.seed * 1000003ull + static_cast<uint64_t>(epoch_));
    // Fisher-Yates with our own index draws, identical on every platform.
    for (size_t i = order->size(); i > 1; --i) {
      const size_t j = static_cast<size_t>(g() % i);
      std::swap((*order)[i - 1], (*order)[j]);
    }
  }
  order_ = std::move(order);
}

size_t row_bytes(const Tensor& t) {
  size_t bytes = dtype_size(t.dtype());
  for (size_t i = 1; i < t.shape().rank(); ++i) bytes *= static_cast<size_t>(t.shape()[i]);
  return bytes;
}

void copy_rows(char* dst, const Tensor& src, const int64_t* rows, int64_t n) {
  if (n == 0) return;
  const int64_t total = src.shape()[0];
  const size_t rb = row_bytes(src);
  const char* s = static_cast<const char*>(src.data());
  for (int64_t i = 0; i < n; ++i) {
    DISTSTRAT_CHECK(rows[i] >= 0 && rows[i] < total, kInternal, "row ", rows[i], " out of range");
    std::memcpy(dst + i * rb, s + rows[i] * rb, rb);
  }
}

namespace {
// Copies rows `rows` of `src` into a new tensor.
Tensor gather_rows(const Tensor& src, const int64_t* rows, int64_t n) {
  std::vector<int64_t> dims = src.shape().dims();
  dims[0] = n;
  Tensor out(Shape(dims), src.dtype(), src.device());
  if (n) copy_rows(static_cast<char*>(out.data()), src, rows, n);
  return out;
}

// The parts of batch i of a source (its numbering of the moment): which
// rows of the epoch's order each local replica, or each local shard in
// determinism mode, gets. Sets *rows to the batch's rows and *first_shard
// to this process's first shard (-1 without shards).
std::vector<FeedPart> plan_batch(const DistributedDataset::Source& s, int64_t i, int64_t* rows,
                                 int* first_shard) {
  const int64_t b = s.batch_rows();
  const int64_t begin = i * b;
  const int64_t n = std::min<int64_t>(b, s.total_rows() - begin);
  *rows = n;
  *first_shard = -1;
  std::vector<FeedPart> parts;
  // Part `part` of the batch's n rows cut into `parts` (even_part), read by
  // local replica `replica`.
  const auto take_part = [&](int64_t count, int64_t part, int replica) {
    int64_t lo = 0, len = 0;
    even_part(n, count, part, &lo, &len);
    parts.push_back(FeedPart{replica, begin + lo, len});
  };
  if (s.virtual_shards > 0) {
    // Determinism mode: the n rows are cut into V shards (shard_rows' cut,
    // the same on any number of replicas), and each local replica takes its
    // range of shards.
    *first_shard =
        shards_of_replica(s.first_local_replica, s.num_replicas_in_sync, s.virtual_shards).first;
    for (int l = 0; l < s.num_local_replicas; ++l) {
      const ShardRange mine =
          shards_of_replica(s.first_local_replica + l, s.num_replicas_in_sync, s.virtual_shards);
      for (int shard = mine.first; shard < mine.first + mine.count; ++shard) {
        take_part(s.virtual_shards, shard, l);
      }
    }
  } else {
    // The batch's n rows are split as evenly as possible over the replicas
    // this source feeds; the first n % R replicas get one extra row.
    for (int l = 0; l < s.num_local_replicas; ++l) take_part(s.replicas_fed(), s.fed_index(l), l);
  }
  return parts;
}
}  // namespace

DistributedBatch DistributedDataset::batch(int64_t i) const {
  DISTSTRAT_CHECK(0 <= i && i < num_batches(), kInvalidArgument, "DistributedDataset: batch ", i,
                  " of ", num_batches(), source_ ? "" : " (an empty DistributedDataset)");
  Source s = *source_;
  if (s.live) {  // an elastic group: its numbering of the moment
    s.num_replicas_in_sync = s.live->num_replicas_in_sync();
    s.first_local_replica = s.live->first_local_replica();
    s.num_workers = s.live->cluster().num_workers;
  }
  int64_t n = 0;
  DistributedBatch out;
  const std::vector<FeedPart> parts = plan_batch(s, i, &n, &out.first_local_shard_);
  out.index_ = i;
  out.first_local_replica_ = s.first_local_replica;
  out.global_size_ = s.global_rows_of_batch(n);
  if (s.feed && !s.live) {
    // Input on the device: the parts are (or will be) there.
    if (s.feed->on_device()) {
      out.device_batch_ = s.feed->on_device_batch(order_, parts);
    } else {
      const int64_t batches = num_batches();
      out.device_batch_ = s.feed->prefetched(order_, i, batches, [&](int64_t j) {
        int64_t rows = 0;
        int shard = -1;
        return plan_batch(s, j, &rows, &shard);
      });
    }
    return out;
  }
  for (const FeedPart& p : parts) {
    const int64_t* rows = order_->data() + p.begin;
    out.features_.push_back(gather_rows(s.data.features(), rows, p.rows));
    out.labels_.push_back(gather_rows(s.data.labels(), rows, p.rows));
  }
  out.device_features_.resize(out.features_.size());
  out.device_labels_.resize(out.labels_.size());
  return out;
}

}  // namespace diststrat
