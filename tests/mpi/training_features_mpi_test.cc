// Training-loop features under mpirun (docs/training.md): the global norm of
// clip_by_global_norm and the loss-scaling skip decision are the same on
// every process, with an inf injected on one replica of the last rank only.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>

#include "runtime/variable_impl.h"
#include "../unit/training_util.h"
#include "diststrat/diststrat.h"
#include "mpi_test_util.h"

namespace ds = diststrat;

namespace {

using diststrat_test::world_size;

ds::MultiWorkerOptions two_local() {
  ds::MultiWorkerOptions o;
  o.devices = {ds::Device::cpu(0), ds::Device::cpu(1)};
  o.communication.timeout = std::chrono::seconds(60);
  return o;
}

// The first step's global norm equals the norm of the single-device gradient
// over the same global batch (<= 1e-6 relative), on every rank.
TEST(TrainingFeaturesMpi, GlobalNormIsTheSingleDeviceNormOnEveryRank) {
  ds::MultiWorkerMirroredStrategy s(two_local());
  const ds::nn::Mlp mlp({784, 16, 10});
  const int64_t batch = 8 * s.num_replicas_in_sync() + 3;
  const ds::Dataset data = ds::testing::synthetic(batch, 41);
  std::vector<ds::Tensor> params = mlp.init_params(5);
  auto st = mlp.forward_backward(params, data.features(), data.labels(), 1.0f / batch);
  double sq = 0;
  for (const ds::Tensor& g : st.grads) {
    for (int64_t k = 0; k < g.num_elements(); ++k)
      sq += double(g.data<float>()[k]) * g.data<float>()[k];
  }
  const double want = std::sqrt(sq);

  std::vector<ds::Variable> vars = mlp.create_variables(s, 5);
  ds::SGD opt(s, {0.1f});
  ds::GradientClipping c;
  c.global_norm = 0.01f;
  opt.set_clipping(c);
  ds::DistributeOptions o;
  o.shuffle = false;
  std::mutex mu;
  std::vector<double> norms;
  for (const auto& b : s.distribute(data, batch, o)) {
    s.run([&](ds::ReplicaContext& ctx) {
      std::vector<ds::Tensor> values;
      for (auto& v : vars) values.push_back(v.read(ctx));
      auto r = mlp.forward_backward(values, b.features(ctx), b.labels(ctx),
                                    1.0f / static_cast<float>(b.global_size()));
      std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
      for (size_t i = 0; i < vars.size(); ++i) gv.emplace_back(r.grads[i], vars[i]);
      const double n = opt.apply_gradients(ctx, gv).global_norm;
      std::lock_guard<std::mutex> lock(mu);
      norms.push_back(n);
    });
  }
  ASSERT_EQ(norms.size(), 2u);
  for (double n : norms) EXPECT_LE(std::fabs(n - want), 1e-6 * want) << n << " vs " << want;
  EXPECT_EQ(norms[0], norms[1]);
  ds::Tensor t(ds::Shape{1}, ds::DType::kFloat64);
  t.data<double>()[0] = norms[0];
  s.broadcast(t, 0, "norm");
  EXPECT_EQ(t.data<double>()[0], norms[0]) << "rank 0's norm differs";
}

// Loss scale 4, growth every 2 steps; the last rank's replica 1 puts an inf
// into its gradient at step 2: every replica of every rank skips step 2, the
// scales agree, the weights stay bit-identical to rank 0's.
TEST(TrainingFeaturesMpi, AnInfOnOneRankSkipsTheStepEverywhere) {
  ds::MultiWorkerMirroredStrategy s(two_local());
  ds::Variable w =
      s.create_variable("w", ds::Shape{3}, ds::DType::kFloat32, ds::init::Constant{1.0});
  ds::SGD opt(s, {0.1f, 0.9f});
  ds::LossScaleOptions lo;
  lo.initial_scale = 4.0f;
  lo.growth_interval = 2;
  opt.enable_loss_scaling(lo);
  const int bad = s.num_replicas_in_sync() - 1;
  const std::vector<float> want_scales = {4, 4, 8, 4, 4};
  std::mutex mu;
  for (int step = 0; step < 5; ++step) {
    s.run([&](ds::ReplicaContext& ctx) {
      const float scale = opt.loss_scale(ctx);
      ds::Tensor g(ds::Shape{3}, ds::DType::kFloat32);
      for (int i = 0; i < 3; ++i) g.data<float>()[i] = 0.01f * (ctx.replica_id() + 1 + i) * scale;
      if (step == 2 && ctx.replica_id() == bad) g.data<float>()[1] = INFINITY;
      const ds::ApplyResult r = opt.apply_gradients(ctx, {{g, w}});
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_EQ(r.skipped, step == 2) << "step " << step << " replica " << ctx.replica_id();
      EXPECT_EQ(r.loss_scale, want_scales[step]) << "step " << step;
    });
  }
  EXPECT_EQ(opt.skipped_steps(), 1);
  EXPECT_EQ(opt.iterations().value().data<int64_t>()[0], 4);
  for (const ds::Tensor& copy : w.impl().copies) {
    ds::Tensor w0 = w.impl().copies[0].clone();
    s.broadcast(w0, 0, "check w");
    EXPECT_EQ(0, std::memcmp(w0.data(), copy.data(), w0.nbytes()));
  }
  EXPECT_GE(world_size(), 1);
}

}  // namespace
