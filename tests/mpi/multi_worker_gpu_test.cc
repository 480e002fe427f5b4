// MultiWorkerMirroredStrategy on fake GPUs across real processes (issue 45):
// one fake GPU per process, its gradients reduced by the fake multi-process
// NCCL (tests/unit/fake_nccl.h: the collectives run on the communication
// stream over the library's MPI transport). Run by ctest as mpi_gpu_np2 and
// mpi_gpu_np3 (tests/mpi/CMakeLists.txt), not by mpi_np*.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/device_manager_impl.h"
#include "runtime/process_group.h"
#include "../common/zero_cases.h"
#include "../unit/fake_nccl.h"
#include "../unit/training_util.h"
#include "diststrat/diststrat.h"
#include "mpi_test_util.h"

namespace ds = diststrat;
namespace zc = ds::zero_cases;
using diststrat_test::FakeNcclBackend;
using diststrat_test::LeaseDir;
using diststrat_test::world_rank;
using diststrat_test::world_size;

namespace {

// The fake NCCL's transport: the library's own process group over MPI,
// made the way the strategy makes its own (so the reduction's algorithm, and
// its bits, are the CPU path's).
FakeNcclBackend::Transport mpi_transport() {
  return [](const std::string&, int, int, const ds::CommunicationOptions& o) {
    ds::ResolvedCluster cluster = ds::resolve_cluster(ds::ClusterConfig{}, o.timeout);
    return std::move(ds::make_process_communicators(cluster, o, false).cross);
  };
}

struct Setup {
  LeaseDir dir;
  FakeNcclBackend* fake = nullptr;
  ds::MultiWorkerOptions options;
};

// One replica per process: a CPU, or one fake GPU.
std::unique_ptr<Setup> setup(bool gpu, ds::GpuReduction reduction = ds::GpuReduction::kAuto) {
  auto s = std::make_unique<Setup>();
  s->options.communication.timeout = std::chrono::seconds(60);
  s->options.communication.bytes_per_pack = 4 << 10;  // several packs per call
  s->options.gpu_reduction = reduction;
  if (gpu) {
    auto backend = std::make_unique<FakeNcclBackend>(1, "rank" + std::to_string(world_rank()),
                                                     mpi_transport());
    s->fake = backend.get();
    s->options.devices = {ds::Device::gpu(0)};
    s->options.device_manager =
        ds::DeviceManagerAccess::shared_with_backend(s->dir.gpu_options(), std::move(backend));
  } else {
    s->options.devices = {ds::Device::cpu(0)};
  }
  return s;
}

std::vector<ds::Tensor> mlp_run(bool gpu, int steps, int64_t* device_packs = nullptr,
                                int* collectives = nullptr) {
  auto su = setup(gpu);
  const ds::nn::Mlp mlp({784, 64, 32, 10});
  const ds::Dataset data = ds::testing::synthetic(48 * steps, 11);
  std::vector<ds::Tensor> out;
  ds::MultiWorkerMirroredStrategy s(su->options);
  EXPECT_EQ(s.uses_nccl(), gpu);
  std::vector<ds::Variable> vars;
  ds::testing::train_under(s, mlp, data, 48, steps, 0.05f, 0.9f, &vars);
  for (const ds::Variable& v : vars) out.push_back(v.value());
  if (device_packs) *device_packs = s.stats().device_packs;
  if (collectives) *collectives = su->fake ? su->fake->nccl_collectives.load() : 0;
  return out;
}

bool bit_equal(const std::vector<ds::Tensor>& a, const std::vector<ds::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t k = 0; k < a.size(); ++k) {
    if (a[k].nbytes() != b[k].nbytes() || std::memcmp(a[k].data(), b[k].data(), a[k].nbytes()))
      return false;
  }
  return true;
}

