// CentralStorageStrategy: one process, several compute replicas, and exactly
// one copy of each variable, kept in host memory (TensorFlow's
// tf.distribute.experimental.CentralStorageStrategy).
//
// Each step every replica reads the single copy (Variable::read returns the
// same storage on every replica; sync-on-read variables, which hold
// per-replica state, have one copy per replica as under MirroredStrategy),
// computes its gradients, and
// apply_gradients reduces them to one (reduce-to-one: the per-replica
// gradients are summed into one host buffer, no all-reduce) and updates the
// single copy once, with the optimizer's slots and step counter also held
// once. The update runs in merge_call on local replica 0 while the others
// wait, so it is the only writer.
//
// GPU compute replicas (TensorFlow's CentralStorageStrategy on a multi-GPU
// machine): the variables stay in host memory, one copy. Variable::read on a
// GPU replica returns a device copy of the host value, made on the replica's
// stream when read (the value at that point of the step: writes to it are
// not seen by the host copy; change variables with an optimizer,
// Strategy::update or assign). apply_gradients copies each replica's
// gradients to host memory, sums them there and updates once on the host
// (the CPU update rule). Integer variables are read in host memory, as on
// MirroredStrategy.
//
// Thread safety: like every strategy, run() is not reentrant; variables may
// be read by all replicas concurrently inside run(), and apply_gradients must
// be called by every replica (it blocks until the update is done).
#pragma once

#include <memory>
#include <vector>

#include "diststrat/strategy.h"

namespace diststrat {

class DeviceManager;

struct CentralStorageOptions {
  // Compute replicas. Empty = every visible GPU, or one CPU device if none.
  std::vector<Device> devices;
  // Where the variables live. Only CPU (host memory, the default) is
  // implemented; TensorFlow puts them on the single GPU when there is exactly
  // one compute device, which is not supported here (UnimplementedError).
  Device parameter_device = Device::cpu(0);
  // GPU configuration and leases for GPU compute devices (see
  // device_manager.h); created when a GPU is listed and none is given.
  std::shared_ptr<DeviceManager> device_manager;
  // Timeout and fusion settings for the replicas' collectives (merge_call,
  // ReplicaContext::all_reduce).
  CommunicationOptions communication;
  // Logger level (DISTSTRAT_LOG_LEVEL overrides).
  LogLevel log_level = LogLevel::kWarning;
  // The same bits on any number of replicas (off by default;
  // diststrat/determinism.h, docs/determinism.md).
  DeterminismOptions determinism;
};

class CentralStorageStrategy : public Strategy {
 public:
  explicit CentralStorageStrategy(CentralStorageOptions options = {});
  explicit CentralStorageStrategy(std::vector<Device> devices);
  ~CentralStorageStrategy() override;

  std::string name() const override { return "central_storage"; }
  int num_replicas_in_sync() const override;
  const std::vector<Device>& devices() const override;
  // The device the variables live on.
  const Device& parameter_device() const;
  // Reduce-to-one of the replicas' gradients, then one optimizer update of
  // the single copy. Blocking; every local replica must call it with the same
  // variables in the same order.
  void apply_gradients(ReplicaContext& ctx, Optimizer& optimizer,
                       const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) override;

  void update(Variable& var, const std::function<void(Tensor&)>& fn) override;
  // The GPU manager of GPU compute replicas; null on CPU.
  std::shared_ptr<DeviceManager> device_manager() const;

  struct Impl;

 protected:
  // On a GPU replica: a device copy of the host value (floating variables).
  // Sync-on-read variables: the replica's own copy.
  Tensor read_variable(const Variable::Impl& var, const ReplicaContext& ctx) const override;
  void assign_variable(Variable::Impl& var, const Tensor& value) override;
  void run_replicas(const std::function<void(ReplicaContext&)>& fn) override;
  void place_variable(Variable::Impl& var, const Initializer& init) override;
  Tensor reduce_tensors_across(ReduceOp op, const std::vector<Tensor>& local) override;
  Tensor gather_across(const std::vector<Tensor>& local) override;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace diststrat
