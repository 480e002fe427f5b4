#include "diststrat/optimizer.h"

#include <cmath>
#include <algorithm>

#include "core/device_scope.h"

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

LearningRateSchedule LearningRateSchedule::piecewise_constant(std::vector<int64_t> boundaries,
                                                             std::vector<float> values) {
  LearningRateSchedule s;
  s.kind = Kind::kPiecewiseConstant;
  s.boundaries = std::move(boundaries);
  s.values = std::move(values);
  s.validate("piecewise_constant");
  return s;
}

LearningRateSchedule LearningRateSchedule::cosine_decay(int64_t decay_steps, int64_t warmup_steps,
                                                       float alpha, float warmup_initial) {
  LearningRateSchedule s;
  s.kind = Kind::kCosineDecay;
  s.decay_steps = decay_steps;
  s.warmup_steps = warmup_steps;
  s.alpha = alpha;
  s.warmup_initial = warmup_initial;
  s.validate("cosine_decay");
  return s;
}

LearningRateSchedule LearningRateSchedule::exponential_decay(int64_t decay_steps, float decay_rate,
                                                            bool staircase) {
  LearningRateSchedule s;
  s.kind = Kind::kExponentialDecay;
  s.decay_steps = decay_steps;
  s.decay_rate = decay_rate;
  s.staircase = staircase;
  s.validate("exponential_decay");
  return s;
}

void LearningRateSchedule::validate(const std::string& owner) const {
  switch (kind) {
    case Kind::kConstant:
      return;
    case Kind::kPiecewiseConstant:
      DISTSTRAT_CHECK(values.size() == boundaries.size() + 1, kInvalidArgument, owner,
                      ": piecewise-constant schedule has ", boundaries.size(), " boundaries and ",
                      values.size(), " values; it needs boundaries + 1 values");
      for (size_t i = 0; i < boundaries.size(); ++i) {
        DISTSTRAT_CHECK(boundaries[i] >= 0 && (i == 0 || boundaries[i] > boundaries[i - 1]),
                        kInvalidArgument, owner, ": piecewise-constant boundary ", i, " (",
                        boundaries[i], ") must be >= 0 and above the one before");
      }
      for (size_t i = 0; i < values.size(); ++i) {
        DISTSTRAT_CHECK(std::isfinite(values[i]) && values[i] >= 0, kInvalidArgument, owner,
                        ": piecewise-constant value ", i, " (", values[i],
                        ") must be finite and >= 0");
      }
      return;
    case Kind::kCosineDecay:
      DISTSTRAT_CHECK(decay_steps > 0, kInvalidArgument, owner, ": cosine decay_steps ",
                      decay_steps, " must be positive");
      DISTSTRAT_CHECK(warmup_steps >= 0, kInvalidArgument, owner, ": cosine warmup_steps ",
                      warmup_steps, " must be >= 0");
      DISTSTRAT_CHECK(alpha >= 0 && alpha <= 1, kInvalidArgument, owner, ": cosine alpha ", alpha,
                      " must be in [0, 1]");
      DISTSTRAT_CHECK(std::isfinite(warmup_initial) && warmup_initial >= 0, kInvalidArgument,
                      owner, ": cosine warmup_initial ", warmup_initial,
                      " must be finite and >= 0");
      return;
    case Kind::kExponentialDecay:
      DISTSTRAT_CHECK(decay_steps > 0, kInvalidArgument, owner, ": exponential decay_steps ",
                      decay_steps, " must be positive");
      DISTSTRAT_CHECK(std::isfinite(decay_rate) && decay_rate > 0, kInvalidArgument, owner,
                      ": exponential decay_rate ", decay_rate, " must be finite and positive");
      return;
  }
  throw InvalidArgumentError(owner + ": unknown learning-rate schedule kind " +
                             std::to_string(static_cast<int>(kind)));
}

