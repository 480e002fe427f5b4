// diststrat::torch in one process: conversions, DistributedDataParallel under
// MirroredStrategy and CentralStorageStrategy (and MultiWorkerMirrored with
// its workers as threads), no_sync, unused parameters.
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <thread>

#include "../common/temp_dir.h"
#include "torch_test_util.h"

namespace diststrat::testing {
namespace {

// ---- conversions ---------------------------------------------------------

TEST(TorchConvert, ZeroCopyEveryDtypeBothWays) {
  const std::vector<std::pair<c10::ScalarType, DType>> types = {
      {torch::kFloat32, DType::kFloat32}, {torch::kFloat64, DType::kFloat64},
      {torch::kFloat16, DType::kFloat16}, {torch::kBFloat16, DType::kBFloat16},
      {torch::kInt32, DType::kInt32},     {torch::kInt64, DType::kInt64}};
  for (const auto& [st, dtype] : types) {
    at::Tensor a = torch::arange(12).to(st).reshape({3, 4});
    Tensor t = dt::to_diststrat(a);
    EXPECT_EQ(t.dtype(), dtype);
    EXPECT_EQ(t.shape(), (Shape{3, 4}));
    EXPECT_TRUE(t.device().is_cpu());
    EXPECT_EQ(t.data(), a.data_ptr());
    at::Tensor back = dt::to_torch(t);
    EXPECT_EQ(back.data_ptr(), a.data_ptr());
    EXPECT_EQ(back.scalar_type(), st);
    EXPECT_EQ(back.sizes(), a.sizes());
  }
}

TEST(TorchConvert, KeepsTheOwnerAlive) {
  Tensor t;
  {
    at::Tensor a = torch::full({1000}, 7.0f);
    t = dt::to_diststrat(a);
  }  // `a` gone: the Tensor still holds its storage
  EXPECT_EQ(t.data<float>()[999], 7.0f);
  at::Tensor v;
  {
    Tensor owned(Shape{5}, DType::kFloat32);
    owned.data<float>()[4] = 3.0f;
    v = dt::to_torch(owned);
  }
  EXPECT_EQ(v[4].item<float>(), 3.0f);
  v[4] = 5.0f;  // writable view
  EXPECT_EQ(v[4].item<float>(), 5.0f);
  Tensor wrapped = dt::to_diststrat(v);
  EXPECT_EQ(wrapped.data<float>()[4], 5.0f);
}

// A lazily negated view (its bytes hold -x) and a ZeroTensor (no memory at
// all) cannot be viewed: the first converted with the wrong sign, the second
// failed inside Tensor::wrap.
TEST(TorchConvert, RejectsLazyNegativeAndZeroTensors) {
  at::Tensor neg = torch::ones({2})._neg_view();
  ASSERT_EQ(neg[0].item<float>(), -1.0f);
  try {
    Tensor t = dt::to_diststrat(neg);
    FAIL() << "a negative view converted, reading " << t.data<float>()[0];
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("resolve_neg()"), std::string::npos) << e.what();
  }
  try {
    dt::to_diststrat(at::_efficientzerotensor({2}));
    FAIL() << "a ZeroTensor converted";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("to_diststrat: tensor Float[2]"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("ZeroTensor"), std::string::npos) << e.what();
  }
}

TEST(TorchConvert, RejectsWhatCannotBeViewed) {
  at::Tensor a = torch::zeros({4, 6});
  try {
    dt::to_diststrat(a.t());
    FAIL() << "a transposed tensor converted";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("not contiguous"), std::string::npos) << e.what();
  }
  try {
    dt::to_diststrat(torch::zeros({3}, torch::kUInt8));
    FAIL() << "a uint8 tensor converted";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("Byte"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("supported: float32"), std::string::npos) << e.what();
  }
  EXPECT_THROW(dt::to_diststrat(torch::zeros({2, 2}).to_sparse()), InvalidArgumentError);
  EXPECT_FALSE(dt::to_diststrat(at::Tensor()).defined());
  EXPECT_FALSE(dt::to_torch(Tensor()).defined());
  // A contiguous slice (offset into the storage) views the right bytes.
  at::Tensor rows = torch::arange(20, torch::kFloat32).reshape({5, 4}).slice(0, 2, 4);
  Tensor t = dt::to_diststrat(rows);
  EXPECT_EQ(t.data<float>()[0], 8.0f);
}

// ---- equivalence with single-process LibTorch -----------------------------

// 19 full global batches of 16 and a short 20th one of 3 rows (a replica
// gets zero rows under 4 replicas).

