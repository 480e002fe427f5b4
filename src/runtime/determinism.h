// Determinism mode's machinery in the runtime (diststrat/determinism.h,
// docs/determinism.md): which virtual shards a real replica computes, and the
// context a shard's call of the step function sees.
#pragma once

#include <cstdint>
#include <functional>
#include <iterator>
#include <type_traits>
#include <utility>
#include <vector>

#include "diststrat/strategy.h"

namespace diststrat {

// A contiguous range of virtual shards [first, first + count).
struct ShardRange {
  int first = 0;
  int count = 0;
};

// The shards of `replica` among `replicas` when `shards` are spread over
// them: as evenly as possible, the first shards % replicas replicas one more,
// each a contiguous range in replica order (so a gather by replica is a
// gather in shard order).
ShardRange shards_of_replica(int replica, int replicas, int shards);

// Part `part` of `total` items cut into `parts` contiguous parts as evenly as
// possible, the first total % parts parts one item more: [begin, begin + len).
// The one rule behind shards_of_replica, shard_rows and the split of a batch's
// rows over replicas (data.cc).
void even_part(int64_t total, int64_t parts, int64_t part, int64_t* begin, int64_t* len);

// The rows [begin, begin + len) of a batch of `rows` rows that shard `shard`
// of `shards` holds: the same cut whatever the replicas (the first
// rows % shards shards one row more).
void shard_rows(int64_t rows, int shards, int shard, int64_t* begin, int64_t* len);

// One rank-0 tensor per value, of the values' DType (dtype_of): the form the
// tensor reductions take host scalars in. `values`: a std::vector or a
// PerReplica.
template <typename Values>
std::vector<Tensor> scalar_tensors(const Values& values) {
  using T = std::decay_t<decltype(*std::begin(values))>;
  std::vector<Tensor> out;
  out.reserve(values.size());
  for (const T& v : values) {
    Tensor t(Shape{}, dtype_of<T>());
    t.data<T>()[0] = v;
    out.push_back(std::move(t));
  }
  return out;
}

// What one shard's call of the step function sees: its shard as replica id,
// V replicas in sync, and otherwise its real replica (local id, device,
// stream, variable copies). Collectives are refused: the shards of one real
// replica run one after another, so a collective from a shard could not
// meet its peers.
class ShardContext : public ReplicaContext {
 public:
  ShardContext(ReplicaContext& real, int shard, int shards, ShardRange local)
      : real_(real), shard_(shard), shards_(shards), local_(local) {}

  int replica_id() const override { return shard_; }
  int local_replica_id() const override { return real_.local_replica_id(); }
  int num_replicas_in_sync() const override { return shards_; }
  const Device& device() const override { return real_.device(); }
  Strategy& strategy() const override { return real_.strategy(); }
  void* stream() const override { return real_.stream(); }
  int virtual_shard() const override { return shard_; }

  void all_reduce(ReduceOp op, std::vector<Tensor>& tensors,
                  const std::vector<std::string>& names = {}) override;
  Tensor all_gather(const Tensor& t, const std::string& name = "") override;
  void barrier(const std::string& name = "") override;

  // The real replica's context (the library's collectives run on it).
  ReplicaContext& real() const { return real_; }
  // This real replica's shards; whether this call computes its last one.
  ShardRange local_shards() const { return local_; }
  bool is_last() const { return shard_ == local_.first + local_.count - 1; }

 protected:
  std::shared_ptr<void> merge_call_impl(
      const std::function<std::shared_ptr<void>(Strategy&)>& fn) override;

 private:
  ReplicaContext& real_;
  int shard_, shards_;
  ShardRange local_;
};

// The real replica's context for gradients that are already the sum over
// every replica in sync, the same bits on each (determinism mode's exact sum
// of the shards): a kSum all-reduce leaves them as they are; everything else
// is the real context's. Handed to a strategy whose apply_gradients combines
// the replicas' gradients by nothing but kSum all-reduces on its context
// (sums_gradients_on_context), it saves that all-reduce.
class SummedContext : public ReplicaContext {
 public:
  explicit SummedContext(ReplicaContext& real) : real_(real) {}

  int replica_id() const override { return real_.replica_id(); }
  int local_replica_id() const override { return real_.local_replica_id(); }
  int num_replicas_in_sync() const override { return real_.num_replicas_in_sync(); }
  const Device& device() const override { return real_.device(); }
  Strategy& strategy() const override { return real_.strategy(); }
  void* stream() const override { return real_.stream(); }

  void all_reduce(ReduceOp op, std::vector<Tensor>& tensors,
                  const std::vector<std::string>& names = {}) override;
  Tensor all_gather(const Tensor& t, const std::string& name = "") override {
    return real_.all_gather(t, name);
  }
  void barrier(const std::string& name = "") override { real_.barrier(name); }

  // The real replica's context (a strategy's own collectives run on it).
  ReplicaContext& real() const { return real_; }

 protected:
  std::shared_ptr<void> merge_call_impl(
      const std::function<std::shared_ptr<void>(Strategy&)>& fn) override {
    return real_.merge_call(fn);
  }

 private:
  ReplicaContext& real_;
};

// `ctx`, or the real context a SummedContext wraps.
inline ReplicaContext& unwrap_summed(ReplicaContext& ctx) {
  auto* summed = dynamic_cast<SummedContext*>(&ctx);
  return summed ? summed->real() : ctx;
}

// Whether `s`'s apply_gradients combines the replicas' gradients by kSum
// all-reduces on the replica's context alone: MirroredStrategy and
// MultiWorkerMirroredStrategy (with ZeRO-1, Optimizer::apply_sharded takes
// its block as a slice of the sum instead of a reduce-scatter). Not
// CentralStorageStrategy, whose reduce-to-one adds every replica's
// gradients in a merge_call: it gets the sum from replica 0 and zeros from
// the others (x + 0 is exact).
bool sums_gradients_on_context(const Strategy& s);

// The option determinism mode refuses, an error naming it: 16-bit wire
// compression (it would round the exact sum).
void check_determinism_options(const DeterminismOptions& determinism,
                               const CommunicationOptions& communication, const std::string& who);

// Calls fn once per shard of the real replica `real`, in shard order.
void run_shards(ReplicaContext& real, int shards, const std::function<void(ReplicaContext&)>& fn);

}  // namespace diststrat
