// LibTorch integration (target diststrat::torch; the only diststrat header
// that includes torch headers). Namespace diststrat::libtorch, so that
// `using namespace diststrat;` never shadows ::torch. docs/torch.md has the
// details.
//
// Rules shared by the calls below (each call's comment gives the details):
//  - Context: the constructors and TrainingState's methods run in
//    cross-replica context (outside Strategy::run); backward(), no_sync(),
//    module(ctx) and gather_rows() in replica context, on that replica's own
//    thread.
//  - Blocking: DistributedDataParallel's and TrainingState's constructors
//    are collective; they and TrainingState's methods block until done.
//    DistributedDataParallel::backward blocks until the step's gradients are
//    reduced (the strategy's deadline bounds every wait), gather_rows()
//    until its rows are pulled; ParameterServerModel::backward only pushes
//    (its errors come at the next wait). The conversions never block.
//  - Ordering: every worker process constructs these objects at the same
//    point, from the same module architecture; every replica in sync calls
//    DistributedDataParallel::backward (one with zero rows too) as often in
//    each run(), and no_sync() on all replicas or none.
//  - Thread safety: to_diststrat, to_torch, torch_device and module(int) are
//    thread-safe; TrainingState is not thread-safe with Strategy::run.
//
//   ```cpp fragment=torch_net torch mpi
//   namespace ds = diststrat; namespace dt = diststrat::libtorch;
//   ds::MultiWorkerMirroredStrategy strategy;          // or Mirrored / CentralStorage
//   auto net = std::make_shared<Net>();                 // a torch::nn::Cloneable<Net>
//   dt::DistributedDataParallel ddp(strategy, net);     // collective: checks + broadcasts
//   std::vector<std::unique_ptr<torch::optim::SGD>> opt;  // one per local replica
//   for (int i = 0; i < ddp.num_local_replicas(); ++i)
//     opt.push_back(std::make_unique<torch::optim::SGD>(ddp.module(i)->parameters(), 0.05));
//   for (const ds::DistributedBatch& batch : strategy.distribute(data, 256)) {
//     ds::PerReplica<float> loss = strategy.run([&](ds::ReplicaContext& ctx) {
//       auto& model = ddp.module(ctx);               // this replica's module
//       at::Tensor x = dt::to_torch(batch.features(ctx));     // zero-copy
//       at::Tensor y = dt::to_torch(batch.labels(ctx)).to(torch::kLong);  // int32 -> int64
//       torch::optim::SGD& o = *opt[ctx.local_replica_id()];
//       o.zero_grad();
//       at::Tensor l = torch::nll_loss(model->as<Net>()->forward(x), y);  // mean over x's rows
//       ddp.backward(ctx, l, x.size(0), batch.global_size());  // grads = global mean
//       o.step();
//       return x.size(0) ? l.item<float>() : 0.0f;
//     });
//   }
//   ```
//
// Strategies: MultiWorkerMirroredStrategy (gradients go through its fusion
// engine, overlapped with backward), MirroredStrategy and
// CentralStorageStrategy (one module clone per local replica, gradients
// reduced in-process; every replica applies the same update to its clone, so
// the clones stay bit-identical). ParameterServerStrategy: ParameterServerModel
// below (the PS applies a diststrat Optimizer; the module's parameters view
// the worker's pull cache).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "diststrat/device_manager.h"
#include "diststrat/elastic.h"
#include "diststrat/multi_worker_mirrored.h"
#include "diststrat/optimizer.h"
#include "diststrat/parameter_server.h"
#include "diststrat/strategy.h"
#include "diststrat/tensor.h"