void expect_equivalent(Strategy& strategy, DdpOptions options = {}) {
  const Dataset data = equivalence_data();
  auto ref = make_net(7);
  train_reference(*ref, data, kGlobalBatch, kSteps);
  ASSERT_GT(max_abs_diff(*ref, *make_net(7)), 1e-3) << "the reference did not train";
  auto net = make_net(7);
  dt::DistributedDataParallel ddp(strategy, net, options);
  train_ddp(strategy, ddp, data, kGlobalBatch, kSteps);
  const double diff = max_abs_diff(*ref, *ddp.module(0));
  EXPECT_LE(diff, 1e-5) << strategy.name();
  EXPECT_GT(ddp.stats().buckets_launched, 0);
  EXPECT_EQ(ddp.stats().sync_steps, kSteps);
}

TEST(TorchDdp, MirroredTwoReplicasMatchesSingleProcess) {
  MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
  expect_equivalent(strategy);
}

// Determinism mode (docs/determinism.md) is not built for LibTorch DDP: its
// hooks all-reduce from inside the step function, which the mode calls once
// per virtual shard, and LibTorch's kernels and batch norm would need pinning
// per shard. Refused when the DDP is made, naming the mode, not at a step.
TEST(TorchDdp, DeterminismModeIsRefusedAtConstruction) {
  MirroredOptions o;
  o.devices = {Device::cpu(0), Device::cpu(1)};
  o.determinism.virtual_shards = 4;
  MirroredStrategy strategy(o);
  try {
    dt::DistributedDataParallel ddp(strategy, make_net(7));
    FAIL() << "DistributedDataParallel accepted a strategy in determinism mode";
  } catch (const UnimplementedError& e) {
    EXPECT_NE(std::string(e.what()).find("determinism mode (virtual_shards 4)"), std::string::npos)
        << e.what();
  }
}

TEST(TorchDdp, CentralStorageTwoReplicasMatchesSingleProcess) {
  CentralStorageStrategy strategy({Device::cpu(0), Device::cpu(1)});
  expect_equivalent(strategy);
}

TEST(TorchDdp, MirroredOverlapOffAndSmallBucketsMatchSingleProcess) {
  {
    MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
    DdpOptions o;
    o.overlap = false;
    expect_equivalent(strategy, o);
  }
  {
    MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
    DdpOptions o;
    o.bytes_per_bucket = 64;  // one parameter per bucket
    expect_equivalent(strategy, o);
  }
}

TEST(TorchDdp, BucketsLaunchFromTheHooksInBackpropOrder) {
  MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
  const Dataset data = equivalence_data();
  for (bool overlap : {true, false}) {
    DdpOptions o;
    o.overlap = overlap;
    o.bytes_per_bucket = 64;  // 4 buckets: fc2.bias, fc2.weight, fc1.bias, fc1.weight
    dt::DistributedDataParallel ddp(strategy, make_net(7), o);
    train_ddp(strategy, ddp, data, kGlobalBatch, 2);
    const DdpStats s = ddp.stats();
    EXPECT_EQ(s.buckets_launched, 2 * 2 * 4)
        << "overlap " << overlap;  // steps x replicas x buckets
    // Every bucket is complete before backward returns, so with overlap all
    // of them start inside the hooks; without, none.
    EXPECT_EQ(s.buckets_in_hook, overlap ? s.buckets_launched : 0) << "overlap " << overlap;
  }
}

