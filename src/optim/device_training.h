// The optimizer's training features on GPU variables (device_training.cc):
// gradient accumulation here; clipping and loss scaling through
// Optimizer::flush_on_device. Internal header.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "diststrat/optimizer.h"

namespace diststrat {

// Gradient accumulation of one micro-batch's GPU gradients (entries of
// `grads` in host memory are left to the caller): `first` allocates each
// device's sums (one buffer per device, in the calling replica's scope) into
// acc[k].first and copies the gradients there; later micro-batches add them.
// One launch per device and micro-batch; no host round trip.
void accumulate_on_device(std::vector<std::pair<Tensor, Variable>>& acc,
                          const std::vector<std::pair<Tensor, Variable>>& grads, bool first);

}  // namespace diststrat
