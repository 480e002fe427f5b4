// The optimizer's training features on GPU variables (issue 24 item 10), on
// the fake GPU backend: gradient clipping (global norm, per-tensor norm,
// value), dynamic loss scaling with a step skipped on inf, gradient
// accumulation, and their combination, under MirroredStrategy with two fake
// GPUs against the same training on two CPU replicas. The fake runs the
// device kernels with the host path's arithmetic and summation order, so the
// runs agree bit for bit; each step's transform is a fixed number of list
// launches (not one per tensor) and at most one device -> host read.
// Compiles to nothing in a tree without the fake backend.
#if __has_include("fake_gpu_backend.h")

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "core/device_manager_impl.h"
#include "../common/temp_dir.h"
#include "../common/zero_cases.h"
#include "diststrat/device_manager.h"
#include "diststrat/diststrat.h"
#include "fake_gpu_backend.h"

namespace ds = diststrat;
namespace zc = ds::zero_cases;
using diststrat_test::FakeGpuBackend;
using diststrat_test::LeaseDir;

namespace {

struct GpuFeatureConfig {
  ds::GradientClipping clip;
  bool loss_scale = false;
  int accumulate = 1;
  bool adam = false;
  int steps = 6;        // updates
  int64_t poison = -1;  // loss scaling: the micro-batch whose gradient on replica 1 gets an inf
  bool zero = false;    // ZeRO-1
};

struct TrainRun {
  std::vector<ds::Tensor> weights;
  std::vector<double> norms;  // ApplyResult::global_norm of replica 0, per micro-batch
  std::vector<bool> skipped, applied;
  std::vector<float> scales;
  int64_t iterations = 0, skipped_steps = 0;
  float final_scale = 0;
  int launches = 0;  // the fake's training-feature list launches
  int updates = 0;   // its update kernels
  int64_t slot_bytes = 0;
};

// A fresh fake-GPU MirroredStrategy (2 GPUs) or a CPU one (2 replicas).
struct TrainSetup {
  explicit TrainSetup(bool gpu, bool zero = false) {
    ds::MirroredOptions o;
    o.shard_optimizer_state = zero;
    o.communication.timeout = std::chrono::seconds(60);
    if (gpu) {
      auto backend = std::make_unique<FakeGpuBackend>(2);
      fake = backend.get();
      ds::GpuOptions g;
      g.lease = dir.options();
      o.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};
      o.device_manager = ds::DeviceManagerAccess::shared_with_backend(g, std::move(backend));
    } else {
      o.devices = {ds::Device::cpu(0), ds::Device::cpu(1)};
    }
    strategy = std::make_unique<ds::MirroredStrategy>(o);
  }
  ~TrainSetup() { strategy.reset(); }  // releases the leases before the directory goes
  LeaseDir dir;
  FakeGpuBackend* fake = nullptr;
  std::unique_ptr<ds::MirroredStrategy> strategy;
};

// Host gradient for the replica from the host value of its copy (read back
// from the device on GPUs), put where the replica computes.
ds::Tensor gradient(ds::ReplicaContext& ctx, const ds::Variable& v, size_t k, int64_t m,
                    float scale, bool poison) {
  ds::Tensor w(v.shape(), ds::DType::kFloat32);
  w.copy_from(v.read(ctx));
  ds::Tensor g = zc::replica_grad(w, k, m, ctx.replica_id(), ctx.num_replicas_in_sync());
  float* p = g.data<float>();
  for (int64_t i = 0; i < g.num_elements(); ++i) p[i] *= scale;
  if (poison && k == 0) p[0] = INFINITY;
  ds::Tensor out(v.shape(), ds::DType::kFloat32, ctx.device());
  out.copy_from(g);
  return out;
}

