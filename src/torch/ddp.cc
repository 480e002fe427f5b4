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
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <sstream>

#include "diststrat/torch.h"

#include "core/fnv1a.h"
#include "intra_op_threads.h"
#include "torch_compat.h"

namespace diststrat::libtorch {

namespace {

std::string shape_text(const at::Tensor& t) {
  std::ostringstream os;
  os << t.scalar_type() << t.sizes();
  return os.str();
}

// One line per parameter / buffer: what every replica must agree on.
std::vector<std::string> module_signature(torch::nn::Module& m) {
  std::vector<std::string> lines;
  for (const auto& p : m.named_parameters(/*recurse=*/true)) {
    lines.push_back("parameter '" + p.key() + "' " + shape_text(p.value()) +
                    (p.value().requires_grad() ? "" : " (no grad)"));
  }
  for (const auto& b : m.named_buffers(/*recurse=*/true)) {
    lines.push_back("buffer '" + b.key() + "' " + shape_text(b.value()));
  }
  return lines;
}

std::string join_lines(const std::vector<std::string>& lines) {
  std::string s;
  for (const std::string& l : lines) s += l + "\n";
  return s;
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream is(s);
  for (std::string l; std::getline(is, l);) out.push_back(l);
  return out;
}

// Checks that every replica in sync has the same signature; throws the same
// InvalidArgumentError on every process otherwise. Collective (two gathers).
void check_same_module(Strategy& strategy, const std::vector<std::string>& lines) {
  const int local = strategy.num_local_replicas();
  const std::string text = join_lines(lines);
  std::vector<Tensor> mine;
  for (int i = 0; i < local; ++i) {
    Tensor t(Shape{1, 2}, DType::kInt64);
    t.data<int64_t>()[0] = static_cast<int64_t>(fnv1a(text));
    t.data<int64_t>()[1] = static_cast<int64_t>(text.size());
    mine.push_back(t);
  }
  const Tensor all = strategy.gather(PerReplica<Tensor>(mine));
  const int64_t n = all.shape()[0];
  const int64_t* v = all.data<int64_t>();
  bool same = true;
  int64_t max_len = 0;
  for (int64_t r = 0; r < n; ++r) {
    same = same && v[2 * r] == v[0] && v[2 * r + 1] == v[1];
    max_len = std::max(max_len, v[2 * r + 1]);
  }
  if (same) return;
  // Somebody differs: every process gathers every signature text (padded to
  // the longest, one int32 per byte) and names the first difference against
  // replica 0 (the chief's first replica).
  std::vector<Tensor> texts;
  for (int i = 0; i < local; ++i) {
    Tensor t(Shape{1, std::max<int64_t>(max_len, 1)}, DType::kInt32);
    for (size_t c = 0; c < text.size(); ++c)
      t.data<int32_t>()[c] = static_cast<unsigned char>(text[c]);
    texts.push_back(t);
  }
  const Tensor all_text = strategy.gather(PerReplica<Tensor>(texts));
  const int64_t width = all_text.shape()[1];
  auto text_of = [&](int64_t r) {
    std::string s(static_cast<size_t>(v[2 * r + 1]), '\0');
    for (size_t c = 0; c < s.size(); ++c)
      s[c] = static_cast<char>(all_text.data<int32_t>()[r * width + c]);
    return split_lines(s);
  };
  const std::vector<std::string> chief = text_of(0);
  for (int64_t r = 1; r < n; ++r) {
    const std::vector<std::string> other = text_of(r);
    for (size_t i = 0; i < std::max(chief.size(), other.size()); ++i) {
      const std::string a = i < chief.size() ? chief[i] : "";
      const std::string b = i < other.size() ? other[i] : "";
      if (a == b) continue;
      std::string what;
      if (a.empty()) {
        what = "replica " + std::to_string(r) + " has " + b + " that replica 0 does not have";
      } else if (b.empty()) {
        what = "replica 0 has " + a + " that replica " + std::to_string(r) + " does not have";
      } else {
        what = "replica 0 has " + a + " where replica " + std::to_string(r) + " has " + b;
      }
      throw_error(ErrorCode::kInvalidArgument,
                  "DistributedDataParallel: the module differs across replicas (entry " +
                      std::to_string(i) + " of named_parameters() then named_buffers()): " + what +
                      "; every worker must construct the same module");
    }
  }
  throw_error(ErrorCode::kInternal,
              "DistributedDataParallel: module signatures differ (hash) but "
              "their texts agree");
}

// Floats after the per-parameter "no gradient" flags in the last bucket
// (Replica::unused_flags says which is which).
constexpr size_t kStepFlags = 8;
// Counts sent as float32 are exact below 2^24; the sync index goes mod 2^20.
constexpr int64_t kSyncIndexModulus = int64_t{1} << 20;

// The replica whose backward() runs an autograd pass on this thread (CPU
// passes run on the caller's thread), so that a hook of another replica's
// parameter, reached because the step used the wrong replica's module, is
// told apart from this replica's own.
struct ActivePass {
  const DistributedDataParallel* ddp = nullptr;
  int local = -1;
};
thread_local ActivePass active_pass;

}  // namespace

struct DistributedDataParallel::Replica {
  int local = 0;
  // The replica's torch device: its module's parameters live there.
  torch::Device device{torch::kCPU};
  bool cuda = false;
  // This replica's backward() is inside its autograd pass. A CUDA pass runs
  // the gradient hooks on autograd's thread of that device, not on the
  // caller's (ActivePass is not set there): this tells them apart from
  // gradients that reach the parameters outside ddp.backward.
  std::atomic<bool> in_pass{false};
  // A CUDA replica's step flags, on its device (an all-reduce takes the
  // tensors of one device); read back into unused_flags after the waits.
  at::Tensor flags_device;
  std::vector<at::Tensor> params;  // requires_grad, in names_ order
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::vector<uintptr_t> hook_keys;

