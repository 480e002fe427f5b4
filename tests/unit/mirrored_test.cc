#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <numeric>
#include <set>
#include <cstring>
#include <thread>

#include "runtime/variable_impl.h"
#include "diststrat/diststrat.h"
#include "training_util.h"

namespace ds = diststrat;
using diststrat::testing::max_abs_diff;
using diststrat::testing::reference_training;
using diststrat::testing::synthetic;
using diststrat::testing::train_under;

namespace {

using diststrat::testing::cpu_devices;
class MirroredEquivalence : public ::testing::TestWithParam<int> {};

TEST_P(MirroredEquivalence, SameWeightsAsSingleDeviceAfter20Steps) {
  const int replicas = GetParam();
  const ds::nn::Mlp mlp({784, 256, 256, 10});
  // 20 full batches of 64, then a short 21st batch of 3 rows (fewer rows than
  // replicas for 4 replicas: one replica gets none and still takes part).
  const ds::Dataset data = synthetic(64 * 20 + 3, 11);
  const auto ref = reference_training(mlp, data, 64, 21, 0.05f, 0.9f);
  ds::MirroredStrategy strategy(cpu_devices(replicas));
  std::vector<ds::Variable> vars;
  train_under(strategy, mlp, data, 64, 21, 0.05f, 0.9f, &vars);
  ASSERT_EQ(vars.size(), ref.size());
  for (size_t i = 0; i < vars.size(); ++i) {
    // Every replica's copy equals the reference...
    for (const ds::Tensor& copy : vars[i].impl().copies) {
      EXPECT_LE(max_abs_diff(copy, ref[i]), 1e-4) << vars[i].name();
    }
    // ...and the copies are bit-identical to each other.
    const auto& copies = vars[i].impl().copies;
    for (size_t c = 1; c < copies.size(); ++c) {
      ASSERT_EQ(0, std::memcmp(copies[c].data(), copies[0].data(), copies[0].nbytes()));
    }
  }
  // The step counter advanced once per step, on every replica.
  EXPECT_EQ(strategy.variable("optimizer/iterations").value().data<int64_t>()[0], 21);
}

INSTANTIATE_TEST_SUITE_P(Replicas, MirroredEquivalence, ::testing::Values(1, 2, 4));

TEST(Mirrored, ReplicaExceptionReachesCallerAndOthersAbortFast) {
  ds::MirroredStrategy strategy(cpu_devices(3));
  std::vector<ds::ErrorCode> codes(3, ds::ErrorCode::kInternal);
  std::vector<double> seconds(3, 0.0);
  try {
    strategy.run([&](ds::ReplicaContext& ctx) {
      if (ctx.replica_id() == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        throw std::out_of_range("replica 1 ran out of data");
      }
      const auto t0 = std::chrono::steady_clock::now();
      try {
        ds::Tensor t(ds::Shape{4}, ds::DType::kFloat32);
        std::vector<ds::Tensor> v{t};
        ctx.all_reduce(ds::ReduceOp::kSum, v);
      } catch (const ds::Error& e) {
        codes[ctx.replica_id()] = e.code();
        seconds[ctx.replica_id()] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        throw;
      }
    });
    FAIL() << "run() did not throw";
  } catch (const std::out_of_range& e) {
    EXPECT_STREQ(e.what(), "replica 1 ran out of data");
  }
  for (int r : {0, 2}) {
    EXPECT_EQ(codes[r], ds::ErrorCode::kAborted);
    EXPECT_LT(seconds[r], 1.0);
  }
  // The strategy is usable again afterwards.
  auto ids = strategy.run([](ds::ReplicaContext& ctx) {
    ds::Tensor t(ds::Shape{1}, ds::DType::kInt32);
    t.data<int32_t>()[0] = ctx.replica_id();
    return ctx.all_reduce(ds::ReduceOp::kSum, t).data<int32_t>()[0];
  });
  EXPECT_EQ(ids[2], 3);
}

TEST(Mirrored, CollectiveOneReplicaNeverJoinsIsDeadlineExceededNamingIt) {
  ds::MirroredOptions o;
  o.devices = cpu_devices(2);
  o.communication.timeout = std::chrono::milliseconds(150);
  ds::MirroredStrategy strategy(o);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    strategy.run([&](ds::ReplicaContext& ctx) {
      if (ctx.replica_id() == 1) return;  // skips the all-reduce
      ds::Tensor t(ds::Shape{2}, ds::DType::kFloat32);
      std::vector<ds::Tensor> v{t};
      ctx.all_reduce(ds::ReduceOp::kSum, v, {"dense0/kernel/grad"});
    });
    FAIL();
  } catch (const ds::DeadlineExceededError& e) {
    EXPECT_NE(e.message().find("rank 1 did not arrive"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("dense0/kernel/grad"), std::string::npos) << e.message();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
}

TEST(Mirrored, ShapeOrDtypeMismatchBetweenReplicasIsAClearError) {
  ds::MirroredStrategy strategy(cpu_devices(2));
  for (int variant = 0; variant < 2; ++variant) {
    try {
      strategy.run([&](ds::ReplicaContext& ctx) {
        const bool odd = ctx.replica_id() == 1;
        ds::Tensor t(variant == 0 && odd ? ds::Shape{5} : ds::Shape{4},
                     variant == 1 && odd ? ds::DType::kFloat64 : ds::DType::kFloat32);
        std::vector<ds::Tensor> v{t};
        ctx.all_reduce(ds::ReduceOp::kSum, v, {"w/grad"});
      });
      FAIL();
    } catch (const ds::InvalidArgumentError& e) {
      EXPECT_NE(e.message().find("rank 1 called"), std::string::npos) << e.message();
      EXPECT_NE(e.message().find("w/grad"), std::string::npos) << e.message();
    }
  }
}

TEST(Mirrored, BatchWithFewerRowsThanReplicasIsRejected) {
  ds::MirroredStrategy strategy(cpu_devices(4));
  EXPECT_THROW(strategy.distribute(synthetic(10, 1), 3), ds::InvalidArgumentError);
  EXPECT_THROW(strategy.distribute(synthetic(10, 1), 0), ds::InvalidArgumentError);
}

// A batch of another strategy's dataset (cut for 3 replicas) read by a
// 2-replica strategy: an error naming both counts, not a third of the rows
// silently left out (outside trial).
TEST(Mirrored, ABatchOfAnotherStrategysDatasetIsRefused) {
  ds::MirroredStrategy strategy(cpu_devices(2)), other(cpu_devices(3));
  ds::DistributedDataset foreign = other.distribute(synthetic(12, 1), 6);
  const ds::DistributedBatch b = foreign.batch(0);
  try {
    strategy.run([&](ds::ReplicaContext& ctx) { (void)b.features(ctx); });
    ADD_FAILURE() << "a 3-replica batch was read by 2 replicas";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("the batch holds slices for 3 local replicas, but "
                                         "replica "),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("'s strategy has 2"), std::string::npos) << e.what();
  }
}

TEST(Mirrored, DistributeSplitsEveryRowOncePerEpochAndReshuffles) {
  ds::MirroredStrategy strategy(cpu_devices(3));
  const int64_t rows = 50;
  ds::Tensor x(ds::Shape{rows, 1}, ds::DType::kFloat32), y(ds::Shape{rows}, ds::DType::kInt32);
  for (int64_t i = 0; i < rows; ++i) {
    x.data<float>()[i] = static_cast<float>(i);
    y.data<int32_t>()[i] = static_cast<int32_t>(i);
  }
  ds::DistributeOptions o;
  o.seed = 3;
  ds::DistributedDataset dist = strategy.distribute(ds::Dataset(x, y), 16, o);
  EXPECT_EQ(dist.num_batches(), 4);
  std::vector<std::vector<int>> epochs;
  for (int e = 0; e < 2; ++e) {
    dist.set_epoch(e);
    std::vector<int> seen;
    for (const auto& b : dist) {
      EXPECT_EQ(b.global_size(), b.index() < 3 ? 16 : 2);
      auto rows_per = strategy.run([&](ds::ReplicaContext& ctx) {
        const ds::Tensor& f = b.features(ctx);
        std::vector<int> mine;
        for (int64_t i = 0; i < f.shape()[0]; ++i)
          mine.push_back(static_cast<int>(f.data<float>()[i]));
        EXPECT_EQ(f.shape()[0], b.labels(ctx).shape()[0]);
        return mine;
      });
      // Even split: sizes differ by at most one.
      size_t lo = SIZE_MAX, hi = 0;
      for (const auto& m : rows_per) {
        lo = std::min(lo, m.size());
        hi = std::max(hi, m.size());
        seen.insert(seen.end(), m.begin(), m.end());
      }
      EXPECT_LE(hi - lo, 1u);
    }
    std::vector<int> sorted = seen;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int> all(rows);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(sorted, all);
    epochs.push_back(seen);
  }
  EXPECT_NE(epochs[0], epochs[1]);
}

TEST(Mirrored, ReduceGatherMergeCallAndAllGather) {
  ds::MirroredStrategy strategy(cpu_devices(3));
  auto vals = strategy.run([](ds::ReplicaContext& ctx) { return float(ctx.replica_id() + 1); });
  EXPECT_EQ(strategy.reduce(ds::ReduceOp::kSum, vals), 6.0f);
  EXPECT_EQ(strategy.reduce(ds::ReduceOp::kMean, vals), 2.0f);
  EXPECT_EQ(strategy.reduce(ds::ReduceOp::kMax, vals), 3.0f);

  auto tensors = strategy.run([](ds::ReplicaContext& ctx) {
    ds::Tensor t(ds::Shape{ctx.replica_id() + 1, 2}, ds::DType::kInt32);
    for (int64_t i = 0; i < t.num_elements(); ++i) t.data<int32_t>()[i] = ctx.replica_id();
    return t;
  });
  ds::Tensor g = strategy.gather(tensors);
  EXPECT_EQ(g.shape(), ds::Shape({6, 2}));
  EXPECT_EQ(g.data<int32_t>()[11], 2);

  std::atomic<int> merge_runs{0};
  auto gathered = strategy.run([&](ds::ReplicaContext& ctx) {
    const int r = ctx.merge_call([&](ds::Strategy& s) {
      ++merge_runs;
      return s.num_replicas_in_sync() * 10;
    });
    EXPECT_EQ(r, 30);
    ds::Tensor t(ds::Shape{ctx.replica_id(), 1}, ds::DType::kFloat32);  // 0, 1, 2 rows
    for (int64_t i = 0; i < t.num_elements(); ++i) t.data<float>()[i] = float(ctx.replica_id());
    return ctx.all_gather(t, "rows");
  });
  EXPECT_EQ(merge_runs.load(), 1);
  for (const auto& t : gathered) {
    ASSERT_EQ(t.shape(), ds::Shape({3, 1}));
    EXPECT_EQ(t.data<float>()[0], 1.0f);
    EXPECT_EQ(t.data<float>()[2], 2.0f);
  }

  // An exception inside merge_call reaches every replica.
  EXPECT_THROW(strategy.run([&](ds::ReplicaContext& ctx) {
    ctx.merge_call([](ds::Strategy&) { throw ds::FailedPreconditionError("merge failed"); });
  }),
               ds::FailedPreconditionError);
  // Each replica gets its own exception object: local replica 0 the one fn
  // threw, the others a copy (for a non-diststrat exception an AbortedError
  // quoting it).
  std::vector<std::string> got(strategy.num_local_replicas());
  strategy.run([&](ds::ReplicaContext& ctx) {
    try {
      ctx.merge_call([](ds::Strategy&) { throw std::runtime_error("user merge failed"); });
    } catch (const ds::AbortedError& e) {
      got[ctx.local_replica_id()] = "aborted: " + e.message();
    } catch (const std::exception& e) {
      got[ctx.local_replica_id()] = e.what();
    }
  });
  EXPECT_EQ(got[0], "user merge failed");
  for (size_t r = 1; r < got.size(); ++r) {
    EXPECT_EQ(got[r], "aborted: replica " + std::to_string(r) +
                          ": merge_call failed on local replica 0: user merge failed");
  }
}

TEST(Mirrored, OnReadVariablesAggregateWhenRead) {
  ds::MirroredStrategy strategy(cpu_devices(4));
  ds::VariableOptions o;
  o.synchronization = ds::VariableSynchronization::kOnRead;
  o.aggregation = ds::VariableAggregation::kSum;
  o.trainable = false;
  ds::Variable count = strategy.create_variable("metrics/count", ds::Shape{}, ds::DType::kFloat32,
                                                ds::init::Zeros{}, o);
  o.aggregation = ds::VariableAggregation::kMean;
  ds::Variable mean = strategy.create_variable("metrics/mean", ds::Shape{}, ds::DType::kFloat32,
                                               ds::init::Zeros{}, o);
  o.aggregation = ds::VariableAggregation::kOnlyFirstReplica;
  ds::Variable first = strategy.create_variable("metrics/first", ds::Shape{}, ds::DType::kFloat32,
                                                ds::init::Zeros{}, o);
  strategy.run([&](ds::ReplicaContext& ctx) {
    count.read(ctx).data<float>()[0] += float(ctx.replica_id() + 1);
    mean.read(ctx).data<float>()[0] = float(ctx.replica_id());
    first.read(ctx).data<float>()[0] = float(ctx.replica_id() + 7);
  });
  EXPECT_EQ(count.value().data<float>()[0], 10.0f);
  EXPECT_EQ(mean.value().data<float>()[0], 1.5f);
  EXPECT_EQ(first.value().data<float>()[0], 7.0f);
}

TEST(Mirrored, VariablesAreMirroredAndUpdateKeepsCopiesEqual) {
  ds::MirroredStrategy strategy(cpu_devices(2));
  ds::Variable w =
      strategy.create_variable("w", ds::Shape{3}, ds::DType::kFloat32, ds::init::Constant{1.5});
  ASSERT_EQ(w.impl().copies.size(), 2u);
  EXPECT_FALSE(w.impl().copies[0].same_storage(w.impl().copies[1]));
  strategy.update(w, [](ds::Tensor& t) { t.data<float>()[1] = 4.0f; });
  for (const auto& c : w.impl().copies) EXPECT_EQ(c.data<float>()[1], 4.0f);
  ds::Tensor v(ds::Shape{3}, ds::DType::kFloat32);
  w.assign(v);
  EXPECT_EQ(w.value().data<float>()[1], 0.0f);
  EXPECT_THROW(w.assign(ds::Tensor(ds::Shape{4}, ds::DType::kFloat32)), ds::InvalidArgumentError);
  EXPECT_THROW(strategy.create_variable("w", ds::Shape{1}, ds::DType::kFloat32, ds::init::Zeros{}),
               ds::InvalidArgumentError);
  EXPECT_THROW(strategy.variable("nope"), ds::NotFoundError);
}

TEST(Mirrored, BadDevicesAreRejected) {
  EXPECT_THROW(ds::MirroredStrategy({ds::Device::cpu(0), ds::Device::cpu(0)}),
               ds::InvalidArgumentError);
}

TEST(Mirrored, DistributeDatasetsFromFunctionSeesInputContext) {
  ds::MirroredStrategy strategy(cpu_devices(2));
  ds::InputContext seen;
  auto dist = strategy.distribute_datasets_from_function(
      [&](const ds::InputContext& ic) {
        seen = ic;
        return synthetic(20, 2);
      },
      8);
  EXPECT_EQ(seen.num_input_pipelines, 1);
  EXPECT_EQ(seen.num_replicas_in_sync, 2);
  EXPECT_EQ(seen.per_replica_batch_size(), 4);
  EXPECT_EQ(dist.num_batches(), 3);
  EXPECT_THROW(strategy.distribute_datasets_from_function(
                   [](const ds::InputContext&) { return synthetic(4, 1); }, 7),
               ds::InvalidArgumentError);
}

TEST(Mirrored, AdamTrainsIdenticallyOnEveryReplica) {
  ds::MirroredStrategy strategy(cpu_devices(2));
  ds::Variable w =
      strategy.create_variable("w", ds::Shape{4}, ds::DType::kFloat32, ds::init::Constant{1.0});
  ds::Adam adam(strategy, {0.1f});
  for (int s = 0; s < 5; ++s) {
    strategy.run([&](ds::ReplicaContext& ctx) {
      ds::Tensor g = w.read(ctx).clone();  // grad of 0.5 * w^2, halved per replica
      for (int i = 0; i < 4; ++i) g.data<float>()[i] *= 0.5f;
      adam.apply_gradients(ctx, {{g, w}});
    });
  }
  // Adam's first steps move by about lr each: 1 - 5 * 0.1.
  EXPECT_NEAR(w.value().data<float>()[0], 0.5f, 0.05f);
  EXPECT_EQ(0, std::memcmp(w.impl().copies[0].data(), w.impl().copies[1].data(), 16));
  EXPECT_EQ(w.impl().slot("m").size(), 2u);
}

}  // namespace