// `before` runs once the model and optimizer exist (a restore), `after`
// once training is done (a save). The gradients continue from the restored
// step counter.
TrainRun train(TrainSetup& s, const GpuFeatureConfig& c,
               const std::function<void(ds::Optimizer&)>& after = nullptr,
               const std::function<void(ds::Optimizer&)>& before = nullptr) {
  ds::Strategy& strategy = *s.strategy;
  auto vars = zc::create_model(strategy);
  auto opt = zc::make_optimizer(strategy, c.adam);
  opt->set_clipping(c.clip);
  if (c.loss_scale) opt->enable_loss_scaling({1024.0f, 2, 2.0f});
  opt->set_accumulation_steps(c.accumulate);
  if (before) before(*opt);
  TrainRun run;
  std::mutex mu;
  const int64_t first = opt->iterations().value().data<int64_t>()[0] * c.accumulate;
  for (int64_t m = first; m < first + int64_t(c.steps) * c.accumulate; ++m) {
    strategy.run([&](ds::ReplicaContext& ctx) {
      const float scale = opt->loss_scale(ctx);
      std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
      for (size_t k = 0; k < vars.size(); ++k) {
        gv.emplace_back(gradient(ctx, vars[k], k, m, scale, m == c.poison && ctx.replica_id() == 1),
                        vars[k]);
      }
      const ds::ApplyResult r = opt->apply_gradients(ctx, gv);
      if (ctx.replica_id() != 0) return;
      std::lock_guard<std::mutex> lock(mu);
      run.norms.push_back(r.global_norm);
      run.skipped.push_back(r.skipped);
      run.applied.push_back(r.applied);
      run.scales.push_back(r.loss_scale);
    });
  }
  for (const ds::Variable& v : vars) {
    run.weights.push_back(v.value());
    // Both replicas' copies (from the device), bit-identical.
    ds::Tensor other(v.shape(), ds::DType::kFloat32);
    strategy.run([&](ds::ReplicaContext& ctx) {
      if (ctx.replica_id() == 1) other.copy_from(v.read(ctx));
    });
    EXPECT_EQ(0, std::memcmp(other.data(), run.weights.back().data(), other.nbytes())) << v.name();
  }
  run.iterations = opt->iterations().value().data<int64_t>()[0];
  run.slot_bytes = opt->slot_bytes_per_replica();
  run.skipped_steps = opt->skipped_steps();
  if (c.loss_scale)
    run.final_scale = strategy.variable("optimizer/loss_scale").value().data<float>()[0];
  if (after) after(*opt);
  if (s.fake) {
    run.launches = s.fake->training_launches.load();
    run.updates = s.fake->updates.load();
  }
  return run;
}

void expect_same(const TrainRun& gpu, const TrainRun& cpu) {
  ASSERT_EQ(gpu.weights.size(), cpu.weights.size());
  for (size_t k = 0; k < cpu.weights.size(); ++k) {
    EXPECT_EQ(0, std::memcmp(gpu.weights[k].data(), cpu.weights[k].data(), cpu.weights[k].nbytes()))
        << "variable " << k << " differs by " << zc::max_diff({gpu.weights[k]}, {cpu.weights[k]});
  }
  ASSERT_EQ(gpu.norms.size(), cpu.norms.size());
  for (size_t i = 0; i < cpu.norms.size(); ++i) {
    if (std::isnan(cpu.norms[i])) {
      EXPECT_TRUE(std::isnan(gpu.norms[i])) << "micro-batch " << i;
    } else {
      EXPECT_EQ(gpu.norms[i], cpu.norms[i]) << "micro-batch " << i;
    }
  }
  EXPECT_EQ(gpu.skipped, cpu.skipped);
  EXPECT_EQ(gpu.applied, cpu.applied);
  EXPECT_EQ(gpu.scales, cpu.scales);
  EXPECT_EQ(gpu.iterations, cpu.iterations);
  EXPECT_EQ(gpu.skipped_steps, cpu.skipped_steps);
  EXPECT_EQ(gpu.final_scale, cpu.final_scale);
}

TrainRun run_on(bool gpu, const GpuFeatureConfig& c) {
  TrainSetup s(gpu, c.zero);
  return train(s, c);
}

}  // namespace

