// MultiWorkerMirroredStrategy: synchronous training across processes (one
// per host or several per host, launched by mpirun), each with one or more
// local devices; every variable is mirrored on every device of every process.
//
//   ```cpp fragment mpi
//   // mpirun -np 2 ./train
//   ds::MultiWorkerMirroredStrategy strategy;          // cluster from mpirun / TF_CONFIG
//   // ... the same loop as under MirroredStrategy ...
//   ```
//
// - num_replicas_in_sync() = local devices summed over the workers.
// - create_variable broadcasts the chief's (worker 0's) initial value to every
//   worker, so all start from the same weights whatever the initializer.
// - distribute() gives each worker only its own replicas' rows of every
//   global batch; DistributedBatch::global_size() is the true global count
//   (also for a short final batch).
// - Gradients (Optimizer::apply_gradients, ReplicaContext::all_reduce[_async])
//   go through a fusion engine: reverse creation order, packed into buffers of
//   CommunicationOptions::bytes_per_pack, reduced by a background thread
//   hierarchically (local replicas in-process, then across processes: inside
//   a node, then across nodes, then back), with optional f16/bf16 wire
//   compression. Ranks compare a signature of every call first: different
//   tensors on different ranks are an InvalidArgumentError on every rank that
//   names the first differing tensor and the ranks, not wrong numbers. The
//   signature includes the step (the run() index; in an elastic group the
//   group's, counted from ElasticState::position.step), so a rank that skips
//   or repeats a step's calls fails at its first mispaired call ("ranks are
//   in different steps"), even with the same tensors every step.
// - Every wait has options.communication.timeout as deadline; a rank that
//   stops participating makes the others fail with DeadlineExceededError
//   naming it. After a deadline or abort the strategy must be recreated.
// - Construction is collective and bounded by the same deadline: a rank
//   whose set-up fails (TF_CONFIG, cluster checks) makes every rank's
//   constructor throw at once (AbortedError naming it on the others). A
//   strategy destroyed while an exception propagates does not wait for its
//   peers: it aborts its communicators, and peers waiting in a collective
//   fail with AbortedError quoting the error (docs/multi_worker.md,
//   "Set-up and tear-down").
//
// Thread safety: like every Strategy, call its cross-replica methods from one
// thread; run() calls the step function on one thread per local replica.
// Every process must make the same sequence of collective calls (create_variable,
// run with the same collectives, reduce, gather, broadcast, barrier).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "diststrat/cluster.h"
#include "diststrat/elastic_options.h"
#include "diststrat/strategy.h"

namespace diststrat {

// The multi-worker fusion buffer size: 256 KiB. Measured with fusion_bench
// (2 ranks, shared memory, 1000 x 4 KiB and the MLP's gradients): packs of
// 256 KiB-1 MiB stay in cache through memcpy-in, reduce and memcpy-out and
// beat both 4 MiB packs and one pack per call by about 1.4x; smaller packs
// pay per-collective latency. See docs/multi_worker.md.
constexpr size_t kMultiWorkerBytesPerPack = 256 << 10;

inline CommunicationOptions multi_worker_communication_defaults() {
  CommunicationOptions c;
  c.bytes_per_pack = kMultiWorkerBytesPerPack;
  return c;
}

class DeviceManager;

// How MultiWorkerMirroredStrategy reduces the gradients of GPU replicas
// across processes (docs/gpu.md, "MultiWorkerMirroredStrategy on GPUs").
enum class GpuReduction {
  // NCCL when every process has exactly one GPU replica, every process's GPU
  // is a different physical GPU (NCCL refuses duplicate devices), the build
  // (backend) has NCCL, the group is not elastic and wire compression is
  // off; host staging otherwise. Every process decides alike.
  kAuto,
  // NCCL, or FailedPreconditionError at construction naming why not.
  kNccl,
  // Through host memory: copied to the host, reduced by the fusion engine,
  // copied back (the fallback, and what CPU replicas do).
  kHostStaged,
};

struct MultiWorkerOptions {
  // This process's replica devices. Empty = one CPU device. GPU devices
  // (Device::gpu(i), logical GPUs of device_manager) hold the variable copies
  // and compute; their gradients cross processes as gpu_reduction says
  // (NCCL or host staging; docs/gpu.md).
  std::vector<Device> devices;
  // GPU configuration and leases for GPU devices; created when a GPU is
  // listed and none is given.
  std::shared_ptr<DeviceManager> device_manager;
  // How GPU gradients cross processes (above): one NCCL communicator over
  // every process's GPU, made through the GPU backend with its unique id
  // broadcast over the process group, fused device buckets reduced on a
  // communication stream; or staged through host memory. Every process
  // gives the same value (the choice is collective, except under elastic,
  // where it is host staging without one).
  GpuReduction gpu_reduction = GpuReduction::kAuto;
  // Timeout, fusion (bytes_per_pack, default kMultiWorkerBytesPerPack),
  // algorithm and wire compression. algorithm kAuto / kHierarchical use the
  // hierarchical path when the job spans several (possibly virtual) nodes;
  // any other value reduces flat.
  CommunicationOptions communication = multi_worker_communication_defaults();
  // Where the cluster comes from (explicit spec, TF_CONFIG, mpirun) and the
  // virtual node grouping (DISTSTRAT_VIRTUAL_NODE_SIZE overrides).
  ClusterConfig cluster;
  // Chrome trace-event JSON to write when the strategy is destroyed (or on
  // write_timeline()); empty = no timeline. DISTSTRAT_TIMELINE overrides.
  std::string timeline_path;
  // Cross-process communicator to use instead of MPI (not owned; must outlive
  // the strategy): one rank per worker process, e.g. InProcessGroup::at(w)
  // to run the workers as threads of one process. When set, `cluster` is
  // ignored and every rank is a worker.
  Communicator* communicator = nullptr;
  // With `communicator`: optional node-local and cross-node communicators
  // (not owned) that make the cross-process all-reduce hierarchical.
  Communicator* node_communicator = nullptr;
  Communicator* cross_node_communicator = nullptr;
  LogLevel log_level = LogLevel::kWarning;
  // ZeRO-1 (off by default): shard optimizer slots over every replica in
  // sync; gradients are reduce-scattered through the fusion engine, each
  // replica updates its block of the variables with its block of the slots
  // (~1/R of the slot memory, Optimizer::slot_bytes_per_replica), and the
  // blocks are all-gathered. Checkpoints hold the full state (the same file
  // as without). CPU or GPU replicas (GPU blocks live in device memory; the
  // engine's collectives run on NCCL where gpu_reduction chose it, else they
  // stage the blocks through the host), the same local
  // replica count on every worker (else UnimplementedError at
  // construction). See docs/training.md.
  bool shard_optimizer_state = false;
  // Elastic training (off unless elastic.rendezvous is set): the workers meet
  // through a store instead of mpirun, and the job goes on when workers die
  // or join; train inside ElasticState::run (diststrat/elastic.h). `cluster`
  // and `communicator` must not be set with it.
  ElasticOptions elastic;
  // The same bits on any number of workers and replicas (off by default;
  // diststrat/determinism.h, docs/determinism.md). Every worker must give
  // the same value.
  DeterminismOptions determinism;
};

// Counters of the fusion engine (for tests and benchmarks).
struct MultiWorkerStats {
  int64_t calls = 0;               // cross-process calls completed
  int64_t packs = 0;               // fused packs reduced
  int64_t bytes = 0;               // bytes reduced (before compression)
  int64_t buffer_allocations = 0;  // fusion buffer allocations (grow-only)
  int64_t device_packs = 0;        // of `packs`: reduced on the GPUs (NCCL)
};

class MultiWorkerMirroredStrategy : public Strategy {
 public:
  // Blocking and collective: every worker process constructs it.
  explicit MultiWorkerMirroredStrategy(MultiWorkerOptions options = {});
  // Writes the timeline if one was requested (collective; falls back to one
  // file per rank if a peer does not answer).
  ~MultiWorkerMirroredStrategy() override;

