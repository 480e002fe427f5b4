// Training-loop features above the all-reduce (issue 17): learning-rate
// schedules driven by the optimizer's step counter; gradient clipping on the
// reduced gradients (global norm, per-tensor norm, value); gradient
// accumulation over micro-batches with one reduction per update; dynamic
// loss scaling whose skip decision every replica and worker shares.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>

#include "runtime/variable_impl.h"
#include "checkpoint_util.h"
#include "diststrat/diststrat.h"
#include "parameter_server/shard_updater.h"
#include "training_util.h"
#include "../common/temp_dir.h"

namespace ds = diststrat;
using Schedule = ds::LearningRateSchedule;

namespace {

const double kPi = 3.14159265358979323846;

using diststrat_test::temp_dir;
constexpr char kTrainingTempPrefix[] =
    "diststrat_training_";  // removed at exit (tests/common/temp_dir.h)

// ---- schedules: closed forms -------------------------------------------------

TEST(LearningRateSchedule, ConstantIsTheBaseRate) {
  const Schedule s;
  EXPECT_EQ(s.learning_rate(0.25f, 0), 0.25f);
  EXPECT_EQ(s.learning_rate(0.25f, 1000000), 0.25f);
}

TEST(LearningRateSchedule, PiecewiseConstantSwitchesAfterEachBoundary) {
  const Schedule s = Schedule::piecewise_constant({10, 20}, {1.0f, 0.5f, 0.1f});
  // Keras: values[0] while t <= 10, values[1] while 10 < t <= 20, then values[2].
  const std::vector<std::pair<int64_t, float>> want = {
      {0, 1.0f}, {9, 1.0f}, {10, 1.0f}, {11, 0.5f}, {20, 0.5f}, {21, 0.1f}, {1000, 0.1f}};
  for (const auto& [t, lr] : want) EXPECT_EQ(s.learning_rate(123.0f, t), lr) << "t=" << t;
}

TEST(LearningRateSchedule, CosineDecayWithLinearWarmupMatchesTheClosedForm) {
  const float peak = 0.8f, alpha = 0.1f, w0 = 0.05f;
  const int64_t warmup = 8, decay = 40;
  const Schedule s = Schedule::cosine_decay(decay, warmup, alpha, w0);
  for (int64_t t : {0, 1, 4, 7, 8, 9, 18, 28, 47, 48, 49, 500}) {
    double want;
    if (t < warmup) {
      want = w0 + (double(peak) - w0) * double(t) / double(warmup);
    } else {
      const double d = std::min<double>(double(t - warmup), double(decay));
      want = peak * ((1 - double(alpha)) * 0.5 * (1 + std::cos(kPi * d / decay)) + alpha);
    }
    EXPECT_NEAR(s.learning_rate(peak, t), want, 1e-7 * peak) << "t=" << t;
  }
  // Landmarks: half-way through warm-up, the peak, half-way down, the floor.
  EXPECT_NEAR(s.learning_rate(peak, 4), (w0 + peak) / 2, 1e-7);
  EXPECT_FLOAT_EQ(s.learning_rate(peak, 8), peak);
  EXPECT_NEAR(s.learning_rate(peak, 28), peak * (0.5 * (1 - alpha) + alpha), 1e-7);
  EXPECT_NEAR(s.learning_rate(peak, 48), peak * alpha, 1e-7);
  EXPECT_NEAR(s.learning_rate(peak, 1 << 30), peak * alpha, 1e-7);
  // No warm-up: cosine from the peak at t = 0.
  EXPECT_FLOAT_EQ(Schedule::cosine_decay(10).learning_rate(2.0f, 0), 2.0f);
  EXPECT_NEAR(Schedule::cosine_decay(10).learning_rate(2.0f, 5), 1.0, 1e-7);
}

TEST(LearningRateSchedule, ExponentialDecaySmoothAndStaircase) {
  const Schedule smooth = Schedule::exponential_decay(10, 0.5f);
  const Schedule stairs = Schedule::exponential_decay(10, 0.5f, true);
  for (int64_t t : {0, 5, 10, 15, 20, 37}) {
    // Within the one rounding to float.
    EXPECT_NEAR(smooth.learning_rate(0.4f, t), 0.4f * std::pow(0.5, t / 10.0), 3e-8) << t;
    EXPECT_NEAR(stairs.learning_rate(0.4f, t), 0.4f * std::pow(0.5, std::floor(t / 10.0)), 3e-8)
        << t;
  }
  EXPECT_FLOAT_EQ(stairs.learning_rate(0.4f, 19), 0.2f);
  EXPECT_FLOAT_EQ(smooth.learning_rate(0.4f, 20), 0.1f);
}

TEST(LearningRateSchedule, BadSchedulesAreRejectedNamingTheField) {
  EXPECT_THROW(Schedule::piecewise_constant({10, 20}, {1.0f}), ds::InvalidArgumentError);
  EXPECT_THROW(Schedule::piecewise_constant({20, 10}, {1.0f, 2.0f, 3.0f}),
               ds::InvalidArgumentError);
  EXPECT_THROW(Schedule::cosine_decay(0), ds::InvalidArgumentError);
  EXPECT_THROW(Schedule::cosine_decay(10, -1), ds::InvalidArgumentError);
  EXPECT_THROW(Schedule::cosine_decay(10, 0, 1.5f), ds::InvalidArgumentError);
  EXPECT_THROW(Schedule::exponential_decay(10, 0.0f), ds::InvalidArgumentError);
  // A hand-built bad schedule is caught by the optimizer.
  ds::MirroredStrategy strategy({ds::Device::cpu(0)});
  ds::SGDOptions o;
  o.schedule.kind = Schedule::Kind::kExponentialDecay;
  o.schedule.decay_steps = 0;
  try {
    ds::SGD sgd(strategy, o);
    FAIL() << "accepted decay_steps 0";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("decay_steps"), std::string::npos) << e.what();
  }
}

// ---- schedules drive the update rules ------------------------------------------

