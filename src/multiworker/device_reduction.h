// MultiWorkerMirroredStrategy's GPU gradients across processes through one
// NCCL communicator (GpuReduction, diststrat/multi_worker_mirrored.h),
// reached through the GpuBackend seam (src/multiworker does not include
// src/gpu).
//
// Set-up (collective over the host process group `cross`, every rank
// deciding alike): each process says whether it can take part (one GPU
// replica, a backend with NCCL, not elastic, no wire compression) and which
// physical GPU it has; NCCL serves only when every process can and no two
// processes share a physical GPU (NCCL refuses duplicate devices: logical
// GPUs of one card in several processes stay host-staged). Rank 0 makes the
// unique id and broadcasts it over `cross`; every rank makes its
// communicator (rank = process rank) on a communication stream of its own.
//
// A fused call (FusionEngine::device_all_reduce_async): the replica records
// an event behind the gradients' producers on its stream; the engine's
// thread, after the signature exchange, makes the communication stream wait
// for that event, packs each multi-tensor pack into a device bucket
// (device-to-device copies on the communication stream; a pack of one tensor
// is reduced in place), all-reduces it with NCCL (bounded by the
// communication timeout: past it, or on an NCCL error, the communicator is
// aborted), unpacks, and makes the replica's stream wait for an event behind
// all of it before the call's Work completes, so the update the replica
// enqueues next runs after the reduction. NCCL does not say which peer is
// missing: after a failed collective every rank meets the others at a
// barrier of the host process group, whose deadline error names the rank
// that never came; the error thrown carries both.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "diststrat/collective.h"
#include "diststrat/multi_worker_mirrored.h"
#include "diststrat/strategy.h"
#include "multiworker/fusion.h"

namespace diststrat {

class GpuBackend;

class DeviceReduction {
 public:
  // Collective over `cross` when a device in `devices` is a GPU and
  // options.gpu_reduction is not kHostStaged (else returns null at once).
  // Returns the reduction, or null with `why` saying why host staging
  // serves; throws FailedPreconditionError on every rank when
  // options.gpu_reduction is kNccl and NCCL cannot serve.
  static std::unique_ptr<DeviceReduction> create(Communicator& cross,
                                                 const std::vector<Device>& devices,
                                                 const MultiWorkerOptions& options,
                                                 int replicas_in_sync, std::string* why);
  ~DeviceReduction();
  DeviceReduction(const DeviceReduction&) = delete;
  DeviceReduction& operator=(const DeviceReduction&) = delete;

  // From the replica's thread: `tensors` (on this process's GPU) are
  // produced by work enqueued on `replica_stream`; reduced in place across
  // processes. Non-blocking; the Work completes once the replica's stream
  // is ordered after the reduction.
  Work all_reduce_async(FusionEngine& engine, ReduceOp op, std::vector<Tensor> tensors,
                        std::vector<std::string> names, void* replica_stream);
  // ZeRO-1's collectives (FusionEngine::reduce_scatter_async /
  // all_gather_async) on the devices: `in` and `out` on this process's GPU,
  // `in` produced on `replica_stream`. Non-blocking, like all_reduce_async.
  Work reduce_scatter_async(FusionEngine& engine, ReduceOp op, Tensor in, Tensor out,
                            std::string name, void* replica_stream);
  Work all_gather_async(FusionEngine& engine, Tensor in, Tensor out, std::string name,
                        void* replica_stream);
  // Aborts the communicator (a collective in flight fails at once).
  void abort(const std::string& reason);

 private:
  DeviceReduction() = default;
  // On the engine's thread.
  void reduce(Communicator& cross, ReduceOp op, std::vector<Tensor>& tensors,
              const std::vector<FusionPack>& packs, void* ready, void* replica_stream);
  void sharded(Communicator& cross, bool scatter, ReduceOp op, const Tensor& in, Tensor& out,
               const std::string& name, void* ready, void* replica_stream);
  // The replica's stream waits for everything enqueued on the
  // communication stream so far.
  void order_replica_after(void* replica_stream);
  std::shared_ptr<void> ready_event(void* replica_stream);
  void* bucket(size_t bytes);
  [[noreturn]] void fail(Communicator& cross, const std::string& what, const std::exception& e);

  std::shared_ptr<DeviceManager> gpus_;  // keeps the backend alive
  GpuBackend* backend_ = nullptr;
  int ordinal_ = 0;
  int rank_ = 0;
  int replicas_in_sync_ = 1;
  CommunicationOptions options_;
  void* comm_stream_ = nullptr;
  std::unique_ptr<Communicator> nccl_;
  void* bucket_ = nullptr;  // engine thread only
  size_t bucket_bytes_ = 0;
};

}  // namespace diststrat
