#include "diststrat/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "core/device_scope.h"
#include "core/user_text.h"
#include "optim/device_training.h"
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
      DISTSTRAT_CHECK(std::isfinite(warmup_initial) && warmup_initial >= 0, kInvalidArgument, owner,
                      ": cosine warmup_initial ", warmup_initial, " must be finite and >= 0");
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

// Each local replica's gradient sums of the micro-batches so far.
struct Optimizer::Accumulator {
  struct Sums {
    int count = 0;
    std::vector<std::pair<Tensor, Variable>> grads_and_vars;
  };
  std::mutex mu;  // guards the map; each replica touches only its own Sums
  std::map<int, Sums> replicas;
};

namespace {
double sum_of_squares(const Tensor& g) {
  const float* p = g.data<float>();
  double s = 0;
  for (int64_t i = 0, n = g.num_elements(); i < n; ++i) s += double(p[i]) * p[i];
  return s;
}
}  // namespace

Optimizer::Optimizer(Strategy& strategy)
    : strategy_(&strategy),
      held_(std::make_shared<Held>()),
      accumulator_(std::make_shared<Accumulator>()),
      zero_(std::make_shared<Zero>()),
      agreement_(new_agreement()) {
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
  const int64_t n = g.num_elements();
  if (g.dtype() == DType::kFloat16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = Half::to_float(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = BFloat16::to_float(src[i]);
  }
  return out;
}
}  // namespace

namespace optim_detail {
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
  agree_on_configuration(ctx);
  if (accumulation_steps_ == 1) return reduce_and_update(ctx, grads_and_vars);
  Accumulator::Sums* sums;
  {
    std::lock_guard<std::mutex> lock(accumulator_->mu);
    sums = &accumulator_->replicas[ctx.local_replica_id()];
  }
  auto& acc = sums->grads_and_vars;
  if (sums->count == 0) {
    acc.clear();
    for (const auto& [g, v] : grads_and_vars)
      acc.emplace_back(g.device().is_cpu() ? g.clone() : Tensor(), v);
    accumulate_on_device(acc, grads_and_vars, /*first=*/true);
  } else {
    DISTSTRAT_CHECK(acc.size() == grads_and_vars.size(), kInvalidArgument,
                    "apply_gradients: replica ", ctx.replica_id(), " passed ",
                    grads_and_vars.size(), " gradients in micro-batch ", sums->count + 1, " of ",
                    accumulation_steps_, ", the first had ", acc.size());
    for (size_t k = 0; k < acc.size(); ++k) {
      const auto& [g, v] = grads_and_vars[k];
      DISTSTRAT_CHECK(v.impl_ptr() == acc[k].second.impl_ptr(), kInvalidArgument,
                      "apply_gradients: replica ", ctx.replica_id(), " passed variable '",
                      echo(v.name()), "' at position ", k, " of micro-batch ", sums->count + 1,
                      " where the first had '", echo(acc[k].second.name()), "'");
      const Device& first_device = acc[k].first.device();
      DISTSTRAT_CHECK(g.device().is_cpu() ? first_device.is_cpu() : g.device() == first_device,
                      kInvalidArgument, "apply_gradients: replica ", ctx.replica_id(),
                      " passed gradient ", g.debug_string(), " of '", echo(v.name()),
                      "' in micro-batch ", sums->count + 1, " where the first was on ",
                      acc[k].first.device().to_string());
      if (g.device().is_gpu()) continue;  // below, one launch for all
      float* dst = acc[k].first.data<float>();
      const float* src = g.data<float>();
      for (int64_t i = 0, n = g.num_elements(); i < n; ++i) dst[i] += src[i];
    }
    accumulate_on_device(acc, grads_and_vars, /*first=*/false);
  }
  ApplyResult result;
  if (++sums->count < accumulation_steps_) {
    result.applied = false;
    return result;
  }
  std::vector<std::pair<Tensor, Variable>> total = std::move(acc);
  acc.clear();
  sums->count = 0;
  return reduce_and_update(ctx, total);
}

void Optimizer::set_accumulation_steps(int k) {
  DISTSTRAT_CHECK(k >= 1, kInvalidArgument, name(), ": accumulation_steps ", k, " must be >= 1");
  std::lock_guard<std::mutex> lock(accumulator_->mu);
  for (const auto& [replica, sums] : accumulator_->replicas) {
    DISTSTRAT_CHECK(sums.count == 0, kFailedPrecondition, name(), ": set_accumulation_steps(", k,
                    ") while local replica ", replica, " has ", sums.count,
                    " micro-batches pending");
  }
  accumulation_steps_ = k;
  configuration_changed();
}

