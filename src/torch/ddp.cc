// DistributedDataParallel for LibTorch over the strategies' all-reduce.
//
// How a synchronizing backward() runs (per local replica, on its thread):
//  1. The parameters (requires_grad, named_parameters() order) are cut into
//     buckets at construction: reverse registration order (the order backprop
//     produces gradients, as c10d's reducer assumes before it has seen a
//     step), consecutive parameters up to bytes_per_bucket. The bucket list is
//     identical on every replica of the job, so is every launch order below.
//  2. backward() seeds the autograd pass with rows / global_rows (the loss
//     is a mean over this replica's rows; under no_sync accumulation with
//     `rows`, the sums being divided by the window's global rows when the
//     bucket launches) and runs it. A post-hook on each parameter's gradient accumulator (the
//     AccumulateGrad node, as c10d's reducer registers it) fires once the
//     parameter's .grad holds this pass's contribution: the parameter is
//     marked ready, and while the next bucket in launch order is complete it
//     is launched: its gradients (rescaled after accumulation) are handed to
//     ReplicaContext::all_reduce_async(kSum) as one call (one fused pack of
//     the multi-worker fusion engine), while backward continues.
//     The first backward() of a window moves each .grad that is already
//     there (not reset by the user) aside, so the buckets carry only the
//     window's gradients; it is added back after the reduction (torch DDP
//     averages identical old values to themselves: old + the global mean).
//  3. After the autograd pass, the buckets not launched yet are launched in
//     order: their parameters without a gradient in this pass keep what they
//     accumulated under no_sync(), or become zeros. The last bucket also
//     carries one float per parameter, 1 where this replica ran an autograd
//     pass in the accumulation window and got no gradient for it, and the
//     step flags (kStepFlags): whether this replica's autograd pass failed,
//     what the step must agree on, whether it ran a pass at all, and whether
//     gradients were accumulated into its parameters outside ddp.backward.
//     So every replica learns after the reduction which parameters some
//     replica missed (an error on every replica unless
//     find_unused_parameters), which ones no replica used, whether the step's
//     sum is incomplete (AbortedError on the others; the failing replica
//     throws its own error) and whether some replica's gradients hold
//     something that was never synchronized (an error on every replica): no
//     rank waits for a bucket another rank never sends.
//  4. Every bucket's Work is waited for; the gradients are then the global
//     mean, identical on every replica. A parameter that no replica used in
//     the window gets back the .grad it had before the window (undefined
//     unless the user kept one), as torch DDP leaves it untouched.
//
// Gradients that reach a parameter outside ddp.backward (a plain
// loss.backward(), another DDP's pass) fire the same hooks with no pass of
// this DDP active on the thread: they are recorded, reported by the next
// synchronizing backward() on every replica, and a second one into the same
// parameter before that (a loop that never calls ddp.backward) throws from
// the hook. torch::autograd::grad runs no AccumulateGrad node, so no hook.
// Under MultiWorkerMirroredStrategy the all-reduce of a bucket runs on the
// fusion engine's thread while backward goes on; under Mirrored/CentralStorage
// it is the in-process all-reduce (it completes in the hook).
//
// The files: ddp.cc (this one) builds the replicas and hands out their
// modules; ddp_module_sync.cc checks that every replica of the job has the
// same module and broadcasts the chief's values; ddp_buckets.cc cuts the
// parameters into buckets; ddp_reducer.cc is the hook and the launch of the
// buckets; ddp_backward.cc the step (2.-4.); ddp_step_checks.cc what the
// reduced step flags say; ddp_replica.h the state of each local replica.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <utility>

#include "diststrat/torch.h"

#include "ddp_buckets.h"
#include "ddp_module_sync.h"
#include "ddp_replica.h"
#include "intra_op_threads.h"
#include "torch_compat.h"