// The in-process multi-worker test below builds its workers' nets on their
// threads (seeds 7 and 99 at once). make_net must give the weights of its
// seed whatever other thread seeds LibTorch's one default generator.
TEST(TorchTestUtil, NetsBuiltOnConcurrentThreadsHaveTheirSeedsWeights) {
  const std::vector<uint64_t> seeds = {7, 99};
  std::vector<std::shared_ptr<NetImpl>> expected;
  for (uint64_t seed : seeds) expected.push_back(make_net(seed));
  constexpr int kThreads = 4, kRounds = 200;
  std::vector<int> wrong(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const size_t which = t % seeds.size();
      for (int i = 0; i < kRounds; ++i) {
        if (max_abs_diff(*expected[which], *make_net(seeds[which])) != 0) ++wrong[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(wrong[t], 0) << "thread " << t << " (seed " << seeds[t % seeds.size()]
                           << "): " << wrong[t] << " of " << kRounds << " nets had other weights";
  }
}

// Two workers as threads of this process (InProcessGroup), 2 replicas each.
TEST(TorchDdp, MultiWorkerInProcessTwoByTwoMatchesSingleProcess) {
  InProcessGroup group(2);
  const Dataset data = equivalence_data();
  auto ref = make_net(7);
  train_reference(*ref, data, kGlobalBatch, kSteps);
  std::vector<double> diff(2, -1);
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> workers;
  for (int w = 0; w < 2; ++w) {
    workers.emplace_back([&, w] {
      try {
        MultiWorkerOptions o;
        o.communicator = &group.at(w);
        o.devices = {Device::cpu(0), Device::cpu(1)};
        MultiWorkerMirroredStrategy strategy(o);
        // Worker 1 starts from other weights: the chief's broadcast fixes that.
        dt::DistributedDataParallel ddp(strategy, make_net(w == 0 ? 7 : 99));
        train_ddp(strategy, ddp, data, kGlobalBatch, kSteps);
        diff[w] = max_abs_diff(*ref, *ddp.module(0));
      } catch (...) {
        errors[w] = std::current_exception();
      }
    });
  }
  for (auto& t : workers) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  EXPECT_GE(diff[0], 0);
  EXPECT_LE(diff[0], 1e-5);
  EXPECT_LE(diff[1], 1e-5);
}

// ---- no_sync --------------------------------------------------------------

// k micro-batches under no_sync (the last one synchronizing) give the
// gradients of one batch k times larger.
TEST(TorchDdp, NoSyncAccumulationEqualsOneLargerBatch) {
  constexpr int kMicro = 3;
  constexpr int64_t kMicroBatch = 8;
  const Dataset data = make_data(kMicro * kMicroBatch);
  auto ref = make_net(7);
  {
    at::Tensor x = dt::to_torch(data.features()), y = dt::to_torch(data.labels());
    torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
  }
  MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
  dt::DistributedDataParallel ddp(strategy, make_net(7));
  DistributeOptions o;
  o.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, kMicroBatch, o);
  ASSERT_EQ(dist.num_batches(), kMicro);
  std::atomic<int> launched_during_no_sync{0};
  strategy.run([&](ReplicaContext& ctx) {
    auto& model = ddp.module(ctx);
    auto step = [&](int64_t i) {
      DistributedBatch b = dist.batch(i);
      at::Tensor x = dt::to_torch(b.features(ctx)), y = dt::to_torch(b.labels(ctx));
      at::Tensor loss = torch::nn::functional::cross_entropy(model->as<NetImpl>()->forward(x), y);
      ddp.backward(ctx, loss, x.size(0), b.global_size());
    };
    {
      auto guard = ddp.no_sync(ctx);
      EXPECT_THROW(ddp.no_sync(ctx), FailedPreconditionError);
      for (int i = 0; i + 1 < kMicro; ++i) step(i);
      if (ddp.stats().buckets_launched != 0) ++launched_during_no_sync;
    }
    step(kMicro - 1);
  });
  EXPECT_EQ(launched_during_no_sync, 0);
  for (int r = 0; r < 2; ++r) {
    auto pr = ref->parameters(), pd = ddp.module(r)->parameters();
    for (size_t i = 0; i < pr.size(); ++i) {
      EXPECT_LE((pr[i].grad() - pd[i].grad()).abs().max().item<double>(), 1e-6)
          << "replica " << r << " parameter " << i;
    }
  }
  EXPECT_EQ(ddp.stats().sync_steps, 1);
}

// ---- unused parameters ----------------------------------------------------

void run_unused(Strategy& strategy, dt::DistributedDataParallel& ddp, const Dataset& data,
                std::vector<std::string>* errors) {
  DistributeOptions o;
  o.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, 8, o);
  std::mutex mu;
  try {
    strategy.run([&](ReplicaContext& ctx) {
      DistributedBatch b = dist.batch(0);
      at::Tensor x = dt::to_torch(b.features(ctx)), y = dt::to_torch(b.labels(ctx));
      at::Tensor loss =
          torch::nn::functional::cross_entropy(ddp.module(ctx)->as<NetImpl>()->forward(x), y);
      try {
        ddp.backward(ctx, loss, x.size(0), b.global_size());
      } catch (const InvalidArgumentError& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors->push_back(e.what());
        throw;
      }
    });
  } catch (const InvalidArgumentError&) {
  }
}

TEST(TorchDdp, UnusedParameterIsAnErrorOnEveryReplicaNamingIt) {
  const Dataset data = make_data(16);
  MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
  // Replica 1's clone inherits use_extra = false; make replica 0 use it so
  // only one replica misses the parameter.
  dt::DistributedDataParallel ddp(strategy, make_net(7, /*extra=*/true, /*use_extra=*/false));
  ddp.module(0)->as<NetImpl>()->use_extra_ = true;
  std::vector<std::string> errors;
  run_unused(strategy, ddp, data, &errors);
  ASSERT_EQ(errors.size(), 2u);  // every replica, not only the one that missed it
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("'extra.weight' (on 1 of 2 replicas"), std::string::npos) << e;
    EXPECT_NE(e.find("'extra.bias'"), std::string::npos) << e;
    EXPECT_EQ(e.find("'fc1.weight'"), std::string::npos) << e;
    EXPECT_NE(e.find("find_unused_parameters"), std::string::npos) << e;
  }
  // The next step works again (nothing left half-done).
  ddp.module(1)->as<NetImpl>()->use_extra_ = true;
  errors.clear();
  run_unused(strategy, ddp, data, &errors);
  EXPECT_TRUE(errors.empty()) << errors[0];
}