TEST(TrainingOnFakeGpus, ClippingByGlobalNormNormAndValueMatchesCpuBitForBit) {
  struct Case {
    const char* name;
    ds::GradientClipping clip;
    int launches_per_step;  // per replica: sums + transform, or the transform alone
  };
  const Case cases[] = {
      {"global_norm", {0.2f, 0, 0}, 2}, {"norm", {0, 0.05f, 0}, 2}, {"value", {0, 0, 0.01f}, 1}};
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    GpuFeatureConfig c;
    c.clip = k.clip;
    const TrainRun cpu = run_on(false, c);
    const TrainRun gpu = run_on(true, c);
    expect_same(gpu, cpu);
    EXPECT_EQ(gpu.launches, c.steps * 2 * k.launches_per_step);  // not one per tensor
    EXPECT_EQ(gpu.updates, c.steps * 2 * 3);
    if (k.clip.global_norm > 0) {
      for (double n : gpu.norms) EXPECT_GT(n, 0.2) << "the test must really clip";
    }
  }
}

TEST(TrainingOnFakeGpus, LossScalingSkipsTheStepWithAnInfOnEveryReplicaLikeTheCpu) {
  for (bool adam : {false, true}) {
    SCOPED_TRACE(adam ? "adam" : "sgd momentum");
    GpuFeatureConfig c;
    c.loss_scale = true;
    c.adam = adam;
    c.poison = 3;
    const TrainRun cpu = run_on(false, c);
    const TrainRun gpu = run_on(true, c);
    expect_same(gpu, cpu);
    ASSERT_EQ(gpu.skipped.size(), 6u);
    EXPECT_TRUE(gpu.skipped[3]);
    EXPECT_EQ(gpu.skipped_steps, 1);
    EXPECT_EQ(gpu.iterations, 5);
    // 1024, 1024, 2048 (grown), 2048 (skipped), 1024, 1024; 2048 at the end.
    EXPECT_EQ(gpu.scales, (std::vector<float>{1024, 1024, 2048, 2048, 1024, 1024}));
    EXPECT_EQ(gpu.final_scale, 2048.0f);
    // Per replica and step: the sums, then the unscaling (not on the skipped step).
    EXPECT_EQ(gpu.launches, 2 * (2 * 6 - 1));
    EXPECT_EQ(gpu.updates, 2 * 5 * 3);
  }
}

TEST(TrainingOnFakeGpus, AccumulationOverKMicroBatchesMatchesCpuWithOneLaunchEach) {
  GpuFeatureConfig c;
  c.accumulate = 3;
  c.steps = 4;
  const TrainRun cpu = run_on(false, c);
  const TrainRun gpu = run_on(true, c);
  expect_same(gpu, cpu);
  ASSERT_EQ(gpu.applied.size(), 12u);
  for (size_t i = 0; i < gpu.applied.size(); ++i) EXPECT_EQ(gpu.applied[i], i % 3 == 2) << i;
  EXPECT_EQ(gpu.iterations, 4);
  EXPECT_EQ(gpu.launches, 2 * 12);  // one accumulate launch per replica and micro-batch
  EXPECT_EQ(gpu.updates, 2 * 4 * 3);
}

TEST(TrainingOnFakeGpus, LossScalingGlobalNormAndAccumulationTogetherMatchCpu) {
  GpuFeatureConfig c;
  c.adam = true;
  c.loss_scale = true;
  c.clip.global_norm = 0.3f;
  c.accumulate = 2;
  c.steps = 5;
  c.poison = 5;  // the second micro-batch of update 2: the inf reaches the sums
  const TrainRun cpu = run_on(false, c);
  const TrainRun gpu = run_on(true, c);
  expect_same(gpu, cpu);
  EXPECT_TRUE(gpu.skipped[5]);
  EXPECT_EQ(gpu.skipped_steps, 1);
  EXPECT_EQ(gpu.iterations, 4);
}

