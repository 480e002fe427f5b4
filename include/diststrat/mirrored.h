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

#include <memory>
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
