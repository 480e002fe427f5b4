// One MLP training step on fake GPUs (issue 44): how much work it enqueues
// and how often the host reads the device, against a budget written here,
// and the fake's executor that runs the work behind the host's back.
// `ctest -R GpuStep` selects exactly these tests. Compiles to nothing in a
// tree without the fake backend.
#if __has_include("fake_gpu_backend.h")

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <filesystem>
#include <map>
#include <string>
#include <memory>

#include "core/device_manager_impl.h"
#include "diststrat/device_manager.h"
#include "diststrat/diststrat.h"
#include "fake_gpu_backend.h"
#include "training_util.h"

namespace ds = diststrat;
using diststrat_test::FakeGpuBackend;
using diststrat_test::LeaseDir;

namespace {

ds::DeadlineClock::time_point step_deadline(int s) {
  return ds::DeadlineClock::now() + std::chrono::seconds(s);
}

// A MirroredStrategy over `gpus` fake GPUs training the three-layer MLP of
// gpu_bench (784-256-256-10, shrunk: the structure sets the launch count).
struct GpuStepSetup {
  // `batches` global batches of 32 rows; `timeout` bounds every wait.
  explicit GpuStepSetup(int gpus = 2, int batches = 1,
                        std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    auto backend = std::make_unique<FakeGpuBackend>(gpus);
    fake = backend.get();
    ds::MirroredOptions o;
    for (int i = 0; i < gpus; ++i) o.devices.push_back(ds::Device::gpu(i));
    o.communication.timeout = timeout;
    o.device_manager =
        ds::DeviceManagerAccess::shared_with_backend(dir.gpu_options(), std::move(backend));
    strategy = std::make_unique<ds::MirroredStrategy>(o);
    vars = mlp.create_variables(*strategy, 3);
    opt = std::make_unique<ds::SGD>(*strategy, ds::SGDOptions{0.05f, 0.9f});
    const int64_t rows = 32 * batches;
    x = ds::Tensor(ds::Shape{rows, 24}, ds::DType::kFloat32);
    y = ds::Tensor(ds::Shape{rows}, ds::DType::kInt32);
    ds::init::RandomNormal{0.0, 1.0, 5}(x);
    for (int64_t i = 0; i < rows; ++i) y.data<int32_t>()[i] = static_cast<int32_t>(i % 10);
    dist = std::make_unique<ds::DistributedDataset>(
        strategy->distribute(ds::Dataset(x, y), 32, {false, 0, false}));
  }
  ~GpuStepSetup() {
    opt.reset();
    strategy.reset();  // releases the leases before the directory goes
  }
  // One training step on global batch `batch`; its loss, per replica, is
  // read only if the caller reads it.
  ds::PerReplica<ds::nn::StepValue<double>> step(int64_t batch = 0) {
    const ds::DistributedBatch b = dist->batch(batch);
    const float scale = 1.0f / static_cast<float>(b.global_size());
    return strategy->run([&](ds::ReplicaContext& ctx) {
      std::vector<ds::Tensor> p;
      for (const ds::Variable& v : vars) p.push_back(v.read(ctx));
      ds::nn::Mlp::Step st = mlp.forward_backward(p, b.features(ctx), b.labels(ctx), scale);
      std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
      for (size_t k = 0; k < vars.size(); ++k) gv.emplace_back(st.grads[k], vars[k]);
      opt->apply_gradients(ctx, gv);
      return st.loss_sum;
    });
  }
  // The weights, on the host (a read: waits for the steps).
  std::vector<float> weights() {
    std::vector<float> out;
    for (const ds::Variable& v : vars) {
      const ds::Tensor t = v.value();
      out.insert(out.end(), t.data<float>(), t.data<float>() + t.num_elements());
    }
    return out;
  }
  LeaseDir dir;
  FakeGpuBackend* fake = nullptr;
  std::unique_ptr<ds::MirroredStrategy> strategy;
  ds::nn::Mlp mlp{{24, 16, 16, 10}};
  std::vector<ds::Variable> vars;
  std::unique_ptr<ds::SGD> opt;
  std::unique_ptr<ds::DistributedDataset> dist;
  ds::Tensor x, y;
};

}  // namespace

