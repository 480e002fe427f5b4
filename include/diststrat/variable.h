// Distributed variables. A Variable is a handle (cheap to copy) to a variable
// that a Strategy created and keeps in sync: mirrored copies on every device,
// one host copy, or shards on parameter servers, depending on the strategy.
//
// Rules: read() is replica context (inside run(), the replica's own
// ReplicaContext) and never communicates. value() and assign() are
// cross-replica context, not concurrent with run(); for sync-on-read
// variables under multi-worker they are collective (every worker, same
// order) and bounded by the strategy's timeout. Handles are cheap to copy;
// copying one does not copy the variable.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "diststrat/tensor.h"

namespace diststrat {

class Strategy;
class ReplicaContext;

// How copies are kept in sync (tf.VariableSynchronization).
enum class VariableSynchronization {
  kOnWrite,  // mirrored: every write updates every copy; reads are local
  kOnRead,   // per-replica: each replica writes its own copy; reading in
             // cross-replica context aggregates them (metrics, BN statistics)
};

// How per-replica values are combined (tf.VariableAggregation).
enum class VariableAggregation { kNone, kSum, kMean, kOnlyFirstReplica };

// Sync-on-read (kOnRead) variables, the same under every strategy and any
// number of replicas and workers (TensorFlow's rules):
//  - in replica context each replica reads and writes its own copy
//    (Variable::read);
//  - value() (cross-replica) aggregates the copies of every replica in sync:
//    kSum adds them, kMean averages them, kOnlyFirstReplica (and kNone)
//    returns global replica 0's copy;
//  - assign(x) (cross-replica) writes the copies so that value() == x:
//    kSum puts x into global replica 0's copy and zeros into the others
//    (TensorFlow writes x / num_replicas_in_sync into each; both sum to x,
//    this way exactly, in every dtype and summation order); kMean and
//    kOnlyFirstReplica write x into every copy;
//  - so a checkpoint, which saves value(), restores (by assign) to the same
//    aggregate, also onto another replica or worker count.
// kOnRead variables cannot be trainable (InvalidArgumentError), and
// ParameterServerStrategy does not support them (UnimplementedError).
struct VariableOptions {
  VariableSynchronization synchronization = VariableSynchronization::kOnWrite;
  // For kOnRead variables: how value() combines the replicas' copies
  // (kNone is treated as kOnlyFirstReplica).
  VariableAggregation aggregation = VariableAggregation::kNone;
  // Whether optimizers may update it (false for counters and statistics;
  // must be false for kOnRead).
  bool trainable = true;
};

// Fills a freshly allocated tensor. Must be deterministic for a given seed:
// strategies that mirror variables rely on identical initial values (the
// multi-process ones also broadcast from the chief).
using Initializer = std::function<void(Tensor&)>;

namespace init {
struct Zeros {
  void operator()(Tensor& t) const;
};
struct Constant {
  double value = 0.0;
  void operator()(Tensor& t) const;
};
// Uniform(-limit, limit), limit = sqrt(6 / (fan_in + fan_out)); fan_in is the
// product of all dims but the last, fan_out the last dim (Keras' convention).
struct GlorotUniform {
  uint64_t seed = 0;
  void operator()(Tensor& t) const;
};
struct RandomNormal {
  double mean = 0.0;
  double stddev = 0.05;
  uint64_t seed = 0;
  void operator()(Tensor& t) const;
};
}  // namespace init

class Variable {
 public:
  struct Impl;  // defined inside the library (src/runtime/variable_impl.h)
  Variable() = default;
  explicit Variable(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  const std::string& name() const;
  const Shape& shape() const;
  DType dtype() const;
  const VariableOptions& options() const;

  // This replica's copy (mirrored), the single host copy (central storage) or
  // the worker's local cache (parameter server). Writes through it are
  // visible to this replica only (mirrored) or to all (central storage): use
  // an optimizer or Strategy::update to change mirrored variables.
  Tensor read(const ReplicaContext& ctx) const;
  // Cross-replica read: for kOnWrite the (identical) value; for kOnRead the
  // aggregate of every replica's copy (see VariableOptions). Returns a new
  // host tensor. Blocks; for kOnRead under multi-worker a collective that
  // every worker calls. Not thread-safe with run().
  Tensor value() const;
  // Cross-replica write: afterwards value() == `value` (kOnRead: see
  // VariableOptions). Blocks; InvalidArgumentError on a shape or dtype
  // mismatch. Not thread-safe with run().
  void assign(const Tensor& value);

  // Implementation access for strategies and optimizers (Impl is opaque to
  // users).
  Impl& impl() const;
  const std::shared_ptr<Impl>& impl_ptr() const { return impl_; }

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace diststrat