// Every rank's values equal rank 0's, bit for bit.
void expect_same_on_every_rank(const std::vector<ds::Tensor>& values) {
  for (size_t k = 0; k < values.size(); ++k) {
    std::vector<char> mine(static_cast<const char*>(values[k].data()),
                           static_cast<const char*>(values[k].data()) + values[k].nbytes());
    std::vector<char> root = mine;
    MPI_Bcast(root.data(), static_cast<int>(root.size()), MPI_CHAR, 0, MPI_COMM_WORLD);
    EXPECT_EQ(root, mine) << "variable " << k << " differs from rank 0's";
  }
}

}  // namespace

// The MLP (784-64-32-10, SGD with momentum, 6 steps of 48 rows) through
// apply_gradients: the fused gradients go through the NCCL communicator
// (its collectives counted by the fake backend) and the weights equal CPU
// replicas' bit for bit (the same packs and the same MPI all-reduce
// algorithm, kAuto's choice for the size and rank count, sum the same
// values in the same order).
TEST(MultiWorkerGpuMpi, MlpThroughNcclEqualsCpuReplicasBitForBit) {
  const auto cpu = mlp_run(false, 6);
  int64_t device_packs = 0;
  int collectives = 0;
  const auto gpu = mlp_run(true, 6, &device_packs, &collectives);
  EXPECT_TRUE(bit_equal(gpu, cpu))
      << "rank " << world_rank() << ": max difference " << ds::testing::max_abs_diff(gpu, cpu);
  // 6 steps x several packs, all on the devices.
  EXPECT_GE(device_packs, 6 * 2);
  EXPECT_GE(collectives, device_packs);
  expect_same_on_every_rank(gpu);
}

// Processes that ask for host staging (or cannot use NCCL) get it, with
// the same numbers; NCCL is not touched.
TEST(MultiWorkerGpuMpi, HostStagedFallbackIsExplicitAndEqual) {
  auto su = setup(true, ds::GpuReduction::kHostStaged);
  {
    ds::MultiWorkerMirroredStrategy s(su->options);
    EXPECT_FALSE(s.uses_nccl());
    std::vector<ds::Variable> vars;
    ds::testing::train_under(s, ds::nn::Mlp({784, 16, 10}), ds::testing::synthetic(96, 3), 48, 2,
                             0.05f, 0.9f, &vars);
    EXPECT_EQ(s.stats().device_packs, 0);
  }
  EXPECT_EQ(su->fake->nccl_communicators.load(), 0);
  EXPECT_EQ(su->fake->nccl_collectives.load(), 0);
}

// kNccl where NCCL cannot serve (two local replicas) fails on every rank,
// naming the rank and why.
TEST(MultiWorkerGpuMpi, NcclRefusedNamesTheRankAndWhy) {
  auto su = setup(true, ds::GpuReduction::kNccl);
  if (world_rank() == 1) {
    auto backend = std::make_unique<FakeNcclBackend>(2, "rank" + std::to_string(world_rank()),
                                                     mpi_transport());
    su->options.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};
    su->options.device_manager =
        ds::DeviceManagerAccess::shared_with_backend(su->dir.gpu_options(), std::move(backend));
  }
  try {
    ds::MultiWorkerMirroredStrategy s(su->options);
    FAIL() << "no error";
  } catch (const ds::FailedPreconditionError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 cannot take part: it has several local GPU"),
              std::string::npos)
        << e.what();
  }
}

