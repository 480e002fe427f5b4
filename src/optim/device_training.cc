// Gradient clipping, dynamic loss scaling and gradient accumulation on GPU
// variables. The host path (optimizer.cc) walks each gradient on the CPU;
// here a step's gradients are handled by list launches of the GpuBackend
// (sum_of_squares, scale_and_clip, accumulate) on the replica's stream, with
// at most one small device -> host read per step (the per-tensor sums and the
// loss scale, when the step needs a host decision: the global norm or
// loss scaling's skip). The arithmetic and the decisions are the host path's
// (optimizer_state.h), so a device step equals a host step within the
// rounding of the sums' order (bit for bit on the fake backend).
#include <cmath>
#include <cstring>
#include <limits>

#include "core/device_scope.h"
#include "core/gpu_backend.h"
#include "core/user_text.h"
#include "diststrat/update_rule.h"
#include "optim/device_training.h"
#include "optim/optimizer_state.h"

namespace diststrat {

namespace {

// One float32 buffer on `device` for tensors of `counts` elements, and the
// views of it laid end to end (the allocation is the scope's: zero-filled
// on the replica's stream).
std::vector<Tensor> device_buffers(const Device& device, const std::vector<Shape>& shapes) {
  int64_t total = 0;
  for (const Shape& s : shapes) total += s.num_elements();
  Tensor flat(Shape{total}, DType::kFloat32, device);
  std::vector<Tensor> out;
  int64_t offset = 0;
  for (const Shape& s : shapes) {
    const int64_t n = s.num_elements();
    out.push_back(flat.slice_rows(offset, offset + n).reshape(s));
    offset += n;
  }
  return out;
}

}  // namespace

// ---- GpuBackend defaults of the training-feature block ----------------------

void GpuBackend::sum_of_squares(int, void*, const float* const*, const size_t*, int, const float*,
                                double*, double*) {
  throw_unavailable_in(*this, "sum_of_squares (gradient clipping / loss scaling on the device)");
}
void GpuBackend::scale_and_clip(int, void*, const float* const*, float* const*, const size_t*, int,
                                const float*, float, const double*, float, float) {
  throw_unavailable_in(*this, "scale_and_clip (gradient clipping / loss scaling on the device)");
}
void GpuBackend::accumulate(int, void*, float* const*, const float* const*, const size_t*, int,
                            bool) {
  throw_unavailable_in(*this, "accumulate (gradient accumulation on the device)");
}
void GpuBackend::fill(int, void*, float*, size_t, float) { throw_unavailable_in(*this, "fill"); }

// The list update's default and its slot count (core/gpu_backend.h): the
// rule's data lives in this room (diststrat/update_rule.h).
void GpuBackend::apply_update_list(int ordinal, void* stream, const UpdateRule& rule,
                                   float* const* vars, const float* const* grads,
                                   float* const* slots, const size_t* counts, int n, int64_t step) {
  const int per = update_slot_count(rule);
  std::vector<float*> mine(static_cast<size_t>(per));
  for (int i = 0; i < n; ++i) {
    for (int s = 0; s < per; ++s) mine[static_cast<size_t>(s)] = slots[s * n + i];
    apply_update(ordinal, stream, rule, vars[i], grads[i], mine.data(), counts[i], step);
  }
}
int update_slot_count(const UpdateRule& rule) {
  switch (rule.kind) {
    case UpdateRule::Kind::kSgd:
      return rule.momentum == 0.0f ? 0 : 1;
    case UpdateRule::Kind::kAdam:
      return 2;
    case UpdateRule::Kind::kNone:
      break;
  }
  return 0;
}

float update_step_rate(const UpdateRule& rule, int64_t step) {
  if (rule.kind != UpdateRule::Kind::kAdam) return rule.learning_rate;
  const double t = static_cast<double>(step);
  return static_cast<float>(rule.learning_rate * std::sqrt(1.0 - std::pow(rule.beta2, t)) /
                            (1.0 - std::pow(rule.beta1, t)));
}

// ---- gradient accumulation ----------------------------------------------------

void accumulate_on_device(std::vector<std::pair<Tensor, Variable>>& acc,
                          const std::vector<std::pair<Tensor, Variable>>& grads, bool first) {
  // Group the GPU gradients by device (a replica's gradients normally share
  // one): one launch per device.
  std::vector<Device> devices;
  for (const auto& gv : grads) {
    const Device& d = gv.first.device();
    if (d.is_gpu() && std::find(devices.begin(), devices.end(), d) == devices.end())
      devices.push_back(d);
  }
  for (const Device& device : devices) {
    std::vector<size_t> idx;
    for (size_t k = 0; k < grads.size(); ++k) {
      if (grads[k].first.device() == device) idx.push_back(k);
    }
    if (first) {
      std::vector<Shape> shapes;
      for (size_t k : idx) shapes.push_back(grads[k].first.shape());
      std::vector<Tensor> sums = device_buffers(device, shapes);
      for (size_t i = 0; i < idx.size(); ++i) acc[idx[i]].first = sums[i];
    }
    std::vector<float*> out;
    std::vector<const float*> in;
    std::vector<size_t> counts;
    for (size_t k : idx) {
      out.push_back(acc[k].first.data<float>());
      in.push_back(grads[k].first.data<float>());
      counts.push_back(static_cast<size_t>(grads[k].first.num_elements()));
    }
    record_op_placement("gradient_accumulation", device);
    const GpuExec e = gpu_exec(device, "gradient accumulation");
    e.backend->accumulate(e.ordinal, e.stream, out.data(), in.data(), counts.data(),
                          static_cast<int>(idx.size()), first);
  }
}

// ---- clipping and loss scaling ------------------------------------------------

void Optimizer::flush_on_device(DeviceStep& step) const {
  std::vector<Held::Update>& ready = step.ready;
  Held::Batch* batch = step.batch;
  const Device device = ready.front().grad.device();
  for (const Held::Update& u : ready) {
    DISTSTRAT_CHECK(u.grad.device() == device, kUnimplemented, name(),
                    ": gradient clipping / loss scaling of one step's gradients on several "
                    "devices (",
                    u.grad.debug_string(), " and ", device.to_string(),
                    "); every variable of a replica must live on its device");
  }
  const bool scaling = batch != nullptr && loss_scaling();
  const int n = static_cast<int>(ready.size());
  std::vector<const float*> in;
  std::vector<size_t> counts;
  for (const Held::Update& u : ready) {
    in.push_back(u.grad.data<float>());
    counts.push_back(static_cast<size_t>(u.grad.num_elements()));
  }
  record_op_placement("gradient_clipping", device);
  const GpuExec e = gpu_exec(device, "gradient clipping / loss scaling");
  Tensor scale_copy;  // the replica's loss scale, on this device
  if (scaling) {
    scale_copy = batch->scale;
    DISTSTRAT_CHECK(scale_copy.device() == device, kUnimplemented, name(), ": loss scale ",
                    scale_copy.debug_string(), " is not on the gradients' device ",
                    device.to_string());
  }
  float* loss_scale = scaling ? scale_copy.data<float>() : nullptr;

  // The per-tensor sums of squares of the unscaled gradients, in device
  // memory: [n sums][the loss scale as read][scratch].
  const bool by_norm = clipping_.global_norm > 0;
  const bool need_sums = by_norm || scaling || clipping_.norm > 0;
  Tensor work;
  double* sums = nullptr;
  if (need_sums) {
    const int64_t scratch = static_cast<int64_t>(n) * GpuBackend::kSumOfSquaresScratch;
    work = Tensor(Shape{n + 1 + scratch}, DType::kFloat64, device);
    sums = work.data<double>();
    e.backend->sum_of_squares(e.ordinal, e.stream, in.data(), counts.data(), n, loss_scale, sums,
                              sums + n + 1);
  }
  optim_detail::StepDecision d;
  if (by_norm || scaling) {
    // The one read of the step: the sums and the scale they were unscaled by.
    if (scaling) e.backend->memcpy_async(e.ordinal, sums + n, loss_scale, sizeof(float), e.stream);
    std::vector<double> host(static_cast<size_t>(n) + 1);
    e.backend->copy_to_host(e.ordinal, host.data(), sums, host.size() * sizeof(double), e.stream,
                            e.deadline(),
                            name() + ": the step's gradient norms on " + device.to_string());
    bool nonfinite = false;
    for (int i = 0; i < n; ++i)
      nonfinite = nonfinite || !std::isfinite(host[static_cast<size_t>(i)]);
    if (scaling) std::memcpy(&batch->scale_value, &host[static_cast<size_t>(n)], sizeof(float));
    d = optim_detail::decide_step(
        scaling, by_norm, nonfinite,
        [&] {
          double sum = 0;
          for (int i = 0; i < n; ++i) sum += host[static_cast<size_t>(i)];
          return sum;
        },
        batch->sum_across);
  }
  if (batch) {
    std::lock_guard<std::mutex> lock(held_->mu);
    batch->flushed = true;
    batch->norm = d.norm;
    batch->skipped = d.skip;
    held_->last_norm = d.norm;
    held_->last_skipped = d.skip;
  }
  float next_scale = 0.0f;
  if (scaling) {
    next_scale = optim_detail::next_loss_scale(loss_scale_options_, batch->scale_value, d.skip,
                                               batch->good.data<int64_t>()[0],
                                               batch->skipped_count.data<int64_t>()[0]);
    if (d.skip) {
      if (next_scale != batch->scale_value)
        e.backend->fill(e.ordinal, e.stream, loss_scale, 1, next_scale);
      return;
    }
  }
  float scale = 1.0f;
  if (by_norm) {
    const double max_norm = clipping_.global_norm;
    scale = std::isfinite(d.norm) ? static_cast<float>(max_norm / std::max(d.norm, max_norm))
                                  : std::numeric_limits<float>::quiet_NaN();
  }
  std::vector<Tensor> grads;
  if (scaling || scale != 1.0f || clipping_.norm > 0 || clipping_.value > 0) {
    std::vector<Shape> shapes;
    for (const Held::Update& u : ready) shapes.push_back(u.grad.shape());
    grads = device_buffers(device, shapes);  // the caller's gradients stay as reduced
    std::vector<float*> out;
    for (Tensor& g : grads) out.push_back(g.data<float>());
    e.backend->scale_and_clip(e.ordinal, e.stream, in.data(), out.data(), counts.data(), n,
                              loss_scale, scale, clipping_.norm > 0 ? sums : nullptr,
                              clipping_.norm, clipping_.value);
  } else {
    for (const Held::Update& u : ready) grads.push_back(u.grad);
  }
  // After the unscaling launch, which reads the step's scale.
  if (scaling && next_scale != batch->scale_value) {
    e.backend->fill(e.ordinal, e.stream, loss_scale, 1, next_scale);
  }
  // One list launch for the step's updates (they share its step).
  std::vector<TensorUpdate> list;
  for (size_t k = 0; k < ready.size(); ++k) {
    if (k > 0 && ready[k].step != ready[k - 1].step) {
      update_now_list(list, ready[k - 1].step);
      list.clear();
    }
    TensorUpdate u{&ready[k].var, grads[k], {}};
    for (Tensor& t : ready[k].slots) u.slots.push_back(&t);
    list.push_back(std::move(u));
  }
  update_now_list(list, ready.back().step);
}

}  // namespace diststrat
