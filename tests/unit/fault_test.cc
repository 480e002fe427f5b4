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
#include <mutex>
#include <string>
#include <thread>

#include "checkpoint_util.h"
#include "diststrat/diststrat.h"
#include "diststrat/multi_worker_mirrored.h"
#include "harness.h"

namespace ds = diststrat;
using std::chrono::milliseconds;

namespace {

constexpr auto kTimeout = milliseconds(2000);
constexpr int kFaultStep = 3;

std::string temp_dir() {
  char tmpl[] = "/tmp/diststrat-fault-XXXXXX";
  return ::mkdtemp(tmpl);
}

// Trains 6 steps under `s` (fault at step kFaultStep counted from now);
// the chief saves after each step. Returns the error message ("" if none).
std::string train(ds::Strategy& s, ds::FaultKind kind, int rank, const std::string& dir,
                  bool chief, int seed) {
  ds::nn::Mlp mlp({8, 5, 3});
  std::vector<ds::Variable> vars = mlp.create_variables(s, seed);
  ds::SGD opt(s, {0.1f, 0.9f});
  ds::Tensor x(ds::Shape{96, 8}, ds::DType::kFloat32), y(ds::Shape{96}, ds::DType::kInt32);
  ds::init::RandomNormal{0, 1, 5}(x);
  for (int i = 0; i < 96; ++i) y.data<int32_t>()[i] = i % 3;
  ds::DistributedDataset dist = s.distribute(ds::Dataset(x, y), 16, {false, 0, false});
  ds::Checkpoint ckpt(s, {&opt});
  ds::CheckpointManager manager(ckpt, dir, {2});
  ds::FaultInjection f;
  f.kind = kind;
  f.rank = rank;
  f.step = s.steps_run() + kFaultStep;
  s.set_fault_injection(f);
  int step = 0;
  try {
    for (const ds::DistributedBatch& batch : dist) {
      ds::testing::mlp_step(s, mlp, vars, opt, batch);
      if (chief) manager.save(step, {{"step", std::to_string(step)}});
      ++step;
    }
  } catch (const ds::Error& e) {
    return e.message();
  }
  return "";
}

void expect_names_rank_and_step(const std::string& msg, int rank, int64_t step) {
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
  const std::string dir = temp_dir();
  auto s = make_local(GetParam().strategy);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg = train(*s, GetParam().kind, 1, dir, true, 3);
  EXPECT_LT(seconds_since(t0), std::chrono::duration<double>(kTimeout).count() + 10.0);
  ASSERT_FALSE(msg.empty()) << "the fault did not fail the step";
  expect_names_rank_and_step(msg, 1, kFaultStep);
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
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  for (const std::string which : {"mirrored", "central_storage"}) {
    const std::string dir = temp_dir();
    EXPECT_EXIT(
        {
          auto s = make_local(which);
          train(*s, ds::FaultKind::kExit, 1, dir, true, 3);
          std::_Exit(0);
        },
        ::testing::ExitedWithCode(17), "")
        << which;
    expect_checkpoint_loads(dir, kFaultStep - 1);
  }
}

class MultiWorkerFault : public ::testing::TestWithParam<ds::FaultKind> {};

// Two workers x two replicas; replica 1 (worker 0's second) misbehaves.
TEST_P(MultiWorkerFault, EveryWorkerFailsWithinTheDeadlineNamingRankAndStep) {
  const std::string dir = temp_dir();
  ds::CommunicationOptions co;
  co.timeout = kTimeout;
  ds::InProcessGroup group(2, co);
  std::vector<std::string> msgs(2);
  std::vector<std::unique_ptr<ds::MultiWorkerMirroredStrategy>> keep(2);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      ds::MultiWorkerOptions o;
      o.devices = {ds::Device::cpu(0), ds::Device::cpu(1)};
      o.communicator = &group.at(w);
      o.communication.timeout = kTimeout;
      keep[w] = std::make_unique<ds::MultiWorkerMirroredStrategy>(o);
      msgs[w] = train(*keep[w], GetParam(), 1, dir, w == 0, 3);
      if (msgs[w].empty()) msgs[w] = "(no error)";
      group.at(w).abort("worker " + std::to_string(w) + " left");
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LT(seconds_since(t0), std::chrono::duration<double>(kTimeout).count() + 10.0);
  for (int w = 0; w < 2; ++w) {
    SCOPED_TRACE("worker " + std::to_string(w));
    EXPECT_NE(msgs[w].find("step " + std::to_string(kFaultStep)), std::string::npos) << msgs[w];
  }
  // The worker that hosts the faulty replica names it; its peer names the
  // worker (cross-worker rank 0) that failed.
  expect_names_rank_and_step(msgs[0], 1, kFaultStep);
  EXPECT_NE(msgs[1].find("rank 0"), std::string::npos) << msgs[1];
  expect_checkpoint_loads(dir, kFaultStep - 1);
  keep.clear();
}

INSTANTIATE_TEST_SUITE_P(Fault, MultiWorkerFault,
                         ::testing::Values(ds::FaultKind::kThrow, ds::FaultKind::kStall,
                                           ds::FaultKind::kCorrupt),
                         [](const ::testing::TestParamInfo<ds::FaultKind>& i) {
                           return std::string(ds::fault_kind_name(i.param));
                         });

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