ApplyResult Optimizer::reduce_and_update(
    ReplicaContext& ctx, const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) {
  const bool clipping = clipping_.global_norm > 0 || clipping_.norm > 0 || clipping_.value > 0;
  DISTSTRAT_CHECK(!clipping || ctx.strategy().name() != "parameter_server", kUnimplemented,
                  "apply_gradients: gradient clipping under ParameterServerStrategy (the parameter "
                  "servers apply each worker's push on its own; there is no global gradient to "
                  "clip); clip in the training loop instead");
  DISTSTRAT_CHECK(
      !loss_scaling() || ctx.strategy().name() != "parameter_server", kUnimplemented,
      "apply_gradients: loss scaling under ParameterServerStrategy (each push is "
      "applied on its own by the parameter servers; workers cannot agree to skip a step)");
  ApplyResult result;
  // This replica's copy of a variable (CentralStorage: the one host copy).
  const auto local_copy = [&](const Variable& v) -> const Tensor& {
    const std::vector<Tensor>& copies = v.impl().copies;
    return copies[copies.size() == 1 ? 0 : static_cast<size_t>(ctx.local_replica_id())];
  };
  // Device variables hold every clipped step (the transform is one launch
  // over the step's gradients, device_training.cc).
  bool device_vars = false;
  for (const auto& gv : grads_and_vars)
    device_vars = device_vars || local_copy(gv.second).device().is_gpu();
  if (clipping_.global_norm <= 0 && !loss_scaling() && !(clipping && device_vars)) {
    ctx.strategy().apply_gradients(ctx, *this, grads_and_vars);
    return result;
  }
  const std::thread::id me = std::this_thread::get_id();
  const auto host_copy = [&](const Variable& v) {
    const Tensor& t = local_copy(v);
    DISTSTRAT_CHECK(t.device().is_cpu(), kInternal, name(), ": loss-scaling counter '",
                    echo(v.name()), "' on ", t.device().to_string(),
                    " (integer variables live in host memory)");
    return t;
  };
  {
    std::lock_guard<std::mutex> lock(held_->mu);
    Held::Batch& b = held_->batches[me];
    b = Held::Batch{};
    b.expected = grads_and_vars.size();
    if (loss_scaling()) {
      // A GPU replica's scale is device memory: the flush reads it with the
      // step's sums (one read per step), and writes the next one there.
      b.scale = local_copy(loss_scale_);
      b.good = host_copy(good_steps_);
      b.skipped_count = host_copy(skipped_steps_);
      if (b.scale.device().is_cpu()) b.scale_value = b.scale.data<float>()[0];
      result.loss_scale = b.scale_value;
    }
  }
  Held::Batch mine;
  try {
    ctx.strategy().apply_gradients(ctx, *this, grads_and_vars);
  } catch (...) {
    std::lock_guard<std::mutex> lock(held_->mu);
    held_->batches.erase(me);
    throw;
  }
  {
    std::lock_guard<std::mutex> lock(held_->mu);
    auto it = held_->batches.find(me);
    mine = std::move(it->second);
    held_->batches.erase(it);
    result.global_norm = mine.flushed ? mine.norm : held_->last_norm;
    result.skipped = mine.flushed ? mine.skipped : held_->last_skipped;
    if (mine.flushed && loss_scaling()) result.loss_scale = mine.scale_value;
  }
  const std::vector<Tensor>& iter_copies = iterations_.impl().copies;
  if (result.skipped && (iter_copies.size() > 1 || ctx.local_replica_id() == 0)) {
    // The strategy counted the step; a skipped step is not one.
    host_copy(iterations_).data<int64_t>()[0] -= 1;
  }
  DISTSTRAT_CHECK(mine.updates.empty(), kInternal, "apply_gradients: strategy '",
                  ctx.strategy().name(), "' updated ", mine.updates.size(), " of ",
                  grads_and_vars.size(), " variables on replica ", ctx.replica_id(),
                  "; clip_by_global_norm and loss scaling need all of one call's updates (none "
                  "applied)");
  return result;
}