// The loss scale lives in device memory on GPU replicas: a checkpoint saves
// the current value and a restore on fresh GPUs continues with it.
TEST(TrainingOnFakeGpus, LossScaleStateOnTheDeviceIsCheckpointed) {
  const diststrat_test::TempDir tmp("diststrat-train-gpu-");
  const std::string path = tmp / "ls.safetensors";
  GpuFeatureConfig c;
  c.loss_scale = true;
  c.poison = 3;
  c.steps = 5;
  TrainSetup a(true);
  const TrainRun ran =
      train(a, c, [&](ds::Optimizer& opt) { ds::Checkpoint(*a.strategy, {&opt}).save(path); });
  TrainSetup b(true);
  auto vars = zc::create_model(*b.strategy);
  auto opt = zc::make_optimizer(*b.strategy, false);
  opt->enable_loss_scaling({1024.0f, 2, 2.0f});
  ds::Checkpoint(*b.strategy, {opt.get()}).restore(path);
  EXPECT_EQ(opt->skipped_steps(), 1);
  b.strategy->run(
      [&](ds::ReplicaContext& ctx) { EXPECT_EQ(opt->loss_scale(ctx), ran.final_scale); });
  EXPECT_TRUE(opt->iterations().value().data<int64_t>()[0] == ran.iterations);
}

// ---- ZeRO-1 with device variables ----------------------------------------------

// The sharded state (gradient block, variable block, slot blocks) lives on
// each replica's GPU; the reduce-scatter and all-gather run on the device
// buffers. Equal to ZeRO-1 on CPU replicas bit for bit, with half the slots
// per replica, also under global-norm clipping and loss scaling with a
// skipped step (their one scalar reduced across the replicas).
TEST(TrainingOnFakeGpus, ZeroOneWithDeviceVariablesMatchesCpuZeroOne) {
  for (int variant = 0; variant < 3; ++variant) {
    GpuFeatureConfig c;
    c.zero = true;
    c.adam = variant == 1;
    if (variant == 2) {
      c.clip.global_norm = 0.2f;
      c.loss_scale = true;
      c.poison = 2;
    }
    SCOPED_TRACE(variant == 0 ? "sgd momentum" : variant == 1 ? "adam" : "clipping + loss scaling");
    const TrainRun cpu = run_on(false, c);
    const TrainRun gpu = run_on(true, c);
    expect_same(gpu, cpu);
    EXPECT_EQ(gpu.slot_bytes, cpu.slot_bytes);
    EXPECT_EQ(gpu.slot_bytes, (zc::kModelElements + 1) / 2 * 4 * (c.adam ? 2 : 1));
    EXPECT_EQ(gpu.updates,
              6 * 2 * 3 - (variant == 2 ? 2 * 3 : 0));  // each replica updates its block
    if (variant == 2) {
      EXPECT_TRUE(gpu.skipped[2]);
      for (size_t i = 0; i < gpu.norms.size(); ++i) {
        if (i != 2) EXPECT_GT(gpu.norms[i], 0.2);
      }
    }
  }
}