namespace diststrat::libtorch {

// ---- conversions (zero-copy) ------------------------------------------------

// A diststrat Tensor viewing `t`'s memory (no copy); it holds a reference to
// `t`'s storage, so the memory stays valid for as long as the Tensor (or any
// copy/view of it) lives. CPU tensors -> Device::cpu(0); CUDA tensors -> the
// GPU of that CUDA ordinal (through the calling thread's DeviceManager inside
// Strategy::run, as Tensor::from_dlpack does). dtypes float32/64, float16,
// bfloat16, int32/64. A non-contiguous tensor, another dtype, another device
// type, a sparse/quantized tensor, a lazily negated/conjugated view or a
// ZeroTensor is InvalidArgumentError naming what is wrong (call
// .contiguous() / .resolve_neg() / .clone() first). An undefined at::Tensor gives an
// undefined Tensor. Does not block; thread-safe.
Tensor to_diststrat(const at::Tensor& t);

// An at::Tensor viewing `t`'s memory (no copy), writable: writes through it
// change `t`. It holds a reference to `t`'s storage, so the memory stays
// valid until the last at::Tensor sharing it is gone (memory `t` merely
// wraps, Tensor::wrap, stays the caller's to keep alive). GPU tensors become
// CUDA tensors of the matching ordinal. An undefined Tensor gives an
// undefined at::Tensor. Does not block; thread-safe.
at::Tensor to_torch(const Tensor& t);

// The torch::Device of diststrat device `device`: CPU -> torch::kCPU; a GPU
// is a logical index of `manager` (several logical GPUs may share one
// physical GPU), so it becomes torch::kCUDA with that logical GPU's physical
// CUDA ordinal (DeviceManager::list_logical_devices()). Split GPUs map
// several logical GPUs to one CUDA device: torch itself knows only physical
// devices. manager == nullptr: the logical index is taken as the ordinal
// (one logical GPU per visible GPU, the default configuration). A GPU the
// manager does not have is NotFoundError naming the ones it has. Thread-safe;
// initializes `manager` (takes its GPU leases) if nothing did before.
torch::Device torch_device(const Device& device, DeviceManager* manager);

// The DeviceManager of `strategy` (Mirrored, MultiWorkerMirrored or
// CentralStorage with GPU devices), or nullptr (CPU strategies and others).
DeviceManager* device_manager_of(Strategy& strategy);

// ---- DistributedDataParallel --------------------------------------------------

struct DdpOptions {
  // false (default): a parameter (requires_grad) that got no gradient in a
  // synchronizing backward() on any replica is InvalidArgumentError on every
  // replica, naming the parameter(s) and how many replicas missed them
  // (after the step's collectives completed, so no rank hangs). true (torch
  // DDP's find_unused_parameters): used by some replicas only, it counts as
  // zero on the others and its .grad is defined afterwards on every replica;
  // used by no replica that ran a pass in the accumulation window (a replica
  // with zero rows is neutral), its .grad is what it was before the window,
  // undefined unless the user kept one, so an optimizer skips it as
  // single-process LibTorch would.
  bool find_unused_parameters = false;
  // true (default): each bucket of gradients is handed to the strategy's
  // all-reduce from the autograd hook the moment its last gradient is
  // accumulated, overlapping communication with the rest of backward.
  // false: nothing is sent until backward has finished, then every bucket
  // (the "after backward" loop of hand-written LibTorch programs).
  bool overlap = true;
  // Bucket size in bytes: consecutive parameters (in reverse registration
  // order, the order backprop produces them) are grouped into buckets of up
  // to this many bytes, one all-reduce call per bucket (which the
  // multi-worker fusion engine packs into one message: the default equals
  // its default bytes_per_pack). 0 = one bucket.
  size_t bytes_per_bucket = kMultiWorkerBytesPerPack;
};

struct DdpStats {
  int64_t sync_steps = 0;        // backward() calls that synchronized
  int64_t buckets_launched = 0;  // bucket all-reduces started (this process, all replicas)
  // Buckets started from an autograd hook, i.e. while backward was still
  // running (overlap); the rest started after backward returned.
  int64_t buckets_in_hook = 0;
};

// Data parallel training of a torch::nn::Module under a synchronous
// strategy. Not copyable or movable (the hooks refer to it).
class DistributedDataParallel {
 public:
  // Collective and blocking, in cross-replica context (outside
  // Strategy::run): every worker process constructs it at the same point
  // with the same module architecture.
  //  1. Checks that every replica of the job has the same parameters and
  //     buffers (names, dtypes, shapes, in named_parameters() /
  //     named_buffers() order); a difference is InvalidArgumentError on every
  //     rank naming the first differing parameter/buffer and the replica.
  //  2. Broadcasts every parameter and buffer from the chief (worker 0), in
  //     place, into `module`.
  //  3. With several local replicas, clones `module` (Module::clone(), so it
  //     must be a torch::nn::Cloneable) once per further replica; module(0)
  //     is `module` itself.
  //  4. Registers a post-hook on each parameter's gradient accumulator.
  // An elastic MultiWorkerMirroredStrategy (diststrat/elastic.h): steps 1
  // and 2 are left out (no collective call before ElasticState::run); the
  // module's values reach every worker with the group's state, through a
  // TrainingState tracked by the ElasticState (TrainingState::track).
  // Parameters must be dense, contiguous, of a dtype to_diststrat accepts.
  // GPU replicas (a CUDA LibTorch): `module` is moved onto replica 0's
  // torch_device() in place and cloned onto the others'; the all-reduce is
  // launched after each CUDA autograd pass, ordered with torch's current
  // stream (docs/torch.md, "CUDA modules"). A LibTorch without CUDA:
  // UnimplementedError naming the replicas' devices.
  // ParameterServerStrategy: UnimplementedError (use ParameterServerModel).
  DistributedDataParallel(Strategy& strategy, std::shared_ptr<torch::nn::Module> module,
                          DdpOptions options = {});
  // Removes the hooks (the modules stay usable as plain modules).
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  int num_local_replicas() const { return static_cast<int>(replicas_.size()); }
  // Local replica i's module (0 = the module given). Thread-safe.
  const std::shared_ptr<torch::nn::Module>& module(int local_replica) const;
  // This replica's module, in replica context. When several replicas share
  // the process it also sets LibTorch's intra-op threads to 1 on the calling
  // thread (at::set_num_threads(1): one replica = one core; note that this
  // also shrinks LibTorch's process-wide pthreadpool).
  const std::shared_ptr<torch::nn::Module>& module(ReplicaContext& ctx);
  // Parameter names (named_parameters() order, requires_grad ones only).
  const std::vector<std::string>& parameter_names() const { return names_; }

