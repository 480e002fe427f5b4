// diststrat::torch under mpirun (ctest: torch_mpi_np2): DistributedDataParallel
// over MultiWorkerMirroredStrategy, 2 processes x 1 and x 2 replicas, against
// single-process LibTorch; a module that differs across ranks and a parameter
// unused on one rank fail on every rank, naming it.
#include <chrono>

#include "torch_test_util.h"

namespace diststrat::testing {
namespace {

constexpr int64_t kGlobalBatch = 16;
constexpr int kSteps = 20;

MultiWorkerOptions options(int local_replicas) {
  MultiWorkerOptions o;
  for (int i = 0; i < local_replicas; ++i) o.devices.push_back(Device::cpu(i));
  o.communication.timeout = std::chrono::seconds(60);
  return o;
}

void expect_equivalent(int local_replicas, DdpOptions ddp_options = {}) {
  // 19 full batches and a short one of 3 rows (a replica without rows
  // under 2 x 2).
  const Dataset data = make_data(kGlobalBatch * (kSteps - 1) + 3);
  auto ref = make_net(7);
  train_reference(*ref, data, kGlobalBatch, kSteps);
  ASSERT_GT(max_abs_diff(*ref, *make_net(7)), 1e-3) << "the reference did not train";
  MultiWorkerMirroredStrategy strategy(options(local_replicas));
  const int rank = strategy.cluster().worker_index;
  // Rank 1 starts from other weights: the chief's broadcast must fix it.
  dt::DistributedDataParallel ddp(strategy, make_net(rank == 0 ? 7 : 99), ddp_options);
  train_ddp(strategy, ddp, data, kGlobalBatch, kSteps);
  EXPECT_LE(max_abs_diff(*ref, *ddp.module(0)), 1e-5) << "rank " << rank;
  EXPECT_EQ(ddp.stats().sync_steps, kSteps);
}

TEST(TorchMultiWorkerMpi, TwoProcessesMatchSingleProcess) { expect_equivalent(1); }

TEST(TorchMultiWorkerMpi, TwoProcessesTimesTwoReplicasMatchSingleProcess) { expect_equivalent(2); }

TEST(TorchMultiWorkerMpi, OverlapOffMatchesSingleProcess) {
  DdpOptions o;
  o.overlap = false;
  o.bytes_per_bucket = 64;
  expect_equivalent(1, o);
}

TEST(TorchMultiWorkerMpi, ModuleThatDiffersAcrossRanksFailsOnEveryRankNamingIt) {
  MultiWorkerMirroredStrategy strategy(options(1));
  const int rank = strategy.cluster().worker_index;
  const auto start = std::chrono::steady_clock::now();
  try {
    dt::DistributedDataParallel ddp(strategy, make_net(7, /*extra=*/rank == 1));
    FAIL() << "rank " << rank << ": modules that differ were accepted";
  } catch (const InvalidArgumentError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("differs across replicas"), std::string::npos) << m;
    EXPECT_NE(m.find("parameter 'extra.weight' Float[4, 4]"), std::string::npos) << m;
    EXPECT_NE(m.find("replica 1 has"), std::string::npos) << m;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  // The strategy is still usable: nothing was left in flight.
  strategy.barrier("after mismatch");
}

TEST(TorchMultiWorkerMpi, ParameterUnusedOnOneRankFailsOnEveryRankNamingIt) {
  MultiWorkerMirroredStrategy strategy(options(1));
  const int rank = strategy.cluster().worker_index;
  const Dataset data = make_data(16);
  for (bool find_unused : {false, true}) {
    DdpOptions o;
    o.find_unused_parameters = find_unused;
    dt::DistributedDataParallel ddp(strategy, make_net(7, true, /*use_extra=*/rank == 0), o);
    DistributeOptions d;
    d.shuffle = false;
    DistributedDataset dist = strategy.distribute(data, 8, d);
    std::string error;
    try {
      strategy.run([&](ReplicaContext& ctx) {
        DistributedBatch b = dist.batch(0);
        at::Tensor x = dt::to_torch(b.features(ctx)), y = dt::to_torch(b.labels(ctx));
        at::Tensor loss = torch::nn::functional::cross_entropy(
            ddp.module(ctx)->as<NetImpl>()->forward(x), y);
        ddp.backward(ctx, loss, x.size(0), b.global_size());
      });
    } catch (const InvalidArgumentError& e) {
      error = e.what();
    }
    if (find_unused) {
      EXPECT_EQ(error, "") << "rank " << rank;
      at::Tensor g = ddp.module(0)->named_parameters()["extra.weight"].grad();
      ASSERT_TRUE(g.defined());
      EXPECT_GT(g.abs().sum().item<double>(), 0);  // rank 0's half of the batch
    } else {
      EXPECT_NE(error.find("'extra.weight' (on 1 of 2 replicas"), std::string::npos)
          << "rank " << rank << ": " << error;
      EXPECT_EQ(error.find("this one included") != std::string::npos, rank == 1) << error;
    }
  }
}

}  // namespace
}  // namespace diststrat::testing