// Adam with global-norm clipping and loss scaling (an inf on the last
// replica's step 2 skips that step everywhere): the gradients and the norm's
// partial sums go through NCCL; equal to CPU replicas bit for bit.
namespace {
std::vector<ds::Tensor> clipped_run(bool gpu, bool zero, int* collectives) {
  auto su = setup(gpu);
  su->options.shard_optimizer_state = zero;
  ds::MultiWorkerMirroredStrategy s(su->options);
  EXPECT_EQ(s.uses_nccl(), gpu);
  auto vars = zc::create_model(s);
  auto opt = zc::make_optimizer(s, true);
  opt->set_clipping({0.2f, 0, 0});
  opt->enable_loss_scaling({1024.0f, 2, 2.0f});
  for (int64_t m = 0; m < 5; ++m) {
    s.run([&](ds::ReplicaContext& ctx) {
      const float scale = opt->loss_scale(ctx);
      std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
      for (size_t k = 0; k < vars.size(); ++k) {
        ds::Tensor w(vars[k].shape(), ds::DType::kFloat32);
        w.copy_from(vars[k].read(ctx));
        ds::Tensor g = zc::replica_grad(w, k, m, ctx.replica_id(), ctx.num_replicas_in_sync());
        float* p = g.data<float>();
        for (int64_t i = 0; i < g.num_elements(); ++i) p[i] *= scale;
        if (m == 2 && k == 0 && ctx.replica_id() == ctx.num_replicas_in_sync() - 1) p[0] = INFINITY;
        ds::Tensor on(vars[k].shape(), ds::DType::kFloat32, ctx.device());
        on.copy_from(g);
        gv.emplace_back(on, vars[k]);
      }
      EXPECT_EQ(opt->apply_gradients(ctx, gv).skipped, m == 2);
    });
  }
  std::vector<ds::Tensor> out;
  for (const ds::Variable& v : vars) out.push_back(v.value());
  *collectives = su->fake ? su->fake->nccl_collectives.load() : 0;
  return out;
}
}  // namespace

TEST(MultiWorkerGpuMpi, ClippingAndLossScalingThroughNcclEqualCpuBitForBit) {
  int unused = 0, collectives = 0;
  const auto cpu = clipped_run(false, false, &unused);
  const auto gpu = clipped_run(true, false, &collectives);
  EXPECT_TRUE(bit_equal(gpu, cpu))
      << "rank " << world_rank() << ": max difference " << ds::testing::max_abs_diff(gpu, cpu);
  EXPECT_GE(collectives, 5);
  expect_same_on_every_rank(gpu);
}

// The same with ZeRO-1: the gradients reduce-scattered and the updated
// blocks all-gathered by the NCCL communicator (two collectives a step at
// least), bit for bit as on CPU replicas.
TEST(MultiWorkerGpuMpi, ZeroOneThroughNcclEqualsCpuBitForBit) {
  int unused = 0, collectives = 0;
  const auto cpu = clipped_run(false, true, &unused);
  const auto gpu = clipped_run(true, true, &collectives);
  EXPECT_TRUE(bit_equal(gpu, cpu))
      << "rank " << world_rank() << ": max difference " << ds::testing::max_abs_diff(gpu, cpu);
  EXPECT_GE(collectives, 2 * 5);
  expect_same_on_every_rank(gpu);
}

