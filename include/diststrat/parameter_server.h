// ParameterServerStrategy: asynchronous data-parallel training with the
// variables sharded over parameter-server (PS) processes (TensorFlow's
// tf.distribute.ParameterServerStrategy, in the TF1 "between-graph" style:
// every worker runs the user's loop at its own pace). For TensorFlow 2's
// way, a chief that schedules functions onto the workers and re-runs those a
// lost worker had, see ClusterCoordinator (diststrat/cluster_coordinator.h).
//
// Roles. The job's processes split into PS ranks and worker ranks: with a
// TF_CONFIG (or explicit ClusterSpec) that has a "ps" job, its tasks are the
// PS ranks; under a plain `mpirun -np N`, the last `num_ps` ranks are (the
// rank order chief, worker, ps of cluster.h either way). A PS rank runs a service loop on a dedicated
// thread that holds its variable shards and applies the optimizer to every
// gradient push as it arrives; the PS process's main thread calls join() and
// exits when the workers are done:
//
//   ```cpp fragment=ps norun
//   ds::ParameterServerStrategy strategy(options);
//   if (strategy.is_ps()) { strategy.join(); return 0; }
//   // ... training loop written against Strategy& ...
//   ```
//
// Without a multi-process launcher or a cluster spec (or with one process)
// the PS ranks run as threads of this process, so the same program works
// unchanged. A job of several processes is started by mpirun (or srun
// --mpi=pmix), or by hand with TF_CONFIG (or a ClusterSpec) naming its
// processes, which then meet over TCP at the chief's address
// (docs/from_tensorflow.md).
//
// Worker side. Variables are placed round-robin over the PS ranks, or split
// along axis 0 into shards by `partitioner` (TensorFlow's semantics: the first
// rows % n shards get one extra row). Before each run() the worker has a
// fresh local copy of every dense variable (pulled from the PS ranks;
// Variable::read returns that cache, shared by the worker's replicas); after
// the replicas' gradients are reduced inside the worker, apply_gradients
// pushes them to the PS ranks without waiting, and the pull for the next step
// is posted right behind the push so it travels while the program prepares
// its next batch. Row-sparse variables (create_row_sparse_variable: embedding
// tables) are never pulled whole: gather_rows pulls only the rows a step needs
// and apply_sparse_gradients pushes gradients for only those rows.
//
// Consistency. Workers are asynchronous: a PS applies each push on receipt.
// `max_staleness` = k >= 0 bounds how far a worker may run ahead of the
// slowest live one (stale-synchronous parallel): a worker does not start step
// c (its pull for step c is not answered) until every live worker has pushed
// at least c - k steps, so it is at most k steps ahead. k = 0 is lockstep:
// besides, a push of step c is applied only once every live worker's step-c
// push has reached the PS, so every worker computes step c on the same
// weights (after all step c - 1 pushes, before any of step c). With plain
// SGD that is synchronous SGD over the global batch (up to the float rounding
// of the order in which the pushes are added). The PS still applies the
// optimizer once per push, i.e. once per worker and step: with n workers,
// momentum, Nesterov and Adam take n steps of their rule per global step
// (Adam's t and optimizer/iterations advance by n), each on one worker's
// gradient, which is not synchronous momentum/Adam unless n = 1.
//
// Errors. A push or pull the PS rejects (wrong shape or dtype, unknown
// variable, row id out of range) raises a clear error at the worker (at the
// next call that waits on the PS: the next run(), flush(), or the pull itself)
// and changes nothing on the PS, which keeps serving the other workers. Every
// wait has a deadline (communication.timeout).
//
// Rules shared by the calls below:
//  - Blocking: create_variable, gather_rows, Variable::value and assign,
//    flush, stats, barrier, broadcast, read_metric, update_hyperparameters
//    and checkpoints wait for the PS ranks' answers; run() waits for its
//    step's pull (held back by max_staleness); apply_gradients and
//    add_to_metric only post (a rejection is raised by the next call that
//    waits); Variable::read returns the worker's pulled copy. On a PS rank,
//    join() blocks until the workers are done.
//  - Ordering: workers create the same variables in the same order (a
//    mismatch is InvalidArgumentError naming the variable); barrier,
//    broadcast and checkpoints are collective over the workers, called by
//    every worker in the same order; everything else is per worker, at its
//    own pace.
//  - Deadline: every wait is bounded by communication.timeout (see Errors).
//  - Thread safety: like every strategy, run() is not reentrant; methods are
//    called from one thread at a time (the program's thread, or inside run()
//    from replicas through apply_gradients and gather_rows).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "diststrat/checkpoint.h"
#include "diststrat/cluster.h"
#include "diststrat/strategy.h"