// SGD without momentum, gradient 1: each update subtracts the scheduled rate
// of its step, read from the step counter (0 for the first update).
TEST(LearningRateSchedule, SgdAndAdamUseTheRateOfTheStepCounter) {
  ds::MirroredStrategy strategy({ds::Device::cpu(0), ds::Device::cpu(1)});
  ds::Variable w =
      strategy.create_variable("w", ds::Shape{3}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::Variable a =
      strategy.create_variable("a", ds::Shape{3}, ds::DType::kFloat32, ds::init::Constant{1.0});
  ds::SGDOptions so;
  so.learning_rate = 0.5f;
  so.schedule = Schedule::exponential_decay(2, 0.5f, true);
  ds::SGD sgd(strategy, so);
  ds::AdamOptions ao;
  ao.learning_rate = 0.1f;
  ao.schedule = Schedule::piecewise_constant({2}, {0.1f, 0.01f});
  ds::Adam adam(strategy, ao);
  double want_w = 0;
  ds::Tensor ref_a(ds::Shape{3}, ds::DType::kFloat32), m(ref_a.shape(), ds::DType::kFloat32),
      v(ref_a.shape(), ds::DType::kFloat32);
  ds::init::Constant{1.0}(ref_a);
  for (int s = 0; s < 6; ++s) {
    EXPECT_FLOAT_EQ(sgd.learning_rate(s), 0.5f * std::pow(0.5f, s / 2));
    want_w -= sgd.learning_rate(s);
    // Adam's reference: the closed form with the scheduled rate at step s.
    const float lr = s <= 2 ? 0.1f : 0.01f;
    EXPECT_EQ(adam.learning_rate(s), lr);
    const double t = s + 1;
    const float alpha =
        static_cast<float>(lr * std::sqrt(1.0 - std::pow(0.999f, t)) / (1.0 - std::pow(0.9f, t)));
    for (int i = 0; i < 3; ++i) {
      const float g = ref_a.data<float>()[i];
      float& mi = m.data<float>()[i];
      float& vi = v.data<float>()[i];
      mi = 0.9f * mi + (1 - 0.9f) * g;
      vi = 0.999f * vi + (1 - 0.999f) * g * g;
      ref_a.data<float>()[i] -= alpha * mi / (std::sqrt(vi) + 1e-7f);
    }
    strategy.run([&](ds::ReplicaContext& ctx) {
      // Two replicas: each contributes half, the sum is 1 (and a's value).
      ds::Tensor g(ds::Shape{3}, ds::DType::kFloat32);
      ds::init::Constant{0.5}(g);
      sgd.apply_gradients(ctx, {{g, w}});
      ds::Tensor ga = a.read(ctx).clone();
      for (int i = 0; i < 3; ++i) ga.data<float>()[i] *= 0.5f;
      adam.apply_gradients(ctx, {{ga, a}});
    });
  }
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(w.value().data<float>()[i], want_w, 1e-6);
  EXPECT_LE(ds::testing::max_abs_diff(a.value(), ref_a), 1e-6);
}

// The parameter server rebuilds the schedule from the wire and applies the
// same rates as the worker's optimizer would.
TEST(LearningRateSchedule, ParameterServerRuleRebuildsTheSchedule) {
  ds::MirroredStrategy local({ds::Device::cpu(0)});
  ds::SGDOptions so;
  so.learning_rate = 0.3f;
  so.momentum = 0.9f;
  so.schedule = Schedule::piecewise_constant({1, 3, 7}, {0.3f, 0.2f, 0.1f, 0.05f});
  ds::AdamOptions ao;
  ao.schedule = Schedule::cosine_decay(9, 3, 0.2f, 0.0001f);
  ds::SGD sgd(local, so);
  ds::Adam adam(local, ao);
  for (const ds::Optimizer* opt : std::vector<const ds::Optimizer*>{&sgd, &adam}) {
    ds::ps::Writer w;
    ds::ps::write_config(w, ds::ps::describe_optimizer(*opt));
    const std::vector<char> bytes = w.bytes();
    ds::ps::Reader r(bytes.data(), bytes.size(), "test");
    const auto rule = ds::ps::make_shard_updater(ds::ps::read_config(r));
    ds::Tensor a(ds::Shape{5}, ds::DType::kFloat32), b(ds::Shape{5}, ds::DType::kFloat32);
    ds::init::RandomNormal{0.0, 1.0, 3}(a);
    b = a.clone();
    std::vector<ds::Tensor> sa, sb;
    for (size_t k = 0; k < opt->slot_names().size(); ++k) {
      sa.emplace_back(a.shape(), ds::DType::kFloat32);
      sb.emplace_back(a.shape(), ds::DType::kFloat32);
    }
    for (int64_t step = 1; step <= 14; ++step) {
      ds::Tensor g = a.clone();
      std::vector<ds::Tensor*> pa;
      std::vector<float*> pb;
      for (auto& s : sa) pa.push_back(&s);
      for (auto& s : sb) pb.push_back(s.data<float>());
      opt->update_tensor(a, g, pa, step);
      rule->update(b.data<float>(), g.data<float>(), pb.data(), 5, step);
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes())) << opt->name() << " step " << step;
    }
  }
}