// Issue 45 item 2: each layer's gradients handed to all_reduce_async from
// nn::Mlp::forward_backward's on_ready hook as backward makes them, then
// Optimizer::apply_reduced_gradients. On fake GPUs through NCCL this equals
// the same loop on CPU replicas bit for bit; and with every launch slowed
// (40 ms each), the first layer's all-reduce starts on the communication
// stream before backward's last gradient exists (the replica's stream still
// has three layers' backward to run then).
namespace {
struct OverlapRun {
  std::vector<ds::Tensor> weights;
  int collectives = 0;
  // The slowed step (GPU): when the first NCCL collective of the step
  // started, and when the step's backward had run (a host function behind
  // it on the replica's stream, minus its own launch delay), from the start
  // of the step.
  double first_collective_ms = -1, backward_done_ms = -1, step_ms = -1;
};

OverlapRun on_ready_run(bool gpu) {
  auto su = setup(gpu);
  const ds::nn::Mlp mlp({784, 64, 32, 32, 10});
  const ds::Dataset data = ds::testing::synthetic(48 * 5, 7);
  OverlapRun out;
  ds::MultiWorkerMirroredStrategy s(su->options);
  EXPECT_EQ(s.uses_nccl(), gpu);
  std::vector<ds::Variable> vars = mlp.create_variables(s, 5);
  ds::SGD opt(s, {0.05f, 0.9f});
  ds::DistributeOptions o;
  o.shuffle = false;
  ds::DistributedDataset dist = s.distribute(data, 48, o);
  constexpr auto kDelay = std::chrono::milliseconds(40);
  int step = 0;
  for (const auto& b : dist) {
    const bool slowed = gpu && step == 4;
    if (slowed) {
      s.synchronize();
      su->fake->set_launch_delay(kDelay);
    }
    const auto t0 = FakeNcclBackend::Clock::now();
    const size_t before = su->fake ? su->fake->collective_times().size() : 0;
    FakeNcclBackend::Clock::time_point backward_done;
    s.run([&](ds::ReplicaContext& ctx) {
      std::vector<ds::Tensor> values;
      for (auto& v : vars) values.push_back(v.read(ctx));
      std::vector<ds::Work> works;
      auto r = mlp.forward_backward(
          values, b.features(ctx), b.labels(ctx), 1.0f / static_cast<float>(b.global_size()),
          [&](size_t l, const ds::Tensor& dw, const ds::Tensor& db) {
            works.push_back(ctx.all_reduce_async(
                ds::ReduceOp::kSum, {dw, db},
                {vars[2 * l].name() + "/grad", vars[2 * l + 1].name() + "/grad"}));
          });
      if (slowed) {
        su->fake->launch_host_function(0, ctx.stream(), "mark", [&backward_done, kDelay] {
          backward_done = FakeNcclBackend::Clock::now() - kDelay;
        });
      }
      for (ds::Work& w : works) w.wait();
      std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
      for (size_t i = 0; i < vars.size(); ++i) gv.emplace_back(r.grads[i], vars[i]);
      opt.apply_reduced_gradients(ctx, gv);
    });
    if (slowed) {
      s.synchronize();
      const auto ms = [&](FakeNcclBackend::Clock::time_point t) {
        return std::chrono::duration<double, std::milli>(t - t0).count();
      };
      out.step_ms = ms(FakeNcclBackend::Clock::now());
      out.backward_done_ms = ms(backward_done);
      const auto times = su->fake->collective_times();
      if (times.size() > before) out.first_collective_ms = ms(times[before].first);
      su->fake->set_launch_delay(std::chrono::microseconds(0));
    }
    ++step;
  }
  for (const ds::Variable& v : vars) out.weights.push_back(v.value());
  out.collectives = su->fake ? su->fake->nccl_collectives.load() : 0;
  return out;
}
}  // namespace

TEST(MultiWorkerGpuMpi, OnReadyOverlapEqualsCpuAndStartsBeforeBackwardEnds) {
  const OverlapRun cpu = on_ready_run(false);
  const OverlapRun gpu = on_ready_run(true);
  EXPECT_TRUE(bit_equal(gpu.weights, cpu.weights))
      << "rank " << world_rank() << ": max difference "
      << ds::testing::max_abs_diff(gpu.weights, cpu.weights);
  expect_same_on_every_rank(gpu.weights);
  // 5 steps x 4 layers x (dw, db), every one through NCCL.
  EXPECT_GE(gpu.collectives, 5 * 4);
  ASSERT_GE(gpu.first_collective_ms, 0) << "no NCCL collective in the slowed step";
  EXPECT_LT(gpu.first_collective_ms, gpu.backward_done_ms)
      << "the first layer's all-reduce did not start before backward's last gradient";
  if (world_rank() == 0) {
    std::printf(
        "[rank 0] slowed step (40 ms a launch): first all-reduce at %.1f ms, backward done "
        "at %.1f ms, step %.1f ms\n",
        gpu.first_collective_ms, gpu.backward_done_ms, gpu.step_ms);
  }
}
