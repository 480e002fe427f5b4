// The Strategy interface: a training loop written against Strategy& runs
// unchanged under every strategy (mirrored, multi-worker, central storage,
// parameter server).
//
//   ```cpp fragment=unqualified
//   Variable w = strategy.create_variable("dense/kernel", {784, 256}, DType::kFloat32,
//                                         init::GlorotUniform{1});
//   for (const auto& batch : strategy.distribute(dataset, 256)) {
//     PerReplica<float> loss = strategy.run([&](ReplicaContext& ctx) {
//       // your model: forward/backward on batch.features(ctx)
//       auto [grad_w, local_loss] = forward_backward(w.read(ctx), batch.features(ctx),
//                                                    batch.labels(ctx));
//       optimizer.apply_gradients(ctx, {{grad_w, w}});
//       return local_loss;
//     });
//     float mean = strategy.reduce(ReduceOp::kSum, loss);
//   }
//   ```
//
// Rules for every call below:
//  - Contexts: a call is made either in cross-replica context (the thread that
//    owns the strategy, outside run()) or in replica context (inside the
//    function given to run(), on that replica's thread, through its
//    ReplicaContext). Each call says which; ReplicaContext's calls are replica
//    context only.
//  - Collective: create_variable, run, reduce, gather, broadcast and barrier
//    are collective in a multi-process job: every process calls them in the
//    same order (ReplicaContext's collectives: every replica in sync, in the
//    same order, with matching tensors). A mismatch the strategy detects is
//    InvalidArgumentError on every rank. distribute and update are local.
//  - Blocking and deadline: collective calls return when this process's part
//    is done and never wait for a peer longer than the strategy's timeout
//    (DeadlineExceededError naming the ranks that did not arrive).
//  - Failure: an exception in one replica aborts the step on every replica
//    and run() rethrows it, prefixed with the step. GPU replicas: run()
//    returns once the step's work is enqueued, so an error the device finds
//    (a label out of range, a failed or hung launch) is thrown at the next
//    synchronization (a read of a value the device computed, synchronize(),
//    a checkpoint, a later run() that waits for a step in flight), naming
//    the step where it happened; the steps enqueued after it ran on its
//    results.
//  - Thread safety: one thread drives a Strategy in cross-replica context; the
//    replica threads it starts use only their own ReplicaContext. Const
//    accessors (name, devices, cluster, variables) are safe from any thread.
//
// Implementers of a strategy override the protected hooks at the bottom of
// the class; users never call them.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "diststrat/collective.h"
#include "diststrat/data.h"
#include "diststrat/determinism.h"
#include "diststrat/device.h"
#include "diststrat/fault.h"
#include "diststrat/flight_recorder.h"
#include "diststrat/logging.h"
#include "diststrat/tensor.h"
#include "diststrat/variable.h"

namespace diststrat {

class DeviceManager;
class Optimizer;
class Strategy;

// One value per local replica, indexed by local replica id (in determinism
// mode one per local virtual shard, in shard order: diststrat/determinism.h).
template <typename T>
class PerReplica {
 public:
  PerReplica() = default;
  explicit PerReplica(std::vector<T> values) : values_(std::move(values)) {}
  // From values of another type that converts to T (run() returning
  // nn::StepValue<double> into PerReplica<double>: each value is read here).
  template <typename U, typename = std::enable_if_t<!std::is_same_v<U, T> &&
                                                    std::is_convertible_v<const U&, T>>>
  PerReplica(const PerReplica<U>& other) {  // NOLINT: converts like its values
    values_.reserve(other.size());
    for (const U& v : other) values_.push_back(static_cast<T>(v));
  }
  size_t size() const { return values_.size(); }
  const T& operator[](size_t i) const { return values_[i]; }
  T& operator[](size_t i) { return values_[i]; }
  const std::vector<T>& values() const { return values_; }
  auto begin() const { return values_.begin(); }
  auto end() const { return values_.end(); }

 private:
  std::vector<T> values_;
};

// A handle to an asynchronous collective. wait() blocks until it completes
// (or throws its error); waiting twice is allowed.
class Work {
 public:
  struct State;
  Work() = default;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}
  void wait();
  bool done() const;
  // A Work that is already complete (or failed with `error`).
  static Work completed(std::exception_ptr error = nullptr);