namespace diststrat {

// Decides how many shards (along axis 0) a variable of `shape` is split into.
// Scalars are never split. Implementations below follow TensorFlow's
// tf.distribute.experimental.partitioners.
using Partitioner = std::function<int64_t(const Shape& shape, DType dtype)>;

namespace partitioners {
// Exactly min(num_shards, rows) shards.
struct FixedShards {
  int64_t num_shards = 1;
  int64_t operator()(const Shape& shape, DType dtype) const;
};
// As many shards as keep each at least min_shard_bytes, at most max_shards:
// max(1, min(rows, max_shards, ceil(total_bytes / min_shard_bytes))).
struct MinSize {
  int64_t min_shard_bytes = 256 << 10;
  int64_t max_shards = 1;
  int64_t operator()(const Shape& shape, DType dtype) const;
};
// As few shards as keep each at most max_shard_bytes (a shard holds at least
// one row), capped at max_shards when it is positive.
struct MaxSize {
  int64_t max_shard_bytes = 0;
  int64_t max_shards = 0;  // 0 = no cap
  int64_t operator()(const Shape& shape, DType dtype) const;
};
}  // namespace partitioners

// Rows of shard i when `rows` rows are split into n shards: the first
// rows % n shards get one extra row. Returns n (offset, rows) pairs.
std::vector<std::pair<int64_t, int64_t>> shard_rows(int64_t rows, int64_t num_shards);

class DeviceManager;

struct ParameterServerOptions {
  // PS ranks in the job (the last num_ps ranks). At least 1. Ignored when the
  // cluster has a "ps" job (its size wins). In a single-process run the PS
  // ranks are threads of this process.
  int num_ps = 1;
  // Where the roles come from: an explicit spec, TF_CONFIG, or the launcher.
  ClusterConfig cluster;
  // Replica devices of each worker. Empty = one CPU device. With GPU devices
  // the worker's variable cache stays in host memory (it is what pulls fill):
  // reads copy it to the replica's GPU, gradients come back to the host for
  // the push (after the local replicas' all-reduce on the GPUs).
  std::vector<Device> devices;
  // GPU configuration and leases for GPU devices (workers only); created when
  // a GPU is listed and none is given.
  std::shared_ptr<DeviceManager> device_manager;
  // How variables are split into shards; empty = never split (each variable
  // lives whole on one PS, placed round-robin).
  Partitioner partitioner;
  // Stale-synchronous bound: a worker may be at most this many steps ahead
  // of the slowest live worker; 0 = lockstep (see "Consistency" above).
  // Negative (default) = fully asynchronous.
  int max_staleness = -1;
  // Deadline of every wait (pulls, staleness waits, barriers, PS replies).
  CommunicationOptions communication;
  // A worker that sends nothing for this long (and waits on nothing) stops
  // holding back the others (staleness bound, barriers); the PS loop ends
  // when every worker has shut down or gone silent, and join() then reports
  // the silent ones. Silence is counted only while the PS loop runs (a
  // stopped PS process does not blame its workers). 0 = communication.timeout.
  std::chrono::milliseconds worker_timeout{0};
  // The only directory PS ranks write checkpoint shard files into, under
  // names they derive (<stem>.ps-<i>-of-<n>.<save id>.safetensors); a save
  // whose index path is elsewhere is rejected. Set it to the same directory
  // on every rank (DISTSTRAT_PS_CHECKPOINT_DIR overrides it). Empty
  // (default, compatible): the PS writes its derived names into the
  // directory of the index the chief saves (logged once); only shard-file
  // names are ever written, but set this to confine them.
  std::string checkpoint_dir;
  // A push whose gradient holds a NaN or an infinity never reaches a
  // variable: it is rejected (false, default: the worker's next call raises
  // InvalidArgumentError naming the variable), or skipped (true: answered
  // OK, not applied, logged and counted in ParameterServerStats::pushes_nonfinite).
  bool skip_nonfinite_gradients = false;
  // The most bytes of broadcasts PS 0 holds at once; a larger broadcast is
  // rejected before anything is allocated. Default 256 MiB.
  int64_t max_broadcast_bytes = int64_t{256} << 20;
  // A worker process that dies (SIGKILL, a lost host) does not end the job:
  // over TCP (TF_CONFIG) its broken connection fails only the transfers
  // that need it, the PS ranks take it for gone after worker_timeout, and a
  // ClusterCoordinator runs its function elsewhere (cluster_coordinator.h).
  // false (default): it ends the job at once, every rank naming it. Under
  // mpirun the launcher ends the job when a process dies, whatever this says.
  bool survive_worker_loss = false;
  LogLevel log_level = LogLevel::kWarning;
};

// What the PS ranks observed (summed over PS ranks for the counts).
struct ParameterServerStats {
  int64_t pushes_sent = 0;       // by this worker (every worker-to-PS push message)
  int64_t pushes_applied = 0;    // by the PS ranks, from all workers
  int64_t pushes_rejected = 0;   // by the PS ranks, from all workers
  int64_t pushes_nonfinite = 0;  // skipped for a non-finite gradient (skip_nonfinite_gradients)
  // Staleness of an applied push: updates the PS applied between the pull the
  // gradients were computed from and the push (0 = perfectly fresh).
  double mean_staleness = 0;
  int64_t max_staleness = 0;
  // Largest (pusher's steps - slowest other live worker's steps) seen at a push.
  int64_t max_step_gap = 0;
  // Steps each worker has pushed, as the PS ranks saw them (max over PS ranks).
  std::vector<int64_t> worker_steps;
};

// A job-wide metric's running totals (TensorFlow's metrics that the
// coordinator reads, e.g. tf.keras.metrics.Mean's total and count): the sums
// of every addition of every worker.
struct MetricTotals {
  double sum = 0;
  double count = 0;
  double mean() const { return count > 0 ? sum / count : 0.0; }
};

// A gradient for some rows of a row-sparse variable: values[i] is the
// gradient of row ids[i] (ids int64 [n], values [n, dims[1:]...]). Duplicate
// ids are summed before the push.
struct SparseGradient {
  Variable variable;
  Tensor ids;
  Tensor values;
};

// Checkpoints (Checkpoint / CheckpointManager / PreemptionHandler, called by
// every worker at the same step; PS ranks only join()): a save quiesces the
// job (each worker flushes its pushes, then all meet at a barrier), every PS
// rank writes its own shard file (values, optimizer slots, per-shard step
// counters), and the chief writes the index last; a restore verifies the
// index and every shard file, then re-splits the variables onto the current
// PS ranks and partitioner. The files must be visible to the chief and the
// PS ranks (one host, or a shared file system). See docs/parameter_server.md.
class ParameterServerStrategy : public Strategy, public CheckpointParticipant {
 public:
  explicit ParameterServerStrategy(ParameterServerOptions options = {});
  ~ParameterServerStrategy() override;

