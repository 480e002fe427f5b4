// A captured step (issue 44 item 2) on fake GPUs: MirroredStrategy::compile
// records each replica's step into graphs once and replays it. Replayed
// training must give the bits eager training gives (over a learning-rate
// schedule, Adam and a partial last batch with a zero-row replica), a replay
// must be graph launches only, and what capture cannot hold must be a clear
// error. `ctest -R GpuStep` selects these with the other step tests.
#if __has_include("fake_gpu_backend.h")

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "core/device_manager_impl.h"
#include "diststrat/device_manager.h"
#include "diststrat/diststrat.h"
#include "fake_gpu_backend.h"

namespace ds = diststrat;
using diststrat_test::FakeGpuBackend;
using diststrat_test::LeaseDir;

namespace {

// MirroredStrategy over `gpus` fake GPUs training a small MLP on `rows`
// rows in global batches of 32 (the last one partial unless rows % 32 == 0).
struct CaptureSetup {
  CaptureSetup(int gpus, int64_t rows, bool adam) {
    auto backend = std::make_unique<FakeGpuBackend>(gpus);
    fake = backend.get();
    ds::MirroredOptions o;
    for (int i = 0; i < gpus; ++i) o.devices.push_back(ds::Device::gpu(i));
    o.communication.timeout = std::chrono::seconds(60);
    o.device_manager =
        ds::DeviceManagerAccess::shared_with_backend(dir.gpu_options(), std::move(backend));
    strategy = std::make_unique<ds::MirroredStrategy>(o);
    vars = mlp.create_variables(*strategy, 3);
    if (adam) {
      ds::AdamOptions a;
      a.learning_rate = 0.01f;
      a.schedule = ds::LearningRateSchedule::piecewise_constant({3, 7}, {0.01f, 0.005f, 0.002f});
      opt = std::make_unique<ds::Adam>(*strategy, a);
    } else {
      ds::SGDOptions s;
      s.learning_rate = 0.05f;
      s.momentum = 0.9f;
      s.schedule = ds::LearningRateSchedule::cosine_decay(12, 2, 0.1f);
      opt = std::make_unique<ds::SGD>(*strategy, s);
    }
    x = ds::Tensor(ds::Shape{rows, 24}, ds::DType::kFloat32);
    y = ds::Tensor(ds::Shape{rows}, ds::DType::kInt32);
    ds::init::RandomNormal{0.0, 1.0, 5}(x);
    for (int64_t i = 0; i < rows; ++i) y.data<int32_t>()[i] = static_cast<int32_t>(i % 10);
    dist = std::make_unique<ds::DistributedDataset>(
        strategy->distribute(ds::Dataset(x, y), 32, {true, 7, false}));
  }
  ~CaptureSetup() {
    losses.clear();
    compiled = ds::CompiledStep();
    opt.reset();
    strategy.reset();  // releases the leases before the directory goes
  }
  // The step, for run() and for compile() alike.
  ds::Tensor step(ds::ReplicaContext& ctx, const ds::DistributedBatch& b) {
    std::vector<ds::Tensor> p;
    for (const ds::Variable& v : vars) p.push_back(v.read(ctx));
    const float scale = 1.0f / static_cast<float>(b.global_size());
    ds::nn::Mlp::Step st = mlp.forward_backward(p, b.features(ctx), b.labels(ctx), scale);
    std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
    for (size_t k = 0; k < vars.size(); ++k) gv.emplace_back(st.grads[k], vars[k]);
    opt->apply_gradients(ctx, gv);
    return st.row_losses;
  }
  // `epochs` passes, every step eagerly through run() or through a compiled step.
  void train(int epochs, bool captured, ds::CaptureOptions options = {}) {
    if (captured && !compiled_made) {
      compiled = strategy->compile(
          [this](ds::ReplicaContext& ctx, const ds::DistributedBatch& b) { return step(ctx, b); },
          options);
      compiled_made = true;
    }
    for (int e = 0; e < epochs; ++e) {
      dist->set_epoch(e);
      for (int64_t i = 0; i < dist->num_batches(); ++i) {
        const ds::DistributedBatch b = dist->batch(i);
        // Each step's per-row losses, read after training.
        losses.push_back(captured ? compiled(b) : strategy->run([&](ds::ReplicaContext& ctx) {
          return step(ctx, b);
        }));
      }
    }
  }
  std::vector<float> weights() {
    std::vector<float> out;
    for (const ds::Variable& v : vars) {
      const ds::Tensor t = v.value();
      out.insert(out.end(), t.data<float>(), t.data<float>() + t.num_elements());
    }
    return out;
  }
  int64_t iterations() { return opt->iterations().value().data<int64_t>()[0]; }
  // Every step's per-row losses (their bits), on the host, gathered over
  // the replicas.
  std::vector<std::vector<uint32_t>> step_losses() {
    std::vector<std::vector<uint32_t>> out;
    for (ds::PerReplica<ds::Tensor> l : losses) {
      // A replica without rows has no row losses: none of its own to gather.
      std::vector<uint32_t> undefined;
      for (size_t r = 0; r < l.size(); ++r) {
        if (!l[r].defined()) {
          undefined.push_back(static_cast<uint32_t>(r));
          l[r] = l[0].slice_rows(0, 0);
        }
      }
      out.push_back(undefined);
      const ds::Tensor t = strategy->gather(l);
      const auto* p = static_cast<const uint32_t*>(t.data());
      out.emplace_back(p, p + t.num_elements());
    }
    return out;
  }