TEST(TorchDdp, FindUnusedParametersCountsThemAsZero) {
  const Dataset data = make_data(16);
  MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
  DdpOptions o;
  o.find_unused_parameters = true;
  dt::DistributedDataParallel ddp(strategy, make_net(7, true, false), o);
  ddp.module(0)->as<NetImpl>()->use_extra_ = true;
  std::vector<std::string> errors;
  run_unused(strategy, ddp, data, &errors);
  ASSERT_TRUE(errors.empty()) << errors[0];
  // Replica 0's gradient for extra.* (replica 1 contributed zero), identical
  // on both replicas.
  for (const char* name : {"extra.weight", "extra.bias"}) {
    at::Tensor g0 = ddp.module(0)->named_parameters()[name].grad();
    at::Tensor g1 = ddp.module(1)->named_parameters()[name].grad();
    ASSERT_TRUE(g0.defined() && g1.defined()) << name;
    EXPECT_TRUE(torch::equal(g0, g1)) << name;
    EXPECT_GT(g0.abs().sum().item<double>(), 0) << name;
  }
}

// A replica whose loss is unusable throws its error; the other does not hang
// waiting for its buckets (they are sent, as zeros, with a failure flag) and
// throws AbortedError; run() reports the real error. The next step works.
TEST(TorchDdp, BadLossOnOneReplicaFailsTheStepEverywhereWithoutHanging) {
  const Dataset data = make_data(16);
  MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
  dt::DistributedDataParallel ddp(strategy, make_net(7));
  DistributeOptions o;
  o.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, 16, o);
  for (bool bad : {true, false}) {
    std::vector<std::string> errors(2);
    try {
      strategy.run([&](ReplicaContext& ctx) {
        DistributedBatch b = dist.batch(0);
        at::Tensor x = dt::to_torch(b.features(ctx)), y = dt::to_torch(b.labels(ctx));
        at::Tensor logits = ddp.module(ctx)->as<NetImpl>()->forward(x);
        at::Tensor loss = bad && ctx.local_replica_id() == 1
                              ? logits  // not a scalar
                              : torch::nn::functional::cross_entropy(logits, y);
        try {
          ddp.backward(ctx, loss, x.size(0), b.global_size());
        } catch (const Error& e) {
          errors[ctx.local_replica_id()] = e.what();
          throw;
        }
      });
      EXPECT_FALSE(bad) << "a non-scalar loss was accepted";
    } catch (const InvalidArgumentError& e) {
      EXPECT_TRUE(bad);
      EXPECT_NE(std::string(e.what()).find("the loss must be a scalar"), std::string::npos)
          << e.what();
    }
    if (bad) {
      EXPECT_NE(errors[0].find("the autograd pass failed on 1 of 2 replicas"), std::string::npos)
          << errors[0];
      EXPECT_NE(errors[1].find("the loss must be a scalar"), std::string::npos) << errors[1];
    } else {
      EXPECT_EQ(errors[0] + errors[1], "");
    }
  }
}

// Replicas that disagree on the step (rows / global_rows that do not add up,
// no_sync() on one replica only) would scale or pair the gradients wrongly
// without a word; every replica throws the same InvalidArgumentError instead,
// within the deadline, and the next consistent step works.
struct Disagreement {
  const char* name;
  const char* expected;  // in every replica's error
  // (replica, rows, global_rows) -> global_rows to pass
  std::function<int64_t(int, int64_t, int64_t)> global_rows;
  bool no_sync_on_replica0 = false;
  bool negative_rows_on_replica1 = false;
  const char* expected0 = nullptr;  // replica 0's error, when it differs
};

