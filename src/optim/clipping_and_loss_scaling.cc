// Gradient clipping and dynamic loss scaling on the reduced gradients
// (diststrat/gradient_options.h): the step's updates are held per calling
// thread until the last one arrives (Optimizer::Held, optimizer_state.h),
// then unscaled, checked for non-finite values, clipped and applied in call
// order, or all dropped for a skipped step. Host gradients are walked here;
// GPU ones go to device_training.cc, which takes the same decisions.
#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <thread>

#include "runtime/variable_impl.h"
#include "core/user_text.h"
#include "optim/optim_kernels.h"
#include "optim/exact_sum.h"
#include "optim/optimizer_state.h"

namespace diststrat {

namespace {
double sum_of_squares(const Tensor& g) {
  return optim_detail::optim_kernels().sum_of_squares(g.data<float>(),
                                                      static_cast<size_t>(g.num_elements()));
}
}  // namespace

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
  // ZeRO-1 in determinism mode: the decision reads the whole gradients.
  std::vector<Tensor> whole = batch->whole;
  if (loss_scaling()) {
    // Unscale into copies (the caller's gradients stay as reduced); one
    // non-finite element anywhere skips the step.
    const float inv = 1.0f / batch->scale_value;
    const auto unscale = [&](Tensor& t) {
      Tensor g = t.clone();
      const bool finite = optim_detail::optim_kernels().scale_all_finite(
          g.data<float>(), static_cast<size_t>(g.num_elements()), inv);
      t = g;
      return finite;
    };
    for (Held::Update& h : ready) skip = !unscale(h.grad) || skip;
    if (!whole.empty()) {
      skip = false;
      for (Tensor& w : whole) skip = !unscale(w) || skip;
    }
  }
  // Determinism mode: the norm's sum rounded once (the order of the terms
  // follows the replica count); docs/determinism.md.
  const bool exact = strategy_->determinism().enabled();
  const optim_detail::StepDecision d = optim_detail::decide_step(
      loss_scaling(), clipping_.global_norm > 0, skip,
      [&] {
        if (exact) {
          optim_detail::ExactSum sum;
          if (whole.empty()) {
            for (const Held::Update& h : ready)
              sum.add_squares(h.grad.data<float>(), static_cast<size_t>(h.grad.num_elements()));
          } else {
            for (const Tensor& w : whole)
              sum.add_squares(w.data<float>(), static_cast<size_t>(w.num_elements()));
          }
          return sum.value();
        }
        double sum = 0;
        for (const Held::Update& h : ready) sum += sum_of_squares(h.grad);
        return sum;
      },
      whole.empty() ? batch->sum_across : nullptr);
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
  const size_t n = static_cast<size_t>(g.num_elements());
  const optim_detail::OptimKernels& k = optim_detail::optim_kernels();
  if (scale != 1.0f) k.scale(p, n, scale);
  if (clipping_.value > 0) k.clip(p, n, -clipping_.value, clipping_.value);
  update_now(var, g, slots, step);
}

}  // namespace diststrat
