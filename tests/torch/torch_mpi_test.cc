// diststrat::torch under mpirun (ctest: torch_mpi_np2): DistributedDataParallel
// over MultiWorkerMirroredStrategy, 2 processes x 1 and x 2 replicas, against
// single-process LibTorch; a module that differs across ranks and a parameter
// unused on one rank fail on every rank, naming it; find_unused_parameters
// with Adam; gradients accumulated outside ddp.backward fail every rank;
// ParameterServerModel with a PS process and a worker process.
#include <unistd.h>

#include <chrono>

#include "../common/temp_dir.h"
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
        at::Tensor loss =
            torch::nn::functional::cross_entropy(ddp.module(ctx)->as<NetImpl>()->forward(x), y);
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

// A rank that calls backward() twice in one run() would pair its second
// call with the other rank's next step (silently diverging ranks, a
// deadline at the end): both ranks fail at once naming the step mismatch.
TEST(TorchMultiWorkerMpi, BackwardTwiceOnOneRankFailsOnEveryRank) {
  MultiWorkerOptions mo = options(1);
  mo.communication.timeout = std::chrono::seconds(10);
  MultiWorkerMirroredStrategy strategy(mo);
  const int rank = strategy.cluster().worker_index;
  const Dataset data = make_data(16);
  dt::DistributedDataParallel ddp(strategy, make_net(7));
  DistributeOptions d;
  d.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, 8, d);
  std::string error;
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < 2 && error.empty(); ++step) {
    try {
      strategy.run([&](ReplicaContext& ctx) {
        DistributedBatch b = dist.batch(step);
        at::Tensor x = dt::to_torch(b.features(ctx)), y = dt::to_torch(b.labels(ctx));
        auto loss = [&] {
          return torch::nn::functional::cross_entropy(ddp.module(ctx)->as<NetImpl>()->forward(x),
                                                      y);
        };
        ddp.backward(ctx, loss(), x.size(0), b.global_size());
        if (rank == 1 && step == 0) ddp.backward(ctx, loss(), x.size(0), b.global_size());
      });
    } catch (const Error& e) {
      error = e.what();
    }
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(8)) << "rank " << rank;
  // Rank 1's second backward reduces in step 0 while rank 0 is in step 1: the
  // step in the call signature names it at that first mispaired call (issue
  // 43); the last bucket's count check says the same where it comes first.
  EXPECT_TRUE(error.find("ranks are in different steps") != std::string::npos ||
              error.find("the replicas are not in the same step") != std::string::npos)
      << "rank " << rank << ": " << error;
}

// find_unused_parameters with Adam over a branch unused for the first 10
// steps: a parameter no rank used keeps an undefined .grad (Adam creates no
// state for it), so 2 ranks x 1 and x 2 replicas equal single-process Adam.
TEST(TorchMultiWorkerMpi, AdamWithABranchUnusedAtFirstMatchesSingleProcess) {
  constexpr int kBranchFrom = 10;
  const Dataset data = make_data(kGlobalBatch * (kSteps - 1) + 3);
  auto make_adam = [](torch::nn::Module& m) {
    return std::make_unique<torch::optim::Adam>(m.parameters(), torch::optim::AdamOptions(0.01));
  };
  auto ref = make_net(7, /*extra=*/true, /*use_extra=*/false);
  {
    auto opt = make_adam(*ref);
    at::Tensor x = dt::to_torch(data.features()), y = dt::to_torch(data.labels());
    for (int s = 0; s < kSteps; ++s) {
      ref->use_extra_ = s >= kBranchFrom;
      const int64_t b = s * kGlobalBatch, e = std::min(data.size(), b + kGlobalBatch);
      opt->zero_grad();
      torch::nn::functional::cross_entropy(ref->forward(x.slice(0, b, e)), y.slice(0, b, e))
          .backward();
      opt->step();
    }
  }
  for (int local_replicas : {1, 2}) {
    MultiWorkerMirroredStrategy strategy(options(local_replicas));
    const int rank = strategy.cluster().worker_index;
    DdpOptions o;
    o.find_unused_parameters = true;
    dt::DistributedDataParallel ddp(strategy, make_net(rank == 0 ? 7 : 99, true, false), o);
    std::vector<std::unique_ptr<torch::optim::Adam>> opts;
    for (int i = 0; i < local_replicas; ++i) opts.push_back(make_adam(*ddp.module(i)));
    DistributeOptions d;
    d.shuffle = false;
    DistributedDataset dist = strategy.distribute(data, kGlobalBatch, d);
    for (int s = 0; s < kSteps; ++s) {
      for (int i = 0; i < local_replicas; ++i)
        ddp.module(i)->as<NetImpl>()->use_extra_ = s >= kBranchFrom;
      DistributedBatch batch = dist.batch(s);
      strategy.run([&](ReplicaContext& ctx) {
        auto& model = ddp.module(ctx);
        at::Tensor x = dt::to_torch(batch.features(ctx)), y = dt::to_torch(batch.labels(ctx));
        auto& opt = *opts[ctx.local_replica_id()];
        opt.zero_grad();
        at::Tensor loss;
        if (x.size(0) > 0)
          loss = torch::nn::functional::cross_entropy(model->as<NetImpl>()->forward(x), y);
        ddp.backward(ctx, loss, x.size(0), batch.global_size());
        opt.step();
      });
      EXPECT_EQ(ddp.module(0)->named_parameters()["extra.weight"].grad().defined(),
                s >= kBranchFrom)
          << "rank " << rank << ", step " << s;
    }
    EXPECT_LE(max_abs_diff(*ref, *ddp.module(0)), 1e-5)
        << "rank " << rank << ", " << local_replicas << " local replica(s)";
  }
}