 private:
  std::shared_ptr<State> state_;
};

// Where a process stands in a multi-process job.
struct ClusterInfo {
  std::string task_type = "worker";  // "chief", "worker", "ps", "evaluator"
  int task_index = 0;
  int rank = 0;         // process rank in the job
  int world_size = 1;   // processes in the job
  int num_workers = 1;  // processes that run replicas
  int worker_index = 0;
  bool is_chief() const { return worker_index == 0 && task_type != "ps"; }
};

// The per-replica view handed to the function given to Strategy::run. Valid
// only inside that call, on the thread that received it.
class ReplicaContext {
 public:
  virtual ~ReplicaContext() = default;

  // Position among all replicas in sync (across workers).
  virtual int replica_id() const = 0;
  // Position among this process's replicas.
  virtual int local_replica_id() const = 0;
  virtual int num_replicas_in_sync() const = 0;
  virtual const Device& device() const = 0;
  virtual Strategy& strategy() const = 0;
  // The replica's stream (cudaStream_t on GPUs), nullptr on CPU.
  virtual void* stream() const { return nullptr; }
  // In determinism mode (diststrat/determinism.h) the virtual shard this call
  // of the step function computes; -1 otherwise.
  virtual int virtual_shard() const { return -1; }

  // All-reduces `tensors` in place over every replica in sync, packing small
  // tensors together. Blocks. Every replica must pass the same list (names,
  // shapes, dtypes, order); `names` (optional) label tensors in errors.
  // Every collective takes tensors on the replica's device (host memory on a
  // CPU replica); another device is InvalidArgumentError.
  virtual void all_reduce(ReduceOp op, std::vector<Tensor>& tensors,
                          const std::vector<std::string>& names = {}) = 0;
  // Enqueues the same and returns at once where the strategy overlaps
  // communication (multi-worker); elsewhere completes before returning. The
  // tensors must stay alive and untouched until wait().
  virtual Work all_reduce_async(ReduceOp op, std::vector<Tensor> tensors,
                                std::vector<std::string> names = {});
  // Concatenates every replica's `t` along axis 0 (shapes may differ only in
  // dim 0), ordered by replica id.
  virtual Tensor all_gather(const Tensor& t, const std::string& name = "") = 0;
  // Blocks until every replica in sync has arrived.
  virtual void barrier(const std::string& name = "") = 0;

  Tensor all_reduce(ReduceOp op, const Tensor& t, const std::string& name = "");

  // Runs fn once, in cross-replica context, while every local replica waits;
  // every replica gets fn's result (or its exception). All local replicas
  // must call it.
  template <typename F>
  auto merge_call(F&& fn) -> std::invoke_result_t<F, Strategy&> {
    using R = std::invoke_result_t<F, Strategy&>;
    if constexpr (std::is_void_v<R>) {
      merge_call_impl([&](Strategy& s) -> std::shared_ptr<void> {
        fn(s);
        return nullptr;
      });
    } else {
      std::shared_ptr<void> r = merge_call_impl(
          [&](Strategy& s) -> std::shared_ptr<void> { return std::make_shared<R>(fn(s)); });
      return *std::static_pointer_cast<R>(r);
    }
  }

 protected:
  // Synchronizes the local replicas, runs fn on local replica 0, and returns
  // its result (or rethrows its exception) on every local replica.
  virtual std::shared_ptr<void> merge_call_impl(
      const std::function<std::shared_ptr<void>(Strategy&)>& fn) = 0;
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  // "mirrored", "multi_worker", "central_storage", "parameter_server".
  virtual std::string name() const = 0;
  // Replicas that step together, over all workers.
  virtual int num_replicas_in_sync() const = 0;
  // This process's replicas and their devices.
  virtual int num_local_replicas() const { return static_cast<int>(devices().size()); }
  virtual const std::vector<Device>& devices() const = 0;
  // Global id of this process's first replica.
  virtual int first_local_replica() const { return 0; }
  virtual ClusterInfo cluster() const { return ClusterInfo{}; }
  // Who slows the synchronous steps down (diststrat/flight_recorder.h):
  // per worker its compute time before each collective and how often it
  // came last, over the latest window. Empty for strategies of one process
  // and for the parameter server (its workers never wait for each other).
  // Thread-safe.
  virtual StragglerReport straggler_report() const { return StragglerReport{}; }

