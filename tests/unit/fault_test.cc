// The fault matrix in one process: each strategy trains a small MLP, saving a
// checkpoint after every step, while one replica misbehaves at step 3
// (throw, stall, corrupt message; exit in a forked child). The others must end
// within the deadline + 10 s with an error naming the rank and the step, and
// the last checkpoint must still load. Multi-worker runs two workers as
// threads (an InProcessGroup as the cross-worker communicator).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <vector>
#include <string>
#include <thread>

#include "checkpoint_util.h"
#include "fault_util.h"
#include "core/thread_pool.h"
#include "diststrat/diststrat.h"
#include "diststrat/multi_worker_mirrored.h"
#include "harness.h"
#include "parameter_server/strategy_impl.h"
#include "../common/temp_dir.h"

namespace ds = diststrat;
using std::chrono::milliseconds;

namespace {

constexpr auto kTimeout = milliseconds(2000);
constexpr int kFaultStep = 3;

using diststrat_test::temp_dir;
constexpr char kFaultTempPrefix[] =
    "diststrat-fault-";  // removed at exit (tests/common/temp_dir.h)

struct Result {
  std::string error;        // "" if training finished
  int64_t fault_step = -1;  // the strategy step (steps_run()) the fault was armed for
};

// Trains 6 batches under `s`, saving a checkpoint after each into `dir` (every
// process calls save; the strategy decides who writes) unless `dir` is empty,
// with the fault armed for the run() of batch kFaultStep.
Result train(ds::Strategy& s, ds::FaultKind kind, int rank, const std::string& dir, int seed) {
  ds::nn::Mlp mlp({8, 5, 3});
  std::vector<ds::Variable> vars = mlp.create_variables(s, seed);
  ds::SGD opt(s, {0.1f, 0.9f});
  ds::Tensor x(ds::Shape{96, 8}, ds::DType::kFloat32), y(ds::Shape{96}, ds::DType::kInt32);
  ds::init::RandomNormal{0, 1, 5}(x);
  for (int i = 0; i < 96; ++i) y.data<int32_t>()[i] = i % 3;
  ds::DistributedDataset dist = s.distribute(ds::Dataset(x, y), 16, {false, 0, false});
  ds::Checkpoint ckpt(s, {&opt});
  std::unique_ptr<ds::CheckpointManager> manager;
  if (!dir.empty())
    manager = std::make_unique<ds::CheckpointManager>(ckpt, dir, ds::CheckpointManagerOptions{2});
  int step = 0;
  Result result;
  try {
    for (const ds::DistributedBatch& batch : dist) {
      if (step == kFaultStep) result.fault_step = ds::testing::arm_fault_at_next_run(s, kind, rank);
      ds::testing::mlp_step(s, mlp, vars, opt, batch);
      if (manager) manager->save(step, {{"step", std::to_string(step)}});
      ++step;
    }
  } catch (const ds::Error& e) {
    result.error = e.message();
  }
  return result;
}

void expect_names_rank_and_step(const std::string& msg, int rank, int64_t step) {
  std::printf("  error: %s\n", msg.c_str());
  EXPECT_NE(msg.find("step " + std::to_string(step)), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank " + std::to_string(rank)), std::string::npos) << msg;
}

// The newest checkpoint is the last step before the fault, and loads.
void expect_checkpoint_loads(const std::string& dir, int64_t last_step) {
  std::ifstream in(dir + "/latest");  // what CheckpointManager::latest() reads
  std::string name;
  ASSERT_TRUE(std::getline(in, name)) << dir;
  const ds::SafetensorsFile file = ds::load_safetensors(dir + "/" + name);
  EXPECT_TRUE(file.verified);
  EXPECT_EQ(file.metadata.at("step"), std::to_string(last_step));
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::unique_ptr<ds::Strategy> make_local(const std::string& which) {
  const std::vector<ds::Device> devices = {ds::Device::cpu(0), ds::Device::cpu(1)};
  if (which == "mirrored") {
    ds::MirroredOptions o;
    o.devices = devices;
    o.communication.timeout = kTimeout;
    return std::make_unique<ds::MirroredStrategy>(o);
  }
  ds::CentralStorageOptions o;
  o.devices = devices;
  o.communication.timeout = kTimeout;
  return std::make_unique<ds::CentralStorageStrategy>(o);
}

struct Cell {
  std::string strategy;
  ds::FaultKind kind;
};
std::string cell_name(const ::testing::TestParamInfo<Cell>& info) {
  return info.param.strategy + "_" + ds::fault_kind_name(info.param.kind);
}

class LocalFault : public ::testing::TestWithParam<Cell> {};

TEST_P(LocalFault, SurvivorsFailWithinTheDeadlineNamingRankAndStep) {
  const std::string dir = temp_dir(kFaultTempPrefix);
  auto s = make_local(GetParam().strategy);
  const auto t0 = std::chrono::steady_clock::now();
  const Result r = train(*s, GetParam().kind, 1, dir, 3);
  EXPECT_LT(seconds_since(t0), std::chrono::duration<double>(kTimeout).count() + 10.0);
  ASSERT_FALSE(r.error.empty()) << "the fault did not fail the step";
  expect_names_rank_and_step(r.error, 1, r.fault_step);
  expect_checkpoint_loads(dir, kFaultStep - 1);
  s.reset();  // a stalled replica's thread is detached, not joined
}

INSTANTIATE_TEST_SUITE_P(Fault, LocalFault,
                         ::testing::Values(Cell{"mirrored", ds::FaultKind::kThrow},
                                           Cell{"mirrored", ds::FaultKind::kStall},
                                           Cell{"mirrored", ds::FaultKind::kCorrupt},
                                           Cell{"central_storage", ds::FaultKind::kThrow},
                                           Cell{"central_storage", ds::FaultKind::kStall},
                                           Cell{"central_storage", ds::FaultKind::kCorrupt}),
                         cell_name);

// exit ends the whole process (in one process there are no survivors): the
// child exits with the fault's code at step 3 and the checkpoint of step 2 loads.
TEST(FaultExit, ProcessExitsAtTheStepAndTheLastCheckpointLoads) {
  // "fast" (fork) so the child writes to the directory made here.
  ::testing::FLAGS_gtest_death_test_style = "fast";
  for (const std::string which : {"mirrored", "central_storage"}) {
    const std::string dir = temp_dir(kFaultTempPrefix);
    EXPECT_EXIT(
        {
          auto s = make_local(which);
          train(*s, ds::FaultKind::kExit, 1, dir, 3);
          std::_Exit(0);
        },
        ::testing::ExitedWithCode(17), "")
        << which;
    expect_checkpoint_loads(dir, kFaultStep - 1);
  }
}

class MultiWorkerFault : public ::testing::TestWithParam<ds::FaultKind> {};

// Two workers with one replica each; worker 1 (replica 1) misbehaves. Worker 0
// must fail within the deadline naming rank 1 and the step; worker 1's own
// run() fails too unless it is stalled (then it stays stuck, as a hung
// process would until its launcher kills it).
TEST_P(MultiWorkerFault, TheOtherWorkerFailsWithinTheDeadlineNamingRankAndStep) {
  const std::string dir = temp_dir(kFaultTempPrefix);
  ds::CommunicationOptions co;
  co.timeout = kTimeout;
  // A stalled worker keeps using the group for good: it outlives the test then.
  auto* group = new ds::InProcessGroup(2, co);
  std::vector<Result> res(2);
  std::vector<ds::MultiWorkerMirroredStrategy*> strategies(2);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      ds::MultiWorkerOptions o;
      o.devices = {ds::Device::cpu(0)};
      o.communicator = &group->at(w);
      o.communication.timeout = kTimeout;
      strategies[w] = new ds::MultiWorkerMirroredStrategy(o);
      res[w] = train(*strategies[w], GetParam(), 1, dir, 3);
      if (res[w].error.empty()) res[w].error = "(no error)";
    });
  }
  const bool stall = GetParam() == ds::FaultKind::kStall;
  threads[0].join();
  if (stall) {
    threads[1].detach();
  } else {
    threads[1].join();
  }
  EXPECT_LT(seconds_since(t0), std::chrono::duration<double>(kTimeout).count() + 10.0);
  expect_names_rank_and_step(res[0].error, 1, res[0].fault_step);
  std::printf("worker 0: %s\nworker 1: %s\n", res[0].error.c_str(), res[1].error.c_str());
  if (!stall) {
    EXPECT_NE(res[1].error.find("step " + std::to_string(res[1].fault_step)), std::string::npos)
        << res[1].error;
  }
  expect_checkpoint_loads(dir, kFaultStep - 1);
  delete strategies[0];
  if (!stall) {
    delete strategies[1];
    delete group;
  } else {
    ds::testing::keep_for_stuck_thread(strategies[1]);
    ds::testing::keep_for_stuck_thread(group);
  }
}