// The budget of one replica's step: its input copies, the forward and
// backward layers, the loss, the gradient all-reduce and the update. Before
// issue 44 it was 48 launches (15 of them memsets zero-filling outputs that
// the kernels overwrite whole) and one read per replica (the loss and the
// label check, between forward and backward); then 35 (2 memsets of the
// input tensors, 12 packing copies into the all-reduce bucket, 3
// dense_forward + 2 relu_forward, 3 dense_backward + 2 relu_backward, 6
// updates, the loss's device -> host read, ...). Now: 2 input copies
// (staged through pinned memory, no zero-fill), 3 dense forward (2 fused
// with their ReLU), the loss (kept on the device with the label check: no
// read), 3 dense backward (2 fused with their dReLU), 1 all-reduce in place,
// 1 list update. Issue 44's goal is <= 12 launches and no read when the
// loss is not read; the budget below is what is built.
TEST(GpuStepLaunches, OneMlpStepStaysWithinItsLaunchAndReadBudget) {
  GpuStepSetup s(2);
  s.step();  // warm-up: slots, allocator blocks
  const int launches = s.fake->launches.load(), reads = s.fake->host_reads.load();
  const std::map<std::string, int> before = s.fake->launched();
  s.step();
  for (const auto& [what, n] : s.fake->launched()) {
    const auto it = before.find(what);
    const int d = n - (it == before.end() ? 0 : it->second);
    if (d) std::printf("[ GpuStep  ]   %s: %d (both replicas)\n", what.c_str(), d);
  }
  const int step_launches = (s.fake->launches.load() - launches) / 2;
  const int step_reads = s.fake->host_reads.load() - reads;
  std::printf("[ GpuStep  ] one MLP step per replica: %d launches, %d device->host reads\n",
              step_launches, step_reads);
  EXPECT_LE(step_launches, 11);
  EXPECT_EQ(step_reads, 0) << "the loss stays on the device until it is read";
}

// run() returns once the step is enqueued: with the launches slowed, the
// step's work is still queued when it returns, at most two steps are in
// flight (the host waits for the oldest beyond), and a read of the loss
// waits for the work and gives the value an unhurried run gives.
TEST(GpuStepAsync, RunReturnsBeforeTheStepsWorkFinishesAndAReadWaitsForIt) {
  GpuStepSetup reference(2, 4), slow(2, 4);
  std::vector<double> expected;
  for (int64_t b = 0; b < 4; ++b) {
    const auto l = reference.step(b);
    expected.push_back(l[0].get() + l[1].get());
  }
  slow.fake->set_launch_delay(std::chrono::milliseconds(2));
  std::vector<ds::PerReplica<ds::nn::StepValue<double>>> losses;
  // The first step with its update kernel paused: run() returns with that
  // work queued. (The fake's collective waits for its stream on the host, so
  // the work before it has run, and the next step's collective waits for
  // this update: resumed before it.) Under TSan a 2 ms launch delay alone
  // was not enough: the host's own step took longer than the queued work.
  slow.fake->pause_kernels("update list");
  for (int64_t b = 0; b < 4; ++b) {
    losses.push_back(slow.step(b));
    if (b == 0) {
      EXPECT_LT(slow.fake->kernels_run.load(), slow.fake->kernels_launched.load())
          << "run() waited for the step's work to finish";
      slow.fake->resume_kernels();
    }
    EXPECT_TRUE(losses.back()[0].pending()) << "the loss was read during the step";
  }
  EXPECT_GT(slow.fake->event_waits.load(), 0) << "more than two steps were in flight";
  const int reads = slow.fake->host_reads.load();
  for (int64_t b = 0; b < 4; ++b) {
    EXPECT_EQ(losses[static_cast<size_t>(b)][0].get() + losses[static_cast<size_t>(b)][1].get(),
              expected[static_cast<size_t>(b)])
        << "step " << b;
  }
  // One read per value, and one per replica for the label checks of its
  // steps whose losses were not read yet (all of them, one launch).
  EXPECT_EQ(slow.fake->host_reads.load() - reads, 8 + 2);
  EXPECT_EQ(slow.weights(), reference.weights());
}

