// The machinery every strategy with several replicas in one process shares:
// one persistent thread per local replica, an in-process communicator group
// over them, a ReplicaContext per replica, merge_call, and run() with
// fail-fast abort. MirroredStrategy uses it as is; multi-worker and central
// storage build on it.
#pragma once

#include <memory>
#include <vector>

#include "allreduce/packed.h"
#include "core/thread_pool.h"
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

  void all_reduce(ReduceOp op, std::vector<Tensor>& tensors,
                  const std::vector<std::string>& names = {}) override;
  Tensor all_gather(const Tensor& t, const std::string& name = "") override;
  void barrier(const std::string& name = "") override;

  // The local group's communicator for this replica.
  Communicator& local_comm() const;

 protected:
  std::shared_ptr<void> merge_call_impl(
      const std::function<std::shared_ptr<void>(Strategy&)>& fn) override;

 private:
  LocalReplicas* owner_;
  int local_id_;
  PackedAllReduce packer_;
};

class LocalReplicas {
 public:
  LocalReplicas(Strategy* strategy, std::vector<Device> devices, CommunicationOptions options);

  Strategy& strategy() const { return *strategy_; }
  const std::vector<Device>& devices() const { return devices_; }
  int size() const { return static_cast<int>(devices_.size()); }
  const CommunicationOptions& options() const { return options_; }
  InProcessGroup& group() { return group_; }
  LocalReplicaContext& context(int i) { return *contexts_[i]; }

  // Runs fn on every replica thread; aborts the others when one throws and
  // rethrows the first replica's own exception (not the aborts it caused).
  void run(const std::function<void(ReplicaContext&)>& fn);

 private:
  friend class LocalReplicaContext;
  Strategy* strategy_;
  std::vector<Device> devices_;
  CommunicationOptions options_;
  InProcessGroup group_;
  ThreadPool pool_;
  std::vector<std::unique_ptr<LocalReplicaContext>> contexts_;
  // merge_call hand-off from local replica 0 to the others.
  std::shared_ptr<void> merge_result_;
  std::exception_ptr merge_error_;
};

// Checks a device list: non-empty, no duplicates.
void validate_devices(const std::vector<Device>& devices, const char* strategy_name);

}  // namespace diststrat
