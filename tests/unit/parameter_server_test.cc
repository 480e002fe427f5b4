#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "runtime/variable_impl.h"
#include "allreduce/transport.h"
#include "diststrat/diststrat.h"
#include "parameter_server/client.h"
#include "parameter_server/strategy_impl.h"
#include "parameter_server/shard_updater.h"
#include "least_squares_util.h"
#include "training_util.h"

namespace ds = diststrat;
namespace pp = diststrat::partitioners;
using std::chrono::milliseconds;

namespace {

using ds::testing::cpu_devices;

// ---- partitioners ------------------------------------------------------------

struct PartitionCase {
  const char* name;
  ds::Partitioner partitioner;
  ds::Shape shape;
  ds::DType dtype;
  int64_t shards;
};

TEST(Partitioners, ShardCountsFollowTensorFlow) {
  const ds::DType f32 = ds::DType::kFloat32, f64 = ds::DType::kFloat64;
  const std::vector<PartitionCase> cases = {
      {"fixed 3 of 10 rows", pp::FixedShards{3}, {10, 4}, f32, 3},
      {"fixed 5 of 2 rows", pp::FixedShards{5}, {2, 4}, f32, 2},
      {"fixed of a vector", pp::FixedShards{4}, {9}, f32, 4},
      {"fixed of a scalar", pp::FixedShards{4}, {}, f32, 1},
      // 1000 x 256 f32 = 1,024,000 B; / 256 KiB = 3.9 -> 4 shards
      {"min 256KiB", pp::MinSize{256 << 10, 8}, {1000, 256}, f32, 4},
      {"min capped by max_shards", pp::MinSize{1024, 3}, {10, 100}, f32, 3},
      {"min bigger than the variable", pp::MinSize{1 << 20, 4}, {10, 4}, f32, 1},
      {"min capped by rows", pp::MinSize{1, 100}, {3, 100}, f64, 3},
      // rows of 16 B: floor(1000 / 16) = 62 rows per shard -> ceil(100 / 62) = 2
      {"max 1000 B", pp::MaxSize{1000, 0}, {100, 4}, f32, 2},
      {"max capped", pp::MaxSize{1000, 1}, {100, 4}, f32, 1},
      {"max below one row", pp::MaxSize{10, 0}, {5, 4}, f32, 5},
      {"max f64 rows", pp::MaxSize{64, 0}, {10, 4}, f64, 5},
      {"max of zero rows", pp::MaxSize{64, 0}, {0, 4}, f32, 1},
  };
  for (const PartitionCase& c : cases) {
    EXPECT_EQ(c.partitioner(c.shape, c.dtype), c.shards) << c.name;
  }
  EXPECT_THROW(pp::FixedShards{0}(ds::Shape{4}, f32), ds::InvalidArgumentError);
  EXPECT_THROW((pp::MaxSize{0, 0}(ds::Shape{4}, f32)), ds::InvalidArgumentError);
}

TEST(Partitioners, FirstRowsModNShardsGetOneExtraRow) {
  using Rows = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(ds::shard_rows(10, 3), (Rows{{0, 4}, {4, 3}, {7, 3}}));
  EXPECT_EQ(ds::shard_rows(11, 4), (Rows{{0, 3}, {3, 3}, {6, 3}, {9, 2}}));
  EXPECT_EQ(ds::shard_rows(6, 3), (Rows{{0, 2}, {2, 2}, {4, 2}}));
  EXPECT_EQ(ds::shard_rows(2, 1), (Rows{{0, 2}}));
}

TEST(ParameterServer, ShardedVariableReassemblesAndIsPlacedRoundRobin) {
  ds::ParameterServerOptions o;
  o.num_ps = 2;
  o.partitioner = pp::FixedShards{3};
  ds::InProcessTransportGroup group(3);  // worker 0, PS ranks 1 and 2
  auto ps1 = ds::ps::make_strategy(group.at(1), o);
  auto ps2 = ds::ps::make_strategy(group.at(2), o);
  {
    auto worker = ds::ps::make_strategy(group.at(0), o);
    ds::Tensor expect(ds::Shape{10, 4}, ds::DType::kFloat32);
    ds::init::GlorotUniform{7}(expect);
    ds::Variable w = worker->create_variable("w", ds::Shape{10, 4}, ds::DType::kFloat32,
                                             ds::init::GlorotUniform{7});
    ds::Variable b =
        worker->create_variable("b", ds::Shape{}, ds::DType::kFloat32, ds::init::Constant{2.0});
    EXPECT_EQ(0, std::memcmp(w.value().data(), expect.data(), expect.nbytes()));
    EXPECT_EQ(b.value().data<float>()[0], 2.0f);
    // Shards 0 and 2 of w on PS 0, shard 1 on PS 1; then b (next in turn) on PS 1.
    auto s1 = ps1->local_shards(), s2 = ps2->local_shards();
    ASSERT_EQ(s1.size(), 2u);
    ASSERT_EQ(s2.size(), 2u);
    ds::Tensor joined(ds::Shape{10, 4}, ds::DType::kFloat32);
    std::vector<int64_t> rows_seen;
    for (const auto* list : {&s1, &s2}) {
      for (const ds::ShardSnapshot& s : *list) {
        if (s.variable != "w") {
          EXPECT_EQ(s.variable, "b");
          EXPECT_EQ(list, &s2);
          continue;
        }
        EXPECT_EQ(s.num_shards, 3);
        EXPECT_EQ(s.full_shape, ds::Shape({10, 4}));
        EXPECT_EQ(list == &s1, s.shard_index != 1);
        rows_seen.push_back(s.value.shape()[0]);
        std::memcpy(static_cast<char*>(joined.data()) + s.row_offset * 16, s.value.data(),
                    s.value.nbytes());
      }
    }
    std::sort(rows_seen.begin(), rows_seen.end());
    EXPECT_EQ(rows_seen, (std::vector<int64_t>{3, 3, 4}));
    EXPECT_EQ(0, std::memcmp(joined.data(), expect.data(), expect.nbytes()));
  }
  ps1->join();
  ps2->join();
}

// ---- equivalence with single-device training --------------------------------

class PsEquivalence : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(PsEquivalence, OneWorkerLockstepEqualsSingleDeviceAfter20Steps) {
  const auto [num_ps, replicas] = GetParam();
  const ds::nn::Mlp mlp({784, 64, 32, 10});
  const ds::Dataset data = ds::testing::synthetic(64 * 20 + 3, 11);
  const auto ref = ds::testing::reference_training(mlp, data, 64, 21, 0.05f, 0.9f);
  ds::ParameterServerOptions o;
  o.num_ps = num_ps;
  o.devices = cpu_devices(replicas);
  o.max_staleness = 0;
  if (num_ps > 1) o.partitioner = pp::FixedShards{3};
  ds::ParameterServerStrategy strategy(o);
  std::vector<ds::Variable> vars;
  ds::testing::train_under(strategy, mlp, data, 64, 21, 0.05f, 0.9f, &vars);
  for (size_t i = 0; i < vars.size(); ++i) {
    EXPECT_LE(ds::testing::max_abs_diff(vars[i].value(), ref[i]), 1e-4) << vars[i].name();
  }
  strategy.flush();
  EXPECT_EQ(strategy.variable("optimizer/iterations").value().data<int64_t>()[0], 21);
  const ds::ParameterServerStats st = strategy.stats();
  EXPECT_EQ(st.pushes_sent, 21 * num_ps);
  EXPECT_EQ(st.pushes_applied, st.pushes_sent);
  EXPECT_EQ(st.pushes_rejected, 0);
  EXPECT_EQ(st.max_staleness, 0);  // one worker in lockstep: always fresh
  EXPECT_EQ(st.worker_steps, std::vector<int64_t>{21});
}

INSTANTIATE_TEST_SUITE_P(Layouts, PsEquivalence,
                         ::testing::Values(std::make_tuple(1, 1), std::make_tuple(2, 1),
                                           std::make_tuple(1, 2)));

TEST(ParameterServer, AdamOnThePsMatchesTheLocalRule) {
  ds::ParameterServerStrategy strategy(ds::ParameterServerOptions{});
  ds::Variable w =
      strategy.create_variable("w", ds::Shape{4}, ds::DType::kFloat32, ds::init::Constant{1.0});
  ds::Adam adam(strategy, {0.1f});
  for (int s = 1; s <= 5; ++s) {
    strategy.run([&](ds::ReplicaContext& ctx) {
      adam.apply_gradients(ctx, {{w.read(ctx).clone(), w}});
    });
  }
  ds::Tensor init(ds::Shape{4}, ds::DType::kFloat32);
  ds::init::Constant{1.0}(init);
  const ds::Tensor ref = ds::testing::adam_reference(adam, init, 5);
  EXPECT_LE(ds::testing::max_abs_diff(w.value(), ref), 1e-6);
}

TEST(ParameterServer, AssignAndNewVariablesBetweenStepsAreSeenByTheNextStep) {
  ds::ParameterServerStrategy strategy(ds::ParameterServerOptions{});
  ds::Variable w =
      strategy.create_variable("w", ds::Shape{3}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::SGD sgd(strategy, {1.0f});
  auto step = [&](float grad) {
    strategy.run([&](ds::ReplicaContext& ctx) {
      ds::Tensor g(ds::Shape{3}, ds::DType::kFloat32);
      ds::init::Constant{grad}(g);
      sgd.apply_gradients(ctx, {{g, w}});
    });
  };
  step(1.0f);  // w = -1, and the pull for the next step is already on its way
  ds::Tensor v(ds::Shape{3}, ds::DType::kFloat32);
  ds::init::Constant{5.0}(v);
  w.assign(v);
  // A variable created while that prefetch is in flight.
  ds::Variable u =
      strategy.create_variable("u", ds::Shape{2, 2}, ds::DType::kFloat32, ds::init::Constant{7.0});
  strategy.run([&](ds::ReplicaContext& ctx) {
    EXPECT_EQ(w.read(ctx).data<float>()[2], 5.0f);  // not the prefetched -1
    EXPECT_EQ(u.read(ctx).data<float>()[3], 7.0f);
  });
  step(2.0f);
  EXPECT_EQ(w.value().data<float>()[0], 3.0f);
  strategy.update(u, [](ds::Tensor& t) { t.data<float>()[0] = -1.0f; });
  strategy.run([&](ds::ReplicaContext& ctx) { EXPECT_EQ(u.read(ctx).data<float>()[0], -1.0f); });
}

// ---- asynchrony --------------------------------------------------------------

struct TwoWorkerRun {
  ds::ParameterServerStats fast_view;  // stats the fast worker read right after its last step
  ds::ps::ServiceStats service;        // the PS's own counters at the end
};

// Two workers (ranks 0 and 1) and a PS (rank 2). Worker 1 sleeps `slow_ms`
// per step; both run `steps` steps of SGD on a small variable.
TwoWorkerRun run_two_workers(int max_staleness, int steps, int slow_ms) {
  ds::ParameterServerOptions o;
  o.max_staleness = max_staleness;
  o.communication.timeout = std::chrono::seconds(20);
  ds::InProcessTransportGroup group(3);
  auto ps = ds::ps::make_strategy(group.at(2), o);
  TwoWorkerRun out;
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto s = ds::ps::make_strategy(group.at(r), o);
        ds::Variable w =
            s->create_variable("w", ds::Shape{16}, ds::DType::kFloat32, ds::init::Zeros{});
        ds::SGD sgd(*s, {0.01f});
        for (int i = 0; i < steps; ++i) {
          s->run([&](ds::ReplicaContext& ctx) {
            ds::Tensor g(ds::Shape{16}, ds::DType::kFloat32);
            ds::init::Constant{1.0}(g);
            sgd.apply_gradients(ctx, {{g, w}});
          });
          if (r == 1) std::this_thread::sleep_for(milliseconds(slow_ms));
        }
        s->flush();
        if (r == 0) out.fast_view = s->stats();
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  ps->join();
  out.service = ds::ps::local_service(*ps).stats();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return out;
}

TEST(ParameterServerAsync, FastWorkerIsNotHeldBackWhenUnbounded) {
  const int steps = 20;
  const TwoWorkerRun run = run_two_workers(-1, steps, 15);
  ASSERT_EQ(run.fast_view.worker_steps.size(), 2u);
  EXPECT_EQ(run.fast_view.worker_steps[0], steps);
  // The slow worker needs >= 300 ms for its steps; the fast one finished long before.
  EXPECT_LE(run.fast_view.worker_steps[1], steps / 2) << "the fast worker was held back";
  EXPECT_GE(run.service.max_step_gap, steps / 2);
  EXPECT_EQ(run.service.version, 2 * steps);
  EXPECT_EQ(run.service.worker_steps, (std::vector<int64_t>{steps, steps}));
}

TEST(ParameterServerAsync, FastWorkerIsHeldToTheStalenessBound) {
  const int steps = 12, bound = 2;
  const TwoWorkerRun run = run_two_workers(bound, steps, 10);
  ASSERT_EQ(run.fast_view.worker_steps.size(), 2u);
  EXPECT_EQ(run.fast_view.worker_steps[0], steps);
  // When the fast worker pushed its last step, the slow one was at most
  // bound + 1 behind (it may start step c only once the slowest pushed c - bound).
  EXPECT_GE(run.fast_view.worker_steps[1], steps - bound - 1);
  EXPECT_LE(run.service.max_step_gap, bound + 1);
  EXPECT_GE(run.service.max_step_gap, 1);
  EXPECT_EQ(run.service.version, 2 * steps);
}

TEST(ParameterServerAsync, LockstepWaitHasADeadlineNamingTheSlowWorker) {
  ds::ParameterServerOptions o;
  o.max_staleness = 0;
  o.communication.timeout = milliseconds(300);
  o.worker_timeout = std::chrono::seconds(20);  // worker 1 is idle on purpose
  ds::InProcessTransportGroup group(3);
  auto ps = ds::ps::make_strategy(group.at(2), o);
  std::exception_ptr other_error;
  std::atomic<bool> fast_done{false};
  std::thread other([&] {
    try {
      // Worker 1 creates the variable and then never steps until worker 0 gave up.
      auto s = ds::ps::make_strategy(group.at(1), o);
      s->create_variable("w", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
      ds::SGD sgd(*s, {0.1f});
      while (!fast_done) std::this_thread::sleep_for(milliseconds(5));
    } catch (...) {
      other_error = std::current_exception();
    }
  });
  {
    auto s = ds::ps::make_strategy(group.at(0), o);
    ds::Variable w = s->create_variable("w", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
    ds::SGD sgd(*s, {0.1f});
    auto step = [&] {
      s->run([&](ds::ReplicaContext& ctx) {
        sgd.apply_gradients(ctx, {{ds::Tensor(ds::Shape{2}, ds::DType::kFloat32), w}});
      });
    };
    step();  // step 0 may start: nobody is ahead
    const auto t0 = std::chrono::steady_clock::now();
    try {
      step();  // step 1 needs worker 1 to have pushed step 0
      FAIL() << "step 1 ran ahead of the bound";
    } catch (const ds::DeadlineExceededError& e) {
      EXPECT_NE(e.message().find("for worker 1 (at step 0, max_staleness 0)"), std::string::npos)
          << e.message();
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 3.0);
    fast_done = true;
  }
  other.join();
  ps->join();
  if (other_error) std::rethrow_exception(other_error);
}

// ---- lockstep and the staleness bound ----------------------------------------

using ds::testing::LeastSquares;
constexpr int kDim = LeastSquares::kDim;

// `workers` workers (ranks 0..workers-1) and one PS train `steps` steps of the
// least-squares model with plain SGD, each worker on its slice of every
// global batch, with random pauses (seeded by `seed`) to vary the
// interleaving. Returns the final weights.
std::vector<float> lockstep_run(const LeastSquares& b, int workers, int steps, float lr,
                                uint64_t seed) {
  ds::ParameterServerOptions o;
  o.max_staleness = 0;
  o.communication.timeout = std::chrono::seconds(30);
  ds::InProcessTransportGroup group(workers + 1);
  auto ps = ds::ps::make_strategy(group.at(workers), o);
  std::vector<float> out;
  std::vector<std::exception_ptr> errors(workers);
  std::vector<std::thread> threads;
  for (int r = 0; r < workers; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::mt19937_64 rng(seed * 31 + r);
        auto pause = [&] {
          const int us = static_cast<int>(rng() % 1500);
          if (us > 500) std::this_thread::sleep_for(std::chrono::microseconds(us));
        };
        if (r > 0) pause();  // the chief often starts first
        auto s = ds::ps::make_strategy(group.at(r), o);
        ds::Variable w = s->create_variable("w", ds::Shape{kDim}, ds::DType::kFloat32,
                                            ds::init::Constant{LeastSquares::kInit});
        ds::SGD sgd(*s, {lr});
        const int lo = LeastSquares::first_row(r, workers),
                  hi = LeastSquares::first_row(r + 1, workers);
        for (int t = 0; t < steps; ++t) {
          pause();
          s->run([&](ds::ReplicaContext& ctx) {
            const ds::Tensor wt = w.read(ctx);
            pause();
            const std::vector<float> g = b.grad(t, lo, hi, wt.data<float>());
            ds::Tensor gt(ds::Shape{kDim}, ds::DType::kFloat32);
            std::copy(g.begin(), g.end(), gt.data<float>());
            sgd.apply_gradients(ctx, {{gt, w}});
          });
        }
        s->flush();
        s->barrier("end");  // every worker's pushes are applied
        if (r == 0) {
          const ds::Tensor v = w.value();
          out.assign(v.data<float>(), v.data<float>() + kDim);
        }
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  ps->join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return out;
}

TEST(ParameterServerLockstep, MaxStalenessZeroEqualsSynchronousSgdIn20Of20Runs) {
  const int steps = 8;
  const float lr = 0.3f;
  const LeastSquares b(steps, 3);
  const std::vector<float> ref = b.synchronous_sgd(steps, lr);
  for (int workers : {2, 3}) {
    int equal = 0;
    double worst = 0;
    for (int run = 0; run < 20; ++run) {
      const std::vector<float> got = lockstep_run(b, workers, steps, lr, 1000 * workers + run);
      ASSERT_EQ(got.size(), ref.size());
      double diff = 0;
      for (int j = 0; j < kDim; ++j) diff = std::max(diff, std::fabs(double(got[j]) - ref[j]));
      worst = std::max(worst, diff);
      if (diff <= 1e-5) ++equal;
    }
    EXPECT_EQ(equal, 20) << workers << " workers: only " << equal
                         << " of 20 runs equal synchronous SGD; worst max |diff| " << worst;
  }
}

// Worker 1 creates the variable and then stays inside its step 0 until told;
// worker 0 must start exactly steps 0..k (k + 1 steps) and then wait.
class StalenessBound : public ::testing::TestWithParam<int> {};

TEST_P(StalenessBound, AWorkerRunsExactlyKStepsAheadOfAStuckOne) {
  const int k = GetParam();
  ds::ParameterServerOptions o;
  o.max_staleness = k;
  o.communication.timeout = std::chrono::seconds(30);
  ds::InProcessTransportGroup group(3);
  auto ps = ds::ps::make_strategy(group.at(2), o);
  std::atomic<int> started{0};  // steps worker 0 has started (its pull was answered)
  std::atomic<bool> release{false};
  std::exception_ptr errors[2];
  const int steps = k + 3;
  auto body = [&](int r) {
    try {
      auto s = ds::ps::make_strategy(group.at(r), o);
      ds::Variable w =
          s->create_variable("w", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
      ds::SGD sgd(*s, {0.1f});
      for (int t = 0; t < steps; ++t) {
        s->run([&](ds::ReplicaContext& ctx) {
          if (r == 0) ++started;
          if (r == 1 && t == 0) {
            while (!release) std::this_thread::sleep_for(milliseconds(2));
          }
          ds::Tensor g(ds::Shape{2}, ds::DType::kFloat32);
          ds::init::Constant{1.0}(g);
          sgd.apply_gradients(ctx, {{g, w}});
        });
      }
      s->flush();
      s->barrier("end");
    } catch (...) {
      errors[r] = std::current_exception();
    }
  };
  std::thread w0(body, 0), w1(body, 1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (started < k + 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(2));
  }
  // Give a wrong bound time to show.
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_EQ(started.load(), k + 1) << "max_staleness " << k << ": worker 0 started " << started
                                   << " steps while worker 1 was stuck in step 0";
  release = true;
  w0.join();
  w1.join();
  ps->join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  EXPECT_EQ(started.load(), steps);
  const ds::ps::ServiceStats st = ds::ps::local_service(*ps).stats();
  EXPECT_EQ(st.worker_steps, (std::vector<int64_t>{steps, steps}));
}

INSTANTIATE_TEST_SUITE_P(K, StalenessBound, ::testing::Values(0, 1, 2));

// ---- row-sparse ------------------------------------------------------------------

TEST(ParameterServerSparse, GatherAndPushOnlyTheRowsOverShards) {
  ds::ParameterServerOptions o;
  o.num_ps = 2;
  o.partitioner = pp::FixedShards{3};
  o.devices = cpu_devices(2);
  ds::ParameterServerStrategy strategy(o);
  const int64_t rows = 10, dim = 3;
  ds::Variable table = strategy.create_row_sparse_variable(
      "emb", ds::Shape{rows, dim}, ds::DType::kFloat32, ds::init::GlorotUniform{4});
  ds::Tensor expect(ds::Shape{rows, dim}, ds::DType::kFloat32);
  ds::init::GlorotUniform{4}(expect);
  ds::SGD sgd(strategy, {0.5f});
  // Replica 0 touches rows {1, 7, 1}, replica 1 rows {9, 4}: row 1 twice.
  strategy.run([&](ds::ReplicaContext& ctx) {
    std::vector<int64_t> ids =
        ctx.local_replica_id() == 0 ? std::vector<int64_t>{1, 7, 1} : std::vector<int64_t>{9, 4};
    ds::Tensor id_t(ds::Shape{static_cast<int64_t>(ids.size())}, ds::DType::kInt64);
    std::copy(ids.begin(), ids.end(), id_t.data<int64_t>());
    const ds::Tensor got = strategy.gather_rows(table, id_t);
    for (size_t k = 0; k < ids.size(); ++k) {
      for (int j = 0; j < dim; ++j) {
        EXPECT_EQ(got.data<float>()[k * dim + j], expect.data<float>()[ids[k] * dim + j]);
      }
    }
    ds::Tensor g(got.shape(), ds::DType::kFloat32);
    ds::init::Constant{1.0}(g);
    strategy.apply_gradients(ctx, sgd, {}, {{table, id_t, g}});
  });
  for (int64_t r : {1, 7, 9, 4}) {
    for (int j = 0; j < dim; ++j) expect.data<float>()[r * dim + j] -= (r == 1 ? 1.0f : 0.5f);
  }
  EXPECT_LE(ds::testing::max_abs_diff(table.value(), expect), 1e-6);
  EXPECT_THROW(strategy.run([&](ds::ReplicaContext& ctx) { table.read(ctx); }),
               ds::FailedPreconditionError);
}

// ---- bad input -----------------------------------------------------------------

// A raw worker (rank 1) that speaks the protocol directly, to send what the
// strategy's own checks would never let through.
struct RawWorker {
  explicit RawWorker(ds::Transport& t) : client(t, {2}, 1, std::chrono::seconds(10)) {
    // A stats request first, as a worker's creates come first: the PS's
    // reply tells its incarnation, which a push must carry.
    std::vector<char> reply((7 + 2) * 8);
    client.wait(client.post(0, ds::ps::Op::kStats, {}, nullptr, nullptr, 0, reply.data(),
                            reply.size(), "stats"));
  }
  void push(const ds::ps::Entry& e, const std::vector<char>& payload) {
    ds::ps::Writer w;
    w.put<int64_t>(1).put<int64_t>(-1);
    w.put<int64_t>(-1).put_string("");
    w.put<int64_t>(1);
    ds::ps::write_entry(w, e);
    auto owner = std::make_shared<std::vector<char>>(payload);
    auto call = client.post(0, ds::ps::Op::kPush, w.bytes(), owner, owner->data(), owner->size(),
                            nullptr, 0, "raw push");
    client.wait(call);
  }
  // Declares `optimizer` as the update rule of `e`'s shard.
  void rule(const ds::ps::Entry& e, const std::string& optimizer) {
    ds::ps::Writer w;
    w.put<uint8_t>(0);
    ds::ps::write_config(w, {optimizer, {}});
    w.put<int64_t>(1);
    ds::ps::write_entry(w, e);
    client.wait(
        client.post(0, ds::ps::Op::kRule, w.bytes(), nullptr, nullptr, 0, nullptr, 0, "raw rule"));
  }
  ds::ps::Client client;
};

ds::ps::Entry dense_entry(int64_t id, const std::string& name, ds::Shape shape,
                          ds::DType dtype = ds::DType::kFloat32) {
  ds::ps::Entry e;
  e.var_id = id;
  e.name = name;
  e.shape = std::move(shape);
  e.dtype = static_cast<int32_t>(dtype);
  return e;
}

void expect_error(const std::function<void()>& fn, ds::ErrorCode code, const std::string& text) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected: " << text;
  } catch (const ds::Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(e.message().find(text), std::string::npos) << e.message();
  }
}

TEST(ParameterServerBadInput, RejectedPushesReachTheWorkerAndLeaveThePsIntact) {
  ds::ParameterServerOptions o;
  o.communication.timeout = std::chrono::seconds(10);
  ds::InProcessTransportGroup group(3);  // worker 0 (strategy), worker 1 (raw), PS 2
  auto ps = ds::ps::make_strategy(group.at(2), o);
  {
    auto s = ds::ps::make_strategy(group.at(0), o);
    ds::Variable w =
        s->create_variable("w", ds::Shape{4}, ds::DType::kFloat32, ds::init::Constant{1.0});
    ds::Variable emb = s->create_row_sparse_variable("emb", ds::Shape{10, 2}, ds::DType::kFloat32,
                                                     ds::init::Constant{3.0});
    ds::SGD sgd(*s, {0.5f});
    const auto before = ds::ps::local_service(*ps).snapshot();
    RawWorker raw(group.at(1));
    const std::vector<char> f4(16), f5(20), f8(32);
    // w is variable 0, emb 1, the step counter 2.
    expect_error([&] { raw.push(dense_entry(0, "w", ds::Shape{5}), f5); },
                 ds::ErrorCode::kInvalidArgument,
                 "push to 'w' shard 0: gradient shape [5] does not match the shard's [4]");
    expect_error([&] { raw.push(dense_entry(0, "w", ds::Shape{4}, ds::DType::kFloat64), f8); },
                 ds::ErrorCode::kInvalidArgument, "push to 'w': gradient dtype float64");
    expect_error([&] { raw.push(dense_entry(7, "nope", ds::Shape{4}), f4); },
                 ds::ErrorCode::kNotFound, "unknown variable 'nope'");
    expect_error([&] { raw.rule(dense_entry(0, "w", ds::Shape{4}), "rmsprop"); },
                 ds::ErrorCode::kInvalidArgument, "unknown optimizer 'rmsprop'");
    {
      ds::ps::Entry e = dense_entry(1, "emb", ds::Shape{1, 2});
      e.sparse = 1;
      e.num_ids = 1;
      std::vector<char> payload(8 + 8);
      const int64_t id = 10;
      std::memcpy(payload.data(), &id, 8);
      expect_error([&] { raw.push(e, payload); }, ds::ErrorCode::kInvalidArgument,
                   "push to 'emb': row id 10 is out of range [0, 10)");
    }
    // The errors name the worker, the op and the PS rank.
    expect_error(
        [&] { raw.push(dense_entry(0, "w", ds::Shape{5}), f5); }, ds::ErrorCode::kInvalidArgument,
        "worker 1 (rank 1): raw push (push to PS rank 2) failed: PS rank 2: push from worker 1");
    // Nothing changed on the PS ...
    const auto after = ds::ps::local_service(*ps).snapshot();
    ASSERT_EQ(before.size(), after.size());
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_EQ(before[i].step, after[i].step);
      EXPECT_EQ(
          0, std::memcmp(before[i].value.data(), after[i].value.data(), before[i].value.nbytes()));
    }
    // ... and it keeps serving worker 0.
    s->run([&](ds::ReplicaContext& ctx) {
      ds::Tensor g(ds::Shape{4}, ds::DType::kFloat32);
      ds::init::Constant{1.0}(g);
      sgd.apply_gradients(ctx, {{g, w}});
    });
    EXPECT_EQ(w.value().data<float>()[0], 0.5f);
    // The strategy's own checks catch the same mistakes before sending.
    ds::Tensor bad_ids(ds::Shape{1}, ds::DType::kInt64);
    bad_ids.data<int64_t>()[0] = 10;
    expect_error([&] { s->gather_rows(emb, bad_ids); }, ds::ErrorCode::kInvalidArgument,
                 "gather_rows of 'emb': row id 10 is out of range [0, 10)");
    expect_error(
        [&] {
          s->run([&](ds::ReplicaContext& ctx) {
            sgd.apply_gradients(ctx, {{ds::Tensor(ds::Shape{5}, ds::DType::kFloat32), w}});
          });
        },
        ds::ErrorCode::kInvalidArgument, "does not match variable 'w'");
    const ds::ParameterServerStats st = s->stats();
    EXPECT_EQ(st.pushes_rejected,
              5);  // the unknown optimizer is a rule declaration now, not a push
    EXPECT_EQ(st.pushes_applied, 1);
    // The raw worker leaves too, so the PS can finish.
    auto done = raw.client.post(0, ds::ps::Op::kDone, {}, nullptr, nullptr, 0, nullptr, 0, "done");
    raw.client.wait(done);
  }
  ps->join();
}

TEST(ParameterServerBadInput, ErrorOfANonBlockingPushSurfacesAtTheNextStep) {
  ds::ParameterServerStrategy strategy(ds::ParameterServerOptions{});
  ds::Variable w =
      strategy.create_variable("w", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::SGD sgd(strategy, {0.1f});
  auto step = [&] {
    strategy.run([&](ds::ReplicaContext& ctx) {
      ds::Tensor g(ds::Shape{2}, ds::DType::kFloat32);
      ds::init::Constant{1.0}(g);
      sgd.apply_gradients(ctx, {{g, w}});
    });
  };
  step();
  // Rename the variable on the worker side only: the PS rejects the next
  // push, which the worker sent without waiting ...
  w.impl().name = "renamed";
  step();
  // ... so the rejection is raised when the worker next waits on the PS.
  expect_error(step, ds::ErrorCode::kInvalidArgument,
               "push of step 1 (push to PS rank 1) failed: PS rank 1: push from worker 0: push: "
               "variable id 0 is 'w' here, not 'renamed'");
  w.impl().name = "w";
  step();  // the worker recovers; the rejected push changed nothing
  EXPECT_NEAR(w.value().data<float>()[0], -0.2f, 1e-6);
  EXPECT_EQ(strategy.stats().pushes_rejected, 1);
}

// ---- job-wide figures: reduce() is per worker, metrics are job-wide -----------

// Three workers with two replicas each and two PS ranks. Every replica's
// "loss" is 1 + worker index; reduce() gives this worker's replicas' figure,
// the metric on PS 0 every worker's.
TEST(ParameterServerMetrics, ReduceIsPerWorkerAndTheMetricIsJobWide) {
  const int workers = 3, num_ps = 2, steps = 5;
  ds::ParameterServerOptions o;
  o.num_ps = num_ps;
  o.devices = cpu_devices(2);
  o.communication.timeout = std::chrono::seconds(30);
  ds::InProcessTransportGroup group(workers + num_ps);
  std::vector<std::unique_ptr<ds::ParameterServerStrategy>> ps;
  for (int p = 0; p < num_ps; ++p) ps.push_back(ds::ps::make_strategy(group.at(workers + p), o));
  std::vector<std::exception_ptr> errors(workers);
  std::vector<ds::MetricTotals> seen(workers);
  std::vector<std::thread> threads;
  for (int r = 0; r < workers; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto s = ds::ps::make_strategy(group.at(r), o);
        EXPECT_EQ(s->num_replicas_in_sync(), 2 * workers);
        ds::Variable w =
            s->create_variable("w", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
        for (int t = 0; t < steps; ++t) {
          // {loss sum, rows} per replica, as the examples return them.
          ds::PerReplica<ds::Tensor> loss = s->run([&](ds::ReplicaContext&) {
            ds::Tensor v(ds::Shape{2}, ds::DType::kFloat64);
            v.data<double>()[0] = 1.0 + r;
            v.data<double>()[1] = 4;  // rows of this replica
            return v;
          });
          const ds::Tensor local = s->reduce(ds::ReduceOp::kSum, loss);
          EXPECT_EQ(local.data<double>()[0], 2.0 * (1 + r));  // this worker's two replicas
          EXPECT_EQ(local.data<double>()[1], 8.0);
          const ds::Tensor mean = s->reduce(ds::ReduceOp::kMean, loss);
          EXPECT_EQ(mean.data<double>()[0], 1.0 + r)
              << "kMean of tensors divides by the local replicas";
          ds::PerReplica<double> scalar = s->run([&](ds::ReplicaContext&) { return 1.0 + r; });
          EXPECT_EQ(s->reduce(ds::ReduceOp::kMean, scalar), 1.0 + r);
          s->add_to_metric("train/loss", local.data<double>()[0], local.data<double>()[1]);
        }
        // A worker sees its own additions at once.
        EXPECT_GE(s->read_metric("train/loss").count, steps * 8.0);
        s->barrier("added");
        seen[r] = s->read_metric("train/loss");
        EXPECT_EQ(s->read_metric("nobody added").count, 0.0);
        s->barrier("read");
        (void)w;
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& p : ps) p->join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  // Every worker's every step: sum 5 * 2 * (1 + 2 + 3), count 5 * 3 * 8.
  for (int r = 0; r < workers; ++r) {
    EXPECT_EQ(seen[r].sum, steps * 2.0 * (1 + 2 + 3)) << "worker " << r;
    EXPECT_EQ(seen[r].count, steps * 8.0 * workers) << "worker " << r;
    EXPECT_DOUBLE_EQ(seen[r].mean(), 2.0 * 6 / 24.0);
  }
}

TEST(ParameterServerMetrics, BadAdditionsAreRejectedAndChangeNothing) {
  ds::ParameterServerOptions o;
  o.communication.timeout = std::chrono::seconds(10);
  ds::InProcessTransportGroup group(3);  // worker 0 (strategy), worker 1 (raw), PS 2
  auto ps = ds::ps::make_strategy(group.at(2), o);
  {
    auto s = ds::ps::make_strategy(group.at(0), o);
    s->add_to_metric("m", 3.0, 2.0);
    expect_error([&] { s->add_to_metric("m", 1.0, -1.0); }, ds::ErrorCode::kInvalidArgument,
                 "worker 0: add_to_metric 'm': count -1 is not a finite number >= 0");
    RawWorker raw(group.at(1));
    auto metric = [&](const std::string& name, double sum, double count) {
      ds::ps::Writer w;
      w.put_string(name).put<double>(sum).put<double>(count);
      auto call = raw.client.post(0, ds::ps::Op::kMetric, w.bytes(), nullptr, nullptr, 0, nullptr,
                                  0, "raw metric");
      raw.client.wait(call);
    };
    expect_error([&] { metric("m", 1.0, std::nan("")); }, ds::ErrorCode::kInvalidArgument,
                 "metric 'm': count nan is not a finite number >= 0");
    expect_error([&] { metric(std::string(300, 'x'), 1.0, 1.0); }, ds::ErrorCode::kInvalidArgument,
                 "a name of 300 characters (1 to 256)");
    expect_error([&] { metric("", 1.0, 1.0); }, ds::ErrorCode::kInvalidArgument,
                 "a name of 0 characters");
    metric("m", 1.0, 1.0);
    const ds::MetricTotals t = s->read_metric("m");
    EXPECT_EQ(t.sum, 4.0);
    EXPECT_EQ(t.count, 3.0);
    auto done = raw.client.post(0, ds::ps::Op::kDone, {}, nullptr, nullptr, 0, nullptr, 0, "done");
    raw.client.wait(done);
  }
  ps->join();
  EXPECT_THROW(ps->add_to_metric("m", 1.0), ds::FailedPreconditionError);
}

// ---- checkpoints -------------------------------------------------------------------

TEST(ParameterServer, ShardsSnapshotAndARestartedJobResumes) {
  ds::ParameterServerOptions o;
  std::vector<ds::ShardSnapshot> saved;
  ds::Tensor trained;
  {
    ds::InProcessTransportGroup group(2);
    auto ps = ds::ps::make_strategy(group.at(1), o);
    {
      auto s = ds::ps::make_strategy(group.at(0), o);
      ds::Variable w =
          s->create_variable("w", ds::Shape{3}, ds::DType::kFloat32, ds::init::Zeros{});
      ds::SGD sgd(*s, {0.1f, 0.9f});
      for (int i = 0; i < 3; ++i) {
        s->run([&](ds::ReplicaContext& ctx) {
          ds::Tensor g(ds::Shape{3}, ds::DType::kFloat32);
          ds::init::Constant{1.0}(g);
          sgd.apply_gradients(ctx, {{g, w}});
        });
      }
      trained = w.value();
    }
    ps->join();
    saved = ps->local_shards();
  }
  ds::InProcessTransportGroup group(2);
  auto ps = ds::ps::make_strategy(group.at(1), o);
  ps->restore_local_shards(saved);
  {
    auto s = ds::ps::make_strategy(group.at(0), o);
    ds::Variable w = s->create_variable("w", ds::Shape{3}, ds::DType::kFloat32, ds::init::Zeros{});
    ds::SGD sgd(*s, {0.1f, 0.9f});
    EXPECT_EQ(0, std::memcmp(w.value().data(), trained.data(), 12));
    EXPECT_EQ(sgd.iterations().value().data<int64_t>()[0], 3);
  }
  ps->join();
  const auto shards = ps->local_shards();
  for (const auto& s : shards) {
    if (s.variable == "w") {
      EXPECT_EQ(s.step, 3);
      EXPECT_EQ(s.slots.count("momentum"), 1u);
    }
  }
}

TEST(ParameterServer, RolesAndMisuse) {
  ds::ParameterServerOptions o;
  o.num_ps = 2;
  ds::InProcessTransportGroup group(3);
  auto ps = ds::ps::make_strategy(group.at(2), o);
  EXPECT_TRUE(ps->is_ps());
  EXPECT_EQ(ps->cluster().task_type, "ps");
  EXPECT_EQ(ps->cluster().task_index, 1);
  EXPECT_EQ(ps->cluster().worker_index, -1);  // runs no replicas, as resolve_cluster() says
  EXPECT_FALSE(ps->cluster().is_chief());
  EXPECT_THROW(ps->create_variable("x", ds::Shape{1}, ds::DType::kFloat32, ds::init::Zeros{}),
               ds::FailedPreconditionError);
  ds::ParameterServerOptions bad;
  bad.num_ps = 3;
  EXPECT_THROW(ds::ps::make_strategy(group.at(0), bad), ds::InvalidArgumentError);
  // ps is destroyed without join(): its loop is stopped, not waited for.
}

}  // namespace