// Checkpoints of sharded device state: saved (the blocks gathered from the
// GPUs), restored before the first step (full slots cut into device blocks)
// and after it (written into the replicas' blocks), training continues as
// one uninterrupted CPU ZeRO-1 run.
TEST(TrainingOnFakeGpus, ZeroOneDeviceStateCheckpointsAndContinuesExactly) {
  const diststrat_test::TempDir tmp("diststrat-train-gpu-zero-");
  const std::string path = tmp / "zero.safetensors";
  for (bool adam : {false, true}) {
    SCOPED_TRACE(adam ? "adam" : "sgd momentum");
    GpuFeatureConfig c;
    c.zero = true;
    c.adam = adam;
    c.steps = 3;
    TrainSetup a(true, true);
    train(a, c, [&](ds::Optimizer& opt) { ds::Checkpoint(*a.strategy, {&opt}).save(path); });
    TrainSetup b(true, true);  // restored before its first step
    const TrainRun resumed = train(b, c, nullptr, [&](ds::Optimizer& opt) {
      ds::Checkpoint(*b.strategy, {&opt}).restore(path);
    });
    GpuFeatureConfig one = c;
    one.steps = 1;
    TrainSetup d(true, true);  // one step of its own first: the blocks exist
    TrainRun overwritten;
    {
      auto vars = zc::create_model(*d.strategy);
      auto opt = zc::make_optimizer(*d.strategy, adam);
      // Lay the state out with a step, then restore over it.
      d.strategy->run([&](ds::ReplicaContext& ctx) {
        std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
        for (size_t k = 0; k < vars.size(); ++k)
          gv.emplace_back(gradient(ctx, vars[k], k, 99, 1.0f, false), vars[k]);
        opt->apply_gradients(ctx, gv);
      });
      ASSERT_TRUE(opt->sharded());
      ds::Checkpoint(*d.strategy, {opt.get()}).restore(path);
      for (int64_t m = 3; m < 6; ++m) {
        d.strategy->run([&](ds::ReplicaContext& ctx) {
          std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
          for (size_t k = 0; k < vars.size(); ++k)
            gv.emplace_back(gradient(ctx, vars[k], k, m, 1.0f, false), vars[k]);
          opt->apply_gradients(ctx, gv);
        });
      }
      for (const ds::Variable& v : vars) overwritten.weights.push_back(v.value());
    }
    GpuFeatureConfig six = c;
    six.steps = 6;
    const TrainRun straight = run_on(false, six);
    ASSERT_EQ(resumed.weights.size(), straight.weights.size());
    for (size_t k = 0; k < straight.weights.size(); ++k) {
      EXPECT_EQ(0, std::memcmp(resumed.weights[k].data(), straight.weights[k].data(),
                               straight.weights[k].nbytes()))
          << "restored before the first step, variable " << k;
      EXPECT_EQ(0, std::memcmp(overwritten.weights[k].data(), straight.weights[k].data(),
                               straight.weights[k].nbytes()))
          << "restored over laid-out blocks, variable " << k;
    }
  }
}