// Under ParameterServerStrategy end to end: the PS applies the scheduled rate.
TEST(LearningRateSchedule, ParameterServerStrategyAppliesTheSchedule) {
  ds::ParameterServerStrategy strategy(ds::ParameterServerOptions{});
  ds::Variable w =
      strategy.create_variable("w", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::SGDOptions so;
  so.learning_rate = 1.0f;
  so.schedule = Schedule::exponential_decay(1, 0.5f);
  ds::SGD sgd(strategy, so);
  for (int s = 0; s < 5; ++s) {
    strategy.run([&](ds::ReplicaContext& ctx) {
      ds::Tensor g(ds::Shape{2}, ds::DType::kFloat32);
      ds::init::Constant{1.0}(g);
      sgd.apply_gradients(ctx, {{g, w}});
    });
  }
  // -(1 + 1/2 + 1/4 + 1/8 + 1/16)
  for (int i = 0; i < 2; ++i) EXPECT_FLOAT_EQ(w.value().data<float>()[i], -1.9375f);
}

// ---- resume mid-schedule -------------------------------------------------------

// A model whose optimizer follows a schedule, under any strategy.
struct Scheduled {
  Scheduled(std::unique_ptr<ds::Strategy> s, uint64_t seed, bool adam)
      : strategy(std::move(s)), mlp({6, 5, 3}), params(mlp.create_variables(*strategy, seed)) {
    if (adam) {
      ds::AdamOptions o;
      o.learning_rate = 0.05f;
      o.schedule = Schedule::cosine_decay(6, 3, 0.1f);
      opt = std::make_unique<ds::Adam>(*strategy, o);
    } else {
      ds::SGDOptions o;
      o.learning_rate = 0.2f;
      o.momentum = 0.9f;
      o.schedule = Schedule::piecewise_constant({2, 4}, {0.2f, 0.05f, 0.01f});
      opt = std::make_unique<ds::SGD>(*strategy, o);
    }
    ckpt =
        std::make_unique<ds::Checkpoint>(*strategy, std::vector<const ds::Optimizer*>{opt.get()});
  }
  void train(int steps, uint64_t seed) {
    ds::testing::mlp_train(*strategy, mlp, params, *opt, 8, steps, seed);
  }
  int64_t iterations() const { return opt->iterations().value().data<int64_t>()[0]; }
  std::unique_ptr<ds::Strategy> strategy;
  ds::nn::Mlp mlp;
  std::vector<ds::Variable> params;
  std::unique_ptr<ds::Optimizer> opt;
  std::unique_ptr<ds::Checkpoint> ckpt;
};

// Uninterrupted: 9 steps. Interrupted: 4 steps, CheckpointManager::save, a
// fresh model (other initial weights) restores and runs the last 5 steps.
// The schedule continues from the restored counter: bit-identical weights.
void resume_case(const std::function<std::unique_ptr<ds::Strategy>()>& make, bool adam) {
  Scheduled a(make(), 3, adam);
  a.train(4, 11);
  a.train(5, 12);

  const std::string dir = temp_dir(kTrainingTempPrefix);
  {
    Scheduled b(make(), 3, adam);
    b.train(4, 11);
    ds::CheckpointManager manager(*b.ckpt, dir, {2});
    manager.save(b.iterations());
  }
  Scheduled c(make(), 77, adam);
  ds::CheckpointManager manager(*c.ckpt, dir, {2});
  ASSERT_TRUE(manager.restore_latest().has_value());
  ASSERT_EQ(c.iterations(), 4);
  EXPECT_EQ(c.opt->learning_rate(c.iterations()), a.opt->learning_rate(4));
  c.train(5, 12);
  EXPECT_EQ(c.iterations(), 9);
  ds::testing::expect_same_state(*a.ckpt, *c.ckpt);
}

std::unique_ptr<ds::Strategy> mirrored2() {
  return std::make_unique<ds::MirroredStrategy>(
      std::vector<ds::Device>{ds::Device::cpu(0), ds::Device::cpu(1)});
}
std::unique_ptr<ds::Strategy> central2() {
  return std::make_unique<ds::CentralStorageStrategy>(
      std::vector<ds::Device>{ds::Device::cpu(0), ds::Device::cpu(1)});
}

TEST(LearningRateScheduleResume, MirroredSgdMomentumPiecewiseContinuesBitExactly) {
  resume_case(mirrored2, false);
}
TEST(LearningRateScheduleResume, MirroredAdamCosineWarmupContinuesBitExactly) {
  resume_case(mirrored2, true);
}
TEST(LearningRateScheduleResume, CentralStorageAdamCosineWarmupContinuesBitExactly) {
  resume_case(central2, true);
}
// Two PS ranks (threads of this process): the schedule runs on the PS from
// each shard's restored step.
std::unique_ptr<ds::Strategy> ps2() {
  ds::ParameterServerOptions o;
  o.num_ps = 2;
  o.partitioner = ds::partitioners::FixedShards{2};
  return std::make_unique<ds::ParameterServerStrategy>(o);
}
TEST(LearningRateScheduleResume, ParameterServerSgdPiecewiseContinuesBitExactly) {
  resume_case(ps2, false);
}
TEST(LearningRateScheduleResume, ParameterServerAdamCosineWarmupContinuesBitExactly) {
  resume_case(ps2, true);
}

// ---- gradient clipping ---------------------------------------------------------

// Plain single-device SGD-momentum over the same global batches, with the
// clipping written out here (independently of Optimizer): the weights and,
// per step, the global norm of the full-batch gradient.
struct ClipReference {
  std::vector<ds::Tensor> params;
  std::vector<double> norms;
};
ClipReference clipped_reference(const ds::nn::Mlp& mlp, const ds::Dataset& data, int64_t batch,
                                int steps, float lr, float momentum,
                                const ds::GradientClipping& c) {
  ClipReference out;
  out.params = mlp.init_params(5);
  std::vector<ds::Tensor> velocity;
  for (auto& p : out.params) velocity.emplace_back(p.shape(), ds::DType::kFloat32);
  for (int s = 0; s < steps; ++s) {
    const int64_t lo = s * batch, hi = std::min<int64_t>(lo + batch, data.size());
    ds::Dataset b = data.slice(lo, hi);
    auto st = mlp.forward_backward(out.params, b.features(), b.labels(), 1.0f / (hi - lo));
    double sq = 0;
    for (const ds::Tensor& g : st.grads) {
      for (int64_t k = 0; k < g.num_elements(); ++k)
        sq += double(g.data<float>()[k]) * g.data<float>()[k];
    }
    const double norm = std::sqrt(sq);
    out.norms.push_back(norm);
    for (size_t i = 0; i < out.params.size(); ++i) {
      ds::Tensor g = st.grads[i].clone();
      float* gp = g.data<float>();
      const int64_t n = g.num_elements();
      float scale = 1.0f;
      if (c.global_norm > 0)
        scale = static_cast<float>(c.global_norm / std::max<double>(norm, c.global_norm));
      if (c.norm > 0) {
        double t = 0;
        for (int64_t k = 0; k < n; ++k) t += double(gp[k]) * gp[k];
        scale = static_cast<float>(c.norm / std::max<double>(std::sqrt(t), c.norm));
      }
      for (int64_t k = 0; k < n; ++k) {
        gp[k] *= scale;
        if (c.value > 0) gp[k] = std::min(c.value, std::max(-c.value, gp[k]));
      }
      float* w = out.params[i].data<float>();
      float* v = velocity[i].data<float>();
      for (int64_t k = 0; k < n; ++k) {
        v[k] = momentum * v[k] - lr * gp[k];
        w[k] += v[k];
      }
    }
  }
  return out;
}

// The same training under a strategy with Optimizer clipping: each replica's
// reported norm per step (norms[step] has one entry per local replica).
std::vector<std::vector<double>> train_clipped(ds::Strategy& strategy, const ds::nn::Mlp& mlp,
                                               const ds::Dataset& data, int64_t batch, int steps,
                                               float lr, float momentum,
                                               const ds::GradientClipping& c,
                                               std::vector<ds::Variable>* vars) {
  *vars = mlp.create_variables(strategy, 5);
  ds::SGD opt(strategy, {lr, momentum});
  opt.set_clipping(c);
  ds::DistributeOptions o;
  o.shuffle = false;
  ds::DistributedDataset dist = strategy.distribute(data, batch, o);
  std::vector<std::vector<double>> norms;
  std::mutex mu;
  int done = 0;
  for (const auto& b : dist) {
    if (done++ == steps) break;
    norms.emplace_back();
    strategy.run([&](ds::ReplicaContext& ctx) {
      std::vector<ds::Tensor> values;
      for (auto& v : *vars) values.push_back(v.read(ctx));
      auto st = mlp.forward_backward(values, b.features(ctx), b.labels(ctx),
                                     1.0f / static_cast<float>(b.global_size()));
      std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
      for (size_t i = 0; i < vars->size(); ++i) gv.emplace_back(st.grads[i], (*vars)[i]);
      const ds::ApplyResult r = opt.apply_gradients(ctx, gv);
      std::lock_guard<std::mutex> lock(mu);
      norms.back().push_back(r.global_norm);
    });
  }
  return norms;
}

constexpr int64_t kClipBatch = 32;
constexpr int kClipSteps = 6;
constexpr float kClipLr = 0.1f, kClipMomentum = 0.9f;

ds::GradientClipping by_global_norm(float n) {
  ds::GradientClipping c;
  c.global_norm = n;
  return c;
}

// Norms reported on every replica of one process equal the reference norm
// (<= 1e-6 relative) and each other (bit for bit); the weights match the
// single-device clipped training.
void expect_matches_reference(const std::vector<std::vector<double>>& norms,
                              const ClipReference& ref, const std::vector<ds::Tensor>& weights,
                              bool global) {
  ASSERT_EQ(norms.size(), ref.norms.size());
  for (size_t s = 0; s < norms.size(); ++s) {
    ASSERT_FALSE(norms[s].empty());
    for (double n : norms[s]) {
      if (global) {
        EXPECT_LE(std::fabs(n - ref.norms[s]), 1e-6 * ref.norms[s]) << "step " << s;
        EXPECT_EQ(n, norms[s][0]) << "step " << s;  // identical on every replica
      } else {
        EXPECT_TRUE(std::isnan(n)) << "no global norm without clip_by_global_norm";
      }
    }
  }
  EXPECT_LE(ds::testing::max_abs_diff(weights, ref.params), 2e-6);
}

std::vector<ds::Tensor> values_of(const std::vector<ds::Variable>& vars) {
  std::vector<ds::Tensor> v;
  for (const auto& x : vars) v.push_back(x.value());
  return v;
}

struct ClipCase {
  const char* name;
  ds::GradientClipping clipping;
};

class Clipping : public ::testing::TestWithParam<ClipCase> {};

const ds::nn::Mlp& clip_mlp() {
  static const ds::nn::Mlp mlp({784, 16, 10});
  return mlp;
}
const ds::Dataset& clip_data() {
  static const ds::Dataset data = ds::testing::synthetic(kClipBatch * kClipSteps, 21);
  return data;
}

TEST_P(Clipping, MirroredAndCentralStorageMatchSingleDeviceClipping) {
  const ds::GradientClipping c = GetParam().clipping;
  const ClipReference ref =
      clipped_reference(clip_mlp(), clip_data(), kClipBatch, kClipSteps, kClipLr, kClipMomentum, c);
  // The bound really clips: the norm exceeds it at every step, and the
  // clipped training ends far from the unclipped one.
  if (c.global_norm > 0) {
    for (double n : ref.norms) EXPECT_GT(n, c.global_norm * 1.5);
  }
  const bool on = c.global_norm > 0 || c.norm > 0 || c.value > 0;
  const ClipReference plain = clipped_reference(clip_mlp(), clip_data(), kClipBatch, kClipSteps,
                                                kClipLr, kClipMomentum, {});
  if (on) EXPECT_GT(ds::testing::max_abs_diff(plain.params, ref.params), 1e-3);
  for (int which = 0; which < 2; ++which) {
    std::unique_ptr<ds::Strategy> s = which == 0 ? mirrored2() : central2();
    std::vector<ds::Variable> vars;
    const auto norms = train_clipped(*s, clip_mlp(), clip_data(), kClipBatch, kClipSteps, kClipLr,
                                     kClipMomentum, c, &vars);
    SCOPED_TRACE(s->name());
    for (const auto& n : norms) EXPECT_EQ(n.size(), 2u);
    expect_matches_reference(norms, ref, values_of(vars), c.global_norm > 0);
  }
}

// Multi-worker, workers as threads over an in-process group (as in
// multi_worker_test.cc): 2 workers x 2 local replicas and 3 workers x 1.
TEST_P(Clipping, MultiWorkerMatchesSingleDeviceClippingOnEveryWorker) {
  const ds::GradientClipping c = GetParam().clipping;
  const ClipReference ref =
      clipped_reference(clip_mlp(), clip_data(), kClipBatch, kClipSteps, kClipLr, kClipMomentum, c);
  for (const auto& [workers, local] : {std::pair<int, int>{2, 2}, {3, 1}}) {
    SCOPED_TRACE(std::to_string(workers) + " workers x " + std::to_string(local));
    ds::CommunicationOptions comm;
    comm.bytes_per_pack = 4 << 10;  // several packs per step
    comm.timeout = std::chrono::seconds(60);
    std::vector<std::vector<std::vector<double>>> norms(workers);
    std::vector<std::vector<ds::Tensor>> weights(workers);
    ds::testing::rethrow_first(ds::testing::run_multi_worker(
        std::vector<bool>(workers, false), local, comm,
        [&](ds::MultiWorkerMirroredStrategy& s, int w) {
          std::vector<ds::Variable> vars;
          norms[w] = train_clipped(s, clip_mlp(), clip_data(), kClipBatch, kClipSteps, kClipLr,
                                   kClipMomentum, c, &vars);
          for (auto& v : vars) {
            for (const ds::Tensor& copy : v.impl().copies) weights[w].push_back(copy.clone());
          }
        }));
    for (int w = 0; w < workers; ++w) {
      std::vector<ds::Tensor> first_copy;
      for (size_t i = 0; i < weights[w].size(); i += local) first_copy.push_back(weights[w][i]);
      expect_matches_reference(norms[w], ref, first_copy, c.global_norm > 0);
      for (size_t s = 0; s < norms[w].size(); ++s) {
        ASSERT_EQ(norms[w][s].size(), size_t(local));
        if (c.global_norm > 0) EXPECT_EQ(norms[w][s][0], norms[0][s][0]) << "worker " << w;
      }
      // Every copy on every worker bit-identical to worker 0's.
      ASSERT_EQ(weights[w].size(), weights[0].size());
      for (size_t i = 0; i < weights[w].size(); ++i) {
        EXPECT_EQ(0,
                  std::memcmp(weights[w][i].data(), weights[0][i].data(), weights[0][i].nbytes()));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, Clipping,
                         ::testing::Values(ClipCase{"global_norm", by_global_norm(0.05f)},
                                           ClipCase{"per_tensor_norm",
                                                    [] {
                                                      ds::GradientClipping c;
                                                      c.norm = 0.02f;
                                                      return c;
                                                    }()},
                                           ClipCase{"value",
                                                    [] {
                                                      ds::GradientClipping c;
                                                      c.value = 0.002f;
                                                      return c;
                                                    }()},
                                           ClipCase{"off", ds::GradientClipping{}}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(ClippingMisuse, ParameterServerIsUnimplementedAndBadSettingsAreRejected) {
  ds::ParameterServerStrategy strategy(ds::ParameterServerOptions{});
  ds::Variable w =
      strategy.create_variable("w", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::SGD sgd(strategy, {0.1f});
  sgd.set_clipping(by_global_norm(1.0f));
  try {
    strategy.run([&](ds::ReplicaContext& ctx) {
      sgd.apply_gradients(ctx, {{ds::Tensor(ds::Shape{2}, ds::DType::kFloat32), w}});
    });
    FAIL() << "clipping under ParameterServerStrategy was accepted";
  } catch (const ds::Error& e) {
    EXPECT_EQ(e.code(), ds::ErrorCode::kUnimplemented);
    EXPECT_NE(std::string(e.what()).find("ParameterServerStrategy"), std::string::npos) << e.what();
  }
  ds::GradientClipping two;
  two.global_norm = 1.0f;
  two.value = 1.0f;
  EXPECT_THROW(sgd.set_clipping(two), ds::InvalidArgumentError);
  EXPECT_THROW(sgd.set_clipping(by_global_norm(-1.0f)), ds::InvalidArgumentError);
  EXPECT_THROW(sgd.set_clipping(by_global_norm(NAN)), ds::InvalidArgumentError);
}

// ---- gradient accumulation -----------------------------------------------------

constexpr int64_t kMicro = 16;  // global examples per micro-batch
constexpr int kUpdates = 20;
constexpr float kAccLr = 0.05f, kAccMomentum = 0.9f;

const ds::nn::Mlp& acc_mlp() {
  static const ds::nn::Mlp mlp({784, 16, 10});
  return mlp;
}
// 20 updates of k micro-batches; the very last micro-batch 3 examples short.
ds::Dataset acc_data(int k) { return ds::testing::synthetic(kUpdates * k * kMicro - 3, 31); }

// k micro-batches per update under `strategy`, each micro-batch's loss scaled
// by 1 / (global examples of the update's k micro-batches). Checks that only
// the k-th call applies.
std::vector<ds::Variable> train_accumulated(ds::Strategy& strategy, int k, int64_t micro,
                                            const ds::Dataset& data) {
  std::vector<ds::Variable> vars = acc_mlp().create_variables(strategy, 5);
  ds::SGD opt(strategy, {kAccLr, kAccMomentum});
  opt.set_accumulation_steps(k);
  ds::DistributeOptions o;
  o.shuffle = false;
  ds::DistributedDataset dist = strategy.distribute(data, micro, o);
  std::vector<ds::DistributedBatch> batches;
  for (const auto& b : dist) batches.push_back(b);
  EXPECT_EQ(batches.size(), size_t(kUpdates * k)) << "micro-batches";
  for (size_t u = 0; u * k < batches.size(); ++u) {
    int64_t total = 0;
    for (int i = 0; i < k; ++i) total += batches[u * k + i].global_size();
    for (int i = 0; i < k; ++i) {
      const ds::DistributedBatch& b = batches[u * k + i];
      strategy.run([&](ds::ReplicaContext& ctx) {
        std::vector<ds::Tensor> values;
        for (auto& v : vars) values.push_back(v.read(ctx));
        auto st = acc_mlp().forward_backward(values, b.features(ctx), b.labels(ctx),
                                             1.0f / static_cast<float>(total));
        std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
        for (size_t j = 0; j < vars.size(); ++j) gv.emplace_back(st.grads[j], vars[j]);
        EXPECT_EQ(opt.apply_gradients(ctx, gv).applied, i == k - 1);
      });
    }
    EXPECT_EQ(opt.iterations().value().data<int64_t>()[0], int64_t(u + 1));
  }
  return vars;
}

class Accumulation : public ::testing::TestWithParam<int> {};

TEST_P(Accumulation, KMicroBatchesEqualOneBatchOfKTimesTheSizeUnderEveryStrategy) {
  const int k = GetParam();
  const ds::Dataset data = acc_data(k);
  // Single device, one batch of k x 16 per update (the last one short).
  const auto ref =
      ds::testing::reference_training(acc_mlp(), data, k * kMicro, kUpdates, kAccLr, kAccMomentum);
  for (int which = 0; which < 2; ++which) {
    std::unique_ptr<ds::Strategy> s = which == 0 ? mirrored2() : central2();
    SCOPED_TRACE(s->name());
    const auto vars = train_accumulated(*s, k, kMicro, data);
    EXPECT_LE(ds::testing::max_abs_diff(values_of(vars), ref), 1e-6);
  }
  {
    // ParameterServer, one worker with 2 replicas in lockstep: one push per
    // update, however many micro-batches.
    ds::ParameterServerOptions o;
    o.devices = ds::testing::cpu_devices(2);
    o.max_staleness = 0;
    ds::ParameterServerStrategy s(o);
    const auto vars = train_accumulated(s, k, kMicro, data);
    s.flush();
    EXPECT_LE(ds::testing::max_abs_diff(values_of(vars), ref), 1e-6) << "parameter_server";
    EXPECT_EQ(s.stats().pushes_sent, kUpdates);
  }
}

// Multi-worker (2 workers x 2 replicas as threads): the same weights as the
// single device, and the communication counters of 20 updates of k
// micro-batches equal those of 20 plain steps: nothing is sent for the
// k - 1 earlier micro-batches.
TEST_P(Accumulation, MultiWorkerCommunicatesOncePerUpdate) {
  const int k = GetParam();
  const ds::Dataset data = acc_data(k);
  const auto ref =
      ds::testing::reference_training(acc_mlp(), data, k * kMicro, kUpdates, kAccLr, kAccMomentum);
  auto run = [&](int steps) {
    const int workers = 2;
    std::vector<ds::MultiWorkerStats> before(workers), after(workers);
    std::vector<std::vector<ds::Tensor>> weights(workers);
    ds::testing::rethrow_first(
        ds::testing::run_multi_worker(std::vector<bool>(workers, false), 2,
                                      ds::testing::comm_with_timeout(std::chrono::seconds(60)),
                                      [&](ds::MultiWorkerMirroredStrategy& s, int w) {
                                        // 1: the strategy run with k micro-batches; else one step per batch of k x 16.
                                        std::vector<ds::Variable> vars;
                                        before[w] = s.stats();
                                        if (steps == 1) {
                                          vars = train_accumulated(s, k, kMicro, data);
                                        } else {
                                          vars = train_accumulated(s, 1, k * kMicro, data);
                                        }
                                        after[w] = s.stats();
                                        for (auto& v : vars)
                                          weights[w].push_back(v.impl().copies[0].clone());
                                      }));
    std::vector<int64_t> counts = {after[0].calls - before[0].calls,
                                   after[0].packs - before[0].packs,
                                   after[0].bytes - before[0].bytes};
    EXPECT_LE(ds::testing::max_abs_diff(weights[0], ref), 1e-6);
    EXPECT_EQ(0, ds::testing::max_abs_diff(weights[1], weights[0]));
    return counts;
  };
  const std::vector<int64_t> accumulated = run(1), plain = run(2);
  EXPECT_EQ(accumulated, plain) << "calls, packs, bytes";
  std::cout << "k=" << k << ": " << accumulated[0] << " cross-process calls, " << accumulated[1]
            << " packs for " << kUpdates << " updates of " << k
            << " micro-batches (plain: " << plain[0] << ", " << plain[1] << ")\n";
  EXPECT_GE(accumulated[0], kUpdates);
}

INSTANTIATE_TEST_SUITE_P(K, Accumulation, ::testing::Values(1, 2, 4));

TEST(AccumulationMisuse, BadStepsMismatchedMicroBatchesAndChangesWhilePending) {
  ds::MirroredStrategy strategy({ds::Device::cpu(0)});
  ds::Variable a =
      strategy.create_variable("a", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::Variable b =
      strategy.create_variable("b", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::SGD sgd(strategy, {0.1f});
  EXPECT_THROW(sgd.set_accumulation_steps(0), ds::InvalidArgumentError);
  sgd.set_accumulation_steps(2);
  ds::Tensor g(ds::Shape{2}, ds::DType::kFloat32);
  strategy.run([&](ds::ReplicaContext& ctx) {
    EXPECT_FALSE(sgd.apply_gradients(ctx, {{g, a}}).applied);
  });
  EXPECT_THROW(sgd.set_accumulation_steps(1), ds::FailedPreconditionError);
  EXPECT_THROW(strategy.run([&](ds::ReplicaContext& ctx) {
    sgd.apply_gradients(ctx, {{g, b}});
  }),
               ds::InvalidArgumentError);
  strategy.run([&](ds::ReplicaContext& ctx) {
    EXPECT_TRUE(sgd.apply_gradients(ctx, {{g, a}}).applied);
  });
  sgd.set_accumulation_steps(1);
}

// ---- loss scaling ----------------------------------------------------------------

constexpr int kLsSteps = 6, kLsBadStep = 3;

// Replica r's gradient of step s before scaling (its share of the sum).
float ls_grad(int step, int replica, int i) {
  return 0.01f * (step + 1) * (replica + 1) + 0.001f * i;
}

struct LsRun {
  std::vector<std::vector<bool>> skipped;  // [step][local replica]
  std::vector<std::vector<float>> scales;  // [step][local replica]: the scale used
  std::vector<ds::Tensor> weights;         // every copy of w, then of its momentum
  int64_t iterations = 0, skipped_steps = 0;
  float final_scale = 0;
};

// SGD-momentum on w[4], initial scale 8, growth every 2 finite steps. The loop
// multiplies its gradient by loss_scale(ctx); at kLsBadStep the replica with
// global id `bad_replica` puts an inf into its gradient (-1: none, and the
// step is left out of the loop instead: the reference of a skipped step).
// `grad_dtype` f16/bf16: the loop hands mixed-precision gradients (its f32
// values rounded to that type; the bad one overflows it, 70000 * scale, instead
// of being set to inf); f32 with `round_like` f16/bf16: the same rounded values
// as float32 gradients (the reference of a mixed-precision run).
LsRun train_loss_scaled(ds::Strategy& strategy, bool scaling, int bad_replica,
                        ds::DType grad_dtype = ds::DType::kFloat32,
                        ds::DType round_like = ds::DType::kFloat32) {
  ds::Variable w =
      strategy.create_variable("w", ds::Shape{4}, ds::DType::kFloat32, ds::init::Constant{1.0});
  ds::SGD opt(strategy, {0.1f, 0.9f});
  if (scaling) {
    ds::LossScaleOptions o;
    o.initial_scale = 8.0f;
    o.growth_interval = 2;
    opt.enable_loss_scaling(o);
  }
  LsRun out;
  std::mutex mu;
  for (int s = 0; s < kLsSteps; ++s) {
    if (!scaling && s == kLsBadStep) continue;
    out.skipped.emplace_back();
    out.scales.emplace_back();
    strategy.run([&](ds::ReplicaContext& ctx) {
      const float scale = opt.loss_scale(ctx);
      const ds::DType low = grad_dtype != ds::DType::kFloat32 ? grad_dtype : round_like;
      std::vector<float> v(4);
      for (int i = 0; i < 4; ++i) v[i] = ls_grad(s, ctx.replica_id(), i) * scale;
      if (s == kLsBadStep && ctx.replica_id() == bad_replica) {
        v[2] = low == ds::DType::kFloat32 ? INFINITY : 70000.0f * scale;
      }
      ds::Tensor g(ds::Shape{4}, grad_dtype);
      for (int i = 0; i < 4; ++i) {
        const float rounded = low == ds::DType::kFloat16    ? float(ds::Half(v[i]))
                              : low == ds::DType::kBFloat16 ? float(ds::BFloat16(v[i]))
                                                            : v[i];
        if (grad_dtype == ds::DType::kFloat16) {
          g.data<ds::Half>()[i] = ds::Half(v[i]);
        } else if (grad_dtype == ds::DType::kBFloat16) {
          g.data<ds::BFloat16>()[i] = ds::BFloat16(v[i]);
        } else {
          g.data<float>()[i] = rounded;
        }
      }
      const ds::ApplyResult r = opt.apply_gradients(ctx, {{g, w}});
      std::lock_guard<std::mutex> lock(mu);
      out.skipped.back().push_back(r.skipped);
      out.scales.back().push_back(r.loss_scale);
    });
  }
  for (const ds::Tensor& c : w.impl().copies) out.weights.push_back(c.clone());
  for (const ds::Tensor& c : w.impl().slot("momentum")) out.weights.push_back(c.clone());
  out.iterations = opt.iterations().value().data<int64_t>()[0];
  out.skipped_steps = opt.skipped_steps();
  if (scaling) out.final_scale = strategy.variable("optimizer/loss_scale").value().data<float>()[0];
  return out;
}

// Scales used: 8, 8 (2 finite: grow), 16, skip at 3 (back off to 8), 8, 8 (grow): 16 at the end.
void expect_one_skip(const LsRun& run, size_t replicas) {
  const std::vector<float> want_scales = {8, 8, 16, 16, 8, 8};
  ASSERT_EQ(run.skipped.size(), size_t(kLsSteps));
  for (int s = 0; s < kLsSteps; ++s) {
    ASSERT_EQ(run.skipped[s].size(), replicas);
    for (size_t r = 0; r < replicas; ++r) {
      EXPECT_EQ(run.skipped[s][r], s == kLsBadStep) << "step " << s << " replica " << r;
      EXPECT_EQ(run.scales[s][r], want_scales[s]) << "step " << s << " replica " << r;
    }
  }
  EXPECT_EQ(run.iterations, kLsSteps - 1);
  EXPECT_EQ(run.skipped_steps, 1);
  EXPECT_EQ(run.final_scale, 16.0f);
}

TEST(LossScaling, AnInfOnOneReplicaSkipsTheStepOnEveryReplicaMirroredAndCentralStorage) {
  for (int which = 0; which < 2; ++which) {
    std::unique_ptr<ds::Strategy> a = which == 0 ? mirrored2() : central2();
    std::unique_ptr<ds::Strategy> b = which == 0 ? mirrored2() : central2();
    SCOPED_TRACE(a->name());
    const LsRun scaled = train_loss_scaled(*a, true, 1);
    expect_one_skip(scaled, 2);
    // Equal to training without the bad step and without scaling (the scales
    // are powers of two: unscaling is exact).
    const LsRun ref = train_loss_scaled(*b, false, -1);
    ASSERT_EQ(scaled.weights.size(), ref.weights.size());
    for (size_t i = 0; i < ref.weights.size(); ++i) {
      EXPECT_EQ(
          0, std::memcmp(scaled.weights[i].data(), ref.weights[i].data(), ref.weights[i].nbytes()))
          << "tensor " << i;
      // Copies bit-identical across replicas.
      EXPECT_EQ(0, std::memcmp(scaled.weights[i].data(),
                               scaled.weights[i - i % (scaled.weights.size() / 2)].data(),
                               ref.weights[i].nbytes()));
    }
  }
}

// Mixed precision: f16 / bf16 gradients of float32 variables. An f16
// overflow on one replica (70000 * scale is inf in f16) skips the step on
// every replica, and the run equals one with float32 gradients holding the
// same rounded values, bit for bit (bf16's range holds 70000 * scale: no
// overflow, no skip; f16 gradients there must be finite to compare).
TEST(LossScaling, HalfAndBFloat16GradientsOfFloat32VariablesAreWidenedAndOverflowSkips) {
  for (int which = 0; which < 2; ++which) {
    SCOPED_TRACE(which == 0 ? "mirrored" : "central_storage");
    std::unique_ptr<ds::Strategy> a = which == 0 ? mirrored2() : central2();
    std::unique_ptr<ds::Strategy> b = which == 0 ? mirrored2() : central2();
    const LsRun half = train_loss_scaled(*a, true, 1, ds::DType::kFloat16);
    expect_one_skip(half, 2);
    const LsRun ref = train_loss_scaled(*b, true, 1, ds::DType::kFloat32, ds::DType::kFloat16);
    expect_one_skip(ref, 2);
    ASSERT_EQ(half.weights.size(), ref.weights.size());
    for (size_t i = 0; i < ref.weights.size(); ++i) {
      EXPECT_EQ(0,
                std::memcmp(half.weights[i].data(), ref.weights[i].data(), ref.weights[i].nbytes()))
          << "tensor " << i;
    }
    std::unique_ptr<ds::Strategy> c = which == 0 ? mirrored2() : central2();
    std::unique_ptr<ds::Strategy> d = which == 0 ? mirrored2() : central2();
    const LsRun bf = train_loss_scaled(*c, true, 1, ds::DType::kBFloat16);
    const LsRun bf_ref = train_loss_scaled(*d, true, 1, ds::DType::kFloat32, ds::DType::kBFloat16);
    for (int s = 0; s < kLsSteps; ++s) EXPECT_FALSE(bf.skipped[s][0]) << s;
    for (size_t i = 0; i < bf_ref.weights.size(); ++i) {
      EXPECT_EQ(0, std::memcmp(bf.weights[i].data(), bf_ref.weights[i].data(),
                               bf_ref.weights[i].nbytes()))
          << "tensor " << i;
    }
  }
  // Without loss scaling too (plain mixed-precision gradients), and the
  // mismatches that stay errors: a float64 gradient, an f16 gradient of the
  // wrong shape.
  auto s = mirrored2();
  ds::Variable w =
      s->create_variable("w", ds::Shape{4}, ds::DType::kFloat32, ds::init::Constant{1.0});
  ds::SGD opt(*s, {0.5f, 0.0f});
  s->run([&](ds::ReplicaContext& ctx) {
    ds::Tensor g(ds::Shape{4}, ds::DType::kFloat16);
    for (int i = 0; i < 4; ++i) g.data<ds::Half>()[i] = ds::Half(0.25f);
    opt.apply_gradients(ctx, {{g, w}});
  });
  for (const ds::Tensor& c : w.impl().copies) EXPECT_EQ(c.data<float>()[0], 1.0f - 0.5f * 0.5f);
  s->run([&](ds::ReplicaContext& ctx) {
    ds::Tensor g64(ds::Shape{4}, ds::DType::kFloat64);
    g64.zero();
    ds::Tensor g16(ds::Shape{3}, ds::DType::kFloat16);
    g16.zero();
    for (const ds::Tensor& g : {g64, g16}) {
      try {
        opt.apply_gradients(ctx, {{g, w}});
        ADD_FAILURE() << "accepted " << g.debug_string();
      } catch (const ds::InvalidArgumentError& e) {
        EXPECT_NE(std::string(e.what()).find("does not match variable 'w'"), std::string::npos)
            << e.what();
      }
    }
  });
}

// Two workers x two replicas as threads; the inf on worker 1's second replica
// (global replica 3): every replica of every worker skips step 3, the scales
// agree everywhere, the weights and momentum stay bit-identical.
TEST(LossScaling, AnInfOnOneReplicaOfOneWorkerSkipsTheStepOnEveryWorker) {
  const int workers = 2;
  std::vector<LsRun> runs(workers);
  ds::testing::rethrow_first(ds::testing::run_multi_worker(
      std::vector<bool>(workers, false), 2,
      ds::testing::comm_with_timeout(std::chrono::seconds(60)),
      [&](ds::MultiWorkerMirroredStrategy& s, int w) { runs[w] = train_loss_scaled(s, true, 3); }));
  for (int w = 0; w < workers; ++w) {
    SCOPED_TRACE("worker " + std::to_string(w));
    expect_one_skip(runs[w], 2);
    ASSERT_EQ(runs[w].weights.size(), 4u);  // 2 copies of w, 2 of its momentum
    for (size_t i = 0; i < 4; ++i) {
      const ds::Tensor& first = runs[0].weights[i < 2 ? 0 : 2];
      EXPECT_EQ(0, std::memcmp(runs[w].weights[i].data(), first.data(), first.nbytes())) << i;
    }
  }
}

TEST(LossScaling, StateIsCheckpointedAndMisuseIsAnError) {
  std::unique_ptr<ds::Strategy> s = mirrored2();
  ds::Variable w = s->create_variable("w", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::SGD opt(*s, {0.1f});
  EXPECT_THROW(opt.enable_loss_scaling({0.5f}), ds::InvalidArgumentError);
  opt.enable_loss_scaling();
  EXPECT_THROW(opt.enable_loss_scaling(), ds::FailedPreconditionError);
  ds::Checkpoint ckpt(*s, {&opt});
  std::vector<std::string> names;
  for (const auto& [name, t] : ckpt.state()) names.push_back(name);
  for (const char* n :
       {"optimizer/loss_scale", "optimizer/loss_scale_good_steps", "optimizer/skipped_steps"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  }

  ds::ParameterServerStrategy ps(ds::ParameterServerOptions{});
  ds::Variable v = ps.create_variable("v", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::SGD psopt(ps, {0.1f});
  psopt.enable_loss_scaling();
  try {
    ps.run([&](ds::ReplicaContext& ctx) {
      psopt.apply_gradients(ctx, {{ds::Tensor(ds::Shape{2}, ds::DType::kFloat32), v}});
    });
    FAIL() << "loss scaling under ParameterServerStrategy was accepted";
  } catch (const ds::Error& e) {
    EXPECT_EQ(e.code(), ds::ErrorCode::kUnimplemented);
    EXPECT_NE(std::string(e.what()).find("ParameterServerStrategy"), std::string::npos) << e.what();
  }
}

}  // namespace

// The same variable twice in one apply_gradients call is an error on every
// replica (it was updated twice, silently, by the unsharded path), with or
// without accumulation, before any communication.
TEST(ApplyGradientsMisuse, AVariablePassedTwiceIsAnErrorNamingIt) {
  for (int which = 0; which < 2; ++which) {
    std::unique_ptr<ds::Strategy> s = which == 0 ? mirrored2() : central2();
    SCOPED_TRACE(s->name());
    ds::Variable a =
        s->create_variable("a", ds::Shape{2}, ds::DType::kFloat32, ds::init::Constant{1.0});
    ds::Variable b =
        s->create_variable("b", ds::Shape{2}, ds::DType::kFloat32, ds::init::Constant{1.0});
    ds::SGD opt(*s, {0.5f, 0.0f});
    std::vector<std::string> errors(2);
    s->run([&](ds::ReplicaContext& ctx) {
      ds::Tensor g(ds::Shape{2}, ds::DType::kFloat32);
      g.data<float>()[0] = g.data<float>()[1] = 1.0f;
      try {
        opt.apply_gradients(ctx, {{g, a}, {g, b}, {g.clone(), a}});
      } catch (const ds::InvalidArgumentError& e) {
        errors[ctx.local_replica_id()] = e.what();
      }
    });
    for (const std::string& e : errors) {
      EXPECT_NE(e.find("passed variable 'a' twice (positions 0 and 2)"), std::string::npos)
          << "'" << e << "'";
    }
    for (const ds::Tensor& c : a.impl().copies) EXPECT_EQ(c.data<float>()[0], 1.0f);
  }
}