  LeaseDir dir;
  FakeGpuBackend* fake = nullptr;
  std::unique_ptr<ds::MirroredStrategy> strategy;
  ds::nn::Mlp mlp{{24, 16, 16, 10}};
  std::vector<ds::Variable> vars;
  std::unique_ptr<ds::Optimizer> opt;
  std::unique_ptr<ds::DistributedDataset> dist;
  ds::Tensor x, y;
  ds::CompiledStep compiled;
  bool compiled_made = false;
  std::vector<ds::PerReplica<ds::Tensor>> losses;
};

ds::CaptureOptions warm_up_once() {
  ds::CaptureOptions o;
  o.warmup_steps = 1;
  return o;
}

// Four epochs of four batches (three of 32 rows, one partial): per batch
// size one eager warm-up step, one captured step, then replays.
void expect_captured_equals_eager(int gpus, int64_t rows, bool adam) {
  CaptureSetup eager(gpus, rows, adam), captured(gpus, rows, adam);
  eager.train(4, false);
  captured.train(4, true, warm_up_once());
  const ds::CompiledStep::Stats st = captured.compiled.stats();
  EXPECT_EQ(st.eager_steps, 2);
  EXPECT_EQ(st.captures, 2) << "one capture per batch size (full, partial)";
  EXPECT_EQ(st.replays, 12);
  EXPECT_GT(captured.fake->graph_launches.load(), 0);
  EXPECT_EQ(captured.iterations(), 16) << "replays count their steps";
  EXPECT_EQ(captured.iterations(), eager.iterations());
  EXPECT_EQ(captured.weights(), eager.weights()) << "replays differ from eager steps";
  EXPECT_EQ(captured.step_losses(), eager.step_losses())
      << "the losses a compiled step returns differ from the eager steps'";
}

}  // namespace

// SGD with momentum under a cosine schedule with warm-up; the last batch of
// each epoch has 12 rows (6 per replica).
TEST(GpuStepCapture, ReplaysEqualEagerStepsBitForBitWithSgdAScheduleAndAPartialBatch) {
  expect_captured_equals_eager(2, 3 * 32 + 12, /*adam=*/false);
}

// Adam (bias correction from the step counter) under a piecewise schedule;
// the last batch has one row, so replica 1 has zero rows in it.
TEST(GpuStepCapture, ReplaysEqualEagerStepsBitForBitWithAdamAndAZeroRowReplica) {
  expect_captured_equals_eager(2, 3 * 32 + 1, /*adam=*/true);
}