  std::string name() const override { return "multi_worker"; }
  int num_replicas_in_sync() const override;
  int64_t membership_group() const override;
  const std::vector<Device>& devices() const override;
  int first_local_replica() const override;
  ClusterInfo cluster() const override;
  StragglerReport straggler_report() const override;
  // Node grouping this process uses (after virtual grouping).
  const Placement& placement() const;
  // True when the cross-process all-reduce runs hierarchically.
  bool hierarchical() const;
  // True for an elastic strategy (options.elastic; diststrat/elastic.h).
  bool elastic() const;
  // True when GPU gradients cross processes through NCCL (gpu_reduction),
  // false when they are staged through host memory (or replicas are CPUs).
  bool uses_nccl() const;

  void broadcast(Tensor& t, int root_worker = 0, const std::string& name = "") override;
  void barrier(const std::string& name = "") override;
  void apply_gradients(ReplicaContext& ctx, Optimizer& optimizer,
                       const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) override;
  // Updates every local copy with gradients already summed over the
  // replicas in sync (Optimizer::apply_reduced_gradients); not with
  // shard_optimizer_state (UnimplementedError).
  void apply_reduced_gradients(
      ReplicaContext& ctx, Optimizer& optimizer,
      const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) override;
  void update(Variable& var, const std::function<void(Tensor&)>& fn) override;
  // The GPU manager of GPU replicas; null on CPU.
  std::shared_ptr<DeviceManager> device_manager() const;

  // Writes the timeline collected so far to options.timeline_path, all ranks
  // merged by worker 0 (collective). No-op without a timeline.
  void write_timeline();
  MultiWorkerStats stats() const;

  struct Impl;

 protected:
  bool run_is_step() const override;
  Tensor variable_value(const Variable::Impl& var) const override;
  void assign_variable(Variable::Impl& var, const Tensor& value) override;
  void run_replicas(const std::function<void(ReplicaContext&)>& fn) override;
  // Corrupts the pack signature of this process's next fused all_reduce.
  void inject_corruption(ReplicaContext& ctx, int64_t step) override;
  void place_variable(Variable::Impl& var, const Initializer& init) override;
  bool replicas_may_change() const override;
  void note_distributed(const Dataset& dataset, int64_t global_batch,
                        const DistributeOptions& options) override;
  double reduce_across(ReduceOp op, const std::vector<double>& local) override;
  Tensor reduce_tensors_across(ReduceOp op, const std::vector<Tensor>& local) override;
  Tensor gather_across(const std::vector<Tensor>& local) override;

 private:
  friend class ElasticState;
  std::unique_ptr<Impl> impl_;
};

}  // namespace diststrat