  std::string name() const override { return "parameter_server"; }
  // Every worker's replicas: a global batch is split over all of them (each
  // worker materializes only its share), but workers apply their shares
  // asynchronously.
  int num_replicas_in_sync() const override;
  int num_local_replicas() const override;
  const std::vector<Device>& devices() const override;
  int first_local_replica() const override;

  // What Strategy::reduce returns here: the reduction over THIS WORKER'S
  // replicas only, not over num_replicas_in_sync() -- workers never meet in
  // a step. kSum sums this worker's replicas, kMean divides by
  // num_local_replicas(). So a loss summed with reduce(kSum) after scaling
  // by 1 / global_size() is this worker's share (about 1 / num_workers of
  // the global batch's loss). Likewise gather() and the collectives of the
  // ReplicaContext (all_reduce, all_gather; kMean by the local count) cover
  // this worker's replicas. For a job-wide figure, every worker adds its
  // share to a metric on PS 0 and any worker reads the totals:
  //
  //   ```cpp fragment=ps_metric norun
  //   // each replica returns float64 {its loss sum, its rows}
  //   const Tensor t = strategy.reduce(ReduceOp::kSum, per_replica);
  //   ps.add_to_metric("train/loss", t.data<double>()[0], t.data<double>()[1]);  // every worker
  //   double mean = ps.read_metric("train/loss").mean();   // any worker, any time
  //   ```
  //
  // (examples/fashion_mnist and benchmarks/train_bench print their loss so.)