// MultiWorkerMirroredStrategy, 2 workers (threads over one InProcessGroup) of
// 2 fake GPUs each, Adam with global-norm clipping and loss scaling (an inf
// on global replica 3 skips step 2 everywhere), with and without ZeRO-1 (the
// fusion engine's reduce-scatter / all-gather staged through the host, as the
// workers' all-reduce is): equal to the same on CPU replicas.
namespace {
std::vector<ds::Tensor> multi_worker_run(bool gpus, bool zero) {
  const int workers = 2;
  ds::CommunicationOptions comm;
  comm.timeout = std::chrono::seconds(60);
  ds::InProcessGroup flat(workers, comm);
  std::vector<std::vector<ds::Tensor>> out(workers);
  std::vector<std::exception_ptr> errors(workers);
  std::vector<std::unique_ptr<LeaseDir>> dirs;
  for (int w = 0; w < workers; ++w) dirs.push_back(std::make_unique<LeaseDir>());
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      try {
        ds::MultiWorkerOptions o;
        o.communication = comm;
        o.communicator = &flat.at(w);
        o.shard_optimizer_state = zero;
        if (gpus) {
          o.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};
          ds::GpuOptions g;
          g.lease = dirs[static_cast<size_t>(w)]->options();
          o.device_manager =
              ds::DeviceManagerAccess::shared_with_backend(g, std::make_unique<FakeGpuBackend>(2));
        } else {
          o.devices = {ds::Device::cpu(0), ds::Device::cpu(1)};
        }
        ds::MultiWorkerMirroredStrategy s(o);
        auto vars = zc::create_model(s);
        auto opt = zc::make_optimizer(s, true);
        opt->set_clipping({0.2f, 0, 0});
        opt->enable_loss_scaling({1024.0f, 2, 2.0f});
        for (int64_t m = 0; m < 5; ++m) {
          s.run([&](ds::ReplicaContext& ctx) {
            const float scale = opt->loss_scale(ctx);
            std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
            for (size_t k = 0; k < vars.size(); ++k) {
              gv.emplace_back(gradient(ctx, vars[k], k, m, scale, m == 2 && ctx.replica_id() == 3),
                              vars[k]);
            }
            const ds::ApplyResult r = opt->apply_gradients(ctx, gv);
            EXPECT_EQ(r.skipped, m == 2);
          });
        }
        for (const ds::Variable& v : vars) out[static_cast<size_t>(w)].push_back(v.value());
      } catch (...) {
        errors[static_cast<size_t>(w)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  EXPECT_EQ(zc::max_diff(out[0], out[1]), 0.0);
  return out[0];
}
}  // namespace

TEST(TrainingOnFakeGpus, MultiWorkerClippingLossScalingAndZeroOneMatchCpu) {
  for (bool zero : {false, true}) {
    SCOPED_TRACE(zero ? "ZeRO-1" : "not sharded");
    const auto cpu = multi_worker_run(false, zero);
    const auto gpu = multi_worker_run(true, zero);
    ASSERT_EQ(cpu.size(), gpu.size());
    for (size_t k = 0; k < cpu.size(); ++k) {
      EXPECT_EQ(0, std::memcmp(gpu[k].data(), cpu[k].data(), cpu[k].nbytes())) << "variable " << k;
    }
  }
}

// Gradient accumulation on GPU workers of ParameterServerStrategy: the sums
// are kept on the workers' GPUs and pushed once per update, as the CPU
// workers' are.
namespace {
std::vector<ds::Tensor> ps_accumulated(bool gpus) {
  LeaseDir dir;
  ds::ParameterServerOptions o;
  o.num_ps = 1;
  o.max_staleness = 0;
  o.communication.timeout = std::chrono::seconds(60);
  if (gpus) {
    o.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};
    ds::GpuOptions g;
    g.lease = dir.options();
    o.device_manager =
        ds::DeviceManagerAccess::shared_with_backend(g, std::make_unique<FakeGpuBackend>(2));
  } else {
    o.devices = {ds::Device::cpu(0), ds::Device::cpu(1)};
  }
  std::vector<ds::Tensor> out;
  {
    ds::ParameterServerStrategy s(o);
    auto vars = zc::create_model(s);
    auto opt = zc::make_optimizer(s, false);
    opt->set_accumulation_steps(2);
    for (int64_t m = 0; m < 6; ++m) {
      s.run([&](ds::ReplicaContext& ctx) {
        std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
        for (size_t k = 0; k < vars.size(); ++k)
          gv.emplace_back(gradient(ctx, vars[k], k, m, 1.0f, false), vars[k]);
        EXPECT_EQ(opt->apply_gradients(ctx, gv).applied, m % 2 == 1);
      });
    }
    s.flush();
    for (const ds::Variable& v : vars) out.push_back(v.value());
  }
  return out;
}
}  // namespace

TEST(TrainingOnFakeGpus, ParameterServerWorkersAccumulateOnTheirGpus) {
  const auto cpu = ps_accumulated(false);
  const auto gpu = ps_accumulated(true);
  EXPECT_LE(zc::max_diff(gpu, cpu), 1e-6);
}

// A micro-batch whose gradient is on another device than the first's sums is
// an error naming the variable, not a silent host read of device memory.
TEST(TrainingOnFakeGpus, AccumulationWithAGradientMovedToTheHostIsAnError) {
  TrainSetup s(true);
  ds::Variable w =
      s.strategy->create_variable("w", ds::Shape{4}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::SGD opt(*s.strategy, {0.1f, 0.0f});
  opt.set_accumulation_steps(2);
  s.strategy->run([&](ds::ReplicaContext& ctx) {
    opt.apply_gradients(ctx, {{ds::Tensor(ds::Shape{4}, ds::DType::kFloat32, ctx.device()), w}});
  });
  try {
    s.strategy->run([&](ds::ReplicaContext& ctx) {
      opt.apply_gradients(ctx, {{ds::Tensor(ds::Shape{4}, ds::DType::kFloat32), w}});
    });
    FAIL() << "no error";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(
        std::string(e.what()).find("'w' in micro-batch 2 where the first was on /device:GPU:"),
        std::string::npos)
        << e.what();
  }
}

#endif  // __has_include("fake_gpu_backend.h")