void Optimizer::enable_loss_scaling(const LossScaleOptions& o) {
  DISTSTRAT_CHECK(!loss_scaling(), kFailedPrecondition, name(), ": loss scaling is already on");
  DISTSTRAT_CHECK(std::isfinite(o.initial_scale) && o.initial_scale >= 1, kInvalidArgument, name(),
                  ": initial loss scale ", o.initial_scale, " must be finite and >= 1");
  DISTSTRAT_CHECK(o.growth_interval >= 1, kInvalidArgument, name(), ": loss-scale growth_interval ",
                  o.growth_interval, " must be >= 1");
  DISTSTRAT_CHECK(std::isfinite(o.multiplier) && o.multiplier > 1, kInvalidArgument, name(),
                  ": loss-scale multiplier ", o.multiplier, " must be finite and > 1");
  const std::string& it = iterations_.name();
  const std::string prefix = it.substr(0, it.size() - std::string("/iterations").size());
  VariableOptions opts;
  opts.trainable = false;
  loss_scale_options_ = o;
  loss_scale_ = strategy_->create_variable(prefix + "/loss_scale", Shape{}, DType::kFloat32,
                                           init::Constant{o.initial_scale}, opts);
  good_steps_ = strategy_->create_variable(prefix + "/loss_scale_good_steps", Shape{},
                                           DType::kInt64, init::Zeros{}, opts);
  skipped_steps_ = strategy_->create_variable(prefix + "/skipped_steps", Shape{}, DType::kInt64,
                                              init::Zeros{}, opts);
  configuration_changed();
}

float Optimizer::loss_scale(ReplicaContext& ctx) const {
  if (!loss_scaling()) return 1.0f;
  const std::vector<Tensor>& copies = loss_scale_.impl().copies;
  const Tensor& t = copies[copies.size() == 1 ? 0 : static_cast<size_t>(ctx.local_replica_id())];
  if (t.device().is_gpu()) {
    Tensor host(Shape{}, DType::kFloat32);
    host.copy_from(t);  // after the replica's queued work (the last step's update of it)
    return host.data<float>()[0];
  }
  return t.data<float>()[0];
}

int64_t Optimizer::skipped_steps() const {
  if (!loss_scaling()) return 0;
  return skipped_steps_.value().data<int64_t>()[0];
}

void Optimizer::set_clipping(const GradientClipping& c) {
  int set = 0;
  for (const auto& [field, v] : {std::pair<const char*, float>{"global_norm", c.global_norm},
                                 {"norm", c.norm},
                                 {"value", c.value}}) {
    DISTSTRAT_CHECK(std::isfinite(v) && v >= 0, kInvalidArgument, name(), ": gradient clipping ",
                    field, " ", v, " must be finite and >= 0");
    set += v > 0;
  }
  DISTSTRAT_CHECK(set <= 1, kInvalidArgument, name(),
                  ": set at most one of clipping global_norm, norm and value");
  clipping_ = c;
  configuration_changed();
}

void Optimizer::update_tensor(Tensor& var, const Tensor& grad, std::vector<Tensor*> slots,
                              int64_t step) const {
  const bool clipping = clipping_.global_norm > 0 || clipping_.norm > 0 || clipping_.value > 0;
  if (!clipping && !loss_scaling()) {
    update_now(var, grad, slots, step);
    return;
  }
  // Device gradients: the step's updates are held and transformed together
  // (device_training.cc), one launch per step instead of one per tensor.
  const bool on_device = grad.device().is_gpu();
  DISTSTRAT_CHECK(grad.dtype() == DType::kFloat32, kUnimplemented, name(),
                  ": gradient clipping or loss scaling of ", grad.debug_string(),
                  ": they run on float32 gradients only");
  const bool whole_step = clipping_.global_norm > 0 || loss_scaling();
  if (!whole_step && !on_device) {
    apply_clipped(var, grad, slots, step, 1.0f);
    return;
  }
  Held::Update update{var, grad, {}, step};
  for (Tensor* t : slots) update.slots.push_back(*t);
  std::vector<Held::Update> ready;
  Held::Batch* batch = nullptr;  // this thread's; only this thread touches its fields
  {
    std::lock_guard<std::mutex> lock(held_->mu);
    auto it = held_->batches.find(std::this_thread::get_id());
    DISTSTRAT_CHECK(it != held_->batches.end() || !whole_step, kFailedPrecondition, name(),
                    ": clip_by_global_norm / loss scaling: update of ", var.debug_string(),
                    " outside apply_gradients (they need every gradient of the step)");
    if (it != held_->batches.end()) {
      Held::Batch& b = it->second;
      b.updates.push_back(std::move(update));
      if (b.updates.size() < b.expected) return;
      ready = std::move(b.updates);
      b.updates.clear();
      batch = &b;
    } else {
      ready.push_back(std::move(update));  // per-tensor clipping of a lone device update
    }
  }
  if (ready.front().grad.device().is_gpu()) {
    DeviceStep device_step{ready, batch};
    flush_on_device(device_step);
    return;
  }
  bool skip = false;
  if (loss_scaling()) {
    // Unscale into copies (the caller's gradients stay as reduced); one
    // non-finite element anywhere skips the step.
    const float inv = 1.0f / batch->scale_value;
    for (Held::Update& h : ready) {
      Tensor g = h.grad.clone();
      float* p = g.data<float>();
      for (int64_t i = 0, n = g.num_elements(); i < n; ++i) {
        p[i] *= inv;
        skip = skip || !std::isfinite(p[i]);
      }
      h.grad = g;
    }
  }
  const optim_detail::StepDecision d = optim_detail::decide_step(
      loss_scaling(), clipping_.global_norm > 0, skip,
      [&] {
        double sum = 0;
        for (const Held::Update& h : ready) sum += sum_of_squares(h.grad);
        return sum;
      },
      batch->sum_across);
  skip = d.skip;
  const double norm = d.norm;
  {
    std::lock_guard<std::mutex> lock(held_->mu);
    batch->flushed = true;
    batch->norm = norm;
    batch->skipped = skip;
    held_->last_norm = norm;
    held_->last_skipped = skip;
  }
  if (loss_scaling()) {
    float& scale = batch->scale.data<float>()[0];
    scale = optim_detail::next_loss_scale(loss_scale_options_, scale, skip,
                                          batch->good.data<int64_t>()[0],
                                          batch->skipped_count.data<int64_t>()[0]);
    if (skip) return;
  }
  float scale = 1.0f;
  if (clipping_.global_norm > 0) {
    const double max_norm = clipping_.global_norm;
    scale = std::isfinite(norm) ? static_cast<float>(max_norm / std::max(norm, max_norm))
                                : std::numeric_limits<float>::quiet_NaN();
  }
  for (Held::Update& h : ready) {
    std::vector<Tensor*> ptrs;
    for (Tensor& t : h.slots) ptrs.push_back(&t);
    apply_clipped(h.var, h.grad, ptrs, h.step, scale);
  }
}

