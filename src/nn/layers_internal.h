// Internal to src/nn: the loss and the correct count from one pass, and the
// dense layers fused with their ReLU (one GPU launch each way).
#pragma once

#include <cstdint>

#include "diststrat/tensor.h"

namespace diststrat {
namespace nn {

// softmax_cross_entropy, also returning count_correct(logits, labels) in
// *correct. On a GPU both come from one kernel and one device -> host copy
// (the two public calls would run the softmax and wait twice).
double softmax_cross_entropy_counted(const Tensor& logits, const Tensor& labels, Tensor& dlogits,
                                     float grad_scale, int64_t* correct);

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
