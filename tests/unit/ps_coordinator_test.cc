// ClusterCoordinator (diststrat/cluster_coordinator.h): the registry, the
// tensor encoding, and in-process jobs (ranks as threads: the coordinator,
// serving workers and a PS) whose results must each arrive exactly once.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "allreduce/transport.h"
#include "diststrat/diststrat.h"
#include "parameter_server/strategy_impl.h"

namespace ds = diststrat;
using std::chrono::milliseconds;

namespace {

ds::Bytes int_bytes(int64_t v) {
  ds::Bytes b(sizeof v);
  std::memcpy(b.data(), &v, sizeof v);
  return b;
}

int64_t bytes_int(const ds::Bytes& b) {
  EXPECT_EQ(b.size(), sizeof(int64_t));
  int64_t v = 0;
  if (b.size() == sizeof v) std::memcpy(&v, b.data(), sizeof v);
  return v;
}

}  // namespace

TEST(PsCoordinator, RegistryRefusesDuplicatesEmptyAndUnknownNames) {
  ds::FunctionRegistry fns;
  fns.register_function("step", [](ds::ParameterServerStrategy&, const ds::Bytes& a) { return a; });
  EXPECT_TRUE(fns.contains("step"));
  EXPECT_EQ(fns.names(), std::vector<std::string>{"step"});
  EXPECT_THROW(fns.register_function(
                   "step", [](ds::ParameterServerStrategy&, const ds::Bytes& a) { return a; }),
               ds::InvalidArgumentError);
  EXPECT_THROW(
      fns.register_function("", [](ds::ParameterServerStrategy&, const ds::Bytes& a) { return a; }),
      ds::InvalidArgumentError);
  EXPECT_THROW(fns.register_function("x", nullptr), ds::InvalidArgumentError);
  try {
    fns.at("nope");
    FAIL() << "an unknown function was found";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("'nope' is not registered"), std::string::npos)
        << e.what();
  }
}

TEST(PsCoordinator, TensorsRoundTripAndBadBytesAreRefused) {
  ds::Tensor a(ds::Shape{2, 3}, ds::DType::kFloat32);
  for (int i = 0; i < 6; ++i) a.data<float>()[i] = 0.5f * i;
  ds::Tensor b(ds::Shape{}, ds::DType::kInt64);
  b.data<int64_t>()[0] = -7;
  ds::Tensor empty(ds::Shape{0, 4}, ds::DType::kFloat64);
  const ds::Bytes bytes = ds::encode_tensors({a, b, empty});
  const std::vector<ds::Tensor> back = ds::decode_tensors(bytes);
  ASSERT_EQ(back.size(), 3u);
  EXPECT_EQ(back[0].shape(), a.shape());
  EXPECT_EQ(back[0].dtype(), ds::DType::kFloat32);
  EXPECT_EQ(0, std::memcmp(back[0].data(), a.data(), a.nbytes()));
  EXPECT_EQ(back[1].data<int64_t>()[0], -7);
  EXPECT_EQ(back[2].shape(), empty.shape());
  EXPECT_TRUE(ds::decode_tensors(ds::encode_tensors({})).empty());
  ds::Bytes short_bytes(bytes.begin(), bytes.end() - 1);
  EXPECT_THROW(ds::decode_tensors(short_bytes), ds::InvalidArgumentError);
  ds::Bytes long_bytes = bytes;
  long_bytes.push_back(0);
  EXPECT_THROW(ds::decode_tensors(long_bytes), ds::InvalidArgumentError);
  EXPECT_THROW(ds::decode_tensors(ds::Bytes(5, 'x')), ds::InvalidArgumentError);
  ds::Bytes huge = ds::encode_tensors({a});
  int64_t big = int64_t{1} << 40;  // the first dimension
  std::memcpy(huge.data() + 8 + 8 + 4 + 4, &big, sizeof big);
  EXPECT_THROW(ds::decode_tensors(huge), ds::InvalidArgumentError);
}

