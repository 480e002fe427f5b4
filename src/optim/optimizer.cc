// The Optimizer base: its step counter, apply_gradients' checks of the
// gradients (mixed-precision ones widened to float32 first), and the
// dispatch of the update rule to the host (Optimizer::update) or to a GPU
// backend's kernel (Optimizer::device_rule). Accumulation, clipping and loss
// scaling, ZeRO-1 and the cross-worker agreement have files of their own.
#include "runtime/variable_impl.h"
#include "diststrat/optimizer.h"

#include <algorithm>
#include <string>

#include "core/cast_kernels.h"
#include "core/cpu_isa.h"
#include "core/device_scope.h"
#include "core/step_capture.h"
#include "core/gpu_backend.h"
#include "core/user_text.h"
#include "optim/optim_kernels.h"
#include "optim/optimizer_state.h"

namespace diststrat {

namespace {
int optimizer_counter(Strategy& s) {
  int n = 0;
  for (const Variable& v : s.variables()) {
    if (v.name().rfind("optimizer", 0) == 0 && v.name().find("/iterations") != std::string::npos)
      ++n;
  }
  return n;
}
}  // namespace

Optimizer::Optimizer(Strategy& strategy)
    : strategy_(&strategy),
      held_(std::make_shared<Held>()),
      accumulator_(std::make_shared<Accumulator>()),
      zero_(std::make_shared<Zero>()),
      agreement_(new_agreement()),
      shard_sums_(new_shard_sums()) {
  // Each optimizer of a strategy gets its own step counter: "optimizer/iterations",
  // then "optimizer_1/iterations", ...
  const int n = optimizer_counter(strategy);
  const std::string prefix = n == 0 ? "optimizer" : "optimizer_" + std::to_string(n);
  VariableOptions opts;
  opts.trainable = false;
  iterations_ =
      strategy.create_variable(prefix + "/iterations", Shape{}, DType::kInt64, init::Zeros{}, opts);
}

namespace {
// A float16 / bfloat16 gradient of a float32 variable (mixed precision).
bool is_low_precision_gradient(const Tensor& g, const Variable& v) {
  return (g.dtype() == DType::kFloat16 || g.dtype() == DType::kBFloat16) &&
         v.dtype() == DType::kFloat32;
}

// The float32 copy of a low-precision host gradient: exact (every f16 / bf16
// value, inf and NaN included, is a float32), so an overflow to inf in the
// loop's f16 arithmetic reaches the loss-scaling check as inf.
Tensor widen_to_float32(const Tensor& g) {
  Tensor out(g.shape(), DType::kFloat32);
  float* dst = out.data<float>();
  const uint16_t* src = static_cast<const uint16_t*>(g.data());
  const size_t n = static_cast<size_t>(g.num_elements());
  const cpu::CastKernels& k = cpu::cast_kernels();
  (g.dtype() == DType::kFloat16 ? k.f16_to_f32 : k.bf16_to_f32)(src, dst, n);
  return out;
}
}  // namespace

namespace optim_detail {
const OptimKernels& optim_kernels() { return DISTSTRAT_ISA_PICK(kOptimKernels); }

// A variable passed twice in one call is an error (it would be updated twice,
// or, sharded, laid out twice), as in every strategy's reduction the
// gradients of one variable must be summed by the caller.
void check_each_variable_once(const std::string& where,
                              const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) {
  std::vector<std::pair<const void*, size_t>> seen;
  seen.reserve(grads_and_vars.size());
  for (size_t k = 0; k < grads_and_vars.size(); ++k) {
    if (grads_and_vars[k].second.defined())
      seen.emplace_back(grads_and_vars[k].second.impl_ptr().get(), k);
  }
  std::sort(seen.begin(), seen.end());
  for (size_t k = 1; k < seen.size(); ++k) {
    if (seen[k].first != seen[k - 1].first) continue;
    const Variable& v = grads_and_vars[seen[k].second].second;
    throw_error(ErrorCode::kInvalidArgument,
                where + ": apply_gradients passed variable '" + echo(v.name()) +
                    "' twice (positions " + std::to_string(seen[k - 1].second) + " and " +
                    std::to_string(seen[k].second) + "); sum its gradients and pass it once");
  }
}
}  // namespace optim_detail

ApplyResult Optimizer::apply_gradients(ReplicaContext& ctx,
                                       const std::vector<std::pair<Tensor, Variable>>& given) {
  const std::string where = "apply_gradients on replica " + std::to_string(ctx.replica_id());
  // Mixed precision: f16 / bf16 host gradients of float32 variables are
  // widened to float32 first; the reduction and the update run in float32.
  std::vector<std::pair<Tensor, Variable>> widened;
  for (size_t k = 0; k < given.size(); ++k) {
    const auto& [g, v] = given[k];
    if (!g.defined() || !v.defined() || !is_low_precision_gradient(g, v) || g.shape() != v.shape())
      continue;
    DISTSTRAT_CHECK(g.device().is_cpu(), kUnimplemented, where, ": gradient ", g.debug_string(),
                    " of float32 variable '", echo(v.name()),
                    "': mixed-precision gradients must be in host memory (cast on the device)");
    if (widened.empty()) widened = given;
    widened[k].first = widen_to_float32(g);
  }
  const std::vector<std::pair<Tensor, Variable>>& grads_and_vars =
      widened.empty() ? given : widened;
  // Host decisions a graph would fix at the captured step's outcome.
  if (clipping_.global_norm > 0 || clipping_.norm > 0 || clipping_.value > 0 || loss_scaling() ||
      accumulation_steps_ != 1) {
    refuse_in_capture(where + " with " +
                      (accumulation_steps_ != 1 ? "gradient accumulation (which micro-batch "
                                                  "applies is decided on the host)"
                                                : "gradient clipping or loss scaling (decided "
                                                  "on the host)"));
  }
  optim_detail::check_each_variable_once(where, grads_and_vars);
  for (size_t k = 0; k < grads_and_vars.size(); ++k) {
    const auto& [g, v] = grads_and_vars[k];
    DISTSTRAT_CHECK(
        v.defined() && g.defined(), kInvalidArgument, where, ": undefined ",
        v.defined() ? "gradient for variable '" + echo(v.name()) + "'" : std::string("variable"),
        " at position ", k);
    DISTSTRAT_CHECK(g.shape() == v.shape() && g.dtype() == v.dtype(), kInvalidArgument, where,
                    ": gradient ", g.debug_string(), " does not match variable '", echo(v.name()),
                    "' ", dtype_name(v.dtype()), v.shape().to_string(),
                    " (gradients are float32, or float16/bfloat16 for a float32 variable)");
    DISTSTRAT_CHECK(v.dtype() == DType::kFloat32, kUnimplemented, where, ": variable '",
                    echo(v.name()), "' is ", dtype_name(v.dtype()), "; optimizers update float32");
    DISTSTRAT_CHECK(v.options().trainable, kInvalidArgument, where, ": variable '", echo(v.name()),
                    "' is not trainable");
  }
  if (ctx.virtual_shard() >= 0) {
    // Determinism mode: the real replica's last shard reduces and updates,
    // with the shards' exact sum, on the real replica's context.
    std::vector<std::pair<Tensor, Variable>> combined;
    ReplicaContext* real = combine_shards(ctx, grads_and_vars, combined);
    if (real == nullptr) {
      ApplyResult held;
      held.applied = false;
      return held;
    }
    agree_on_configuration(*real);
    if (accumulation_steps_ == 1) return reduce_and_update(*real, combined);
    return accumulate_micro_batch(*real, combined);
  }
  agree_on_configuration(ctx);
  if (accumulation_steps_ == 1) return reduce_and_update(ctx, grads_and_vars);
  return accumulate_micro_batch(ctx, grads_and_vars);
}

ApplyResult Optimizer::apply_reduced_gradients(
    ReplicaContext& ctx, const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) {
  const std::string where =
      "apply_reduced_gradients on replica " + std::to_string(ctx.replica_id());
  const bool clipping = clipping_.global_norm > 0 || clipping_.norm > 0 || clipping_.value > 0;
  DISTSTRAT_CHECK(
      !clipping && !loss_scaling() && accumulation_steps_ == 1 && ctx.virtual_shard() < 0,
      kUnimplemented, where, ": ",
      clipping                   ? "gradient clipping"
      : loss_scaling()           ? "loss scaling"
      : ctx.virtual_shard() >= 0 ? "determinism's virtual shards"
                                 : "gradient accumulation",
      " needs the reduction inside the call: use apply_gradients");
  optim_detail::check_each_variable_once(where, grads_and_vars);
  for (size_t k = 0; k < grads_and_vars.size(); ++k) {
    const auto& [g, v] = grads_and_vars[k];
    DISTSTRAT_CHECK(v.defined() && g.defined() && g.shape() == v.shape() &&
                        g.dtype() == DType::kFloat32 && v.dtype() == DType::kFloat32,
                    kInvalidArgument, where, ": gradient ",
                    g.defined() ? g.debug_string() : std::string("(undefined)"), " at position ", k,
                    " for variable '", v.defined() ? echo(v.name()) : std::string("?"),
                    "': float32 gradients of float32 variables' shapes");
    DISTSTRAT_CHECK(v.options().trainable, kInvalidArgument, where, ": variable '", echo(v.name()),
                    "' is not trainable");
  }
  agree_on_configuration(ctx);
  ctx.strategy().apply_reduced_gradients(ctx, *this, grads_and_vars);
  return ApplyResult{};
}

void Optimizer::update_tensors(const std::vector<TensorUpdate>& updates, int64_t step,
                               const Tensor* step_counter) const {
  const bool clipping = clipping_.global_norm > 0 || clipping_.norm > 0 || clipping_.value > 0;
  if (clipping || loss_scaling()) {
    refuse_in_capture("apply_gradients with gradient clipping or loss scaling (a host decision)");
    // Held per step (clipping_and_loss_scaling.cc); a device step's flush
    // applies them with one list launch.
    for (const TensorUpdate& u : updates) update_tensor(*u.var, u.grad, u.slots, step);
    return;
  }
  update_now_list(updates, step, step_counter);
}

void Optimizer::update_now_list(const std::vector<TensorUpdate>& updates, int64_t step,
                                const Tensor* step_counter) const {
  if (updates.empty()) return;
  const Device device = updates.front().var->device();
  const UpdateRule rule = device_rule();
  bool one_launch = device.is_gpu() && rule.kind != UpdateRule::Kind::kNone;
  const size_t per = static_cast<size_t>(update_slot_count(rule));
  for (const TensorUpdate& u : updates) {
    if (!one_launch) break;
    one_launch = u.var->device() == device && u.grad.device() == device && u.slots.size() == per;
    for (const Tensor* t : u.slots) one_launch = one_launch && t->device() == device;
  }
  if (!one_launch) {
    // Host variables, or a case update_now explains with an error.
    for (const TensorUpdate& u : updates) update_now(*u.var, u.grad, u.slots, step);
    return;
  }
  const int n = static_cast<int>(updates.size());
  std::vector<float*> vars, slots(per * updates.size());
  std::vector<const float*> grads;
  std::vector<size_t> counts;
  for (size_t i = 0; i < updates.size(); ++i) {
    const TensorUpdate& u = updates[i];
    record_op_placement("optimizer_update", device);
    vars.push_back(u.var->data<float>());
    grads.push_back(u.grad.data<float>());
    counts.push_back(static_cast<size_t>(u.var->num_elements()));
    for (size_t s = 0; s < per; ++s) slots[s * updates.size() + i] = u.slots[s]->data<float>();
  }
  UpdateRule r = rule;
  r.learning_rate = learning_rate(step - 1);
  const GpuExec e = gpu_exec(device, "optimizer_update");
  const ExecScope* scope = current_exec_scope();
  if (scope && scope->capture && scope->capture->active()) {
    // A captured update: its rate is a device scalar written before every
    // launch from the counter's value then (update_step_rate, the bits the
    // kernels compute from a step).
    DISTSTRAT_CHECK(step_counter != nullptr, kFailedPrecondition, name(),
                    ": this update cannot be captured (its step would be fixed in the graph)");
    const Tensor counter = *step_counter;
    const float* rate = scope->capture->device_scalar([this, rule, counter] {
      const int64_t s = counter.data<int64_t>()[0];
      UpdateRule at = rule;
      at.learning_rate = learning_rate(s - 1);
      return update_step_rate(at, s);
    });
    e.backend->apply_update_list_at(e.ordinal, e.stream, r, vars.data(), grads.data(), slots.data(),
                                    counts.data(), n, rate);
    return;
  }
  e.backend->apply_update_list(e.ordinal, e.stream, r, vars.data(), grads.data(), slots.data(),
                               counts.data(), n, step);
}

// The rule on one tensor: a GPU backend's kernel of device_rule() for a
// device variable, update() on the host otherwise.
void Optimizer::update_now(Tensor& var, const Tensor& grad, const std::vector<Tensor*>& slots,
                           int64_t step) const {
  std::vector<float*> slot_ptrs;
  for (Tensor* s : slots) {
    DISTSTRAT_CHECK(s->device() == var.device() || (s->device().is_cpu() && var.device().is_cpu()),
                    kInvalidArgument, name(), ": slot ", s->debug_string(),
                    " is not on the variable's device");
    slot_ptrs.push_back(s->data<float>());
  }
  DISTSTRAT_CHECK(
      grad.device() == var.device() || (grad.device().is_cpu() && var.device().is_cpu()),
      kInvalidArgument, name(), ": gradient ", grad.debug_string(),
      " is not on the variable's device ", var.device().to_string());
  record_op_placement("optimizer_update", var.device());
  if (var.device().is_gpu()) {
    refuse_in_capture(name() + ": an update of " + var.debug_string() + " with its step fixed");
    UpdateRule rule = device_rule();
    if (rule.kind != UpdateRule::Kind::kNone) rule.learning_rate = learning_rate(step - 1);
    DISTSTRAT_CHECK(rule.kind != UpdateRule::Kind::kNone, kUnimplemented, "optimizer '", name(),
                    "' has no device rule, so it cannot update ", var.debug_string(),
                    " (override Optimizer::device_rule)");
    const GpuExec e = gpu_exec(var.device(), "optimizer_update");
    e.backend->apply_update(e.ordinal, e.stream, rule, var.data<float>(), grad.data<float>(),
                            slot_ptrs.data(), static_cast<size_t>(var.num_elements()), step);
    return;
  }
  update(var.data<float>(), grad.data<float>(), slot_ptrs.data(),
         static_cast<size_t>(var.num_elements()), step);
}

}  // namespace diststrat
