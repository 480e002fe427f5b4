// DistributedDataParallel's start: every replica of the job has the same
// module, and it starts from the chief's values. Internal (src/torch).
#pragma once

#include <string>
#include <vector>

#include "diststrat/torch.h"

namespace diststrat::libtorch::ddp_detail {

// "float[2, 3]": a tensor's dtype and shape, as DDP's messages quote them.
std::string shape_text(const at::Tensor& t);

// One line per parameter / buffer: what every replica must agree on.
std::vector<std::string> module_signature(torch::nn::Module& m);

// Checks that every replica in sync has the same signature; throws the same
// InvalidArgumentError on every process otherwise. Collective (two gathers).
void check_same_module(Strategy& strategy, const std::vector<std::string>& lines);

// Broadcasts every parameter and buffer of `module` from the chief (worker
// 0), in place. Collective (one broadcast per tensor, by name).
void broadcast_from_chief(Strategy& strategy, torch::nn::Module& module);

}  // namespace diststrat::libtorch::ddp_detail