  bool in_no_sync = false;
  // The accumulation window (micro-batches since the last synchronization).
  int64_t window_global_rows = 0;
  int64_t window_rows = 0;     // this replica's rows in the window
  int64_t window_batches = 0;  // backward() calls in the window
  // Synchronizing backward() calls in the current Strategy::run (the run
  // told apart by Strategy::steps_run()).
  int64_t run_seen = -1;
  int64_t sync_index = 0;
  // Every parameter of the module (named_parameters() order, with or
  // without requires_grad) when DDP was constructed: a replaced layer is
  // found by identity.
  std::vector<at::Tensor> module_params;
  std::vector<char> module_trainable;  // their requires_grad then
  // Per parameter: a gradient reached it in a pass of this replica's
  // backward() in the window (the hook fired with a defined .grad).
  std::vector<char> got_grad;
  // Per parameter: the .grad it had when the window began (moved aside).
  std::vector<at::Tensor> stash;
  bool window_ran_pass = false;  // an autograd pass ran in the window
  // The synchronizing backward in progress.
  bool syncing = false;
  ReplicaContext* ctx = nullptr;
  float scale = 1.0f;
  std::vector<char> ready;   // per parameter: its bucket may include it
  std::vector<int> pending;  // per bucket: parameters not ready yet
  size_t next_bucket = 0;    // first bucket not launched
  std::vector<Work> works;
  std::exception_ptr launch_error;
  // float32 [P + kStepFlags], summed over replicas (last bucket): [k] =
  // replicas that ran a pass but got no gradient for parameter k, [P] =
  // replicas whose backward failed, [P+1] = their window rows, [P+2] =
  // their window global_rows, [P+3] = their window backward() calls,
  // [P+4] = their synchronization index in this run() (what they must agree
  // on), [P+5] = replicas that ran an autograd pass in the window, [P+6] =
  // replicas with gradients from outside ddp.backward, [P+7] = the sum of
  // those replicas' ids + 1 (names the replica when there is one).
  Tensor unused_flags;
  bool failed = false;  // this replica's autograd pass failed
  // Set by a hook of another replica's parameter during this replica's pass.
  std::string foreign_parameter;
  // Gradients accumulated into this replica's parameters outside any
  // backward() of this DDP (any thread may run such a pass: guarded).
  std::mutex stray_mu;
  std::vector<char> stray;   // per parameter, since the last synchronization
  std::string stray_first;   // the first such parameter's name
  int64_t stray_count = 0;   // parameters in `stray`
  bool stray_sent = false;   // the current synchronization carries them
  std::string stray_report;  // what they were, once sent and cleared
  std::atomic<int64_t> launched{0}, in_hook{0}, sync_steps{0};
};

DistributedDataParallel::DistributedDataParallel(Strategy& strategy,
                                                 std::shared_ptr<torch::nn::Module> module,
                                                 DdpOptions options)
    : strategy_(&strategy), options_(options) {
  DISTSTRAT_CHECK(module != nullptr, kInvalidArgument, "DistributedDataParallel: null module");
  DISTSTRAT_CHECK(strategy.name() != "parameter_server", kUnimplemented,
                  "DistributedDataParallel: ParameterServerStrategy is not supported (its workers "
                  "do not all-reduce; use ParameterServerModel, docs/torch.md)");
  const int local = strategy.num_local_replicas();
  const std::vector<std::string> signature = module_signature(*module);

  // 1. Same module everywhere (only where other processes take part: local
  // replicas are clones of one module).
  const ClusterInfo cluster = strategy.cluster();
  if (cluster.num_workers > 1) check_same_module(strategy, signature);

  // 2. The chief's values, in place.
  {
    torch::NoGradGuard no_grad;
    if (cluster.num_workers > 1) {
      // Through host memory for a module already on a GPU (cross-replica
      // context has no replica stream to order a device broadcast with).
      auto broadcast = [&](const at::Tensor& v, const std::string& name) {
        at::Tensor host = v.to(torch::kCPU).contiguous();
        Tensor t = to_diststrat(host);
        strategy.broadcast(t, 0, name);
        if (!host.is_same(v)) const_cast<at::Tensor&>(v).copy_(host);
      };
      for (auto& p : module->named_parameters(true))
        broadcast(p.value(), "ddp/parameter/" + p.key());
      for (auto& b : module->named_buffers(true)) broadcast(b.value(), "ddp/buffer/" + b.key());
    }
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
                    "DistributedDataParallel: parameter '", p.key(), "' ", shape_text(t),
                    " must be dense and contiguous");
    sizes.push_back(static_cast<size_t>(t.numel()) * t.element_size());
  }
  std::vector<size_t> bucket;
  size_t bytes = 0;
  for (size_t k = names_.size(); k-- > 0;) {
    if (!bucket.empty() && options_.bytes_per_bucket > 0 &&
        bytes + sizes[k] > options_.bytes_per_bucket) {
      buckets_.push_back(bucket);
      bucket.clear();
      bytes = 0;
    }
    bucket.push_back(k);
    bytes += sizes[k];
  }
  if (!bucket.empty()) buckets_.push_back(bucket);
  std::vector<size_t> bucket_of(names_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (size_t k : buckets_[b]) bucket_of[k] = b;
  }
  bucket_of_ = bucket_of;
  // The names the fusion engine checks across ranks (and quotes in errors).
  for (size_t b = 0; b < buckets_.size(); ++b) {
    std::vector<std::string> n;
    for (size_t k : buckets_[b]) n.push_back("ddp/" + names_[k]);
    if (b + 1 == buckets_.size()) n.push_back("ddp/step_flags");
    bucket_names_.push_back(std::move(n));
  }

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

void DistributedDataParallel::on_gradient_ready(int local, size_t k) {
  if (active_pass.ddp != this) {
    Replica& own = *state_[static_cast<size_t>(local)];
    if (own.cuda && own.in_pass.load()) {
      // Replica `local`'s CUDA pass, on autograd's device thread (its
      // backward() waits for it): mark only. The buckets launch after the
      // pass, on the replica's thread, where its device scope and stream
      // are (no overlap of communication with a CUDA backward).
      if (own.params[k].grad().defined()) own.got_grad[k] = 1;
      if (own.syncing && !own.ready[k]) {
        own.ready[k] = 1;
        --own.pending[bucket_of_[k]];
      }
      return;
    }
    record_stray(local, k);
    return;
  }
  if (active_pass.local != local) {
    // Replica `active_pass.local` ran replica `local`'s module: leave that
    // replica's step alone (it runs on its own thread), fail this one.
    Replica& caller = *state_[static_cast<size_t>(active_pass.local)];
    if (caller.foreign_parameter.empty())
      caller.foreign_parameter =
          "local replica " + std::to_string(local) + "'s parameter '" + names_[k] + "'";
    return;
  }
  Replica& r = *state_[static_cast<size_t>(local)];
  // As c10d's reducer: a hook that fires with an undefined gradient (the
  // parameter's outputs got none) leaves the parameter unused. The .grad
  // from before the window is set aside, so defined means "got one now".
  if (r.params[k].grad().defined()) r.got_grad[k] = 1;
  if (!r.syncing || r.ready[k]) return;
  r.ready[k] = 1;
  --r.pending[bucket_of_[k]];
  if (options_.overlap) launch_ready_buckets(r, /*in_hook=*/true);
}

// A gradient accumulated into local replica `local`'s parameter k with no
// backward() of this DDP running on this thread.
void DistributedDataParallel::record_stray(int local, size_t k) {
  Replica& r = *state_[static_cast<size_t>(local)];
  std::lock_guard<std::mutex> lock(r.stray_mu);
  if (r.stray[k]) {
    // The first one was never reported: no synchronizing backward() came
    // in between (a loop that calls loss.backward() instead). Thrown out of
    // that loss.backward() on every replica that runs such a loop; no
    // collective is involved, so nobody waits.
    throw_error(ErrorCode::kFailedPrecondition,
                "DistributedDataParallel: parameter '" + names_[k] + "' of local replica " +
                    std::to_string(local) +
                    " got a gradient outside ddp.backward again, with no synchronizing "
                    "ddp.backward in between: such gradients are never synchronized, the "
                    "replicas drift apart; call ddp.backward(ctx, loss, rows, global_rows) "
                    "instead of loss.backward() (torch::autograd::grad is fine: it accumulates "
                    "into no .grad)");
  }
  r.stray[k] = 1;
  if (r.stray_count++ == 0) r.stray_first = names_[k];
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

// Bucket b has been reduced: a parameter this replica used gets its old
// .grad (from before the window) plus the reduced one, in the old tensor
// (the one the user holds, as autograd's accumulation would).
void DistributedDataParallel::add_back_used(Replica& r, size_t b) {
  torch::NoGradGuard no_grad;
  for (size_t k : buckets_[b]) {
    if (!r.got_grad[k] || !r.stash[k].defined()) continue;
    at::Tensor old = std::move(r.stash[k]);
    r.stash[k] = at::Tensor();
    old.add_(r.params[k].grad());
    r.params[k].mutable_grad() = old;
  }
}

// After the window's reduction: a parameter that no replica used gets back
// the .grad it had before the window (undefined unless the user kept one);
// the others get that old .grad plus the reduced one. `flags` is null when
// the reduction did not complete (then nothing counts as unused).
void DistributedDataParallel::finish_window(Replica& r, const float* flags) {
  torch::NoGradGuard no_grad;
  const size_t P = names_.size();
  for (size_t k = 0; k < P; ++k) {
    at::Tensor& p = r.params[k];
    at::Tensor old = std::move(r.stash[k]);
    r.stash[k] = at::Tensor();
    if (flags != nullptr && flags[k] == flags[P + 5]) {
      p.mutable_grad() = old;
    } else if (old.defined()) {
      // old + reduced, into the tensor the user holds (as autograd would).
      if (p.grad().defined()) old.add_(p.grad());
      p.mutable_grad() = old;
    }
  }
}

void DistributedDataParallel::launch_ready_buckets(Replica& r, bool in_hook) {
  while (r.next_bucket < buckets_.size() && r.pending[r.next_bucket] == 0) {
    launch_bucket(r, r.next_bucket, in_hook);
    ++r.next_bucket;
  }
}

void DistributedDataParallel::launch_bucket(Replica& r, size_t b, bool in_hook) {
  if (r.launch_error) return;
  try {
    std::vector<Tensor> tensors;
    std::vector<std::string> names;
    {
      torch::NoGradGuard no_grad;
      for (size_t k : buckets_[b]) {
        at::Tensor& p = r.params[k];
        at::Tensor g = p.grad();
        DISTSTRAT_CHECK(
            !g.defined() || g.layout() == c10::kStrided, kInvalidArgument,
            "DistributedDataParallel: the gradient of '", names_[k],
            "' is sparse; sparse gradients are not supported (Embedding: sparse=false)");
        if (!g.defined()) {
          p.mutable_grad() = torch::zeros_like(p, at::MemoryFormat::Contiguous);
        } else if (!g.is_contiguous()) {
          p.mutable_grad() = g.contiguous();
        }
        if (r.scale != 1.0f) p.mutable_grad().mul_(r.scale);
        tensors.push_back(to_diststrat(p.grad()));
      }
    }
    names = bucket_names_[b];
    if (b + 1 == buckets_.size()) {
      const size_t P = names_.size();
      r.unused_flags = Tensor(Shape{static_cast<int64_t>(P + kStepFlags)}, DType::kFloat32);
      float* f = r.unused_flags.data<float>();
      const bool ran = r.window_ran_pass && !r.failed;  // else neutral
      for (size_t k = 0; k < P; ++k) f[k] = ran && !r.got_grad[k] ? 1.0f : 0.0f;
      f[P] = r.failed ? 1.0f : 0.0f;
      f[P + 1] = static_cast<float>(r.window_rows);
      f[P + 2] = static_cast<float>(r.window_global_rows);
      f[P + 3] = static_cast<float>(r.window_batches);
      f[P + 4] = static_cast<float>(r.sync_index % kSyncIndexModulus);
      f[P + 5] = ran ? 1.0f : 0.0f;
      {
        std::lock_guard<std::mutex> lock(r.stray_mu);
        r.stray_sent = r.stray_count > 0;
      }
      f[P + 6] = r.stray_sent ? 1.0f : 0.0f;
      f[P + 7] = r.stray_sent ? static_cast<float>(r.ctx->replica_id() + 1) : 0.0f;
      if (r.cuda) {
        torch::NoGradGuard no_grad;
        r.flags_device =
            to_torch(r.unused_flags).to(r.device, /*non_blocking=*/false, /*copy=*/true);
        tensors.push_back(to_diststrat(r.flags_device));
      } else {
        tensors.push_back(r.unused_flags);
      }
    }
    // The library's stream reads the gradients after torch's wrote them.
    if (r.cuda)
      compat::order_streams(r.device, r.ctx->stream(), compat::StreamOrder::kTorchThenLibrary);
    r.works.push_back(
        r.ctx->all_reduce_async(ReduceOp::kSum, std::move(tensors), std::move(names)));
    ++r.launched;
    if (in_hook) ++r.in_hook;
  } catch (...) {
    r.launch_error = std::current_exception();
  }
}

void DistributedDataParallel::backward(ReplicaContext& ctx, const at::Tensor& loss, int64_t rows,
                                       int64_t global_rows) {
  const int local = ctx.local_replica_id();
  DISTSTRAT_CHECK(&ctx.strategy() == strategy_ && local >= 0 && local < num_local_replicas(),
                  kInvalidArgument,
                  "DistributedDataParallel::backward: the replica context is not "
                  "one of this model's strategy");
  // Bad rows fail this replica's pass like a bad loss: its buckets still go
  // (zeros, failure flag), so no peer waits for them.
  std::exception_ptr argument_error;
  if (rows < 0 || global_rows < rows) {
    try {
      throw_error(ErrorCode::kInvalidArgument,
                  "DistributedDataParallel::backward (replica " + std::to_string(ctx.replica_id()) +
                      "): rows " + std::to_string(rows) + " and global_rows " +
                      std::to_string(global_rows) + " (0 <= rows <= global_rows expected)");
    } catch (...) {
      argument_error = std::current_exception();
    }
    rows = 0;
    global_rows = std::max<int64_t>(global_rows, 0);
  }
  if (num_local_replicas() > 1) single_intra_op_thread();
  Replica& r = *state_[static_cast<size_t>(local)];
  // A module changed since construction fails this replica's pass like a
  // bad loss (its buckets still go).
  if (!argument_error) {
    const std::string changed = module_change(r);
    if (!changed.empty()) {
      try {
        throw_error(ErrorCode::kFailedPrecondition,
                    "DistributedDataParallel::backward (replica " +
                        std::to_string(ctx.replica_id()) + "): the module of local replica " +
                        std::to_string(local) +
                        " changed after DistributedDataParallel was constructed: " + changed +
                        "; DDP's hooks are on the parameters it had, so these gradients would "
                        "never be synchronized; construct DistributedDataParallel after the "
                        "module's last change");
      } catch (...) {
        argument_error = std::current_exception();
      }
    }
  }
  if (r.window_batches == 0) {
    // The window begins: the .grads already there (kept by the user, or
    // zeroed by LibTorch's zero_grad()) step aside, so that the buckets
    // carry this window's gradients only and a hook sees whether this
    // window produced one.
    for (size_t k = 0; k < r.params.size(); ++k) {
      r.stash[k] = r.params[k].grad();
      if (r.stash[k].defined()) r.params[k].mutable_grad() = at::Tensor();
    }
    r.window_ran_pass = false;
  }
  // A window of one micro-batch (no no_sync before it) seeds backward with
  // rows / global_rows directly, so the hooks need not rescale; otherwise the
  // micro-batches seed `rows` and the synchronizing pass divides the sums by
  // the window's global rows.
  const bool single = !r.in_no_sync && r.window_global_rows == 0;
  r.window_global_rows += global_rows;
  r.window_rows += rows;
  ++r.window_batches;
  const double seed =
      single
          ? (global_rows > 0 ? static_cast<double>(rows) / static_cast<double>(global_rows) : 0.0)
          : static_cast<double>(rows);
  const bool sync = !r.in_no_sync;
  if (sync) {
    r.syncing = true;
    r.ctx = &ctx;
    r.scale = single ? 1.0f
              : r.window_global_rows > 0
                  ? static_cast<float>(1.0 / static_cast<double>(r.window_global_rows))
                  : 0.0f;
    std::fill(r.ready.begin(), r.ready.end(), 0);
    r.pending.assign(buckets_.size(), 0);
    for (size_t b = 0; b < buckets_.size(); ++b)
      r.pending[b] = static_cast<int>(buckets_[b].size());
    r.next_bucket = 0;
    r.works.clear();
    r.launch_error = nullptr;
    r.failed = false;
    const int64_t run = strategy_->steps_run();
    if (run != r.run_seen) {
      r.run_seen = run;
      r.sync_index = 0;
    }
    ++r.sync_index;
  }
  // Leaves the replica's step state clean whatever happens.
  struct Reset {
    Replica& r;
    bool sync;
    ~Reset() {
      if (!sync) return;
      r.syncing = false;
      r.ctx = nullptr;
      r.works.clear();
      r.window_global_rows = 0;
      r.window_rows = 0;
      r.window_batches = 0;
      r.window_ran_pass = false;
      std::fill(r.got_grad.begin(), r.got_grad.end(), 0);
    }
  } reset{r, sync};

  std::exception_ptr backward_error = argument_error;
  if (argument_error) {
    // Nothing to differentiate; the failure flag goes with the buckets.
  } else if (rows > 0) {
    // A bad loss or a failing autograd pass still launches every bucket
    // below (so no peer waits for them), then throws.
    try {
      DISTSTRAT_CHECK(loss.defined() && loss.numel() == 1, kInvalidArgument,
                      "DistributedDataParallel::backward (replica ", ctx.replica_id(),
                      "): the loss must be a scalar, got ",
                      loss.defined() ? shape_text(loss) : std::string("an undefined tensor"));
      // The loss is a mean over this replica's rows (see `seed` above).
      struct Active {
        Replica& r;
        ActivePass saved = active_pass;
        ~Active() {
          active_pass = saved;
          r.in_pass = false;
        }
      } active{r};
      active_pass = {this, local};
      r.in_pass = true;
      r.foreign_parameter.clear();
      r.window_ran_pass = true;
      torch::autograd::backward({loss}, {torch::full_like(loss, seed)});
      DISTSTRAT_CHECK(r.foreign_parameter.empty(), kInvalidArgument,
                      "DistributedDataParallel::backward (replica ", ctx.replica_id(),
                      "): the autograd pass reached ", r.foreign_parameter,
                      ": each replica must run its own module, ddp.module(ctx), not another "
                      "replica's");
    } catch (...) {
      backward_error = std::current_exception();
    }
  }
  // No rows: nothing to differentiate; the replica contributes zeros and is
  // neutral on which parameters were used (window_ran_pass stays false).
  if (!sync) {
    if (backward_error) std::rethrow_exception(backward_error);
    return;
  }
  // The buckets the hooks did not launch, in order. Even after a failed
  // backward: the other replicas wait for these calls (they get zeros and
  // the failure flag; this replica then throws its own error).
  if (backward_error) r.failed = true;  // neutral on "unused" too
  for (size_t b = r.next_bucket; b < buckets_.size(); ++b) {
    for (size_t k : buckets_[b]) r.ready[k] = 1;
    r.pending[b] = 0;
  }
  launch_ready_buckets(r, /*in_hook=*/false);
  std::exception_ptr wait_error;
  // works[b] is bucket b's (launched in order; the first launch error
  // stops the rest). The old .grads of parameters this replica used (so not
  // unused by all) are added back as each bucket completes, while the
  // fusion engine may still be reducing later ones.
  for (size_t b = 0; b < r.works.size(); ++b) {
    try {
      r.works[b].wait();
      // torch's stream reads the reduced gradients after the library wrote them.
      if (r.cuda)
        compat::order_streams(r.device, ctx.stream(), compat::StreamOrder::kLibraryThenTorch);
    } catch (...) {
      if (!wait_error) wait_error = std::current_exception();
    }
    if (!wait_error && !r.launch_error && !r.failed) add_back_used(r, b);
  }
  if (r.cuda && !r.launch_error && !wait_error && r.flags_device.defined() &&
      r.works.size() == buckets_.size()) {
    torch::NoGradGuard no_grad;
    r.unused_flags = to_diststrat(r.flags_device.to(torch::kCPU));  // waits for torch's stream
  }
  if (local == 0) ++r.sync_steps;
  const bool reduced = !r.launch_error && !wait_error;
  finish_window(r, reduced ? r.unused_flags.data<float>() : nullptr);
  if (reduced && r.stray_sent) {
    // Reported below, on every replica: start afresh.
    std::lock_guard<std::mutex> lock(r.stray_mu);
    r.stray_report =
        "parameter '" + r.stray_first + "'" +
        (r.stray_count > 1 ? " and " + std::to_string(r.stray_count - 1) + " more" : std::string());
    std::fill(r.stray.begin(), r.stray.end(), 0);
    r.stray_count = 0;
  }
  if (backward_error) std::rethrow_exception(backward_error);
  if (r.launch_error) std::rethrow_exception(r.launch_error);
  if (wait_error) std::rethrow_exception(wait_error);
  // Before the failure check: replicas that drifted apart matter more than
  // one aborted step.
  check_no_stray(ctx, r);
  const float failed = r.unused_flags.data<float>()[names_.size()];
  if (failed > 0) {
    throw_error(ErrorCode::kAborted,
                "DistributedDataParallel::backward (replica " + std::to_string(ctx.replica_id()) +
                    "): the autograd pass failed on " +
                    std::to_string(static_cast<int64_t>(failed)) + " of " +
                    std::to_string(ctx.num_replicas_in_sync()) +
                    " replicas (see that replica's error); this step's gradients are incomplete");
  }
  check_same_step(ctx, r);
  if (!options_.find_unused_parameters) {
    const float* f = r.unused_flags.data<float>();
    std::string which;
    int listed = 0;
    for (size_t k = 0; k < names_.size(); ++k) {
      if (f[k] == 0.0f) continue;
      if (listed < 8) {
        which += (listed ? ", '" : "'") + names_[k] + "' (on " +
                 std::to_string(static_cast<int64_t>(f[k])) + " of " +
                 std::to_string(ctx.num_replicas_in_sync()) + " replicas" +
                 (r.got_grad[k] ? "" : ", this one included") + ")";
      }
      ++listed;
    }
    if (listed > 0) {
      if (listed > 8) which += " and " + std::to_string(listed - 8) + " more";
      throw_error(ErrorCode::kInvalidArgument,
                  "DistributedDataParallel::backward (replica " + std::to_string(ctx.replica_id()) +
                      "): parameter(s) " + which +
                      " got no gradient in this step (not part of the loss); set "
                      "DdpOptions::find_unused_parameters = true to count them as zero");
    }
  }
}

// After the reduction of the step flags: no replica may hold gradients that
// were accumulated outside ddp.backward (they were in the sum, unmatched on
// the others, or applied by an optimizer step on that replica alone).
void DistributedDataParallel::check_no_stray(ReplicaContext& ctx, Replica& r) const {
  const float* f = r.unused_flags.data<float>() + names_.size();
  const auto count = static_cast<int64_t>(f[6]);
  if (count == 0) return;
  std::string where = count == 1 ? "replica " + std::to_string(static_cast<int64_t>(f[7]) - 1)
                                 : std::to_string(count) + " replicas";
  if (r.stray_sent) where += " (this one: " + r.stray_report + ")";
  r.stray_sent = false;
  throw_error(ErrorCode::kFailedPrecondition,
              "DistributedDataParallel::backward (replica " + std::to_string(ctx.replica_id()) +
                  " of " + std::to_string(ctx.num_replicas_in_sync()) +
                  "): gradients were accumulated outside ddp.backward on " + where +
                  " since the last synchronization (a plain loss.backward()?); they were never "
                  "synchronized, so the replicas' gradients, and the parameters of any optimizer "
                  "step taken with them, differ; call ddp.backward(ctx, loss, rows, global_rows) "
                  "instead of loss.backward() (torch::autograd::grad is fine; freeze a DDP "
                  "module that another loss passes through with requires_grad_(false))");
}

// After the reduction of the step flags: the replicas must have synchronized
// the same step (as many backward() calls, in as many micro-batches) and
// their rows must add up to the global_rows every one of them passed, or the
// sums just applied pair or scale gradients wrongly. A difference shows in
// the sums on every replica alike (the same error everywhere); a deviation
// that cancels in the sums is still caught by the replicas that deviate.
void DistributedDataParallel::check_same_step(ReplicaContext& ctx, const Replica& r) const {
  const float* f = r.unused_flags.data<float>() + names_.size();
  const int64_t n = ctx.num_replicas_in_sync();
  const auto sum = [&](size_t i) { return static_cast<int64_t>(f[i]); };
  const std::string who = "DistributedDataParallel::backward (replica " +
                          std::to_string(ctx.replica_id()) + " of " + std::to_string(n) + "): ";
  const int64_t index = r.sync_index % kSyncIndexModulus;
  if (sum(3) != n * r.window_batches || sum(4) != n * index) {
    throw_error(ErrorCode::kInvalidArgument,
                who + "the replicas are not in the same step: this replica synchronizes " +
                    std::to_string(r.window_batches) +
                    " micro-batch(es) as its synchronizing backward() #" +
                    std::to_string(r.sync_index) + " in this run(), but over all " +
                    std::to_string(n) + " replicas the micro-batch counts sum to " +
                    std::to_string(sum(3)) + " and the indices to " + std::to_string(sum(4)) +
                    " (expected " + std::to_string(n * r.window_batches) + " and " +
                    std::to_string(n * index) +
                    "); every replica must call backward() as often in each run(), and "
                    "no_sync() on all replicas or none");
  }
  if (sum(1) != r.window_global_rows || sum(2) != n * r.window_global_rows) {
    // Say who passed what and what everyone should pass: the rows of all
    // replicas add up to sum(1), so that is every replica's global_rows.
    const int64_t want = sum(1);
    const std::string others =
        sum(2) == n * r.window_global_rows
            ? "every replica passed global_rows " + std::to_string(r.window_global_rows)
            : "the replicas passed different global_rows (they add up to " +
                  std::to_string(sum(2)) + ", not " + std::to_string(n) + " x " +
                  std::to_string(r.window_global_rows) + ")";
    throw_error(ErrorCode::kInvalidArgument,
                who + "this replica passed rows " + std::to_string(r.window_rows) +
                    " and global_rows " + std::to_string(r.window_global_rows) + "; " + others +
                    ", but the rows of all " + std::to_string(n) + " replicas add up to " +
                    std::to_string(want) + ": every replica must pass global_rows " +
                    std::to_string(want) +
                    " (the sum of all replicas' rows, DistributedBatch::global_size())");
  }
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