  // Worker: adds (sum, count) to the job-wide metric `name` (1..256
  // characters) held by PS 0, created as (0, 0) at its first addition. Does
  // not wait, like a push: a rejection (count negative or not finite, more
  // than 1024 metrics) is raised by the next call that waits on the PS.
  // Metrics live as long as the PS ranks; checkpoints do not hold them.
  void add_to_metric(const std::string& name, double sum, double count = 1);
  // Worker: the totals of `name` ((0, 0) if nobody added yet): every addition
  // PS 0 has applied, including this worker's earlier ones and every
  // worker's made before a barrier() this worker has since passed (so after
  // a barrier every worker reads the same totals). Blocking: one round trip
  // to PS 0 with the communication timeout.
  MetricTotals read_metric(const std::string& name);
  // This process's task as TF_CONFIG (or the explicit ClusterSpec) names it:
  // "chief" 0, "worker" i, "ps" j; without one (plain mpirun, one process)
  // "worker" <worker index> or "ps" <PS index>. worker_index is the position
  // among the workers (the chief is 0; TF_CONFIG's worker i is i + 1 when
  // there is a chief), -1 on PS ranks, as resolve_cluster() reports.
  ClusterInfo cluster() const override;

  bool is_ps() const;
  bool is_worker() const { return !is_ps(); }
  // PS ranks: blocks until every worker has shut down (a worker's strategy
  // destructor tells the PS ranks), or every remaining one has sent nothing
  // for worker_timeout: then DeadlineExceededError naming them. Destroying a
  // PS rank's strategy without join() stops its service at once.
  void join();

  // Worker: a variable whose rows are pulled and pushed individually.
  // read() is not available for it; use gather_rows.
  Variable create_row_sparse_variable(const std::string& name, const Shape& shape, DType dtype,
                                      const Initializer& init, const VariableOptions& options = {});
  // Worker, in replica or cross-replica context: pulls rows `ids` (int64 [n])
  // of `var` from the PS ranks. Blocking. Returns [n, dims[1:]...].
  Tensor gather_rows(const Variable& var, const Tensor& ids);
  // Worker, in replica context (every local replica calls it with the same
  // variables): reduces dense gradients over the local replicas, concatenates
  // the sparse ones, and pushes one step to the PS ranks without waiting.
  void apply_gradients(ReplicaContext& ctx, Optimizer& optimizer,
                       const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) override;
  void apply_gradients(ReplicaContext& ctx, Optimizer& optimizer,
                       const std::vector<std::pair<Tensor, Variable>>& grads_and_vars,
                       const std::vector<SparseGradient>& sparse);