namespace diststrat::libtorch {

DistributedDataParallel::DistributedDataParallel(Strategy& strategy,
                                                 std::shared_ptr<torch::nn::Module> module,
                                                 DdpOptions options)
    : strategy_(&strategy), options_(options) {
  DISTSTRAT_CHECK(module != nullptr, kInvalidArgument, "DistributedDataParallel: null module");
  DISTSTRAT_CHECK(strategy.name() != "parameter_server", kUnimplemented,
                  "DistributedDataParallel: ParameterServerStrategy is not supported (its workers "
                  "do not all-reduce; use ParameterServerModel, docs/torch.md)");
  // Its hooks all-reduce from inside the step function, which the mode calls
  // once per virtual shard (collectives refused there); LibTorch's kernels
  // and batch norm would need pinning per shard (docs/determinism.md).
  DISTSTRAT_CHECK(!strategy.determinism().enabled(), kUnimplemented,
                  "DistributedDataParallel: the strategy is in determinism mode (virtual_shards ",
                  strategy.determinism().virtual_shards,
                  "), which is not built for LibTorch DDP; use the library's own models "
                  "(diststrat/nn.h) for world-size-invariant training, docs/determinism.md");
  const int local = strategy.num_local_replicas();
  const std::vector<std::string> signature = ddp_detail::module_signature(*module);

  // 1. Same module everywhere (only where other processes take part: local
  // replicas are clones of one module). 2. The chief's values, in place.
  // An elastic strategy makes no collective call before ElasticState::run:
  // the group's values come with its state (TrainingState::track), and a
  // module that differs fails that state's assignment, naming the variable.
  const ClusterInfo cluster = strategy.cluster();
  const auto* multi_worker = dynamic_cast<const MultiWorkerMirroredStrategy*>(&strategy);
  elastic_ = multi_worker != nullptr && multi_worker->elastic();
  if (cluster.num_workers > 1 && !elastic_) {
    ddp_detail::check_same_module(strategy, signature);
    ddp_detail::broadcast_from_chief(strategy, *module);
  }

  // 3. One module per local replica. A GPU replica's device is a logical
  // GPU of the strategy's DeviceManager; torch knows the physical CUDA
  // ordinal (two logical GPUs of one split GPU are both cuda:0).
  DeviceManager* manager = device_manager_of(strategy);
  std::vector<torch::Device> devices;
  for (int i = 0; i < local; ++i)
    devices.push_back(torch_device(strategy.devices()[static_cast<size_t>(i)], manager));
  bool any_cuda = false;
  std::string where;
  for (size_t i = 0; i < devices.size(); ++i) {
    any_cuda = any_cuda || devices[i].is_cuda();
    where += (i ? ", " : "") + devices[i].str() + " (" + strategy.devices()[i].to_string() + ")";
  }
  DISTSTRAT_CHECK(!any_cuda || torch::cuda::is_available(), kUnimplemented,
                  "DistributedDataParallel: the local replicas are on ", where,
                  ", but this LibTorch (", compat::version(),
                  ") has no CUDA or sees no CUDA device (torch::cuda::is_available() is false)");
  if (devices[0].is_cuda()) {
    // Replica 0 trains `module` itself, on its GPU: moved there in place
    // (Module::to keeps the parameter objects), before any hook exists.
    try {
      module->to(devices[0]);
    } catch (const c10::Error& e) {
      throw_error(ErrorCode::kInvalidArgument,
                  "DistributedDataParallel: cannot move the module onto " + devices[0].str() +
                      " for local replica 0: " + e.what_without_backtrace());
    }
  }
  replicas_.push_back(module);
  for (int i = 1; i < local; ++i) {
    const Device& d = strategy.devices()[static_cast<size_t>(i)];
    const torch::Device target = devices[static_cast<size_t>(i)];
    std::shared_ptr<torch::nn::Module> copy;
    try {
      copy = d.is_gpu() ? module->clone(target) : module->clone();
    } catch (const c10::Error& e) {
      throw_error(ErrorCode::kInvalidArgument,
                  "DistributedDataParallel: cannot replicate the module for local replica " +
                      std::to_string(i) + " onto " + target.str() + " (" + d.to_string() +
                      "; make it a torch::nn::Cloneable, and a CUDA LibTorch for a GPU): " +
                      e.what_without_backtrace());
    }
    // Module::clone() re-creates parameters through reset(), trainable:
    // freeze what the original has frozen, or the replicas would train
    // different parameter sets.
    const auto from = module->named_parameters(true);
    const auto to = copy->named_parameters(true);
    DISTSTRAT_CHECK_EQ(from.size(), to.size(),
                       "DistributedDataParallel: parameters of the clone of local replica ", i);
    for (size_t j = 0; j < from.size(); ++j) {
      if (to[j].value().requires_grad() != from[j].value().requires_grad())
        to[j].value().set_requires_grad(from[j].value().requires_grad());
    }
    replicas_.push_back(copy);
  }

  // Parameters that train, and the buckets in launch order.
  for (const auto& p : module->named_parameters(true)) {
    if (p.value().requires_grad()) names_.push_back(p.key());
  }
  std::vector<size_t> sizes;
  for (const auto& p : module->named_parameters(true)) {
    if (!p.value().requires_grad()) continue;
    const at::Tensor& t = p.value();
    DISTSTRAT_CHECK(t.layout() == c10::kStrided && t.is_contiguous(), kInvalidArgument,
                    "DistributedDataParallel: parameter '", p.key(), "' ",
                    ddp_detail::shape_text(t), " must be dense and contiguous");
    sizes.push_back(static_cast<size_t>(t.numel()) * t.element_size());
  }
  ddp_detail::BucketPlan plan = ddp_detail::plan_buckets(names_, sizes, options_.bytes_per_bucket);
  buckets_ = std::move(plan.buckets);
  bucket_of_ = std::move(plan.bucket_of);
  bucket_names_ = std::move(plan.names);

  // 4. Hooks on every replica's gradient accumulators.
  for (int i = 0; i < local; ++i) {
    auto r = std::make_unique<Replica>();
    r->local = i;
    r->device = devices[static_cast<size_t>(i)];
    r->cuda = r->device.is_cuda();
    for (const auto& p : replicas_[static_cast<size_t>(i)]->named_parameters(true)) {
      if (p.value().requires_grad()) r->params.push_back(p.value());
    }
    DISTSTRAT_CHECK_EQ(r->params.size(), names_.size(),
                       "DistributedDataParallel: parameters of the clone of local replica ", i);
    for (const auto& p : replicas_[static_cast<size_t>(i)]->named_parameters(true)) {
      r->module_params.push_back(p.value());
      r->module_trainable.push_back(p.value().requires_grad() ? 1 : 0);
    }
    r->got_grad.assign(names_.size(), 0);
    r->stash.resize(names_.size());
    r->stray.assign(names_.size(), 0);
    r->ready.assign(names_.size(), 0);
    for (size_t k = 0; k < r->params.size(); ++k) {
      std::shared_ptr<torch::autograd::Node> acc =
          torch::autograd::impl::grad_accumulator(r->params[k]);
      DISTSTRAT_CHECK(acc != nullptr, kInvalidArgument, "DistributedDataParallel: parameter '",
                      names_[k], "' is not a leaf that accumulates a gradient");
      const uintptr_t key =
          acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
              [this, i, k](const torch::autograd::variable_list& outputs,
                           const torch::autograd::variable_list&) {
                on_gradient_ready(i, k);
                return outputs;
              }));
      r->accumulators.push_back(std::move(acc));
      r->hook_keys.push_back(key);
    }
    state_.push_back(std::move(r));
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  for (auto& r : state_) {
    for (size_t k = 0; k < r->accumulators.size(); ++k)
      r->accumulators[k]->del_post_hook(r->hook_keys[k]);
  }
}

