// ZeRO-1 misuse (sharded optimizer state on some workers only, different
// variable lists across workers or replicas, awkward sizes) and
// mixed-precision gradients that must be rejected: a clear error on every
// worker / replica within the deadline, never a hang or wrong numbers.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "diststrat/diststrat.h"
#include "training_util.h"

namespace ds = diststrat;

namespace {

// fn(strategy, worker) on `workers` threads over one InProcessGroup, worker w
// sharding when zero[w]; returns each worker's error message ("" = none).
std::vector<std::string> run_workers(const std::vector<bool>& zero,
                                     const std::function<void(ds::MultiWorkerMirroredStrategy&, int)>& fn) {
  const int workers = static_cast<int>(zero.size());
  ds::CommunicationOptions comm;
  comm.timeout = std::chrono::seconds(20);
  ds::InProcessGroup group(workers, comm);
  std::vector<std::string> errors(static_cast<size_t>(workers));
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      try {
        ds::MultiWorkerOptions o;
        o.communication = comm;
        o.communicator = &group.at(w);
        o.devices = ds::testing::cpu_devices(1);
        o.shard_optimizer_state = zero[static_cast<size_t>(w)];
        ds::MultiWorkerMirroredStrategy s(o);
        fn(s, w);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(w)] = e.what();
        group.at(w).abort("worker " + std::to_string(w) + " failed");
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

ds::Tensor filled(const ds::Shape& shape, float v) {
  ds::Tensor t(shape, ds::DType::kFloat32);
  for (int64_t i = 0; i < t.num_elements(); ++i) t.data<float>()[i] = v + 0.125f * static_cast<float>(i);
  return t;
}

}  // namespace

TEST(ZeroMisuse, ShardingOnOneWorkerOnlyIsAnErrorOnEveryWorker) {
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::string> errors = run_workers({true, false}, [](ds::MultiWorkerMirroredStrategy& s, int) {
    ds::Variable a = s.create_variable("a", ds::Shape{6}, ds::DType::kFloat32, ds::init::Zeros{});
    ds::Adam adam(s, {});
    for (int step = 0; step < 2; ++step) {
      s.run([&](ds::ReplicaContext& ctx) { adam.apply_gradients(ctx, {{filled(a.shape(), 1), a}}); });
    }
  });
  for (size_t w = 0; w < errors.size(); ++w) {
    EXPECT_NE(errors[w].find("shard_optimizer_state must be the same on every worker"), std::string::npos)
        << "worker " << w << ": '" << errors[w] << "'";
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15)) << "a timeout, not a check";
}

TEST(ZeroMisuse, DifferentVariablesOfTheSameTotalSizeAcrossWorkersAreAnError) {
  // Worker 0 trains {a, b}, worker 1 {a, c}: the flat vectors have the same
  // length, so the collectives alone would match and mix b's and c's state.
  const std::vector<std::string> errors = run_workers({true, true}, [](ds::MultiWorkerMirroredStrategy& s, int w) {
    ds::Variable a = s.create_variable("a", ds::Shape{4}, ds::DType::kFloat32, ds::init::Zeros{});
    ds::Variable b = s.create_variable("b", ds::Shape{4}, ds::DType::kFloat32, ds::init::Zeros{});
    ds::Variable c = s.create_variable("c", ds::Shape{2, 2}, ds::DType::kFloat32, ds::init::Zeros{});
    ds::SGD sgd(s, {.learning_rate = 0.1f, .momentum = 0.9f});
    ds::Variable second = w == 0 ? b : c;
    s.run([&](ds::ReplicaContext& ctx) {
      sgd.apply_gradients(ctx, {{filled(a.shape(), 1), a}, {filled(second.shape(), 2), second}});
    });
  });
  for (size_t w = 0; w < errors.size(); ++w) {
    EXPECT_NE(errors[w].find("sharded"), std::string::npos) << "worker " << w << ": '" << errors[w] << "'";
  }
}

TEST(ZeroMisuse, DifferentVariablesAcrossMirroredReplicasAreAnErrorNotAHang) {
  ds::MirroredOptions o;
  o.devices = ds::testing::cpu_devices(2);
  o.shard_optimizer_state = true;
  o.communication.timeout = std::chrono::seconds(20);
  ds::MirroredStrategy s(o);
  ds::Variable a = s.create_variable("a", ds::Shape{4}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::Variable b = s.create_variable("b", ds::Shape{3}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::Adam adam(s, {});
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(s.run([&](ds::ReplicaContext& ctx) {
    if (ctx.local_replica_id() == 0) {
      adam.apply_gradients(ctx, {{filled(a.shape(), 1), a}, {filled(b.shape(), 1), b}});
    } else {
      adam.apply_gradients(ctx, {{filled(a.shape(), 1), a}});
    }
  }),
               ds::Error);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15)) << "a timeout, not a check";
}