TEST(TorchDdp, StepsThatDisagreeAcrossReplicasFailOnEveryReplica) {
  const Dataset data = make_data(16);
  MirroredOptions mo;
  mo.devices = {Device::cpu(0), Device::cpu(1)};
  mo.communication.timeout = std::chrono::seconds(5);  // before the fix: a hang until it
  MirroredStrategy strategy(mo);
  dt::DistributedDataParallel ddp(strategy, make_net(7));
  DistributeOptions o;
  o.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, 8, o);
  const std::vector<Disagreement> cases = {
      {"global_rows differs on one replica", "global_rows",
       [](int r, int64_t, int64_t g) { return r == 1 ? g + 4 : g; }},
      {"global_rows is not the sum of the rows",
       "every replica passed global_rows 16, but the rows of all 2 replicas add up to 8: every "
       "replica must pass global_rows 8",
       [](int, int64_t, int64_t g) { return 2 * g; }},
      {"no_sync on one replica only", "micro-batch", [](int, int64_t, int64_t g) { return g; },
       true},
      {"negative rows on one replica", "rows -1 and global_rows",
       [](int, int64_t, int64_t g) { return g; }, false, true,
       "the autograd pass failed on 1 of 2 replicas"},
      {"consistent", "", [](int, int64_t, int64_t g) { return g; }},
  };
  for (const Disagreement& c : cases) {
    std::vector<std::string> errors(2);
    const auto start = std::chrono::steady_clock::now();
    try {
      strategy.run([&](ReplicaContext& ctx) {
        const int r = ctx.local_replica_id();
        auto step = [&](int64_t i) {
          DistributedBatch b = dist.batch(i);
          at::Tensor x = dt::to_torch(b.features(ctx)), y = dt::to_torch(b.labels(ctx));
          at::Tensor loss =
              torch::nn::functional::cross_entropy(ddp.module(ctx)->as<NetImpl>()->forward(x), y);
          const int64_t rows = c.negative_rows_on_replica1 && r == 1 ? -1 : x.size(0);
          ddp.backward(ctx, loss, rows, c.global_rows(r, x.size(0), b.global_size()));
        };
        try {
          if (c.no_sync_on_replica0 && r == 0) {
            auto guard = ddp.no_sync(ctx);
            step(0);
          } else {
            step(0);
          }
          step(1);
        } catch (const Error& e) {
          errors[static_cast<size_t>(r)] = e.what();
          throw;
        }
      });
    } catch (const Error&) {
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4)) << c.name;
    for (int r = 0; r < 2; ++r) {
      const std::string& e = errors[static_cast<size_t>(r)];
      if (*c.expected == '\0') {
        EXPECT_EQ(e, "") << c.name;
        continue;
      }
      const char* expected = r == 0 && c.expected0 ? c.expected0 : c.expected;
      EXPECT_NE(e.find(expected), std::string::npos) << c.name << ", replica " << r << ": " << e;
      EXPECT_NE(e.find("replica " + std::to_string(r)), std::string::npos) << c.name << ": " << e;
    }
  }
  // After the consistent step the clones agree.
  auto p0 = ddp.module(0)->parameters(), p1 = ddp.module(1)->parameters();
  for (size_t i = 0; i < p0.size(); ++i) EXPECT_TRUE(torch::equal(p0[i].grad(), p1[i].grad())) << i;
}

// Every replica running replica 0's module (ddp.module(0) instead of
// ddp.module(ctx)): replica 1's autograd pass would fire replica 0's hooks
// from replica 1's thread, racing on replica 0's step. It fails the step on
// every replica, naming the mix-up, within the deadline; the next step works.
TEST(TorchDdp, ModuleOfAnotherReplicaFailsTheStep) {
  const Dataset data = make_data(16);
  MirroredOptions mo;
  mo.devices = {Device::cpu(0), Device::cpu(1)};
  mo.communication.timeout = std::chrono::seconds(5);
  MirroredStrategy strategy(mo);
  dt::DistributedDataParallel ddp(strategy, make_net(7));
  DistributeOptions o;
  o.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, 8, o);
  for (bool wrong : {true, false}) {
    std::vector<std::string> errors(2);
    const auto start = std::chrono::steady_clock::now();
    try {
      strategy.run([&](ReplicaContext& ctx) {
        const int r = ctx.local_replica_id();
        DistributedBatch b = dist.batch(0);
        at::Tensor x = dt::to_torch(b.features(ctx)), y = dt::to_torch(b.labels(ctx));
        auto& m = wrong ? ddp.module(0) : ddp.module(ctx);
        at::Tensor loss = torch::nn::functional::cross_entropy(m->as<NetImpl>()->forward(x), y);
        try {
          ddp.backward(ctx, loss, x.size(0), b.global_size());
        } catch (const Error& e) {
          errors[static_cast<size_t>(r)] = e.what();
          throw;
        }
      });
    } catch (const Error&) {
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
    if (wrong) {
      EXPECT_NE(errors[1].find("local replica 0's parameter"), std::string::npos) << errors[1];
      EXPECT_NE(errors[0].find("the autograd pass failed on 1 of 2 replicas"), std::string::npos)
          << errors[0];
    } else {
      EXPECT_EQ(errors[0] + errors[1], "");
    }
  }
}