// A replayed step enqueues no kernel of its own and reads nothing back: one
// graph launch per replica on one GPU; on two, the step is split around
// its gradient all-reduce (the device collectives wait on the host), so
// two graphs and the collective between them.
TEST(GpuStepCapture, AReplayIsGraphLaunchesOnlyOnePerReplicaOnOneGpu) {
  for (int gpus : {1, 2}) {
    CaptureSetup s(gpus, 4 * 32, false);
    s.train(1, true, warm_up_once());  // eager, captured, two replays
    s.strategy->synchronize();
    const int kernels = s.fake->kernels_launched.load(), graphs = s.fake->graph_launches.load();
    const int reads = s.fake->host_reads.load();
    std::map<std::string, int> before = s.fake->launched();
    s.train(1, true);  // four replays
    const int steps = 4;
    std::map<std::string, int> after = s.fake->launched();
    for (const auto& [what, n] : after) {
      const auto it = before.find(what);
      const int d = n - (it == before.end() ? 0 : it->second);
      if (d)
        std::printf("[ GpuStep  ] %d GPU(s), %d replays: %s: %d\n", gpus, steps, what.c_str(), d);
    }
    const int per_replica = (s.fake->graph_launches.load() - graphs) / (steps * gpus);
    EXPECT_EQ(per_replica, gpus == 1 ? 1 : 2) << gpus << " GPU(s)";
    EXPECT_EQ(s.compiled.stats().graphs_per_step, gpus == 1 ? 1 : 2);
    EXPECT_EQ(s.compiled.stats().host_boundaries, gpus == 1 ? 0 : 1);
    EXPECT_EQ(s.fake->kernels_launched.load() - kernels, 0) << "kernels launched outside graphs";
    EXPECT_EQ(s.fake->host_reads.load() - reads, 0);
    EXPECT_EQ(after["collective"] - before["collective"], gpus == 1 ? 0 : steps * gpus);
    EXPECT_EQ(s.compiled.stats().replays, 2 + steps);
  }
}

// Reading the loss inside the step (a device -> host read) cannot be
// captured: the call fails with an error naming the read, and later calls
// of that batch size run eagerly.
TEST(GpuStepCapture, AHostReadInsideTheCapturedStepIsAClearError) {
  CaptureSetup s(2, 2 * 32, false);
  double seen = 0;
  ds::CompiledStep step = s.strategy->compile(
      [&](ds::ReplicaContext& ctx, const ds::DistributedBatch& b) {
        std::vector<ds::Tensor> p;
        for (const ds::Variable& v : s.vars) p.push_back(v.read(ctx));
        ds::nn::Mlp::Step st = s.mlp.forward_backward(p, b.features(ctx), b.labels(ctx), 0.03f);
        if (ctx.local_replica_id() == 0) seen += st.loss_sum.get();  // a host read
      },
      warm_up_once());
  step(s.dist->batch(0));  // eager: the read is fine
  try {
    step(s.dist->batch(1));
    ADD_FAILURE() << "a host read was captured";
  } catch (const ds::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("replica 0's step cannot be captured into a graph"), std::string::npos) << m;
    EXPECT_NE(m.find("softmax_cross_entropy's loss"), std::string::npos) << m;
    EXPECT_NE(m.find("cudaErrorStreamCaptureUnsupported"), std::string::npos) << m;
  }
  EXPECT_NO_THROW(step(s.dist->batch(0))) << "the size's later calls run eagerly";
  EXPECT_EQ(step.stats().eager_steps, 2);
  EXPECT_EQ(step.stats().captures, 0);
}