INSTANTIATE_TEST_SUITE_P(Fault, MultiWorkerFault,
                         ::testing::Values(ds::FaultKind::kThrow, ds::FaultKind::kStall,
                                           ds::FaultKind::kCorrupt),
                         [](const ::testing::TestParamInfo<ds::FaultKind>& i) {
                           return std::string(ds::fault_kind_name(i.param));
                         });

class ParameterServerFault : public ::testing::TestWithParam<ds::FaultKind> {};

// Two workers (ranks 0, 1) and a PS (rank 2), staleness bound 1 so worker 0
// depends on worker 1's progress; worker 1 misbehaves at step 3. Worker 0 is
// held until the PS declares worker 1 gone (worker_timeout), then finishes;
// the PS reports the failed worker and its step. A thrown step fails worker
// 1's run() naming it; a corrupted push (damaged request header) is rejected
// by the PS naming the worker, and worker 1's next run() fails naming it and
// the push's step; a stalled worker is named by the PS's join().
TEST_P(ParameterServerFault, SurvivorsFinishAndThePsNamesTheFailedWorkerAndStep) {
  // Without checkpoints here: that the last one still loads after a PS
  // worker's fault is checked in ps_checkpoint_fault_test.cc.
  const std::string dir;
  ds::ParameterServerOptions o;
  o.max_staleness = 1;
  o.worker_timeout = kTimeout;
  // Longer than worker_timeout: worker 0's staleness wait must outlast the
  // PS declaring worker 1 gone (equal deadlines race on a loaded machine).
  o.communication.timeout = 3 * kTimeout;
  const bool stall = GetParam() == ds::FaultKind::kStall;
  const auto job = ds::testing::run_ps_job<Result>(
      o, stall,
      [&](ds::ParameterServerStrategy& s, int) { return train(s, GetParam(), 1, dir, 3); });
  EXPECT_LT(job.seconds, std::chrono::duration<double>(3 * kTimeout).count() + 10.0);
  EXPECT_EQ(job.workers[0].error, "") << "the surviving worker failed";
  if (stall) {
    // The PS names the worker and the step it was in (its pushed steps = the
    // training step, kFaultStep).
    expect_names_rank_and_step(job.ps_error, 1, kFaultStep);
  } else {
    expect_names_rank_and_step(job.workers[1].error, 1, job.workers[1].fault_step);
  }
}