namespace {

TEST(Mirrored, StalledReplicaEndsTheStepWithinTheDeadline) {
  ds::MirroredOptions o;
  o.devices = {ds::Device::cpu(0), ds::Device::cpu(1)};
  o.communication.timeout = std::chrono::milliseconds(200);
  auto strategy = std::make_unique<ds::MirroredStrategy>(o);
  // The stalled replica never returns (an abandoned thread must not: the step
  // it was running is gone). It sleeps until the process exits.
  static std::atomic<bool> release{false};
  const auto t0 = std::chrono::steady_clock::now();
  try {
    strategy->run([&](ds::ReplicaContext& ctx) {
      if (ctx.replica_id() == 1) {
        while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        return;
      }
      ds::Tensor t(ds::Shape{1}, ds::DType::kFloat32);
      std::vector<ds::Tensor> v{t};
      ctx.all_reduce(ds::ReduceOp::kSum, v, {"g"});
    });
    FAIL();
  } catch (const ds::DeadlineExceededError& e) {
    EXPECT_NE(e.message().find("rank 1 did not arrive"), std::string::npos) << e.message();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 2.0);
  // The strategy refuses to run again rather than hang.
  EXPECT_THROW(strategy->run([](ds::ReplicaContext&) {}), ds::FailedPreconditionError);
  strategy.reset();  // detaches the stuck thread instead of joining it
}

}  // namespace
