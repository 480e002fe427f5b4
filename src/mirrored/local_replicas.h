// The machinery every strategy with several replicas in one process shares:
// one persistent thread per local replica, an in-process communicator group
// over them, a ReplicaContext per replica, merge_call, and run() with
// fail-fast abort. MirroredStrategy uses it as is; multi-worker and central
// storage build on it.
#pragma once

#include <memory>
#include <vector>

#include "allreduce/packed.h"
#include "core/device_scope.h"
#include "core/thread_pool.h"
#include "diststrat/device_manager.h"
#include "diststrat/strategy.h"

namespace diststrat {

class LocalReplicas;

class LocalReplicaContext : public ReplicaContext {
 public:
  LocalReplicaContext(LocalReplicas* owner, int local_id) : owner_(owner), local_id_(local_id) {}

  int replica_id() const override;
  int local_replica_id() const override { return local_id_; }
  int num_replicas_in_sync() const override;
  const Device& device() const override;
  Strategy& strategy() const override;
  void* stream() const override;

  void all_reduce(ReduceOp op, std::vector<Tensor>& tensors,
                  const std::vector<std::string>& names = {}) override;
  Tensor all_gather(const Tensor& t, const std::string& name = "") override;
  void barrier(const std::string& name = "") override;

  // The local group's communicator for this replica (host memory: barriers,
  // merge_call, CPU tensors).
  Communicator& local_comm() const;
  // The communicator for this replica's GPU buffers (NCCL, or the
  // shared-device reduction for logical GPUs of one physical GPU); null on CPU.
  Communicator* device_comm() const;

 protected:
  std::shared_ptr<void> merge_call_impl(
      const std::function<std::shared_ptr<void>(Strategy&)>& fn) override;

 private:
  LocalReplicas* owner_;
  int local_id_;
  PackedAllReduce packer_;
  Tensor device_pack_;  // GPU replicas' pack buffer (device memory)
};

// With GPU devices (all replicas on GPUs; CPU and GPU replicas do not mix),
// each replica gets its own stream and the group a device communicator:
// NCCL when every replica is on a different physical GPU, the shared-device
// reduction kernel when all are logical GPUs of one physical GPU. Each
// replica function runs inside an ExecScope for its device, and its stream is
// drained (with the communication timeout as deadline) before run() returns.
class LocalReplicas {
 public:
  // `gpus` is required when a device is a GPU.
  LocalReplicas(Strategy* strategy, std::vector<Device> devices, CommunicationOptions options,
                std::shared_ptr<DeviceManager> gpus = nullptr);
  ~LocalReplicas();

  Strategy& strategy() const { return *strategy_; }
  const std::vector<Device>& devices() const { return devices_; }
  int size() const { return static_cast<int>(devices_.size()); }
  const CommunicationOptions& options() const { return options_; }
  InProcessGroup& group() { return group_; }
  LocalReplicaContext& context(int i) { return *contexts_[i]; }
  bool on_gpu() const { return gpus_ != nullptr; }
  const std::shared_ptr<DeviceManager>& gpus() const { return gpus_; }
  // The scope replica i's function runs in (also usable from the main thread
  // for work on that replica's device, with its default stream).
  ExecScope scope(int i, bool with_stream = true) const;

  // Runs fn on every replica thread; aborts the others when one throws and
  // rethrows the first replica's own exception (not the aborts it caused).
  void run(const std::function<void(ReplicaContext&)>& fn);

 private:
  friend class LocalReplicaContext;
  Strategy* strategy_;
  std::vector<Device> devices_;
  CommunicationOptions options_;
  InProcessGroup group_;
  std::shared_ptr<DeviceManager> gpus_;           // null on CPU
  std::vector<void*> streams_;                    // per replica (GPU)
  std::vector<std::unique_ptr<Communicator>> device_comms_;
  ThreadPool pool_;
  std::vector<std::unique_ptr<LocalReplicaContext>> contexts_;
  // merge_call hand-off from local replica 0 to the others.
  std::shared_ptr<void> merge_result_;
  std::exception_ptr merge_error_;
};

// Checks a device list: non-empty, no duplicates.
void validate_devices(const std::vector<Device>& devices, const char* strategy_name);

}  // namespace diststrat
