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
