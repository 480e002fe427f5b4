#include "diststrat/nn.h"
#include "nn/layers_internal.h"

namespace diststrat {
namespace nn {

Mlp::Mlp(std::vector<int64_t> sizes) : sizes_(std::move(sizes)) {
  DISTSTRAT_CHECK(sizes_.size() >= 2, kInvalidArgument,
                  "Mlp needs at least input and output sizes");
  for (int64_t s : sizes_) DISTSTRAT_CHECK(s > 0, kInvalidArgument, "Mlp layer size ", s);
}

std::string Mlp::param_name(size_t i) const {
  return "dense" + std::to_string(i / 2) + (i % 2 == 0 ? "/kernel" : "/bias");
}

Shape Mlp::param_shape(size_t i) const {
  const size_t layer = i / 2;
  return i % 2 == 0 ? Shape{sizes_[layer], sizes_[layer + 1]} : Shape{sizes_[layer + 1]};
}

std::vector<Variable> Mlp::create_variables(Strategy& strategy, uint64_t seed) const {
  std::vector<Variable> vars;
  for (size_t i = 0; i < num_params(); ++i) {
    Initializer init =
        i % 2 == 0 ? Initializer(init::GlorotUniform{seed + i / 2}) : Initializer(init::Zeros{});
    vars.push_back(strategy.create_variable(param_name(i), param_shape(i), DType::kFloat32, init));
  }
  return vars;
}

std::vector<Tensor> Mlp::init_params(uint64_t seed) const {
  std::vector<Tensor> params;
  for (size_t i = 0; i < num_params(); ++i) {
    Tensor t(param_shape(i), DType::kFloat32);
    if (i % 2 == 0) init::GlorotUniform{seed + i / 2}(t);
    params.push_back(t);
  }
  return params;
}

namespace {
// The gradients' tensors, written whole by the backward. On a GPU they are
// views of one buffer laid end to end in parameter order, so a strategy's
// all-reduce finds them contiguous in the order it is given them and
// reduces them in place, without packing copies (allreduce/packed.h).
std::vector<Tensor> gradient_buffers(const std::vector<Tensor>& params, const Device& device) {
  std::vector<Tensor> out;
  if (!device.is_gpu()) {
    for (const Tensor& p : params) {
      out.push_back(Tensor::uninitialized(p.shape(), DType::kFloat32, device));
    }
    return out;
  }
  int64_t total = 0;
  for (const Tensor& p : params) total += p.num_elements();
  Tensor flat = Tensor::uninitialized(Shape{total}, DType::kFloat32, device);
  int64_t offset = 0;
  for (const Tensor& p : params) {
    const int64_t n = p.num_elements();
    out.push_back(flat.slice_rows(offset, offset + n).reshape(p.shape()));
    offset += n;
  }
  return out;
}
}  // namespace

Mlp::Step Mlp::forward_backward(const std::vector<Tensor>& params, const Tensor& x,
                                const Tensor& labels, float grad_scale,
                                const GradientsReady& on_ready) const {
  DISTSTRAT_CHECK_EQ(params.size(), num_params(), "Mlp::forward_backward params");
  DISTSTRAT_CHECK(x.shape().rank() == 2 && x.shape()[1] == sizes_[0], kInvalidArgument,
                  "Mlp::forward_backward: x ", x.debug_string(), " must be [n, ", sizes_[0], "]");
  const int64_t n = x.shape()[0];
  const size_t layers = sizes_.size() - 1;
  // acts[0] = x, acts[l+1] = output of layer l (after ReLU except the last).
  // Every output below is overwritten whole by its op, so GPU memory is
  // not zero-filled first (a memset launch each).
  std::vector<Tensor> acts{x};
  for (size_t l = 0; l < layers; ++l) {
    Tensor y = Tensor::uninitialized(Shape{n, sizes_[l + 1]}, DType::kFloat32, x.device());
    if (l + 1 < layers) {
      dense_relu_forward(acts[l], params[2 * l], params[2 * l + 1], y);  // one launch on a GPU
    } else {
      dense_forward(acts[l], params[2 * l], params[2 * l + 1], y);
    }
    acts.push_back(y);
  }
  Step step;
  Tensor dy = Tensor::uninitialized(acts.back().shape(), DType::kFloat32, x.device());
  if (n) {
    XentStep xent = softmax_cross_entropy_deferred(acts.back(), labels, dy, grad_scale);
    step.loss_sum = xent.loss_sum;
    step.correct = xent.correct;
    step.row_losses = xent.row_losses;
    step.row_hits = xent.row_hits;
  }
  step.grads = gradient_buffers(params, x.device());
  for (size_t l = layers; l-- > 0;) {
    Tensor& dw = step.grads[2 * l];
    Tensor& db = step.grads[2 * l + 1];
    Tensor dx;
    if (l > 0) dx = Tensor::uninitialized(acts[l].shape(), DType::kFloat32, x.device());
    if (l + 1 < layers) {
      // dy is the gradient of this layer's ReLU output acts[l + 1].
      dense_relu_backward(acts[l], params[2 * l], acts[l + 1], dy, l > 0 ? &dx : nullptr, dw, db);
    } else {
      dense_backward(acts[l], params[2 * l], dy, l > 0 ? &dx : nullptr, dw, db);
    }
    if (on_ready) on_ready(l, dw, db);
    if (l > 0) dy = dx;
  }
  return step;
}

Tensor Mlp::predict(const std::vector<Tensor>& params, const Tensor& x) const {
  const int64_t n = x.shape()[0];
  Tensor h = x;
  for (size_t l = 0; l + 1 < sizes_.size(); ++l) {
    Tensor y(Shape{n, sizes_[l + 1]}, DType::kFloat32, x.device());
    if (l + 2 < sizes_.size()) {
      dense_relu_forward(h, params[2 * l], params[2 * l + 1], y);
    } else {
      dense_forward(h, params[2 * l], params[2 * l + 1], y);
    }
    h = y;
  }
  return h;
}

}  // namespace nn
}  // namespace diststrat
