// The machinery every strategy with several replicas in one process shares:
// one persistent thread per local replica, an in-process communicator group
// over them, a ReplicaContext per replica, merge_call, and run() with
// fail-fast abort. MirroredStrategy uses it as is; multi-worker and central
// storage build on it.
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "runtime/variable_impl.h"
#include "allreduce/packed.h"
#include "core/device_scope.h"
#include "core/thread_pool.h"
#include "diststrat/device_manager.h"
#include "diststrat/strategy.h"

namespace diststrat {

struct LocalReplicasCore;

class LocalReplicaContext : public ReplicaContext {
 public:
  LocalReplicaContext(LocalReplicasCore* owner, int local_id)
      : owner_(owner), local_id_(local_id) {}

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
  LocalReplicasCore* owner_;
  int local_id_;
  PackedAllReduce packer_;
  Tensor device_pack_;  // GPU replicas' pack buffer (device memory)
};

// What the replica threads use during a step: devices, communicators,
// contexts, merge_call slots. Held by shared_ptr, co-owned by each step's
// task, so a replica thread that is abandoned mid-step (stuck) never touches
// freed memory of it after the strategy is destroyed (LocalReplicas::run).
struct LocalReplicasCore {
  LocalReplicasCore(Strategy* strategy, std::vector<Device> devices, CommunicationOptions options);
  ~LocalReplicasCore();  // destroys the GPU streams
  LocalReplicasCore(const LocalReplicasCore&) = delete;
  LocalReplicasCore& operator=(const LocalReplicasCore&) = delete;

  int size() const { return static_cast<int>(devices.size()); }
  ExecScope scope(int i, bool with_stream) const;
  // GPU replicas: at most this many of a replica's steps are in flight when
  // run() returns (the host waits for the oldest beyond it).
  static constexpr size_t kMaxStepsInFlight = 2;
  // The end of replica i's step on its thread (GPU): marks the step on the
  // stream, waits (bounded) for the step kMaxStepsInFlight before it, and
  // reads the replica's device checks when kMaxPending have piled up.
  void end_step(int i);
  // From the strategy's thread between steps: waits (bounded) for every
  // replica's enqueued work and reads its device checks; throws the first
  // error (after trying every replica).
  void synchronize();
  // Aborts replica i's communicators (its peers' pending collectives throw).
  void abort_all(int i, const std::string& why);

  Strategy* strategy;
  // The strategy's replica numbering, copied by run() before each step so
  // contexts do not read the strategy object from replica threads.
  int first_replica = 0;
  int num_in_sync = 1;
  std::vector<Device> devices;
  CommunicationOptions options;
  InProcessGroup group;
  std::shared_ptr<DeviceManager> gpus;  // null on CPU
  std::vector<void*> streams;           // per replica (GPU)
  // Per replica (GPU): its device checks, the events marking the ends of
  // its steps still in flight (oldest first) and spare ones.
  std::vector<std::shared_ptr<DeviceChecks>> checks;
  std::vector<std::deque<void*>> in_flight;
  std::vector<std::vector<void*>> spare_events;
  std::atomic<int64_t> step{-1};  // the step run() runs (steps_run() - 1)
  std::vector<std::unique_ptr<Communicator>> device_comms;
  std::vector<std::unique_ptr<LocalReplicaContext>> contexts;
  // merge_call hand-off from local replica 0 to the others. Replica 0
  // rethrows its own exception; the others throw a copy made from the plain
  // code and message, so no exception object is shared between threads.
  std::shared_ptr<void> merge_result;
  bool merge_failed = false;
  bool merge_error_is_error = false;  // a diststrat::Error (else: what() below)
  ErrorCode merge_code = ErrorCode::kInternal;
  std::string merge_message;
};

// With GPU devices (all replicas on GPUs; CPU and GPU replicas do not mix),
// each replica gets its own stream and the group a device communicator:
// NCCL when every replica is on a different physical GPU, the shared-device
// reduction kernel when all are logical GPUs of one physical GPU. Each
// replica function runs inside an ExecScope for its device. run() returns
// once a GPU step's work is enqueued, with at most kMaxStepsInFlight steps
// of each replica in flight; reads of device values, synchronize() and the
// device checks wait for the work (each wait bounded by the timeout).
class LocalReplicas {
 public:
  // `gpus` is required when a device is a GPU.
  LocalReplicas(Strategy* strategy, std::vector<Device> devices, CommunicationOptions options,
                std::shared_ptr<DeviceManager> gpus = nullptr);