INSTANTIATE_TEST_SUITE_P(Fault, ParameterServerFault,
                         ::testing::Values(ds::FaultKind::kThrow, ds::FaultKind::kStall,
                                           ds::FaultKind::kCorrupt),
                         [](const ::testing::TestParamInfo<ds::FaultKind>& i) {
                           return std::string(ds::fault_kind_name(i.param));
                         });

// An injected stall parks its thread: the pool abandons it as soon as another
// thread has failed, without waiting out the grace period, and refuses to run
// again; destroying the pool does not wait for the parked thread.
TEST(FaultInjection, ParkedThreadIsAbandonedAtOnceAfterAFailure) {
  ds::ThreadPool pool(2);
  const auto t0 = std::chrono::steady_clock::now();
  const ds::ThreadPool::Result r = pool.run_all(
      [](int i) {
        if (i == 1) ds::ThreadPool::park_forever();
        throw std::runtime_error("thread 0 fails");
      },
      std::chrono::hours(1));
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_EQ(r.unfinished, std::vector<int>{1});
  EXPECT_TRUE(r.errors[0] != nullptr);
  EXPECT_TRUE(r.errors[1] == nullptr);
  EXPECT_TRUE(pool.broken());
  EXPECT_THROW(pool.run_all([](int) {}), ds::FailedPreconditionError);
}

TEST(FaultInjection, ParsesTheEnvironmentSpec) {
  const ds::FaultInjection f = ds::FaultInjection::parse("stall:2:17");
  EXPECT_EQ(f.kind, ds::FaultKind::kStall);
  EXPECT_EQ(f.rank, 2);
  EXPECT_EQ(f.step, 17);
  EXPECT_TRUE(f.fires(2, 17));
  EXPECT_FALSE(f.fires(1, 17));
  EXPECT_FALSE(ds::FaultInjection::parse("").active());
  for (const char* bad : {"boom:1:2", "throw:1", "throw:x:2", "throw:-1:2", "throw:1:2z"}) {
    EXPECT_THROW(ds::FaultInjection::parse(bad), ds::InvalidArgumentError) << bad;
  }
  ::setenv("DISTSTRAT_FAULT", "throw:0:0", 1);
  ds::MirroredOptions o;
  o.devices = {ds::Device::cpu(0)};
  ds::MirroredStrategy s(o);
  ::unsetenv("DISTSTRAT_FAULT");
  EXPECT_EQ(s.fault_injection().kind, ds::FaultKind::kThrow);
  try {
    s.run([](ds::ReplicaContext&) {});
    FAIL() << "no fault";
  } catch (const ds::InternalError& e) {
    EXPECT_EQ(e.message(), "step 0: injected fault: rank 0 at step 0 throws");
  }
  s.run([](ds::ReplicaContext&) {});  // one step only
  EXPECT_EQ(s.steps_run(), 2);
}

}  // namespace