  // Replica context; every replica in sync calls it (also one with zero
  // rows). `loss` is the mean loss over this replica's `rows` rows of the
  // current (micro-)batch (a scalar); `global_rows` the rows of that batch
  // over every replica in sync (DistributedBatch::global_size()). Runs the
  // backward pass; outside no_sync() it also synchronizes: when it returns,
  // every parameter's .grad holds the gradient of the mean loss over all
  // rows of every replica and of every micro-batch accumulated under
  // no_sync() since the last synchronization (the true global batch, so a
  // short last batch is weighted right), identical on every replica, plus
  // the .grad it already had when the window began (not reset since the
  // last step; summed as single-process accumulation would).
  // A replica with rows == 0 runs no backward (its loss is NaN) and
  // contributes zero. Gradients accumulated into the modules' parameters
  // outside backward() (a plain loss.backward(), another model's backward
  // through this one; torch::autograd::grad accumulates none) are never
  // synchronized: the next synchronizing backward() throws
  // FailedPreconditionError on every replica (after the step's collectives),
  // and a second such gradient into one parameter before that throws from
  // that autograd pass. A module whose parameters were replaced or changed
  // dtype/device since construction fails the pass (FailedPreconditionError,
  // handled as a bad loss). A replica whose autograd pass throws (a non-scalar
  // loss, an autograd error) still sends its buckets (zeros) and rethrows;
  // every other replica then throws AbortedError (the step's sum is
  // incomplete) instead of waiting. Blocking (the strategy's deadline bounds
  // every wait); errors of the collectives (a peer that never arrives, a
  // mismatch) are thrown here. Call it from the replica's own thread.
  void backward(ReplicaContext& ctx, const at::Tensor& loss, int64_t rows, int64_t global_rows);

  // RAII guard (torch DDP's no_sync): backward() calls while it lives only
  // accumulate gradients locally; the first backward() after it is gone
  // synchronizes everything accumulated. Per replica: each replica takes its
  // own guard on its own thread. Not nestable for one replica.
  class NoSync {
   public:
    ~NoSync();
    NoSync(NoSync&& o) noexcept;
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    friend class DistributedDataParallel;
    NoSync(DistributedDataParallel* ddp, int local) : ddp_(ddp), local_(local) {}
    DistributedDataParallel* ddp_;
    int local_;
  };
  NoSync no_sync(ReplicaContext& ctx);

  const DdpOptions& options() const { return options_; }
  Strategy& strategy() const { return *strategy_; }
  DdpStats stats() const;

  struct Replica;  // per local replica state (src/torch/ddp_replica.h)

 private:
  void on_gradient_ready(int local, size_t param);
  void record_stray(int local, size_t param);
  std::string module_change(const Replica& r) const;
  void add_back_used(Replica& r, size_t bucket);
  void finish_window(Replica& r, const float* flags);
  void launch_ready_buckets(Replica& r, bool in_hook);
  void launch_bucket(Replica& r, size_t bucket, bool in_hook);
  void check_no_stray(ReplicaContext& ctx, Replica& r) const;
  void check_same_step(ReplicaContext& ctx, const Replica& r) const;