void Optimizer::apply_clipped(Tensor& var, const Tensor& grad, const std::vector<Tensor*>& slots,
                              int64_t step, float scale) const {
  if (clipping_.norm > 0) {
    const double n = std::sqrt(sum_of_squares(grad));
    scale = std::isfinite(n)
                ? static_cast<float>(clipping_.norm / std::max<double>(n, clipping_.norm))
                : std::numeric_limits<float>::quiet_NaN();
  }
  if (scale == 1.0f && clipping_.value <= 0) {
    update_now(var, grad, slots, step);
    return;
  }
  Tensor g = grad.clone();  // the caller's gradient stays as reduced
  float* p = g.data<float>();
  const int64_t n = g.num_elements();
  if (scale != 1.0f) {
    for (int64_t i = 0; i < n; ++i) p[i] *= scale;
  }
  if (clipping_.value > 0) {
    const float hi = clipping_.value, lo = -clipping_.value;
    for (int64_t i = 0; i < n; ++i) p[i] = p[i] < lo ? lo : (p[i] > hi ? hi : p[i]);
  }
  update_now(var, g, slots, step);
}

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
  DISTSTRAT_CHECK(std::isfinite(options.learning_rate) && options.learning_rate > 0,
                  kInvalidArgument, "SGD learning_rate ", options.learning_rate,
                  " must be finite and positive");
  options.schedule.validate("SGD");
  DISTSTRAT_CHECK(options.momentum >= 0 && options.momentum < 1, kInvalidArgument, "SGD momentum ",
                  options.momentum, " must be in [0, 1)");
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
  DISTSTRAT_CHECK(std::isfinite(options.learning_rate) && options.learning_rate > 0,
                  kInvalidArgument, "Adam learning_rate ", options.learning_rate,
                  " must be finite and positive");
  for (const auto& [field, b] :
       {std::pair<const char*, float>{"beta1", options.beta1}, {"beta2", options.beta2}}) {
    DISTSTRAT_CHECK(b >= 0 && b < 1, kInvalidArgument, "Adam ", field, " ", b,
                    " must be in [0, 1)");
  }
  DISTSTRAT_CHECK(std::isfinite(options.epsilon) && options.epsilon > 0, kInvalidArgument,
                  "Adam epsilon ", options.epsilon, " must be finite and positive");
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
  const float alpha =
      static_cast<float>(lr * std::sqrt(1.0 - std::pow(b2, t)) / (1.0 - std::pow(b1, t)));
  float* m = slots[0];
  float* v = slots[1];
  for (size_t i = 0; i < count; ++i) {
    m[i] = b1 * m[i] + (1 - b1) * grad[i];
    v[i] = b2 * v[i] + (1 - b2) * grad[i] * grad[i];
    var[i] -= alpha * m[i] / (std::sqrt(v[i]) + options.epsilon);
  }
}

}  // namespace diststrat