TEST(ZeroMisuse, EmptyAndOneElementVariablesOnFourReplicasMatchUnsharded) {
  std::vector<std::vector<float>> result;
  for (bool zero : {false, true}) {
    ds::MirroredOptions o;
    o.devices = ds::testing::cpu_devices(4);
    o.shard_optimizer_state = zero;
    ds::MirroredStrategy s(o);
    ds::Variable e = s.create_variable("empty", ds::Shape{0}, ds::DType::kFloat32, ds::init::Zeros{});
    ds::Variable one = s.create_variable("one", ds::Shape{1}, ds::DType::kFloat32, ds::init::Constant{0.5});
    ds::Adam adam(s, {.learning_rate = 0.05f});
    adam.set_clipping({.global_norm = 1.0f});
    for (int step = 0; step < 3; ++step) {
      s.run([&](ds::ReplicaContext& ctx) {
        adam.apply_gradients(ctx, {{ds::Tensor(ds::Shape{0}, ds::DType::kFloat32), e},
                                   {filled(one.shape(), 0.5f + ctx.replica_id()), one}});
      });
    }
    std::vector<float> copies;
    for (const ds::Tensor& c : one.impl().copies) copies.push_back(c.data<float>()[0]);
    result.push_back(copies);
  }
  for (size_t r = 0; r < 4; ++r) EXPECT_EQ(result[1][r], result[0][r]) << "replica " << r;
}

TEST(MixedPrecisionMisuse, WrongShapeAndLowPrecisionVariablesAreRejected) {
  ds::MirroredOptions o;
  o.devices = ds::testing::cpu_devices(2);
  o.shard_optimizer_state = true;
  ds::MirroredStrategy s(o);
  ds::Variable a = s.create_variable("a", ds::Shape{4}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::SGD sgd(s, {.learning_rate = 0.1f});
  EXPECT_THROW(s.run([&](ds::ReplicaContext& ctx) {
    sgd.apply_gradients(ctx, {{ds::Tensor(ds::Shape{5}, ds::DType::kFloat16), a}});
  }),
               ds::InvalidArgumentError);
  ds::MirroredStrategy plain(ds::MirroredOptions{.devices = ds::testing::cpu_devices(2)});
  ds::Variable h = plain.create_variable("h", ds::Shape{4}, ds::DType::kFloat16, ds::init::Zeros{});
  ds::SGD sgd2(plain, {.learning_rate = 0.1f});
  EXPECT_THROW(plain.run([&](ds::ReplicaContext& ctx) {
    sgd2.apply_gradients(ctx, {{ds::Tensor(ds::Shape{4}, ds::DType::kFloat16), h}});
  }),
               ds::UnimplementedError);
}

TEST(MixedPrecisionMisuse, BFloat16NaNUnderZeroSkipsTheStepWithLossScaling) {
  ds::MirroredOptions o;
  o.devices = ds::testing::cpu_devices(3);
  o.shard_optimizer_state = true;
  ds::MirroredStrategy s(o);
  ds::Variable a = s.create_variable("a", ds::Shape{5}, ds::DType::kFloat32, ds::init::Constant{1.0});
  ds::Adam adam(s, {});
  adam.enable_loss_scaling({8.0f, 1000, 2.0f});
  std::vector<bool> skipped(3);
  s.run([&](ds::ReplicaContext& ctx) {
    ds::Tensor g(a.shape(), ds::DType::kBFloat16);
    uint16_t* p = static_cast<uint16_t*>(g.data());
    for (int i = 0; i < 5; ++i) p[i] = ds::BFloat16::from_float(1.0f);
    if (ctx.replica_id() == 2) p[0] = ds::BFloat16::from_float(std::nanf(""));
    skipped[static_cast<size_t>(ctx.local_replica_id())] = adam.apply_gradients(ctx, {{g, a}}).skipped;
  });
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_TRUE(skipped[r]) << "replica " << r;
    for (int i = 0; i < 5; ++i) EXPECT_EQ(a.impl().copies[r].data<float>()[i], 1.0f) << "replica " << r;
  }
  EXPECT_EQ(adam.skipped_steps(), 1);
}