TEST(TorchDdp, OneReplicaKeepsTheModuleAndNamesItsParameters) {
  MirroredStrategy strategy({Device::cpu(0)});
  auto net = make_net(7);
  dt::DistributedDataParallel ddp(strategy, net);
  EXPECT_EQ(ddp.num_local_replicas(), 1);
  EXPECT_EQ(ddp.module(0).get(), net.get());
  EXPECT_EQ(ddp.parameter_names(),
            (std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}));
}

TEST(TorchDdp, SeveralReplicasNeedACloneableModule) {
  struct Plain : torch::nn::Module {
    Plain() { register_module("fc", torch::nn::Linear(2, 2)); }
  };
  MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
  try {
    dt::DistributedDataParallel ddp(strategy, std::make_shared<Plain>());
    FAIL() << "a module without clone() was replicated";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("torch::nn::Cloneable"), std::string::npos) << e.what();
  }
}

// ---- ParameterServerStrategy ----------------------------------------------------

ParameterServerOptions ps_options() {
  ParameterServerOptions o;
  o.num_ps = 1;  // one process: the PS rank runs as a thread
  o.devices = {Device::cpu(0), Device::cpu(1)};
  o.max_staleness = 0;  // one worker in lockstep: synchronous SGD
  return o;
}

double max_abs_diff_to_ps(torch::nn::Module& ref, dt::ParameterServerModel& model) {
  double d = 0;
  for (const auto& p : ref.named_parameters(true)) {
    const Tensor v = model.variable(p.key()).value();
    d = std::max(d, (p.value() - dt::to_torch(v)).abs().max().item<double>());
  }
  return d;
}

TEST(TorchParameterServer, DenseModuleMatchesSingleProcessSgd) {
  const Dataset data = equivalence_data();
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
  ParameterServerStrategy strategy(ps_options());
  SGDOptions so;
  so.learning_rate = static_cast<float>(kLr);
  SGD sgd(strategy, so);
  auto net = make_net(7);
  dt::ParameterServerModel model(strategy, net, sgd);
  DistributeOptions d;
  d.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, kGlobalBatch, d);
  for (int s = 0; s < kSteps; ++s) {
    DistributedBatch batch = dist.batch(s);
    strategy.run([&](ReplicaContext& ctx) {
      auto& m = model.module(ctx);
      // The module's parameters are the pull cache itself (no copy).
      EXPECT_EQ(m->named_parameters()["fc1.weight"].data_ptr(),
                model.variable("fc1.weight").read(ctx).data());
      at::Tensor x = dt::to_torch(batch.features(ctx)), y = dt::to_torch(batch.labels(ctx));
      at::Tensor loss;
      if (x.size(0) > 0)
        loss = torch::nn::functional::cross_entropy(m->as<NetImpl>()->forward(x), y);
      model.backward(ctx, loss, x.size(0), batch.global_size());
    });
  }
  strategy.flush();
  ASSERT_GT(max_abs_diff(*ref, *make_net(7)), 1e-3) << "the reference did not train";
  EXPECT_LE(max_abs_diff_to_ps(*ref, model), 1e-5);
}

// An embedding table as a row-sparse PS variable: only the rows a step uses
// are pulled and pushed; the result equals dense single-process training.
struct EmbNetImpl : torch::nn::Cloneable<EmbNetImpl> {
  EmbNetImpl() { reset(); }
  void reset() override {
    emb = register_module("emb", torch::nn::Embedding(30, 4));
    fc = register_module("fc", torch::nn::Linear(4, 3));
  }
  at::Tensor head(const at::Tensor& e) { return fc->forward(e.mean(1)); }  // e: [n, 3, 4]
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear fc{nullptr};
};