  friend class TrainingState;  // track() marks the model as committed by an ElasticState

  Strategy* strategy_;
  DdpOptions options_;
  // An elastic strategy: backward() refuses to run until a TrainingState of
  // this model is tracked (TrainingState::track), or the replicas would
  // diverge without a word (nothing broadcasts the module there).
  bool elastic_ = false;
  bool elastic_tracked_ = false;
  std::vector<std::shared_ptr<torch::nn::Module>> replicas_;
  std::vector<std::string> names_;                      // parameters with requires_grad
  std::vector<std::vector<size_t>> buckets_;            // parameter indices, launch order
  std::vector<size_t> bucket_of_;                       // parameter index -> bucket
  std::vector<std::vector<std::string>> bucket_names_;  // per bucket, as all-reduced
  std::vector<std::unique_ptr<Replica>> state_;
};

// ---- ParameterServerStrategy ---------------------------------------------------

// A torch::nn::Module trained by parameter servers. Worker side:
//
//   ```cpp fragment=torch_ps torch norun
//   ds::ParameterServerStrategy strategy(options);
//   if (strategy.is_ps()) { strategy.join(); return 0; }
//   ds::SGD sgd(strategy, {.learning_rate = 0.05f});       // applied on the PS ranks
//   dt::ParameterServerModel model(strategy, net, sgd, {"emb.weight"});
//   strategy.run([&](ds::ReplicaContext& ctx) {
//     auto& m = model.module(ctx);                    // parameters = the pulled cache
//     auto rows = model.gather_rows(ctx, "emb.weight", ids);   // row-sparse pull
//     at::Tensor e = torch::embedding(rows.rows, rows.index);
//     at::Tensor loss = loss_of(e, y);                // mean over this replica's rows
//     model.backward(ctx, loss, rows_here, batch.global_size());  // pushes, no wait
//   });
//   ```
//
// Each dense parameter (requires_grad, by its named_parameters() name) is a PS
// variable; the worker's replicas' module parameters are views of the
// worker's pull cache (no copy: Variable::read), so forward always sees the
// weights pulled for this step. Parameters named in `row_sparse` (an
// Embedding's [V, D] weight) are row-sparse PS variables that are never pulled
// whole: gather_rows pulls only a step's rows and backward pushes gradients for
// only those rows. Gradients are pushed after backward (asynchronously, per
// ParameterServerOptions::max_staleness), summed over the worker's replicas
// and scaled by 1 / global rows, as Optimizer::apply_gradients expects.
// Buffers are not trained by the PS (each worker keeps its own).
class ParameterServerModel {
 public:
  // Cross-replica context on a worker; every worker constructs it at the
  // same point (variables are created in named_parameters() order; the PS
  // keeps the chief's initial values). Clones the module per further local
  // replica (a torch::nn::Cloneable). PS ranks: FailedPreconditionError.
  ParameterServerModel(ParameterServerStrategy& strategy, std::shared_ptr<torch::nn::Module> module,
                       Optimizer& optimizer, std::vector<std::string> row_sparse = {});
  ~ParameterServerModel();
  ParameterServerModel(const ParameterServerModel&) = delete;
  ParameterServerModel& operator=(const ParameterServerModel&) = delete;

  int num_local_replicas() const { return static_cast<int>(replicas_.size()); }
  const std::shared_ptr<torch::nn::Module>& module(int local_replica) const;
  // Replica context: this replica's module, its dense parameters viewing the
  // cache pulled for this step (intra-op threads set to 1 as under DDP).
  const std::shared_ptr<torch::nn::Module>& module(ReplicaContext& ctx);
  // The PS variable of a parameter (dense or row-sparse); NotFoundError.
  Variable variable(const std::string& parameter) const;

  struct Rows {
    at::Tensor rows;   // [n_unique, D] pulled rows, a leaf that requires grad
    at::Tensor index;  // ids remapped into `rows` (same shape as ids)
  };
  // Replica context: pulls the rows `ids` (int64, any shape) of row-sparse
  // parameter `name` (blocking); torch::embedding(rows.rows, rows.index)
  // equals the full table's lookup. The rows' gradients are pushed by the
  // next backward(). Several calls per step accumulate.
  Rows gather_rows(ReplicaContext& ctx, const std::string& name, const at::Tensor& ids);
  // Replica context, every local replica: backward of `loss` (the mean over
  // this replica's `rows` rows; rows == 0 runs none and pushes zeros), then
  // one push of every dense gradient and every gathered rows' gradient.
  // Does not wait for the PS (errors come at the next wait: run, flush).
  void backward(ReplicaContext& ctx, const at::Tensor& loss, int64_t rows, int64_t global_rows);

