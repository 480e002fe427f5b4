// Internal to src/nn: the loss and the correct count from one pass, and the
// dense layers fused with their ReLU (one GPU launch each way).
#pragma once

#include <cstdint>

#include "diststrat/nn.h"
#include "diststrat/tensor.h"

namespace diststrat {
namespace nn {

// softmax_cross_entropy and count_correct(logits, labels) from one pass.
// On a GPU one kernel gives both and nothing waits: the values are read
// from the device when first used (Mlp::Step's rule), and the label check
// is left to the replica's DeviceChecks; on a CPU they are computed here.
struct XentStep {
  StepValue<double> loss_sum;
  StepValue<int64_t> correct;
  Tensor row_losses, row_hits;  // GPU only: device views of the per-row values
};
XentStep softmax_cross_entropy_deferred(const Tensor& logits, const Tensor& labels, Tensor& dlogits,
                                        float grad_scale);

// dense_forward, then relu_forward(y, y); on a GPU one fused backend call
// (GpuBackend::dense_relu_forward). Same operand rules as dense_forward.
void dense_relu_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y);

// The backward of that layer: dy (the gradient of its ReLU output y) is
// masked in place, dy = y > 0 ? dy : 0, then dense_backward(x, w, dy, ...);
// on a GPU one fused backend call (GpuBackend::dense_relu_backward).
void dense_relu_backward(const Tensor& x, const Tensor& w, const Tensor& y, Tensor& dy, Tensor* dx,
                         Tensor& dw, Tensor& db);

}  // namespace nn
}  // namespace diststrat
