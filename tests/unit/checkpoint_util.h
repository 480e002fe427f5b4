// Test helper for the checkpoint tests: one training step of an MLP under any
// strategy (forward, backward, apply_gradients on every replica).
#pragma once

#include <utility>
#include <vector>

#include "diststrat/diststrat.h"

namespace diststrat {
namespace testing {

inline void mlp_step(Strategy& strategy, const nn::Mlp& mlp, const std::vector<Variable>& vars,
                     Optimizer& opt, const DistributedBatch& batch) {
  const float scale = 1.0f / static_cast<float>(batch.global_size());
  strategy.run([&](ReplicaContext& ctx) {
    std::vector<Tensor> p;
    for (const Variable& v : vars) p.push_back(v.read(ctx));
    nn::Mlp::Step st = mlp.forward_backward(p, batch.features(ctx), batch.labels(ctx), scale);
    std::vector<std::pair<Tensor, Variable>> gv;
    for (size_t k = 0; k < vars.size(); ++k) gv.emplace_back(st.grads[k], vars[k]);
    opt.apply_gradients(ctx, gv);
  });
}

}  // namespace testing
}  // namespace diststrat
