// Test helpers for the checkpoint tests: training an MLP under any strategy,
// and comparing two checkpoints' states byte for byte.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <string>
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

// `steps` passes over `rows` random rows (one global batch of `rows`) seeded
// by `seed`, labels i % classes.
inline void mlp_train(Strategy& strategy, const nn::Mlp& mlp, const std::vector<Variable>& vars,
                      Optimizer& opt, int64_t rows, int steps, uint64_t seed) {
  Tensor x(Shape{rows, mlp.sizes().front()}, DType::kFloat32), y(Shape{rows}, DType::kInt32);
  init::RandomNormal{0.0, 1.0, seed}(x);
  for (int64_t i = 0; i < rows; ++i) y.data<int32_t>()[i] = static_cast<int32_t>(i % mlp.sizes().back());
  DistributedDataset dist = strategy.distribute(Dataset(x, y), rows, {false, 0, false});
  for (int s = 0; s < steps; ++s) {
    for (const DistributedBatch& b : dist) mlp_step(strategy, mlp, vars, opt, b);
  }
}

// Same names and the same bytes in every tensor of the two states.
inline void expect_same_state(const Checkpoint& a, const Checkpoint& b) {
  const auto sa = a.state(), sb = b.state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first);
    const Tensor &x = sa[i].second, &y = sb[i].second;
    ASSERT_TRUE(x.dtype() == y.dtype() && x.shape() == y.shape()) << sa[i].first;
    EXPECT_EQ(0, x.nbytes() ? std::memcmp(x.data(), y.data(), x.nbytes()) : 0) << sa[i].first;
  }
}

// The state equals a checkpoint's contents (load_checkpoint: a single file
// or a parameter-server index with its shard files), byte for byte.
inline void expect_state_is_file(const Checkpoint& c, const std::string& path) {
  const SafetensorsFile f = load_checkpoint(path);
  EXPECT_TRUE(f.verified);
  const auto st = c.state();
  ASSERT_EQ(st.size(), f.tensors.size());
  for (size_t i = 0; i < st.size(); ++i) {
    EXPECT_EQ(st[i].first, f.tensors[i].first);
    const Tensor &x = st[i].second, &y = f.tensors[i].second;
    ASSERT_TRUE(x.dtype() == y.dtype() && x.shape() == y.shape()) << st[i].first;
    EXPECT_EQ(0, x.nbytes() ? std::memcmp(x.data(), y.data(), x.nbytes()) : 0) << st[i].first;
  }
}

}  // namespace testing
}  // namespace diststrat
