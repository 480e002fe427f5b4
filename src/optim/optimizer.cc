#include "diststrat/optimizer.h"

#include <cmath>

#include "core/device_scope.h"
#include "core/user_text.h"

namespace diststrat {

namespace {
int optimizer_counter(Strategy& s) {
  int n = 0;
  for (const Variable& v : s.variables()) {
    if (v.name().rfind("optimizer", 0) == 0 && v.name().find("/iterations") != std::string::npos) ++n;
  }
  return n;
}
}  // namespace

Optimizer::Optimizer(Strategy& strategy) : strategy_(&strategy) {
  // Each optimizer of a strategy gets its own step counter: "optimizer/iterations",
  // then "optimizer_1/iterations", ...
  const int n = optimizer_counter(strategy);
  const std::string prefix = n == 0 ? "optimizer" : "optimizer_" + std::to_string(n);
  VariableOptions opts;
  opts.trainable = false;
  iterations_ = strategy.create_variable(prefix + "/iterations", Shape{}, DType::kInt64,
                                         init::Zeros{}, opts);
}

void Optimizer::apply_gradients(ReplicaContext& ctx,
                                const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) {
  const std::string where = "apply_gradients on replica " + std::to_string(ctx.replica_id());
  for (size_t k = 0; k < grads_and_vars.size(); ++k) {
    const auto& [g, v] = grads_and_vars[k];
    DISTSTRAT_CHECK(v.defined() && g.defined(), kInvalidArgument, where, ": undefined ",
                    v.defined() ? "gradient for variable '" + echo(v.name()) + "'" : std::string("variable"),
                    " at position ", k);
    DISTSTRAT_CHECK(g.shape() == v.shape() && g.dtype() == v.dtype(), kInvalidArgument, where,
                    ": gradient ", g.debug_string(), " does not match variable '", echo(v.name()),
                    "' ", dtype_name(v.dtype()), v.shape().to_string());
    DISTSTRAT_CHECK(v.dtype() == DType::kFloat32, kUnimplemented, where, ": variable '",
                    echo(v.name()), "' is ", dtype_name(v.dtype()), "; optimizers update float32");
    DISTSTRAT_CHECK(v.options().trainable, kInvalidArgument, where, ": variable '",
                    echo(v.name()), "' is not trainable");
  }
  ctx.strategy().apply_gradients(ctx, *this, grads_and_vars);
}

void Optimizer::update_tensor(Tensor& var, const Tensor& grad, std::vector<Tensor*> slots,
                              int64_t step) const {
  std::vector<float*> slot_ptrs;
  for (Tensor* s : slots) {
    DISTSTRAT_CHECK(s->device() == var.device() || (s->device().is_cpu() && var.device().is_cpu()),
                    kInvalidArgument, name(), ": slot ",
                    s->debug_string(), " is not on the variable's device");
    slot_ptrs.push_back(s->data<float>());
  }
  DISTSTRAT_CHECK(grad.device() == var.device() || (grad.device().is_cpu() && var.device().is_cpu()),
                  kInvalidArgument, name(), ": gradient ",
                  grad.debug_string(), " is not on the variable's device ",
                  var.device().to_string());
  record_op_placement("optimizer_update", var.device());
  if (var.device().is_gpu()) {
    const UpdateRule rule = device_rule();
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

SGD::SGD(Strategy& strategy, SGDOptions options) : Optimizer(strategy), options_(options) {
  DISTSTRAT_CHECK(options.learning_rate > 0, kInvalidArgument, "SGD learning_rate ",
                  options.learning_rate, " must be positive");
  DISTSTRAT_CHECK(options.momentum >= 0 && options.momentum < 1, kInvalidArgument,
                  "SGD momentum ", options.momentum, " must be in [0, 1)");
}

std::vector<std::string> SGD::slot_names() const { return slot_names_for(options_); }

std::vector<std::string> SGD::slot_names_for(const SGDOptions& options) {
  if (options.momentum == 0.0f) return {};
  return {"momentum"};
}

void SGD::update(float* var, const float* grad, float* const* slots, size_t count,
                 int64_t) const {
  apply(options_, var, grad, slots, count);
}

void SGD::apply(const SGDOptions& options, float* var, const float* grad, float* const* slots,
                size_t count) {
  const float lr = options.learning_rate, mu = options.momentum;
  if (mu == 0.0f) {
    for (size_t i = 0; i < count; ++i) var[i] -= lr * grad[i];
    return;
  }
  float* v = slots[0];
  if (options.nesterov) {
    for (size_t i = 0; i < count; ++i) {
      v[i] = mu * v[i] - lr * grad[i];
      var[i] += mu * v[i] - lr * grad[i];
    }
  } else {
    for (size_t i = 0; i < count; ++i) {
      v[i] = mu * v[i] - lr * grad[i];
      var[i] += v[i];
    }
  }
}

UpdateRule SGD::device_rule() const {
  UpdateRule r;
  r.kind = UpdateRule::Kind::kSgd;
  r.learning_rate = options_.learning_rate;
  r.momentum = options_.momentum;
  r.nesterov = options_.nesterov;
  return r;
}

UpdateRule Adam::device_rule() const {
  UpdateRule r;
  r.kind = UpdateRule::Kind::kAdam;
  r.learning_rate = options_.learning_rate;
  r.beta1 = options_.beta1;
  r.beta2 = options_.beta2;
  r.epsilon = options_.epsilon;
  return r;
}

Adam::Adam(Strategy& strategy, AdamOptions options) : Optimizer(strategy), options_(options) {
  DISTSTRAT_CHECK(options.learning_rate > 0, kInvalidArgument, "Adam learning_rate ",
                  options.learning_rate, " must be positive");
}

void Adam::update(float* var, const float* grad, float* const* slots, size_t count,
                  int64_t step) const {
  apply(options_, var, grad, slots, count, step);
}

void Adam::apply(const AdamOptions& options, float* var, const float* grad, float* const* slots,
                 size_t count, int64_t step) {
  const float b1 = options.beta1, b2 = options.beta2;
  const double t = static_cast<double>(step);
  const float alpha = static_cast<float>(options.learning_rate * std::sqrt(1.0 - std::pow(b2, t)) /
                                         (1.0 - std::pow(b1, t)));
  float* m = slots[0];
  float* v = slots[1];
  for (size_t i = 0; i < count; ++i) {
    m[i] = b1 * m[i] + (1 - b1) * grad[i];
    v[i] = b2 * v[i] + (1 - b2) * grad[i] * grad[i];
    var[i] -= alpha * m[i] / (std::sqrt(v[i]) + options.epsilon);
  }
}

}  // namespace diststrat