TEST(TorchParameterServer, RowSparseEmbeddingMatchesDenseTraining) {
  constexpr int64_t n = kGlobalBatch * 10;
  torch::manual_seed(5);
  at::Tensor ids = torch::randint(0, 30, {n, 3}, torch::kLong);
  at::Tensor labels = torch::randint(0, 3, {n}, torch::kLong);
  Tensor f(Shape{n, 3}, DType::kInt64), l(Shape{n}, DType::kInt64);
  std::memcpy(f.data(), ids.data_ptr(), f.nbytes());
  std::memcpy(l.data(), labels.data_ptr(), l.nbytes());
  const Dataset data(f, l);
  torch::manual_seed(11);
  auto ref = std::make_shared<EmbNetImpl>();
  torch::manual_seed(11);
  auto net = std::make_shared<EmbNetImpl>();
  {
    torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(kLr));
    for (int s = 0; s < 10; ++s) {
      const int64_t b = s * kGlobalBatch, e = b + kGlobalBatch;
      opt.zero_grad();
      torch::nn::functional::cross_entropy(ref->head(ref->emb->forward(ids.slice(0, b, e))),
                                           labels.slice(0, b, e))
          .backward();
      opt.step();
    }
  }
  ParameterServerStrategy strategy(ps_options());
  SGDOptions so;
  so.learning_rate = static_cast<float>(kLr);
  SGD sgd(strategy, so);
  dt::ParameterServerModel model(strategy, net, sgd, {"emb.weight"});
  DistributeOptions d;
  d.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, kGlobalBatch, d);
  for (int s = 0; s < 10; ++s) {
    DistributedBatch batch = dist.batch(s);
    strategy.run([&](ReplicaContext& ctx) {
      auto m = model.module(ctx)->as<EmbNetImpl>();
      at::Tensor x = dt::to_torch(batch.features(ctx)), y = dt::to_torch(batch.labels(ctx));
      auto rows = model.gather_rows(ctx, "emb.weight", x);
      EXPECT_LE(rows.rows.size(0), x.numel());
      at::Tensor loss =
          torch::nn::functional::cross_entropy(m->head(torch::embedding(rows.rows, rows.index)), y);
      model.backward(ctx, loss, x.size(0), batch.global_size());
    });
  }
  strategy.flush();
  torch::manual_seed(11);
  ASSERT_GT(max_abs_diff(*ref, *std::make_shared<EmbNetImpl>()), 1e-3)
      << "the reference did not train";
  EXPECT_LE(max_abs_diff_to_ps(*ref, model), 1e-5);
}

// ---- checkpoints ------------------------------------------------------------

// A new private directory (removed by the test at its end). No
// std::filesystem in LibTorch programs: diststrat_test::remove_tree says why.
std::string scratch_dir(const std::string& name) {
  return diststrat_test::make_temp_dir("diststrat_torch_" + name + "_");
}

// 10 steps uninterrupted == 5 steps, checkpoint, a fresh job (other initial
// weights, fresh optimizers) that restores and runs 5 more: bit-identical
// weights and momentum on every replica. Then Python's torch loads the
// checkpoint's parameters into the equivalent nn.Module: same logits.
TEST(TorchCheckpoint, ResumeIsBitIdenticalAndPythonGetsTheSameLogits) {
  const Dataset data = equivalence_data();
  const std::string dir = scratch_dir("resume");
  MirroredStrategy a_strategy({Device::cpu(0), Device::cpu(1)});
  dt::DistributedDataParallel a(a_strategy, make_net(7));
  auto a_opts = make_sgds(a);
  train_ddp_steps(a_strategy, a, a_opts, data, kGlobalBatch, 0, 10);

  std::string saved;
  {
    MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
    dt::DistributedDataParallel ddp(strategy, make_net(7));
    auto opts = make_sgds(ddp);
    dt::TrainingState state(ddp, {opts[0].get(), opts[1].get()});
    Checkpoint ckpt(strategy);
    CheckpointManager manager(ckpt, dir);
    train_ddp_steps(strategy, ddp, opts, data, kGlobalBatch, 0, 5);
    state.capture(5);
    saved = manager.save(5);

    // Python: the same logits on the first batch.
    at::Tensor x = dt::to_torch(data.features()).slice(0, 0, kGlobalBatch).contiguous();
    at::Tensor logits;
    {
      torch::NoGradGuard no_grad;
      logits = ddp.module(0)->as<NetImpl>()->forward(x).contiguous();
    }
    const std::string bx = dir + "/batch.f32", bl = dir + "/logits.f32";
    std::ofstream(bx, std::ios::binary).write(static_cast<const char*>(x.data_ptr()), x.nbytes());
    std::ofstream(bl, std::ios::binary)
        .write(static_cast<const char*>(logits.data_ptr()), logits.nbytes());
    const std::string cmd = "PYTHONPATH=" + std::string(DISTSTRAT_SOURCE_DIR) +
                            "/.deps/python /usr/bin/python3 " + DISTSTRAT_SOURCE_DIR +
                            "/tests/torch/check_checkpoint.py " + saved + " " + bx + " " + bl +
                            " " + std::to_string(kGlobalBatch) + " 2>&1";
    FILE* p = ::popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string out;
    char buf[512];
    while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
    const int rc = ::pclose(p);
    if (out.find("No module named 'torch'") != std::string::npos) {
      std::printf(
          "note: /usr/bin/python3 has no torch (python3-torch); the Python check is skipped\n");
    } else {
      EXPECT_EQ(rc, 0) << out;
      EXPECT_NE(out.find("OK"), std::string::npos) << out;
      std::printf("python: %s", out.c_str());
    }
  }

  MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
  dt::DistributedDataParallel ddp(strategy, make_net(99));
  auto opts = make_sgds(ddp);
  dt::TrainingState state(ddp, {opts[0].get(), opts[1].get()});
  Checkpoint ckpt(strategy);
  CheckpointManager manager(ckpt, dir);
  ASSERT_TRUE(manager.restore_latest().has_value());
  EXPECT_EQ(state.apply(), 5);
  ASSERT_TRUE(bit_identical(*ddp.module(0), *ddp.module(1)));
  train_ddp_steps(strategy, ddp, opts, data, kGlobalBatch, 5, 10);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(bit_identical(*a.module(r), *ddp.module(r)))
        << "replica " << r << ": max diff " << max_abs_diff(*a.module(r), *ddp.module(r));
    auto pa = a.module(r)->parameters(), pb = ddp.module(r)->parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      auto& sa = static_cast<torch::optim::SGDParamState&>(
          *a_opts[r]->state().at(compat::optimizer_state_key(pa[i])));
      auto& sb = static_cast<torch::optim::SGDParamState&>(
          *opts[r]->state().at(compat::optimizer_state_key(pb[i])));
      EXPECT_TRUE(torch::equal(sa.momentum_buffer(), sb.momentum_buffer())) << "parameter " << i;
    }
  }
  // The file holds the names torch uses.
  const SafetensorsFile file = load_safetensors(saved, SafetensorsLoadOptions{});
  for (const char* name :
       {"fc1.weight", "fc2.bias", "scale", "fc1.weight/momentum_buffer", "torch/step"}) {
    EXPECT_NE(file.find(name), nullptr) << name;
  }
  diststrat_test::remove_tree(dir);
}

