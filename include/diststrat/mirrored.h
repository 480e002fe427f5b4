// MirroredStrategy: one process, many devices, synchronous. Every variable has
// a copy on every device; each step's gradients are all-reduced across the
// replicas and every copy applies the same update, so copies stay identical.
// On CPU a "device" is a persistent worker thread; replicas all-reduce in the
// shared address space (each reduces its slice straight out of its peers').
// On GPUs (Device::gpu(i), logical indices of the DeviceManager) each replica
// has its own stream, float variables live in device memory (integer ones,
// like the optimizer's step counter, stay in host memory as TensorFlow keeps
// int32 on the host), gradients are all-reduced with NCCL, or with a device
// kernel for logical GPUs sharing one physical GPU, and the strategy holds the
// host-wide lease on its GPUs while the DeviceManager lives.
//
// Rules: those of every strategy (strategy.h). One process: nothing here
// waits for another process; replicas wait for each other in their
// collectives, bounded by options.communication.timeout.
#pragma once

#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "diststrat/device_manager.h"
#include "diststrat/strategy.h"

namespace diststrat {

struct MirroredOptions {
  // Replica devices. Empty = every visible GPU, or one CPU device if none.
  std::vector<Device> devices;
  // Timeout, algorithm and fusion settings for the replicas' collectives.
  CommunicationOptions communication;
  // Logger level (DISTSTRAT_LOG_LEVEL overrides).
  LogLevel log_level = LogLevel::kWarning;
  // GPU configuration, memory and leases. Null = a DeviceManager with default
  // GpuOptions, created when GPUs are used. Share one between strategies that
  // use the same GPUs.
  std::shared_ptr<DeviceManager> device_manager;
  // Log the device of every variable, collective and op
  // (DISTSTRAT_LOG_DEVICE_PLACEMENT=1 overrides).
  bool log_device_placement = false;
  // ZeRO-1: shard optimizer slots over the replicas (reduce-scatter the
  // gradients, each replica updates its block, all-gather the variables;
  // see Optimizer::apply_sharded and docs/training.md). CPU or GPU
  // replicas (on GPUs the blocks live in device memory).
  bool shard_optimizer_state = false;
  // The same bits on any number of replicas (off by default;
  // diststrat/determinism.h, docs/determinism.md).
  DeterminismOptions determinism;
};

// A step of MirroredStrategy::compile: one replica's step on `batch`. It
// must read its inputs through `batch` only (features(ctx), labels(ctx)).
// It may return a tensor on the replica's device (a loss, per-row losses) or
// an undefined Tensor; compile() also takes a function returning void.
using StepFunction = std::function<Tensor(ReplicaContext& ctx, const DistributedBatch& batch)>;

// How MirroredStrategy::compile captures a step (GPU replicas).
struct CaptureOptions {
  // Calls with a given global batch size that run eagerly before that size
  // is captured: the warm-up that creates the optimizer's slots, the
  // allocator's blocks and cuBLAS's workspace (capture must not create them).
  int warmup_steps = 2;
  // Batch sizes captured at most (a graph each, holding its memory); a call
  // with another size runs eagerly.
  int max_graphs = 4;
};

// A step function compiled by MirroredStrategy::compile. Call it once per
// step with the step's batch; it runs the step on every replica as run()
// does (a numbered step, same error rules). Not thread-safe. It refers to
// the strategy, the optimizer and the variables the step used: destroy it
// before them.
class CompiledStep {
 public:
  CompiledStep() = default;
  // Runs one step on `batch`: eagerly while its batch size warms up, then
  // captured once, then replayed. Blocks like run() (returns once the work
  // is enqueued on GPU replicas). Throws what run() throws; a step that
  // capture cannot hold throws FailedPreconditionError (or the backend's
  // error) naming the operation, and later calls of that size run eagerly.
  // Returns what the function returned on each replica (undefined tensors
  // for a function returning void): on a replay, a copy of the captured
  // output made on the device right after the replay (each step's value is
  // its own; read it when logging, as a loss of run()).
  PerReplica<Tensor> operator()(const DistributedBatch& batch);

  // What the calls did so far (this process).
  struct Stats {
    int64_t eager_steps = 0;  // run as run() runs them (warm-up, CPU, other sizes)
    int64_t captures = 0;     // steps that were captured (and ran)
    int64_t replays = 0;      // steps replayed from a capture
    // Of the last capture, per replica: its graphs, and the host work
    // between them (device collectives wait on the host, so a step is split
    // around each: graphs = collectives + 1).
    int graphs_per_step = 0;
    int host_boundaries = 0;
  };
  Stats stats() const;

  struct Impl;

 private:
  friend class MirroredStrategy;
  explicit CompiledStep(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

class MirroredStrategy : public Strategy {
 public:
  explicit MirroredStrategy(MirroredOptions options = {});
  explicit MirroredStrategy(std::vector<Device> devices);
  ~MirroredStrategy() override;

  std::string name() const override { return "mirrored"; }
  int num_replicas_in_sync() const override;
  const std::vector<Device>& devices() const override;
  void apply_gradients(ReplicaContext& ctx, Optimizer& optimizer,
                       const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) override;
  void update(Variable& var, const std::function<void(Tensor&)>& fn) override;
  // The DeviceManager of a GPU strategy (null on CPU).
  std::shared_ptr<DeviceManager> device_manager() const;
  // A step captured into CUDA graphs and replayed, in the spirit of
  // tf.function (issue 44 item 2; docs/gpu.md "Captured steps"). A compiled
  // step takes its batch as an argument, as tf.function takes its inputs,
  // because a replay does not run `fn`: the batch's rows are copied into the
  // static input buffers the capture read (run()'s lambda hides its batch,
  // so run() itself cannot be replayed). Per global batch size: the first
  // options.warmup_steps calls run eagerly, the next is captured (each
  // replica's work recorded from its stream, then run), later ones replay
  // it. The optimizer's step counter, learning-rate schedule and Adam's bias
  // correction advance on every replay (device scalars written before each
  // launch); the last, partial batch of an epoch gets its own capture (or
  // runs eagerly past max_graphs). Replays give the bits eager steps give.
  // Host work inside the step is not repeated by replays: the step must not
  // read the device, copy from host memory or decide on the host (clipping,
  // loss scaling: refused with FailedPreconditionError naming the
  // operation). On CPU replicas, and in determinism mode, every call runs
  // eagerly. Call from the thread that owns the strategy.
  // `fn(ctx, batch)` returns void or a Tensor on the replica's device.
  template <typename F>
  CompiledStep compile(F fn, CaptureOptions options = {}) {
    using R = std::invoke_result_t<F&, ReplicaContext&, const DistributedBatch&>;
    if constexpr (std::is_void_v<R>) {
      return compile_step(
          [fn](ReplicaContext& ctx, const DistributedBatch& batch) mutable {
            fn(ctx, batch);
            return Tensor();
          },
          options);
    } else {
      return compile_step(StepFunction(std::move(fn)), options);
    }
  }
  CompiledStep compile_step(StepFunction fn, CaptureOptions options = {});

  struct Impl;

 protected:
  // GPU variables are copied to host memory for value().
  Tensor variable_value(const Variable::Impl& var) const override;
  void assign_variable(Variable::Impl& var, const Tensor& value) override;
  void run_replicas(const std::function<void(ReplicaContext&)>& fn) override;
  void place_variable(Variable::Impl& var, const Initializer& init) override;
  Tensor reduce_tensors_across(ReduceOp op, const std::vector<Tensor>& local) override;
  Tensor gather_across(const std::vector<Tensor>& local) override;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace diststrat
