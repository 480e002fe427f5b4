// Internal to src/nn: the loss and the correct count from one pass.
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

}  // namespace nn
}  // namespace diststrat