  // Creates a variable under this strategy; every process of a multi-process
  // job must create the same variables in the same order. Blocking.
  Variable create_variable(const std::string& name, const Shape& shape, DType dtype,
                           const Initializer& init, const VariableOptions& options = {});
  // Variables in creation order.
  const std::vector<Variable>& variables() const { return variables_; }
  // Looks a variable up by name; throws NotFoundError.
  Variable variable(const std::string& name) const;

  // Runs fn(ReplicaContext&) once per local replica, each on its replica's
  // thread, and waits for all. Returns PerReplica<R> (nothing for void). On
  // GPU replicas the functions enqueue device work that may still run when
  // run() returns (at most two steps of a replica are in flight; see
  // synchronize()).
  // If a replica throws, the others are aborted (their pending collectives
  // throw AbortedError) and run() rethrows the first replica's exception.
  // Errors thrown out of run() are prefixed with "step S: " (S as in
  // steps_run()), so a failure names the step where it happened.
  // A step captured into CUDA graphs and replayed (the host launching a few
  // graphs instead of every kernel): MirroredStrategy::compile, which takes
  // the step's batch as an argument (diststrat/mirrored.h).
  template <typename F>
  auto run(F&& fn) {
    using R = std::invoke_result_t<F, ReplicaContext&>;
    if constexpr (std::is_void_v<R>) {
      run_step([&](ReplicaContext& ctx) { fn(ctx); });
    } else {
      std::vector<std::unique_ptr<R>> out(static_cast<size_t>(num_local_values()));
      run_step([&](ReplicaContext& ctx) { out[value_slot(ctx)] = std::make_unique<R>(fn(ctx)); });
      std::vector<R> values;
      values.reserve(out.size());
      for (auto& v : out) values.push_back(std::move(*v));
      return PerReplica<R>(std::move(values));
    }
  }

  // Waits until the work that run() enqueued on this process's GPU replicas
  // is done, each wait bounded by the strategy's timeout
  // (DeadlineExceededError naming the replica and device), and throws the
  // device errors of those steps naming the step where each happened (a
  // label out of range: InvalidArgumentError). Call it at the end of an
  // epoch, before timing, or before handing device memory elsewhere; reads
  // of values, checkpoints and host decisions wait by themselves. No-op on
  // CPU replicas. Cross-replica context; not collective.
  void synchronize();

  // Values run() returns in this process: one per local replica, or one per
  // local virtual shard in determinism mode.
  int num_local_values() const;
  // The determinism options the strategy was made with (off by default).
  const DeterminismOptions& determinism() const { return determinism_; }

  // Cross-replica reductions of run()'s results over all replicas in sync
  // (all workers). kMean divides by num_replicas_in_sync() (in determinism
  // mode: V, and the values are combined in shard order). Blocking; under
  // multi-worker a collective every worker calls in the same order. A
  // PerReplica must hold one value per local replica (num_local_replicas(),
  // as run() returns) and no undefined tensor, else InvalidArgumentError.
  // Exception: ParameterServerStrategy reduces over the calling worker's
  // replicas only (its workers never meet; parameter_server.h says how to get
  // a job-wide figure).
  double reduce(ReduceOp op, const PerReplica<double>& values);
  float reduce(ReduceOp op, const PerReplica<float>& values);
  // Integer results (counts), exact at any magnitude: a kSum or kProduct
  // outside int64 is InvalidArgumentError ("int64 sum overflows", "int64
  // product overflows"); kMean is the exact sum divided by
  // num_replicas_in_sync(), truncated toward zero.
  int64_t reduce(ReduceOp op, const PerReplica<int64_t>& values);
  Tensor reduce(ReduceOp op, const PerReplica<Tensor>& values);
  // TensorFlow's reduce(op, value, axis): reduces over the replicas in sync
  // and then over dimension `axis` of each value (negative: from the end),
  // giving the value's shape without that dimension. kMean is the mean of
  // every element along `axis` of every replica (sum / total count, so
  // replicas with fewer rows, as in a short last batch, weigh less; integer
  // dtypes truncate). axis 0: the values may differ in dimension 0 (they are
  // gathered); another axis: every value must have the same shape. A
  // kMin/kMax/kMean over no elements is InvalidArgumentError, as is an axis
  // out of range.
  Tensor reduce(ReduceOp op, const PerReplica<Tensor>& values, int axis);
  // Concatenates every replica's tensor along axis 0, over all workers.
  Tensor gather(const PerReplica<Tensor>& values);
  // Copies root worker's tensor to every worker (no-op with one process).
  virtual void broadcast(Tensor& t, int root_worker = 0, const std::string& name = "");
  // Blocks until every process of the job arrives (no-op with one process).
  virtual void barrier(const std::string& name = "");

