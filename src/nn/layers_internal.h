// Internal to src/nn: the loss and the correct count from one pass.
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

}  // namespace nn
}  // namespace diststrat