// A copy from host memory inside the step would read that memory at every
// replay: refused before it reaches the backend.
TEST(GpuStepCapture, ACopyFromHostMemoryInsideTheCapturedStepIsRefused) {
  CaptureSetup s(1, 32, false);
  ds::Tensor host(ds::Shape{4}, ds::DType::kFloat32);
  ds::CompiledStep step = s.strategy->compile(
      [&](ds::ReplicaContext& ctx, const ds::DistributedBatch&) {
        ds::Tensor t = ds::Tensor::uninitialized(ds::Shape{4}, ds::DType::kFloat32, ctx.device());
        t.copy_from(host);
      },
      warm_up_once());
  step(s.dist->batch(0));
  try {
    step(s.dist->batch(0));
    ADD_FAILURE() << "a copy from host memory was captured";
  } catch (const ds::FailedPreconditionError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("copy_from: a copy of"), std::string::npos) << m;
    EXPECT_NE(m.find("inside a captured step"), std::string::npos) << m;
  }
}

// Host decisions of the optimizer (clipping, loss scaling, accumulation)
// would be fixed in a graph at the captured step's outcome: refused by name.
TEST(GpuStepCapture, ClippingAndAccumulationInsideTheCapturedStepAreRefused) {
  for (bool accumulate : {false, true}) {
    CaptureSetup s(2, 32, false);
    if (accumulate) {
      s.opt->set_accumulation_steps(2);
    } else {
      ds::GradientClipping c;
      c.global_norm = 1.0f;
      s.opt->set_clipping(c);
    }
    ds::CompiledStep step = s.strategy->compile(
        [&](ds::ReplicaContext& ctx, const ds::DistributedBatch& b) { s.step(ctx, b); },
        warm_up_once());
    step(s.dist->batch(0));
    try {
      step(s.dist->batch(0));
      ADD_FAILURE() << "captured";
    } catch (const ds::FailedPreconditionError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(accumulate ? "with gradient accumulation" : "with gradient clipping"),
                std::string::npos)
          << m;
      EXPECT_NE(m.find("inside a captured step"), std::string::npos) << m;
    }
  }
}

// Host work that a replay would not repeat: merge_call is refused by name
// (on every replica, so none waits for the others in it).
TEST(GpuStepCapture, MergeCallInsideTheCapturedStepIsRefused) {
  CaptureSetup s(2, 32, false);
  ds::CompiledStep step = s.strategy->compile(
      [&](ds::ReplicaContext& ctx, const ds::DistributedBatch&) {
        ctx.merge_call([](ds::Strategy&) {});
      },
      warm_up_once());
  step(s.dist->batch(0));
  try {
    step(s.dist->batch(0));
    ADD_FAILURE() << "captured";
  } catch (const ds::FailedPreconditionError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("merge_call (host work"), std::string::npos) << m;
    EXPECT_NE(m.find("inside a captured step"), std::string::npos) << m;
  }
}

// A bad label in a replayed step is still found on the device and reported
// at the next synchronization, naming the replayed step (each replay's flag
// is copied out before the next replay rewrites it).
TEST(GpuStepCapture, ABadLabelInAReplaySurfacesNamingItsStep) {
  CaptureSetup s(2, 32, false);
  ds::CompiledStep step = s.strategy->compile(
      [&](ds::ReplicaContext& ctx, const ds::DistributedBatch& b) { s.step(ctx, b); },
      warm_up_once());
  step(s.dist->batch(0));  // step 0, eager
  step(s.dist->batch(0));  // step 1, captured
  step(s.dist->batch(0));  // step 2, replayed
  ds::Tensor bad_y = s.y.clone();
  bad_y.data<int32_t>()[20] = 10;  // replica 1's row 4 (no shuffle below)
  ds::DistributedDataset bad =
      s.strategy->distribute(ds::Dataset(s.x, bad_y), 32, {false, 0, false});
  step(bad.batch(0));      // step 3, replayed
  step(s.dist->batch(0));  // step 4: the flag is rewritten with 0
  try {
    s.strategy->synchronize();
    ADD_FAILURE() << "synchronize() did not report the bad label";
  } catch (const ds::InvalidArgumentError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("in step 3: the label of row 4 is outside [0, 10)"), std::string::npos) << m;
  }
  EXPECT_EQ(step.stats().replays, 3);
}

#endif  // fake_gpu_backend.h