// Features and labels go to the device through pinned buffers that the
// copies read when they run: run() does not wait for them, a buffer is
// reused only after its copy ran (same weights as an unhurried run over four
// different batches), and none is freed under a pending copy.
TEST(GpuStepAsync, StagedInputCopiesOutliveTheirCopies) {
  GpuStepSetup reference(2, 4), slow(2, 4);
  slow.fake->set_launch_delay(std::chrono::milliseconds(2));
  for (int round = 0; round < 2; ++round) {
    for (int64_t b = 0; b < 4; ++b) {
      reference.step(b);
      slow.step(b);
    }
  }
  EXPECT_GT(slow.fake->host_allocs.load(), 0) << "the inputs were not staged in pinned memory";
  EXPECT_GT(slow.fake->launched()["memcpy h2d"], 0);
  EXPECT_EQ(slow.weights(), reference.weights());
  EXPECT_EQ(slow.fake->pinned_frees_with_pending_reads.load(), 0);
}

// A launch that hangs: run() still returns (it only enqueued), and the next
// wait fails within the deadline, naming the device.
TEST(GpuStepAsync, AHungLaunchFailsTheNextWaitWithinItsDeadlineNamingTheDevice) {
  GpuStepSetup s(2, 1, std::chrono::milliseconds(150));
  s.fake->set_launch_delay(std::chrono::milliseconds(1500));  // "hangs" past every deadline
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_NO_THROW(s.strategy->run([&](ds::ReplicaContext& ctx) {
    ds::Tensor x(ds::Shape{8}, ds::DType::kFloat32, ctx.device());
    ds::Tensor y = ds::Tensor::uninitialized(ds::Shape{8}, ds::DType::kFloat32, ctx.device());
    ds::nn::relu_forward(x, y);
  })) << "run() waited for the device";
  try {
    s.strategy->synchronize();
    ADD_FAILURE() << "the wait returned";
  } catch (const ds::DeadlineExceededError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("GPU:0"), std::string::npos) << m;
    EXPECT_NE(m.find("fake GPU 0"), std::string::npos) << m;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  s.fake->set_launch_delay(std::chrono::microseconds(0));
}

// A label out of range is found by the loss kernel, on the device: the step
// is not held up for it, and it surfaces at the next synchronization (a
// read of a later loss, or synchronize()), naming the step.
TEST(GpuStepAsync, ABadLabelSurfacesAtTheNextSynchronizationNamingItsStep) {
  GpuStepSetup s(2, 3);
  s.y.data<int32_t>()[32 + 20] = 10;  // batch 1, replica 1's row 4: outside [0, 10)
  s.dist = std::make_unique<ds::DistributedDataset>(
      s.strategy->distribute(ds::Dataset(s.x, s.y), 32, {false, 0, false}));
  s.fake->set_launch_delay(std::chrono::milliseconds(1));
  s.step(0);
  EXPECT_NO_THROW(s.step(1)) << "the step waited for its label check";
  const auto later = s.step(2);
  try {
    (void)later[1].get();
    ADD_FAILURE() << "the read of a later loss did not report the bad label";
  } catch (const ds::InvalidArgumentError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("in step 1: the label of row 4 is outside [0, 10)"), std::string::npos) << m;
  }
  EXPECT_NO_THROW(s.step(1));  // step 3
  s.step(2);
  try {
    s.strategy->synchronize();
    ADD_FAILURE() << "synchronize() did not report the bad label";
  } catch (const ds::InvalidArgumentError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("in step 3: the label of row 4"), std::string::npos) << m;
  }
  EXPECT_NO_THROW(s.strategy->synchronize()) << "reported once";
}