  // Splits each global batch of `dataset` over the replicas in sync; in a
  // multi-worker job each worker materializes only its own replicas' rows.
  DistributedDataset distribute(const Dataset& dataset, int64_t global_batch,
                                const DistributeOptions& options = {});
  // For users who own their input: fn is called once in this process with its
  // InputContext and returns this worker's data, which is batched by
  // per_replica_batch_size * num_local_replicas.
  DistributedDataset distribute_datasets_from_function(
      const std::function<Dataset(const InputContext&)>& fn, int64_t global_batch,
      const DistributeOptions& options = {});

  // Applies fn to every local copy of `var` (tf.distribute's extended.update):
  // fn must be deterministic so mirrored copies stay identical. Cross-replica
  // context only.
  virtual void update(Variable& var, const std::function<void(Tensor&)>& fn);

  // Called by Optimizer::apply_gradients in replica context: reduce the
  // gradients the way this strategy does and apply `optimizer` to the
  // variables. Every local replica must call it with the same variables.
  virtual void apply_gradients(ReplicaContext& ctx, Optimizer& optimizer,
                               const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) = 0;
  // Called by Optimizer::apply_reduced_gradients in replica context: apply
  // `optimizer` to the variables with gradients the caller has already
  // reduced over every replica in sync (no reduction here). Default:
  // UnimplementedError naming the strategy (MultiWorkerMirroredStrategy
  // has it).
  virtual void apply_reduced_gradients(
      ReplicaContext& ctx, Optimizer& optimizer,
      const std::vector<std::pair<Tensor, Variable>>& grads_and_vars);

  // Fault injection for tests (see diststrat/fault.h); the constructor
  // reads DISTSTRAT_FAULT. Set before run(); not thread-safe.
  void set_fault_injection(const FaultInjection& fault) { fault_ = fault; }
  const FaultInjection& fault_injection() const { return fault_; }
  // Number of run() calls so far (the step index the next run() gets); the
  // runs of run_between_steps are not counted.
  int64_t steps_run() const { return step_; }
  // Runs fn on every replica as run() does, as the library's own work
  // between training steps (a checkpoint reading or writing optimizer slots,
  // ZeRO-1 gathering them, an elastic commit): it gets no step number
  // (steps_run() is unchanged), no injected fault fires in it, an elastic
  // strategy neither commits nor looks for joiners before it, and its
  // errors start "before step S: ".
  void run_between_steps(const std::function<void(ReplicaContext&)>& fn);
  // The group of workers this strategy runs in: 0 for a fixed group; an
  // elastic strategy's group number, which changes with every membership
  // change (diststrat/elastic.h). Agreements made once per group (an
  // optimizer's configuration check) are made again when it changes.
  virtual int64_t membership_group() const { return 0; }

  Logger& logger() { return logger_; }
  // Device placement logging of this strategy's variables, collectives and
  // ops (off unless enabled here, by the strategy's options, or by
  // DISTSTRAT_LOG_DEVICE_PLACEMENT=1).
  PlacementLog& placement_log() { return placement_; }

 protected:
  // Also warns (once per process) about DISTSTRAT_* variables that nothing
  // reads, naming the closest known one: a misspelled override is not silent.
  explicit Strategy(LogLevel log_level = LogLevel::kWarning, std::string log_prefix = "");