// Both ranks call loss.backward() instead of ddp.backward(): nothing is
// synchronized and the ranks drift apart. Every rank fails by its second
// step (no collective involved, so nobody waits).
TEST(TorchMultiWorkerMpi, PlainBackwardFailsOnEveryRank) {
  MultiWorkerOptions mo = options(1);
  mo.communication.timeout = std::chrono::seconds(10);
  MultiWorkerMirroredStrategy strategy(mo);
  const int rank = strategy.cluster().worker_index;
  const Dataset data = make_data(64);
  dt::DistributedDataParallel ddp(strategy, make_net(7));
  auto opts = make_sgds(ddp);
  DistributeOptions d;
  d.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, 16, d);
  std::string error;
  int failed_at = -1;
  for (int s = 0; s < 3 && failed_at < 0; ++s) {
    try {
      strategy.run([&](ReplicaContext& ctx) {
        DistributedBatch b = dist.batch(s);
        at::Tensor x = dt::to_torch(b.features(ctx)), y = dt::to_torch(b.labels(ctx));
        opts[0]->zero_grad();
        torch::nn::functional::cross_entropy(ddp.module(ctx)->as<NetImpl>()->forward(x), y)
            .backward();
        opts[0]->step();
      });
    } catch (const std::exception& e) {
      error = e.what();
      failed_at = s;
    }
  }
  EXPECT_EQ(failed_at, 1) << "rank " << rank << ": " << error;
  EXPECT_NE(error.find("ddp.backward(ctx, loss, rows, global_rows)"), std::string::npos)
      << "rank " << rank << ": " << error;
  strategy.barrier("after plain backward");
}

// ddp.backward, then an extra loss.backward() on rank 1 only: the next
// ddp.backward fails on both ranks (the flag travels with the step's
// reduction), naming rank 1's replica, within the deadline.
TEST(TorchMultiWorkerMpi, ExtraBackwardOnOneRankFailsTheNextStepOnEveryRank) {
  MultiWorkerOptions mo = options(1);
  mo.communication.timeout = std::chrono::seconds(10);
  MultiWorkerMirroredStrategy strategy(mo);
  const int rank = strategy.cluster().worker_index;
  const Dataset data = make_data(64);
  dt::DistributedDataParallel ddp(strategy, make_net(7));
  auto opts = make_sgds(ddp);
  DistributeOptions d;
  d.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, 16, d);
  std::string error;
  int failed_at = -1;
  const auto start = std::chrono::steady_clock::now();
  for (int s = 0; s < 3 && failed_at < 0; ++s) {
    try {
      strategy.run([&](ReplicaContext& ctx) {
        DistributedBatch b = dist.batch(s);
        auto net = ddp.module(ctx)->as<NetImpl>();
        at::Tensor x = dt::to_torch(b.features(ctx)), y = dt::to_torch(b.labels(ctx));
        opts[0]->zero_grad();
        ddp.backward(ctx, torch::nn::functional::cross_entropy(net->forward(x), y), x.size(0),
                     b.global_size());
        if (rank == 1 && s == 0) net->forward(x).pow(2).mean().backward();
        opts[0]->step();
      });
    } catch (const Error& e) {
      error = e.what();
      failed_at = s;
    }
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(8)) << "rank " << rank;
  EXPECT_EQ(failed_at, 1) << "rank " << rank << ": " << error;
  EXPECT_NE(error.find("outside ddp.backward"), std::string::npos)
      << "rank " << rank << ": " << error;
  EXPECT_NE(error.find("on replica 1"), std::string::npos) << "rank " << rank << ": " << error;
  strategy.barrier("after extra backward");
}