  Strategy& strategy() const { return *core_->strategy; }
  const std::vector<Device>& devices() const { return core_->devices; }
  int size() const { return core_->size(); }
  const CommunicationOptions& options() const { return core_->options; }
  InProcessGroup& group() { return core_->group; }
  LocalReplicaContext& context(int i) { return *core_->contexts[static_cast<size_t>(i)]; }
  bool on_gpu() const { return core_->gpus != nullptr; }
  const std::shared_ptr<DeviceManager>& gpus() const { return core_->gpus; }
  // The scope replica i's function runs in (also usable from the main thread
  // for work on that replica's device, with its default stream).
  ExecScope scope(int i, bool with_stream = true) const { return core_->scope(i, with_stream); }

  // Runs fn on every replica thread; aborts the others when one throws and
  // rethrows the first replica's own exception (not the aborts it caused).
  // The replica threads run a copy of fn and co-own the core: a replica that
  // is stuck and abandoned (see ThreadPool) keeps both alive; what fn itself
  // captures by reference is the caller's.
  void run(const std::function<void(ReplicaContext&)>& fn);
  // LocalReplicasCore::synchronize (no-op on CPU replicas).
  void synchronize() { core_->synchronize(); }

  // The local replica whose device is `d`; throws InvalidArgumentError.
  int replica_of(const Device& d) const;
  // A host copy of `t` (a clone when it is already in host memory). GPU
  // tensors are copied in replica_of(t.device())'s scope on its default
  // stream, so this works from the main thread and from any replica thread.
  // Blocks until the copy is done.
  Tensor to_host(const Tensor& t) const;
  // Host views of per-replica results: GPU tensors copied, host ones as they are.
  std::vector<Tensor> to_host(const std::vector<Tensor>& ts) const;
  // Makes var.copies: one copy of `initial` (host) per replica on its device;
  // integer variables (step counters) stay in host memory on GPU replicas,
  // as TensorFlow keeps int32 on the host. Returns once `initial` is read
  // (the device copies are enqueued, from pinned staging).
  void place_copies(Variable::Impl& var, const Tensor& initial) const;
  // Calls fn on copies[i] in replica i's scope (default stream), from the
  // main thread: cross-replica writes of per-replica copies. Blocks.
  void for_each_copy(std::vector<Tensor>& copies, const std::function<void(Tensor&)>& fn) const;

 private:
  std::shared_ptr<LocalReplicasCore> core_;
  ThreadPool pool_;
};

// "MirroredStrategy", "CentralStorageStrategy", ... for error messages.
std::string strategy_display_name(const Strategy& s);

// Checks a device list: non-empty, no duplicates.
void validate_devices(const std::vector<Device>& devices, const char* strategy_name);

// A variable read on a replica whose variables stay in host memory (central
// storage, parameter-server worker caches): on a GPU replica, a copy of the
// floating `stored` on `device` made on the replica's stream (call it on the
// replica thread); otherwise `stored` itself. Returns once `stored` is read
// (Tensor::copy_from host -> device: the copy itself is enqueued).
Tensor read_on_replica_device(const Tensor& stored, const Device& device);

// Replaces a GPU tensor by a host copy made in the calling thread's scope
// (on a replica thread: after the work queued on its stream); host tensors
// are left as they are. Blocks until the copy is done.
void stage_to_host(Tensor& t);

// The device defaults every local-replica strategy shares: an empty list
// means every visible GPU (through `manager`, created if null), else one CPU
// device; the list is validated; a manager is created when a GPU is listed
// and dropped when none is (CPU replicas take no GPU and no lease). Without a
// GPU backend or GPU, listing Device::gpu(i) fails later with the manager's
// NotFound/Unimplemented error.
void resolve_replica_devices(std::vector<Device>& devices, std::shared_ptr<DeviceManager>& manager,
                             const char* strategy_name);

}  // namespace diststrat