// A checkpoint is a synchronization: a bad label of a step before it is
// reported naming its step, and nothing is saved.
TEST(GpuStepAsync, ACheckpointReportsTheDeviceErrorsOfTheStepsBeforeIt) {
  GpuStepSetup s(2, 2);
  s.y.data<int32_t>()[32 + 20] = 10;
  s.dist = std::make_unique<ds::DistributedDataset>(
      s.strategy->distribute(ds::Dataset(s.x, s.y), 32, {false, 0, false}));
  s.step(0);
  s.step(1);
  diststrat_test::TempDir dir("diststrat-gpustep-ckpt-");
  const std::string path = dir.path() + "/ckpt.safetensors";
  try {
    ds::Checkpoint(*s.strategy, {s.opt.get()}).save(path);
    ADD_FAILURE() << "saved";
  } catch (const ds::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("in step 1: the label of row 4"), std::string::npos) << m;
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

// The executor runs a stream's work in order on its own thread, without
// anyone waiting; a slowed launch is still running when the host goes on.
TEST(GpuStepExecutor, WorkRunsUnaskedInStreamOrderAndAfterItsLaunchDelay) {
  FakeGpuBackend b(1);
  void* s = b.create_stream(0);
  void* d = b.raw_malloc(0, 64);
  b.set_launch_delay(std::chrono::milliseconds(200));
  b.memset_async(0, d, 1, 64, s);
  b.fill(0, s, static_cast<float*>(d), 4, 3.0f);  // a kernel: delayed
  void* done = b.create_event(0);
  b.record_event(0, done, s);
  EXPECT_FALSE(b.event_done(0, done)) << "the slowed launch has not finished";
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!b.event_done(0, done) && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(b.event_done(0, done)) << "nobody waited, yet the work ran";
  EXPECT_EQ(b.read<float>(0, d, 4)[3], 3.0f);
  b.destroy_event(0, done);
  b.destroy_stream(0, s);
  b.raw_free(0, d);
}

// stream_wait_event orders a second stream after the first's mark without
// the host waiting.
TEST(GpuStepExecutor, StreamWaitEventOrdersOneStreamAfterAnother) {
  FakeGpuBackend b(1);
  void* s1 = b.create_stream(0);
  void* s2 = b.create_stream(0);
  void* d = b.raw_malloc(0, 16);
  void* mark = b.create_event(0);
  b.hold(0, s1);
  b.fill(0, s1, static_cast<float*>(d), 4, 1.0f);
  b.record_event(0, mark, s1);
  b.stream_wait_event(0, s2, mark);
  b.fill(0, s2, static_cast<float*>(d), 4, 2.0f);  // must land after s1's
  EXPECT_THROW(b.synchronize(0, s2, ds::DeadlineClock::now() + std::chrono::milliseconds(50), "s2"),
               ds::DeadlineExceededError)
      << "s2 waits for s1's held work";
  b.release(0, s1);
  b.synchronize(0, s2, step_deadline(30), "s2");
  EXPECT_EQ(b.read<float>(0, d, 4)[0], 2.0f);
  EXPECT_EQ(b.stream_waits.load(), 1);
  b.destroy_event(0, mark);
  b.destroy_stream(0, s1);
  b.destroy_stream(0, s2);
  b.raw_free(0, d);
}

// A copy from pinned memory reads it when it runs: the host may not reuse
// or free the buffer before the copy is done. Pageable memory is staged.
TEST(GpuStepExecutor, PinnedSourcesAreReadWhenTheCopyRuns) {
  FakeGpuBackend b(1);
  void* s = b.create_stream(0);
  void* d = b.raw_malloc(0, 4 * sizeof(float));
  float* pinned = static_cast<float*>(b.host_alloc(4 * sizeof(float)));
  float pageable[4] = {5, 5, 5, 5};
  for (int i = 0; i < 4; ++i) pinned[i] = 1.0f;
  b.hold(0, s);
  b.memcpy_async(0, d, pinned, 4 * sizeof(float), s);
  pinned[0] = 7.0f;  // before the copy ran: the copy sees it
  b.release(0, s);
  b.synchronize(0, s, step_deadline(30), "pinned");
  EXPECT_EQ(b.read<float>(0, d, 4)[0], 7.0f);
  b.hold(0, s);
  b.memcpy_async(0, d, pageable, sizeof(pageable), s);
  pageable[0] = 9.0f;  // staged at the call: the copy does not see it
  b.release(0, s);
  b.synchronize(0, s, step_deadline(30), "pageable");
  EXPECT_EQ(b.read<float>(0, d, 4)[0], 5.0f);
  // Freed while its copy is queued: counted, and the copy brings poison.
  b.hold(0, s);
  b.memcpy_async(0, d, pinned, 4 * sizeof(float), s);
  b.host_free(pinned);
  EXPECT_EQ(b.pinned_frees_with_pending_reads.load(), 1);
  b.release(0, s);
  b.synchronize(0, s, step_deadline(30), "freed");
  EXPECT_TRUE(std::isnan(b.read<float>(0, d, 4)[0]));
  b.destroy_stream(0, s);
  b.raw_free(0, d);
}

// A launch that never finishes fails the wait at its deadline, naming the
// device, instead of hanging the host.
TEST(GpuStepExecutor, AHungLaunchFailsTheWaitWithinItsDeadlineNamingTheDevice) {
  FakeGpuBackend b(2);
  void* d = b.raw_malloc(1, 16);
  b.set_launch_delay(std::chrono::hours(1));
  b.fill(1, nullptr, static_cast<float*>(d), 4, 1.0f);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    b.synchronize(1, nullptr, ds::DeadlineClock::now() + std::chrono::milliseconds(100), "step");
    ADD_FAILURE() << "the wait returned";
  } catch (const ds::DeadlineExceededError& e) {
    EXPECT_NE(std::string(e.what()).find("fake GPU 1"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
  b.set_launch_delay(std::chrono::microseconds(0));
}

namespace {

// Launches of `what` (both replicas) during one step after a warm-up step.
std::map<std::string, int> step_launches(GpuStepSetup& s) {
  s.step();
  const std::map<std::string, int> before = s.fake->launched();
  s.step();
  std::map<std::string, int> d;
  for (const auto& [what, n] : s.fake->launched()) {
    const auto it = before.find(what);
    d[what] = n - (it == before.end() ? 0 : it->second);
  }
  return d;
}

// The MLP of GpuStepSetup trained `steps` steps under MirroredStrategy on
// two fake GPUs or two CPU replicas, with `opt` (SGD or Adam, a schedule
// included), every other step on a partial last batch with a zero-row
// replica; the final weights (host copies of replica 0's and a check that
// replica 1's are the same bits), and the fake's launch counts.
struct MlpRun {
  std::vector<ds::Tensor> weights;
  std::map<std::string, int> launched;
};
MlpRun train_mlp(bool gpu, const std::function<std::unique_ptr<ds::Optimizer>(ds::Strategy&)>& opt,
                 int steps) {
  LeaseDir dir;
  FakeGpuBackend* fake = nullptr;
  ds::MirroredOptions o;
  o.communication.timeout = std::chrono::seconds(60);
  if (gpu) {
    auto backend = std::make_unique<FakeGpuBackend>(2);
    fake = backend.get();
    o.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};
    o.device_manager =
        ds::DeviceManagerAccess::shared_with_backend(dir.gpu_options(), std::move(backend));
  } else {
    o.devices = {ds::Device::cpu(0), ds::Device::cpu(1)};
  }
  MlpRun run;
  {
    ds::MirroredStrategy strategy(o);
    ds::nn::Mlp mlp{{24, 16, 16, 10}};
    std::vector<ds::Variable> vars = mlp.create_variables(strategy, 3);
    std::unique_ptr<ds::Optimizer> optimizer = opt(strategy);
    // 33 rows: a full batch, then a last batch of one row (replica 1 gets
    // none), in turn.
    ds::Tensor x(ds::Shape{33, 24}, ds::DType::kFloat32), y(ds::Shape{33}, ds::DType::kInt32);
    ds::init::RandomNormal{0.0, 1.0, 5}(x);
    for (int64_t i = 0; i < 33; ++i) y.data<int32_t>()[i] = static_cast<int32_t>(i % 10);
    ds::DistributedDataset dist = strategy.distribute(ds::Dataset(x, y), 32, {false, 0, false});
    for (int step = 0; step < steps; ++step) {
      const ds::DistributedBatch b = dist.batch(step % 2);
      const float scale = 1.0f / static_cast<float>(b.global_size());
      strategy.run([&](ds::ReplicaContext& ctx) {
        std::vector<ds::Tensor> p;
        for (const ds::Variable& v : vars) p.push_back(v.read(ctx));
        ds::nn::Mlp::Step st = mlp.forward_backward(p, b.features(ctx), b.labels(ctx), scale);
        std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
        for (size_t k = 0; k < vars.size(); ++k) gv.emplace_back(st.grads[k], vars[k]);
        optimizer->apply_gradients(ctx, gv);
      });
    }
    for (const ds::Variable& v : vars) {
      run.weights.push_back(v.value());
      ds::Tensor other(v.shape(), ds::DType::kFloat32);
      strategy.run([&](ds::ReplicaContext& ctx) {
        if (ctx.replica_id() == 1) other.copy_from(v.read(ctx));
      });
      EXPECT_EQ(0, std::memcmp(other.data(), run.weights.back().data(), other.nbytes()))
          << v.name() << ": the replicas' copies differ";
    }
    if (fake) run.launched = fake->launched();
    optimizer.reset();
  }
  return run;
}

void expect_same_bits(const MlpRun& a, const MlpRun& b) {
  ASSERT_EQ(a.weights.size(), b.weights.size());
  for (size_t k = 0; k < a.weights.size(); ++k) {
    EXPECT_EQ(0, std::memcmp(a.weights[k].data(), b.weights[k].data(), a.weights[k].nbytes()))
        << "parameter " << k;
  }
}

}  // namespace

// Issue 44 item 3: the optimizer updates all of a replica's variables with
// one launch (before: one "update" launch per variable, 6 per replica).
TEST(GpuStepLaunches, OneUpdateLaunchPerReplicaForAllItsVariables) {
  GpuStepSetup s(2);
  std::map<std::string, int> d = step_launches(s);
  EXPECT_EQ(d["update"], 0) << "no per-variable update launch";
  EXPECT_EQ(d["update list"], 2) << "one list update per replica";
  EXPECT_EQ(s.fake->update_lists.load(), 4);  // 2 steps x 2 replicas
}

// The MLP's gradients are views of one device buffer in parameter order,
// so the all-reduce finds them contiguous and reduces them in place
// (before: 12 device-to-device packing copies per replica and step).
TEST(GpuStepLaunches, GradientsAreReducedInPlaceWithoutPackingCopies) {
  GpuStepSetup s(2);
  std::map<std::string, int> d = step_launches(s);
  EXPECT_EQ(d["memcpy d2d"], 0);
  EXPECT_EQ(d["collective"], 2) << "one all-reduce of the whole bucket per replica";
}

// Each hidden dense layer is one launch with its ReLU forward and one with
// its dReLU backward (before: dense_forward + relu_forward, relu_backward +
// dense_backward).
TEST(GpuStepLaunches, DenseLayersFuseTheirReluBothWays) {
  GpuStepSetup s(2);
  std::map<std::string, int> d = step_launches(s);
  EXPECT_EQ(d["relu_forward"], 0);
  EXPECT_EQ(d["relu_backward"], 0);
  EXPECT_EQ(d["dense_relu_forward"], 2 * 2);   // two hidden layers x replicas
  EXPECT_EQ(d["dense_relu_backward"], 2 * 2);  // their backward
  EXPECT_EQ(d["dense_forward"], 2);            // the output layer
  EXPECT_EQ(d["dense_backward"], 2);
}

// The fused step (list update, in-place reduction, fused layers) trains to
// the same bits as the unfused host path on two CPU replicas: SGD with
// Nesterov momentum and Adam with bias correction, both over a schedule,
// full batches and a partial last one (one replica without rows).
TEST(GpuStepUpdates, FusedGpuStepTrainsBitIdenticalToCpuWithSgdAndAdamOverASchedule) {
  const auto sgd = [](ds::Strategy& st) -> std::unique_ptr<ds::Optimizer> {
    ds::SGDOptions o;
    o.learning_rate = 0.05f;
    o.momentum = 0.9f;
    o.nesterov = true;
    o.schedule = ds::LearningRateSchedule::piecewise_constant({2, 4}, {0.05f, 0.02f, 0.01f});
    return std::make_unique<ds::SGD>(st, o);
  };
  const auto adam = [](ds::Strategy& st) -> std::unique_ptr<ds::Optimizer> {
    ds::AdamOptions o;
    o.learning_rate = 0.01f;
    o.schedule = ds::LearningRateSchedule::cosine_decay(6, 2, 0.1f, 0.001f);
    return std::make_unique<ds::Adam>(st, o);
  };
  using Make = std::function<std::unique_ptr<ds::Optimizer>(ds::Strategy&)>;
  for (const auto& [name, make] :
       std::vector<std::pair<const char*, Make>>{{"sgd", sgd}, {"adam", adam}}) {
    SCOPED_TRACE(name);
    const MlpRun cpu = train_mlp(false, make, 6);
    const MlpRun gpu = train_mlp(true, make, 6);
    expect_same_bits(cpu, gpu);
    EXPECT_EQ(gpu.launched.count("update"), 0u) << "the GPU run used the list update";
    EXPECT_EQ(gpu.launched.at("update list"), 6 * 2);
    EXPECT_EQ(gpu.launched.count("memcpy d2d"), 0u);
  }
}

// The backend call itself: one apply_update_list equals apply_update per
// tensor bit for bit, for every rule, over several steps (Adam's bias
// correction changes with the step), tensors of odd sizes and an empty one.
TEST(GpuStepUpdates, ListUpdateEqualsOneUpdatePerTensorBitForBit) {
  FakeGpuBackend b(1);
  const std::vector<size_t> sizes = {7, 0, 300, 33};
  std::vector<ds::UpdateRule> rules(4);
  rules[0].kind = ds::UpdateRule::Kind::kSgd;
  rules[0].learning_rate = 0.1f;
  rules[1] = rules[0];
  rules[1].momentum = 0.9f;
  rules[2] = rules[1];
  rules[2].nesterov = true;
  rules[3].kind = ds::UpdateRule::Kind::kAdam;
  rules[3].learning_rate = 0.01f;
  rules[3].beta1 = 0.9f;
  rules[3].beta2 = 0.999f;
  rules[3].epsilon = 1e-7f;
  for (const ds::UpdateRule& rule : rules) {
    const int per = ds::update_slot_count(rule);
    // [tensor][0: var, 1: grad, 2..: slots] for the per-tensor and the list run.
    std::vector<std::vector<void*>> one, list;
    for (size_t i = 0; i < sizes.size(); ++i) {
      std::vector<float> init(sizes[i]);
      for (auto* run : {&one, &list}) {
        run->emplace_back();
        for (int k = 0; k < 2 + per; ++k) {
          for (size_t j = 0; j < sizes[i]; ++j)
            init[j] = k == 0   ? 0.01f * static_cast<float>(j) - 0.3f
                      : k == 1 ? std::sin(0.37f * static_cast<float>(j + i))
                               : 0.0f;
          void* d = b.raw_malloc(0, std::max<size_t>(sizes[i], 1) * sizeof(float));
          b.memcpy_async(0, d, init.data(), sizes[i] * sizeof(float), nullptr);
          run->back().push_back(d);
        }
      }
    }
    const int n = static_cast<int>(sizes.size());
    for (int64_t step = 1; step <= 4; ++step) {
      ds::UpdateRule r = rule;
      r.learning_rate = rule.learning_rate / static_cast<float>(step);  // a schedule
      for (int i = 0; i < n; ++i) {
        std::vector<float*> slots;
        for (int k = 0; k < per; ++k) slots.push_back(static_cast<float*>(one[i][2 + k]));
        b.apply_update(0, nullptr, r, static_cast<float*>(one[i][0]),
                       static_cast<const float*>(one[i][1]), slots.data(), sizes[i], step);
      }
      std::vector<float*> vars, slots(static_cast<size_t>(per * n));
      std::vector<const float*> grads;
      for (int i = 0; i < n; ++i) {
        vars.push_back(static_cast<float*>(list[i][0]));
        grads.push_back(static_cast<const float*>(list[i][1]));
        for (int k = 0; k < per; ++k) slots[k * n + i] = static_cast<float*>(list[i][2 + k]);
      }
      b.apply_update_list(0, nullptr, r, vars.data(), grads.data(), slots.data(), sizes.data(), n,
                          step);
    }
    for (int i = 0; i < n; ++i) {
      for (int k = 0; k < 2 + per; ++k) {
        if (k == 1) continue;
        EXPECT_EQ(b.read<uint32_t>(0, one[i][k], sizes[i]),
                  b.read<uint32_t>(0, list[i][k], sizes[i]))
            << "rule " << static_cast<int>(rule.kind) << " tensor " << i << " buffer " << k;
      }
      for (int k = 0; k < 2 + per; ++k) {
        b.raw_free(0, one[i][k]);
        b.raw_free(0, list[i][k]);
      }
    }
  }
  EXPECT_EQ(b.update_lists.load(), 4 * 4);
}

#endif  // __has_include("fake_gpu_backend.h")