// An optimizer over another replica's parameters (or over tensors of no
// replica) would step the wrong clone and checkpoint no state: the
// TrainingState constructor names it.
TEST(TorchCheckpoint, OptimizerOverTheWrongReplicaIsNamed) {
  MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
  dt::DistributedDataParallel ddp(strategy, make_net(7));
  auto swapped0 = make_sgd(*ddp.module(1)), swapped1 = make_sgd(*ddp.module(0));
  try {
    dt::TrainingState state(ddp, {swapped0.get(), swapped1.get()});
    FAIL() << "optimizers over the other replica's parameters were accepted";
  } catch (const InvalidArgumentError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("optimizer 0"), std::string::npos) << m;
    EXPECT_NE(m.find("'fc1.weight' of local replica 1"), std::string::npos) << m;
  }
  at::Tensor stray = torch::zeros({3}, torch::requires_grad());
  torch::optim::SGD foreign({stray}, torch::optim::SGDOptions(kLr).momentum(kMomentum));
  auto good0 = make_sgd(*ddp.module(0));
  try {
    dt::TrainingState state(ddp, {good0.get(), &foreign});
    FAIL() << "an optimizer over a tensor of no replica was accepted";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("Float[3]"), std::string::npos) << e.what();
  }
  auto good1 = make_sgd(*ddp.module(1));
  dt::TrainingState state(ddp, {good0.get(), good1.get()});
}

// A checkpoint of another model (an extra layer), or a damaged file, is an
// error naming the file, and leaves the model as it was.
TEST(TorchCheckpoint, ForeignOrDamagedCheckpointIsRefused) {
  const std::string dir = scratch_dir("foreign");
  std::string saved;
  {
    MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
    dt::DistributedDataParallel ddp(strategy, make_net(8, /*extra=*/true));
    auto opts = make_sgds(ddp);
    dt::TrainingState state(ddp, {opts[0].get(), opts[1].get()});
    Checkpoint ckpt(strategy);
    state.capture(3);
    saved = dir + "/other.safetensors";
    ckpt.save(saved);
  }
  MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
  dt::DistributedDataParallel ddp(strategy, make_net(7));
  auto opts = make_sgds(ddp);
  dt::TrainingState state(ddp, {opts[0].get(), opts[1].get()});
  const at::Tensor before = ddp.module(0)->parameters()[0].clone();
  Checkpoint ckpt(strategy);
  EXPECT_THROW(ckpt.restore(saved), Error);
  EXPECT_TRUE(torch::equal(before, ddp.module(0)->parameters()[0]));
  // Truncated.
  struct stat st {};
  ASSERT_EQ(::stat(saved.c_str(), &st), 0) << saved;
  ASSERT_EQ(::truncate(saved.c_str(), st.st_size / 2), 0) << saved;
  try {
    ckpt.restore(saved);
    FAIL() << "a truncated checkpoint was restored";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(saved), std::string::npos) << e.what();
  }
  diststrat_test::remove_tree(dir);
}

}  // namespace
}  // namespace diststrat::testing