// TrainingState under multi-worker: the chief writes, every rank restores
// into a module that started elsewhere and gets the saved weights and
// momentum bit for bit.
TEST(TorchMultiWorkerMpi, TrainingStateRestoresOnEveryRank) {
  MultiWorkerMirroredStrategy strategy(options(1));
  Tensor pid(Shape{1}, DType::kInt64);
  pid.data<int64_t>()[0] = ::getpid();
  strategy.broadcast(pid, 0, "scratch dir");
  const std::string dir = "/tmp/diststrat_torch_mpi_ckpt_" + std::to_string(pid.data<int64_t>()[0]);
  const Dataset data = make_data(kGlobalBatch * 3);
  std::vector<at::Tensor> saved_params, saved_momentum;
  {
    dt::DistributedDataParallel ddp(strategy, make_net(7));
    auto opts = make_sgds(ddp);
    dt::TrainingState state(ddp, {opts[0].get()});
    Checkpoint ckpt(strategy);
    CheckpointManager manager(ckpt, dir);
    train_ddp_steps(strategy, ddp, opts, data, kGlobalBatch, 0, 3);
    state.capture(3);
    manager.save(3);
    for (const at::Tensor& p : ddp.module(0)->parameters()) {
      saved_params.push_back(p.detach().clone());
      saved_momentum.push_back(static_cast<torch::optim::SGDParamState&>(
                                   *opts[0]->state().at(compat::optimizer_state_key(p)))
                                   .momentum_buffer()
                                   .clone());
    }
  }
  MultiWorkerMirroredStrategy fresh(options(1));
  dt::DistributedDataParallel ddp(fresh, make_net(99));
  auto opts = make_sgds(ddp);
  dt::TrainingState state(ddp, {opts[0].get()});
  Checkpoint ckpt(fresh);
  CheckpointManager manager(ckpt, dir);
  ASSERT_TRUE(manager.restore_latest().has_value());
  EXPECT_EQ(state.apply(), 3);
  auto params = ddp.module(0)->parameters();
  ASSERT_EQ(params.size(), saved_params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::equal(params[i], saved_params[i])) << "parameter " << i;
    auto& st = static_cast<torch::optim::SGDParamState&>(
        *opts[0]->state().at(compat::optimizer_state_key(params[i])));
    EXPECT_TRUE(torch::equal(st.momentum_buffer(), saved_momentum[i])) << "momentum " << i;
  }
  fresh.barrier("checkpoint read");
  if (fresh.cluster().is_chief()) diststrat_test::remove_tree(dir);
}

// ParameterServerModel across processes: rank 1 is the PS, rank 0 the only
// worker (2 replicas) in lockstep: equal to single-process torch SGD.
TEST(TorchParameterServerMpi, WorkerAndPsProcessesMatchSingleProcessSgd) {
  ParameterServerOptions o;
  o.num_ps = 1;
  o.devices = {Device::cpu(0), Device::cpu(1)};
  o.max_staleness = 0;
  o.communication.timeout = std::chrono::seconds(60);
  ParameterServerStrategy strategy(o);
  if (strategy.is_ps()) {
    strategy.join();
    return;
  }
  const Dataset data = make_data(kGlobalBatch * (kSteps - 1) + 3);
  auto ref = make_net(7);
  {
    torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(kLr));
    at::Tensor x = dt::to_torch(data.features()), y = dt::to_torch(data.labels());
    for (int s = 0; s < kSteps; ++s) {
      const int64_t b = s * kGlobalBatch, e = std::min(data.size(), b + kGlobalBatch);
      opt.zero_grad();
      torch::nn::functional::cross_entropy(ref->forward(x.slice(0, b, e)), y.slice(0, b, e))
          .backward();
      opt.step();
    }
  }
  SGDOptions so;
  so.learning_rate = static_cast<float>(kLr);
  SGD sgd(strategy, so);
  dt::ParameterServerModel model(strategy, make_net(7), sgd);
  DistributeOptions d;
  d.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, kGlobalBatch, d);
  for (int s = 0; s < kSteps; ++s) {
    DistributedBatch batch = dist.batch(s);
    strategy.run([&](ReplicaContext& ctx) {
      auto& m = model.module(ctx);
      at::Tensor x = dt::to_torch(batch.features(ctx)), y = dt::to_torch(batch.labels(ctx));
      at::Tensor loss;
      if (x.size(0) > 0)
        loss = torch::nn::functional::cross_entropy(m->as<NetImpl>()->forward(x), y);
      model.backward(ctx, loss, x.size(0), batch.global_size());
    });
  }
  strategy.flush();
  double diff = 0;
  for (const auto& p : ref->named_parameters(true)) {
    const Tensor v = model.variable(p.key()).value();
    diff = std::max(diff, (p.value() - dt::to_torch(v)).abs().max().item<double>());
  }
  EXPECT_LE(diff, 1e-5);
}

}  // namespace
}  // namespace diststrat::testing