float LearningRateSchedule::learning_rate(float base, int64_t iterations) const {
  const int64_t t = std::max<int64_t>(0, iterations);
  switch (kind) {
    case Kind::kConstant:
      return base;
    case Kind::kPiecewiseConstant: {
      size_t i = 0;
      while (i < boundaries.size() && t > boundaries[i]) ++i;
      return values[i];
    }
    case Kind::kCosineDecay: {
      if (t < warmup_steps) {
        return static_cast<float>(warmup_initial + (double(base) - warmup_initial) *
                                                       (double(t) / double(warmup_steps)));
      }
      const double d = double(std::min<int64_t>(t - warmup_steps, decay_steps));
      const double pi = 3.14159265358979323846;
      const double cosine = 0.5 * (1.0 + std::cos(pi * d / double(decay_steps)));
      return static_cast<float>(double(base) * ((1.0 - alpha) * cosine + alpha));
    }
    case Kind::kExponentialDecay: {
      double p = double(t) / double(decay_steps);
      if (staircase) p = std::floor(p);
      return static_cast<float>(double(base) * std::pow(double(decay_rate), p));
    }
  }
  return base;
}

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
  for (const auto& [g, v] : grads_and_vars) {
    DISTSTRAT_CHECK(v.defined() && g.defined(), kInvalidArgument,
                    "apply_gradients: undefined gradient or variable");
    DISTSTRAT_CHECK(g.shape() == v.shape() && g.dtype() == v.dtype(), kInvalidArgument,
                    "apply_gradients: gradient ", g.debug_string(), " does not match variable '",
                    v.name(), "' ", dtype_name(v.dtype()), v.shape().to_string());
    DISTSTRAT_CHECK(v.dtype() == DType::kFloat32, kUnimplemented, "apply_gradients: variable '",
                    v.name(), "' is ", dtype_name(v.dtype()), "; optimizers update float32");
    DISTSTRAT_CHECK(v.options().trainable, kInvalidArgument, "apply_gradients: variable '",
                    v.name(), "' is not trainable");
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

SGD::SGD(Strategy& strategy, SGDOptions options) : Optimizer(strategy), options_(options) {
  DISTSTRAT_CHECK(options.learning_rate > 0, kInvalidArgument, "SGD learning_rate ",
                  options.learning_rate, " must be positive");
  options.schedule.validate("SGD");
  DISTSTRAT_CHECK(options.momentum >= 0 && options.momentum < 1, kInvalidArgument,
                  "SGD momentum ", options.momentum, " must be in [0, 1)");
}

std::vector<std::string> SGD::slot_names() const { return slot_names_for(options_); }

std::vector<std::string> SGD::slot_names_for(const SGDOptions& options) {
  if (options.momentum == 0.0f) return {};
  return {"momentum"};
}

void SGD::update(float* var, const float* grad, float* const* slots, size_t count,
                 int64_t step) const {
  apply(options_, var, grad, slots, count, step);
}

float SGD::learning_rate(int64_t iterations) const {
  return options_.schedule.learning_rate(options_.learning_rate, iterations);
}

void SGD::apply(const SGDOptions& options, float* var, const float* grad, float* const* slots,
                size_t count, int64_t step) {
  const float lr = options.schedule.learning_rate(options.learning_rate, step - 1);
  const float mu = options.momentum;
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
  options.schedule.validate("Adam");
}

void Adam::update(float* var, const float* grad, float* const* slots, size_t count,
                  int64_t step) const {
  apply(options_, var, grad, slots, count, step);
}

float Adam::learning_rate(int64_t iterations) const {
  return options_.schedule.learning_rate(options_.learning_rate, iterations);
}

void Adam::apply(const AdamOptions& options, float* var, const float* grad, float* const* slots,
                 size_t count, int64_t step) {
  const float b1 = options.beta1, b2 = options.beta2;
  const double t = static_cast<double>(step);
  const float lr = options.schedule.learning_rate(options.learning_rate, step - 1);
  const float alpha = static_cast<float>(lr * std::sqrt(1.0 - std::pow(b2, t)) /
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