namespace {

// An in-process job: workers 0 (the coordinator) .. workers-1 and one PS
// (the last rank). Every worker registers "twice" (pushes a gradient of 1
// to w, returns 2 x its argument) and "throw" (throws when the argument is
// negative). `stall_index` (a serving worker, or -1) sleeps `stall_ms` in
// its first call, past the coordinator's function_timeout: a stopped worker
// that comes back; after its push, or before it (`stall_before_push`).
struct JobResult {
  std::vector<int64_t> results;
  ds::CoordinatorStats stats;
  int64_t runs = 0;            // pushes of "twice" that returned, on every worker (effects)
  int64_t pushes_applied = 0;  // by the PS
  float w_after = 0;
  std::string join_error;
};

JobResult run_job(int workers, int functions, int stall_index, int stall_ms,
                  milliseconds function_timeout, bool with_error = false,
                  bool stall_before_push = false, int max_attempts = 4) {
  ds::ParameterServerOptions o;
  o.communication.timeout = std::chrono::seconds(20);
  ds::InProcessTransportGroup group(workers + 1);
  auto ps = ds::ps::make_strategy(group.at(workers), o);
  JobResult out;
  std::atomic<int64_t> runs{0};
  std::vector<std::exception_ptr> errors(workers);
  std::vector<std::thread> threads;
  for (int r = 0; r < workers; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto s = ds::ps::make_strategy(group.at(r), o);
        ds::Variable w =
            s->create_variable("w", ds::Shape{4}, ds::DType::kFloat32, ds::init::Zeros{});
        ds::SGD sgd(*s, {0.5f});
        bool stalled = false;
        ds::FunctionRegistry fns;
        fns.register_function("twice", [&](ds::ParameterServerStrategy& st, const ds::Bytes& a) {
          if (r == stall_index && !stalled && stall_before_push) {
            stalled = true;
            std::this_thread::sleep_for(milliseconds(stall_ms));
          }
          st.run([&](ds::ReplicaContext& ctx) {
            ds::Tensor g(ds::Shape{4}, ds::DType::kFloat32);
            ds::init::Constant{1.0}(g);
            sgd.apply_gradients(ctx, {{g, w}});
          });
          st.flush();
          ++runs;
          if (r == stall_index && !stalled) {
            stalled = true;
            std::this_thread::sleep_for(milliseconds(stall_ms));
          }
          return int_bytes(2 * bytes_int(a));
        });
        fns.register_function("throw", [&](ds::ParameterServerStrategy&, const ds::Bytes& a) {
          if (bytes_int(a) == -2) throw 42;  // not a std::exception
          if (bytes_int(a) < 0) throw ds::InvalidArgumentError("negative argument");
          return a;
        });
        ds::CoordinatorOptions co;
        co.function_timeout = function_timeout;
        co.timeout = std::chrono::seconds(20);
        co.max_attempts = max_attempts;
        ds::ClusterCoordinator coordinator(*s, fns, co);
        if (!coordinator.is_coordinator()) {
          EXPECT_THROW(coordinator.schedule("twice", int_bytes(1)), ds::FailedPreconditionError);
          coordinator.serve();
          return;
        }
        EXPECT_THROW(coordinator.serve(), ds::FailedPreconditionError);
        EXPECT_THROW(coordinator.schedule("unknown"), ds::InvalidArgumentError);
        coordinator.declare_update_rule(sgd);
        std::vector<ds::RemoteValue> values;
        for (int i = 0; i < functions; ++i)
          values.push_back(coordinator.schedule("twice", int_bytes(i)));
        if (with_error) {
          ds::RemoteValue bad = coordinator.schedule("throw", int_bytes(-1));
          ds::RemoteValue odd = coordinator.schedule("throw", int_bytes(-2));
          try {
            coordinator.join();
          } catch (const ds::Error& e) {
            out.join_error = e.what();
          }
          EXPECT_TRUE(coordinator.done());  // the error was raised once, then forgotten
          EXPECT_THROW(bad.fetch(), ds::InvalidArgumentError);
          // Something that is not a std::exception fails its function, not the worker.
          try {
            odd.fetch();
            ADD_FAILURE() << "a function that threw 42 delivered a result";
          } catch (const ds::InternalError& e) {
            EXPECT_NE(std::string(e.what()).find("threw something that is not a std::exception"),
                      std::string::npos)
                << e.what();
          }
        } else if (max_attempts == 1) {
          try {
            coordinator.join();
          } catch (const ds::Error& e) {
            out.join_error = e.what();
          }
        } else {
          coordinator.join();
        }
        EXPECT_TRUE(coordinator.done());
        for (const ds::RemoteValue& v : values) {
          try {
            out.results.push_back(bytes_int(v.fetch()));
          } catch (const ds::UnavailableError&) {
            if (max_attempts != 1) throw;
            out.results.push_back(-1);  // lost max_attempts times
          }
        }
        // A stalled worker's late result comes after join: wait for it.
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (stall_index >= 0 && coordinator.stats().late_results_refused == 0 &&
               std::chrono::steady_clock::now() < until) {
          std::this_thread::sleep_for(milliseconds(10));
        }
        out.stats = coordinator.stats();
        out.w_after = w.value().data<float>()[0];
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
  out.runs = runs;
  out.pushes_applied = ds::ps::local_service(*ps).stats().version;
  return out;
}

}  // namespace

TEST(PsCoordinator, EveryResultArrivesOnceOverTwoServingWorkers) {
  const int n = 12;
  const JobResult r = run_job(3, n, -1, 0, std::chrono::seconds(20));
  ASSERT_EQ(r.results.size(), static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) EXPECT_EQ(r.results[i], 2 * i);
  EXPECT_EQ(r.stats.scheduled, n);
  EXPECT_EQ(r.stats.results_delivered, n);
  EXPECT_EQ(r.stats.reruns, 0);
  EXPECT_EQ(r.stats.late_results_refused, 0);
  EXPECT_EQ(r.runs, n);
  // Every run pushed a gradient of 1 with learning rate 0.5.
  EXPECT_FLOAT_EQ(r.w_after, -0.5f * n);
}

// A serving worker that stops answering for longer than function_timeout
// (as a SIGSTOPped one does) loses its attempt: the function runs again on
// the other worker, the late result is refused, each result arrives once;
// the function's effects landed twice (counted in runs).
TEST(PsCoordinator, AStalledWorkersFunctionRunsAgainAndItsLateResultIsRefused) {
  const int n = 8;
  const JobResult r = run_job(3, n, /*stall_index=*/1, /*stall_ms=*/1500, milliseconds(500));
  ASSERT_EQ(r.results.size(), static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) EXPECT_EQ(r.results[i], 2 * i);
  EXPECT_EQ(r.stats.scheduled, n);
  EXPECT_EQ(r.stats.results_delivered, n);
  EXPECT_GE(r.stats.reruns, 1);
  EXPECT_GE(r.stats.late_results_refused, 1);
  EXPECT_EQ(r.stats.attempts, n + r.stats.reruns);
  EXPECT_GE(r.runs, n + 1) << "the stalled attempt's push landed too (effects at least once)";
  ASSERT_FALSE(r.stats.lost_workers.empty());
  EXPECT_EQ(r.stats.lost_workers[0], 1);
}

// The same stall before the function's push: when the worker runs again the
// coordinator has fenced its attempt, so run() posts no push for it; the
// function's effects land exactly once (before fencing, the stalled
// attempt's push landed too: pushes = n + 1).
TEST(PsCoordinator, AFencedAttemptPostsNoPushWhenItsWorkerRunsAgain) {
  const int n = 6;
  const JobResult r = run_job(3, n, /*stall_index=*/1, /*stall_ms=*/2000, milliseconds(800),
                              /*with_error=*/false, /*stall_before_push=*/true);
  ASSERT_EQ(r.results.size(), static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) EXPECT_EQ(r.results[i], 2 * i);
  EXPECT_EQ(r.stats.results_delivered, n);
  EXPECT_GE(r.stats.reruns, 1);
  EXPECT_GE(r.stats.late_results_refused, 1);
  EXPECT_EQ(r.runs, n);
  EXPECT_EQ(r.pushes_applied, n) << "the fenced attempt's push landed";
  EXPECT_FLOAT_EQ(r.w_after, -0.5f * n);
}

TEST(PsCoordinator, AFunctionsErrorIsRaisedByJoinNamingFunctionAndWorker) {
  const JobResult r = run_job(2, 3, -1, 0, std::chrono::seconds(20), /*with_error=*/true);
  EXPECT_NE(r.join_error.find("function 'throw'"), std::string::npos) << r.join_error;
  EXPECT_NE(r.join_error.find("on worker 1 (rank 1)"), std::string::npos) << r.join_error;
  EXPECT_NE(r.join_error.find("negative argument"), std::string::npos) << r.join_error;
  EXPECT_EQ(r.stats.failed, 2);
  EXPECT_EQ(r.stats.results_delivered, 3);
}

TEST(PsCoordinator, AJobWithoutAServingWorkerIsRefused) {
  ds::ParameterServerOptions o;
  o.communication.timeout = std::chrono::seconds(10);
  ds::InProcessTransportGroup group(2);
  auto ps = ds::ps::make_strategy(group.at(1), o);
  {
    auto s = ds::ps::make_strategy(group.at(0), o);
    ds::FunctionRegistry fns;
    EXPECT_THROW({ ds::ClusterCoordinator c(*s, fns); }, ds::FailedPreconditionError);
    ds::FunctionRegistry none;
    EXPECT_THROW({ ds::ClusterCoordinator c(*ps, none); }, ds::FailedPreconditionError);
  }
  ps->join();
}

// A function lost max_attempts times fails with UnavailableError naming it
// and the worker that lost it; the others' results arrive.
TEST(PsCoordinator, AFunctionLostMaxAttemptsTimesFailsNamingItsWorkers) {
  const int n = 4;
  const JobResult r = run_job(3, n, /*stall_index=*/1, /*stall_ms=*/1500, milliseconds(500), false,
                              false, /*max_attempts=*/1);
  EXPECT_NE(r.join_error.find("[kUnavailable]"), std::string::npos) << r.join_error;
  EXPECT_NE(r.join_error.find("function 'twice'"), std::string::npos) << r.join_error;
  EXPECT_NE(r.join_error.find("was lost 1 times: worker 1 (rank 1): no answer within "
                              "function_timeout"),
            std::string::npos)
      << r.join_error;
  EXPECT_EQ(r.stats.failed, 1);
  EXPECT_EQ(r.stats.reruns, 0);
  EXPECT_EQ(r.stats.results_delivered, n - 1);
  ASSERT_EQ(r.results.size(), static_cast<size_t>(n));
  EXPECT_EQ(std::count(r.results.begin(), r.results.end(), -1), 1);
}

// The coordinator's failure ends the job: a serving worker that hears
// nothing for `timeout` fails naming the coordinator's rank (here worker 0
// never makes its coordinator, as if it had died).
TEST(PsCoordinator, AServingWorkerWhoseCoordinatorIsSilentFailsNamingIt) {
  ds::ParameterServerOptions o;
  o.communication.timeout = std::chrono::seconds(10);
  ds::InProcessTransportGroup group(3);
  auto ps = ds::ps::make_strategy(group.at(2), o);
  std::string error;
  std::thread coordinator_rank([&] {
    auto s = ds::ps::make_strategy(group.at(0), o);
    std::this_thread::sleep_for(milliseconds(800));
  });
  {
    auto s = ds::ps::make_strategy(group.at(1), o);
    ds::FunctionRegistry fns;
    ds::CoordinatorOptions co;
    co.timeout = milliseconds(300);
    ds::ClusterCoordinator c(*s, fns, co);
    try {
      c.serve();
    } catch (const ds::DeadlineExceededError& e) {
      error = e.what();
    }
  }
  coordinator_rank.join();
  ps->join();
  EXPECT_NE(error.find("serve on worker 1 (rank 1): the coordinator (rank 0) sent nothing"),
            std::string::npos)
      << error;
}

// A PS that fails fails the functions that need it: join() raises the error
// naming the PS and its reason (the job then ends, as any PS job does).
TEST(PsCoordinator, APsFailureFailsTheFunctionsAndJoinNamesThePs) {
  ds::ParameterServerOptions o;
  o.communication.timeout = std::chrono::seconds(10);
  ds::InProcessTransportGroup group(3);  // coordinator 0, worker 1, PS 2
  auto ps = ds::ps::make_strategy(group.at(2), o);
  std::string before, after;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto s = ds::ps::make_strategy(group.at(r), o);
        ds::Variable w =
            s->create_variable("w", ds::Shape{4}, ds::DType::kFloat32, ds::init::Zeros{});
        ds::SGD sgd(*s, {0.5f});
        ds::FunctionRegistry fns;
        fns.register_function("push", [&](ds::ParameterServerStrategy& st, const ds::Bytes& a) {
          st.run([&](ds::ReplicaContext& ctx) {
            ds::Tensor g(ds::Shape{4}, ds::DType::kFloat32);
            ds::init::Constant{1.0}(g);
            sgd.apply_gradients(ctx, {{g, w}});
          });
          st.flush();
          return a;
        });
        ds::CoordinatorOptions co;
        co.timeout = std::chrono::seconds(10);
        ds::ClusterCoordinator c(*s, fns, co);
        if (!c.is_coordinator()) {
          c.serve();
          return;
        }
        c.declare_update_rule(sgd);
        c.schedule("push", int_bytes(1));
        c.join();
        before = "joined";
        ds::ps::local_service(*ps).fail("its disk is full");
        c.schedule("push", int_bytes(2));
        try {
          c.join();
        } catch (const ds::Error& e) {
          after = e.what();
        }
      } catch (const ds::Error&) {
        // The workers' ends after the PS failed may throw; the test reads `after`.
      }
    });
  }
  for (auto& t : threads) t.join();
  try {
    ps->join();
  } catch (const ds::Error&) {
  }
  EXPECT_EQ(before, "joined");
  EXPECT_NE(after.find("function 'push'"), std::string::npos) << after;
  EXPECT_NE(after.find("PS rank 2"), std::string::npos) << after;
  EXPECT_NE(after.find("its disk is full"), std::string::npos) << after;
}