const std::shared_ptr<torch::nn::Module>& DistributedDataParallel::module(int local_replica) const {
  DISTSTRAT_CHECK(local_replica >= 0 && local_replica < num_local_replicas(), kInvalidArgument,
                  "DistributedDataParallel::module(", local_replica, "): ", num_local_replicas(),
                  " local replicas");
  return replicas_[static_cast<size_t>(local_replica)];
}

const std::shared_ptr<torch::nn::Module>& DistributedDataParallel::module(ReplicaContext& ctx) {
  if (num_local_replicas() > 1) single_intra_op_thread();
  return module(ctx.local_replica_id());
}

DdpStats DistributedDataParallel::stats() const {
  DdpStats s;
  for (const auto& r : state_) {
    s.buckets_launched += r->launched;
    s.buckets_in_hook += r->in_hook;
  }
  if (!state_.empty()) s.sync_steps = state_[0]->sync_steps;
  return s;
}

// Empty, or what changed in local replica r's module since construction:
// parameters that DDP has no hook on would never be synchronized.
std::string DistributedDataParallel::module_change(const Replica& r) const {
  torch::nn::Module& m = *replicas_[static_cast<size_t>(r.local)];
  const std::vector<at::Tensor> now = m.parameters(/*recurse=*/true);
  bool same = now.size() == r.module_params.size();
  for (size_t j = 0; same && j < now.size(); ++j)
    same = now[j].unsafeGetTensorImpl() == r.module_params[j].unsafeGetTensorImpl();
  if (!same) {
    const auto named = m.named_parameters(/*recurse=*/true);
    for (size_t j = 0; j < named.size(); ++j) {
      if (j >= r.module_params.size() ||
          named[j].value().unsafeGetTensorImpl() != r.module_params[j].unsafeGetTensorImpl()) {
        return "parameter '" + named[j].key() +
               "' is not the tensor it had then (a replaced layer or parameter?)";
      }
    }
    return "it has " + std::to_string(named.size()) + " parameters where it had " +
           std::to_string(r.module_params.size());
  }
  for (size_t j = 0; j < now.size(); ++j) {
    if (!r.module_trainable[j] && now[j].requires_grad()) {
      // Unfrozen later: no hook, so its gradient would stay local.
      return "parameter '" + m.named_parameters(/*recurse=*/true)[j].key() +
             "' requires grad now but did not then (unfrozen?)";
    }
  }
  for (size_t k = 0; k < r.params.size(); ++k) {
    if (torch::autograd::impl::try_get_grad_accumulator(r.params[k]).get() !=
        r.accumulators[k].get()) {
      return "parameter '" + names_[k] +
             "' has another gradient accumulator (its dtype or device changed, e.g. by "
             "module->to(...))";
    }
  }
  return "";
}

DistributedDataParallel::NoSync DistributedDataParallel::no_sync(ReplicaContext& ctx) {
  const int local = ctx.local_replica_id();
  DISTSTRAT_CHECK(&ctx.strategy() == strategy_ && local >= 0 && local < num_local_replicas(),
                  kInvalidArgument,
                  "DistributedDataParallel::no_sync: the replica context is not "
                  "one of this model's strategy");
  Replica& r = *state_[static_cast<size_t>(local)];
  DISTSTRAT_CHECK(!r.in_no_sync, kFailedPrecondition, "DistributedDataParallel::no_sync (replica ",
                  ctx.replica_id(), "): already inside a no_sync() guard");
  r.in_no_sync = true;
  return NoSync(this, local);
}

DistributedDataParallel::NoSync::NoSync(NoSync&& o) noexcept : ddp_(o.ddp_), local_(o.local_) {
  o.ddp_ = nullptr;
}

DistributedDataParallel::NoSync::~NoSync() {
  if (ddp_ != nullptr) ddp_->state_[static_cast<size_t>(local_)]->in_no_sync = false;
}

}  // namespace diststrat::libtorch