  struct Replica;  // src/torch/parameter_server.cc

 private:
  ParameterServerStrategy* strategy_;
  Optimizer* optimizer_;
  std::vector<std::shared_ptr<torch::nn::Module>> replicas_;
  std::vector<std::string> dense_names_, sparse_names_;
  std::vector<Variable> dense_vars_, sparse_vars_;
  std::vector<std::unique_ptr<Replica>> state_;
};

// ---- checkpoints -------------------------------------------------------------

// A LibTorch job's state as diststrat variables, so that Checkpoint /
// CheckpointManager save and restore it like any model (safetensors files
// that Python's torch / safetensors read):
//   "<prefix><name>"            every parameter and buffer, by its
//                               named_parameters() / named_buffers() name
//   "<prefix><name>/<slot>"     optimizer state: SGD momentum_buffer; Adam and
//                               AdamW exp_avg, exp_avg_sq, max_exp_avg_sq
//                               (amsgrad) and step (int64 [1])
//   "<prefix>torch/optimizer_state"  int64 [P]: 1 where the optimizer has state
//                               for parameter p (it creates it lazily)
//   "<prefix>torch/step"        int64 [1]: the step passed to capture()
//
//   ```cpp fragment=torch_ddp torch
//   dt::TrainingState state(ddp, {opt0.get(), opt1.get()});   // collective
//   ds::Checkpoint ckpt(strategy);
//   ds::CheckpointManager manager(ckpt, dir);
//   if (manager.restore_latest()) step = state.apply();   // resume
//   for (; step < steps; ++step) {                        // train; every N steps:
//     train_step(dist.batch(step % dist.num_batches()));  // the data position: docs/torch.md
//     if ((step + 1) % every == 0) { state.capture(step + 1); manager.save(step + 1); }
//   }
//   ```
//
// The variables are created with trainable = false (no diststrat optimizer
// touches them) through Strategy::create_variable, so every process creates
// them at the same point (multi-worker: the chief's values). Optimizers other
// than SGD, Adam and AdamW are UnimplementedError. All methods: cross-replica
// context (outside Strategy::run), blocking, not thread-safe with run().
class TrainingState {
 public:
  // `optimizers`: none, or one per local replica, each over
  // ddp.module(i)->parameters() (the same kind and options on every replica).
  TrainingState(DistributedDataParallel& ddp, std::vector<torch::optim::Optimizer*> optimizers = {},
                std::string prefix = "");
  ~TrainingState();
  TrainingState(const TrainingState&) = delete;
  TrainingState& operator=(const TrainingState&) = delete;

  // Copies local replica 0's module and optimizer state and `step` into the
  // variables (call before Checkpoint::save / CheckpointManager::save).
  void capture(int64_t step);
  // Writes the variables into every local replica's module and optimizer
  // (call after a successful restore); returns the captured step.
  int64_t apply();
  // Elastic training (diststrat/elastic.h; required there: DDP's backward
  // refuses to run under an elastic strategy until it is called): the modules and optimizers are
  // committed with the ElasticState's other state (capture(position.step)
  // before each commit) and put back (apply()) after a failure or when the
  // state comes from a member, so a joiner's module and optimizer start from
  // the group's. Call before state.run(); this object must outlive the run.
  // The optimizer's hyper-parameters as they are at this call (every param
  // group's lr, momentum, dampening, weight_decay, nesterov; Adam's and
  // AdamW's lr, betas, eps, weight_decay, amsgrad) are compared whenever a
  // group forms (ElasticState::agree_on): a joiner configured otherwise
  // leaves before it is admitted, naming the setting.
  //   ```cpp fragment=torch_elastic torch norun
  //   dt::TrainingState ts(ddp, {opt0.get()});
  //   ds::ElasticState state(strategy);
  //   ts.track(state);
  //   ```
  void track(ElasticState& state);
  // The variables, in creation order.
  const std::vector<Variable>& variables() const { return variables_; }

  struct Slot;  // src/torch/checkpoint.cc

 private:
  DistributedDataParallel* ddp_;
  std::vector<torch::optim::Optimizer*> optimizers_;
  std::vector<Variable> variables_;
  std::vector<std::unique_ptr<Slot>> slots_;
  Variable defined_, step_;
};

}  // namespace diststrat::libtorch