  // ---- The implementer's hooks ----
  virtual void run_replicas(const std::function<void(ReplicaContext&)>& fn) = 0;
  // True when the replicas in sync may change while the strategy lives
  // (elastic training): distributed datasets then split each batch over the
  // replicas of the moment, asking num_replicas_in_sync() and
  // first_local_replica() at every batch().
  virtual bool replicas_may_change() const { return false; }
  // distribute() split `dataset` into global batches of `global_batch` (an
  // elastic strategy checks that its workers agree: rows, batch, options and
  // content).
  virtual void note_distributed(const Dataset& dataset, int64_t global_batch,
                                const DistributeOptions& options) {
    (void)dataset, (void)global_batch, (void)options;
  }
  // Variable access the Variable handle forwards to. Sync-on-read variables
  // (kOnRead) are aggregated and assigned by the Variable handle itself
  // through the strategy's reductions (see variable.h), the same way under
  // every strategy; these hooks read and write the copies.
  virtual Tensor read_variable(const Variable::Impl& var, const ReplicaContext& ctx) const;
  virtual Tensor variable_value(const Variable::Impl& var) const;
  virtual void assign_variable(Variable::Impl& var, const Tensor& value);
  // Allocates the local copies of a new variable and initializes them
  // (multi-process strategies broadcast the chief's value).
  virtual void place_variable(Variable::Impl& var, const Initializer& init) = 0;
  // Reduces one double per local replica over every replica in sync.
  virtual double reduce_across(ReduceOp op, const std::vector<double>& local);
  // Reduces tensors (one per local replica, equal shapes) over every replica.
  virtual Tensor reduce_tensors_across(ReduceOp op, const std::vector<Tensor>& local);
  // Concatenates per-replica tensors over every worker, ordered by replica.
  virtual Tensor gather_across(const std::vector<Tensor>& local);

  // kCorrupt: makes replica `ctx` send a corrupted message in this step.
  // Default: a collective whose size disagrees with its peers' (they are in
  // their first collective of the step), which the group must reject naming
  // the rank. Multi-worker overrides it to corrupt the next pack signature.
  virtual void inject_corruption(ReplicaContext& ctx, int64_t step);
  // Turns determinism mode on (set-up of a strategy whose options ask for
  // it, once the replicas in sync are known): checks V against them and pins
  // the CPU GEMM blocking. `who` names the strategy in errors.
  void enable_determinism(const DeterminismOptions& options, const std::string& who);

  // Whether the run now starting is a training step (numbered, the fault
  // injection's target, "step S: " in its errors): not inside
  // run_between_steps. A strategy may say no for more of its own runs.
  virtual bool run_is_step() const { return !between_steps_; }

  std::vector<Variable> variables_;
  Logger logger_;
  PlacementLog placement_;

 private:
  // One step: fires the fault injection (if any) on the replica threads, runs
  // fn through run_replicas and prefixes errors with the step.
  void run_step(const std::function<void(ReplicaContext&)>& fn);
  // Where run() stores the value of `ctx`'s call: its local replica, or its
  // shard among this process's shards.
  size_t value_slot(const ReplicaContext& ctx) const;
  // Determinism mode's reductions of per-shard values, in shard order
  // (determinism.cc); the shards' values regrouped per local replica.
  double reduce_shard_values(ReduceOp op, const std::vector<double>& values);
  int64_t reduce_shard_ints(ReduceOp op, const std::vector<int64_t>& values);
  Tensor reduce_shard_tensors(ReduceOp op, const std::vector<Tensor>& values);
  void check_value_count(const std::string& what, size_t n) const;
  void inject_fault(ReplicaContext& ctx, int64_t step);
  // Cross-replica read and write of a kOnRead variable (Variable::value and
  // Variable::assign): collective over every worker, like reduce.
  friend class Variable;
  Tensor on_read_value(const Variable::Impl& var);
  void on_read_assign(Variable& var, const Tensor& value);

  // Waits for this process's GPU replicas (set by the local replicas).
  friend class LocalReplicas;
  std::function<void()> synchronize_devices_;
  // The GPU replicas' device manager and the bound of their waits, for
  // input on the device (DistributeOptions::prefetch_to_device, on_device);
  // set by the local replicas, null on CPU replicas.
  std::shared_ptr<DeviceManager> input_gpus_;
  std::chrono::milliseconds input_timeout_{std::chrono::seconds(300)};
  FaultInjection fault_;
  DeterminismOptions determinism_;
  int64_t step_ = 0;
  bool between_steps_ = false;  // inside run_between_steps
};

}  // namespace diststrat