  // Worker: waits for every outstanding push to be acknowledged (rethrowing a
  // rejection) and for any prefetched pull. Under lockstep (max_staleness 0)
  // a push is acknowledged once every live worker has pushed the same step.
  void flush();
  // Worker: counters and staleness as the PS ranks saw them (blocking).
  ParameterServerStats stats();
  // Chief (worker 0) only: makes the PS ranks apply `optimizer`'s
  // hyper-parameters (learning rate, momentum, betas, schedule) from now on,
  // to every variable whose update rule is fixed (every variable the chief
  // has pushed to): Keras's ReduceLROnPlateau under this strategy. The rule
  // of a variable is fixed by the chief's first push to it and is never
  // taken from pushes; the optimizer kind and its slots cannot change.
  // Blocking: returns once every PS rank holding such a variable has
  // acknowledged (ordered after this worker's earlier pushes). Not
  // thread-safe with run() of the same worker. Throws FailedPreconditionError
  // on another worker, InvalidArgumentError for an invalid or different kind
  // of optimizer.
  void update_hyperparameters(const Optimizer& optimizer);
  // Blocks until every live worker calls barrier (through PS rank 0).
  void barrier(const std::string& name = "") override;

  // PS ranks: copies of this rank's shards, and restoring them (before the
  // workers create their variables: a restored shard keeps its value when the
  // chief creates the variable, so a restarted job resumes).
  std::vector<ShardSnapshot> local_shards() const;
  void restore_local_shards(const std::vector<ShardSnapshot>& shards);

  void update(Variable& var, const std::function<void(Tensor&)>& fn) override;

  // Workers: broadcast from a worker to every worker, through PS 0 (the
  // root's bytes wait there for the others). Collective over the workers;
  // host tensors; blocking with the communication timeout.
  void broadcast(Tensor& t, int root_worker = 0, const std::string& name = "") override;

  // CheckpointParticipant (see above; FailedPreconditionError on PS ranks).
  void check_checkpoint_supported(Strategy& strategy, const std::string& what) override;
  bool needs_state_to_write() const override;
  bool agree_to_stop(Strategy& strategy, int64_t step, bool signalled) override;
  std::vector<Tensor> read_slots(Strategy& strategy, const std::vector<SlotRef>& slots) override;
  void assign_slots(Strategy& strategy, const std::vector<SlotRef>& slots,
                    const std::vector<Tensor>& values) override;
  void write_checkpoint(Strategy& strategy, const std::string& path,
                        const std::vector<std::pair<std::string, Tensor>>& state,
                        const CheckpointMetadata& metadata) override;
  CheckpointContents read_checkpoint(Strategy& strategy, const std::string& path,
                                     const std::vector<std::pair<std::string, Tensor>>& expected,
                                     const std::vector<std::string>& optional,
                                     const RestoreOptions& options) override;

 protected:
  Tensor read_variable(const Variable::Impl& var, const ReplicaContext& ctx) const override;
  Tensor variable_value(const Variable::Impl& var) const override;
  void assign_variable(Variable::Impl& var, const Tensor& value) override;
  void run_replicas(const std::function<void(ReplicaContext&)>& fn) override;
  void place_variable(Variable::Impl& var, const Initializer& init) override;
  // reduce() covers this worker's replicas only (see above).
  double reduce_across(ReduceOp op, const std::vector<double>& local) override;
  Tensor reduce_tensors_across(ReduceOp op, const std::vector<Tensor>& local) override;
  Tensor gather_across(const std::vector<Tensor>& local) override;
  // kCorrupt: this worker's next push carries a damaged request header (its
  // magic bits flipped), which the PS rejects naming the worker and its rank;
  // the worker's next call then fails naming the push's step.
  void inject_corruption(ReplicaContext& ctx, int64_t step) override;

 private:
  struct Impl;
  // The internal way in (src/parameter_server/strategy_impl.h): a strategy
  // over an already-built transport endpoint, and its Impl.
  friend struct ParameterServerAccess;
  explicit ParameterServerStrategy(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;
};

}  // namespace diststrat
