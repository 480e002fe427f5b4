// Parameter-server fault cells with checkpoints: two workers and a PS as
// threads, every worker saving through a CheckpointManager after every step,
// while worker 1 throws or stalls at step 3. Worker 0 keeps training: its
// saves meet worker 1 at the save barrier until worker 1 has shut down
// (throw: its strategy is destroyed) or the PS declared it gone (stall:
// worker_timeout of silence). Whatever happened, the last checkpoint loads,
// verifies and restores into a fresh job (one with two PS ranks).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "allreduce/transport.h"
#include "checkpoint_util.h"
#include "fault_util.h"
#include "diststrat/diststrat.h"
#include "parameter_server/strategy_impl.h"
#include "../common/temp_dir.h"

namespace ds = diststrat;
using std::chrono::milliseconds;

namespace {

constexpr auto kWorkerTimeout = milliseconds(2000);
constexpr int kPsFaultStep = 3, kPsSteps = 6;

struct Outcome {
  std::string error;
  int64_t last_saved = -1;
};

// Trains kPsSteps steps, saving after each; replica `fault_rank` misbehaves at kPsFaultStep.
Outcome train_and_save(ds::ParameterServerStrategy& s, const std::string& dir, ds::FaultKind kind,
                       int fault_rank) {
  Outcome out;
  try {
    ds::nn::Mlp mlp({8, 5, 3});
    std::vector<ds::Variable> vars = mlp.create_variables(s, 3);
    ds::SGD opt(s, {0.1f, 0.9f});
    ds::Checkpoint ckpt(s, {&opt});
    ds::CheckpointManager manager(ckpt, dir, {2});
    for (int step = 0; step < kPsSteps; ++step) {
      if (step == kPsFaultStep) ds::testing::arm_fault_at_next_run(s, kind, fault_rank);
      ds::testing::mlp_train(s, mlp, vars, opt, 16, 1, 100 + step);
      manager.save(step, {{"step", std::to_string(step)}});
      out.last_saved = step;
    }
  } catch (const ds::Error& e) {
    out.error = e.message();
  }
  return out;
}

class PsCheckpointFault : public ::testing::TestWithParam<ds::FaultKind> {};

TEST_P(PsCheckpointFault, TheLastCheckpointStillLoadsAndRestores) {
  const diststrat_test::TempDir temp("diststrat-ps-fault-");
  const std::string& dir = temp.path();
  const bool stall = GetParam() == ds::FaultKind::kStall;
  ds::ParameterServerOptions o;
  o.worker_timeout = kWorkerTimeout;
  o.communication.timeout = 3 * kWorkerTimeout;  // outlasts the PS declaring worker 1 gone
  const auto job = ds::testing::run_ps_job<Outcome>(
      o, stall,
      [&](ds::ParameterServerStrategy& s, int) { return train_and_save(s, dir, GetParam(), 1); });
  const std::vector<Outcome>& res = job.workers;
  const std::string& ps_error = job.ps_error;
  EXPECT_LT(job.seconds, 30.0);
  EXPECT_EQ(res[0].error, "") << "the surviving worker failed";
  EXPECT_EQ(res[0].last_saved, kPsSteps - 1);
  if (stall) {
    EXPECT_NE(ps_error.find("rank 1"), std::string::npos) << ps_error;
  } else {
    EXPECT_NE(res[1].error.find("injected fault"), std::string::npos) << res[1].error;
    EXPECT_EQ(res[1].last_saved, kPsFaultStep - 1);
  }

  // The newest checkpoint is worker 0's last save; it loads, verifies and restores.
  const std::string latest = dir + "/ckpt-" + std::to_string(kPsSteps - 1) + ".safetensors";
  const ds::SafetensorsFile file = ds::load_checkpoint(latest);
  EXPECT_TRUE(file.verified);
  EXPECT_EQ(file.metadata.at("step"), std::to_string(kPsSteps - 1));
  ds::ParameterServerOptions fresh;
  fresh.num_ps = 2;
  fresh.partitioner = ds::partitioners::FixedShards{2};
  ds::ParameterServerStrategy s(fresh);
  ds::nn::Mlp mlp({8, 5, 3});
  std::vector<ds::Variable> vars = mlp.create_variables(s, 9);
  ds::SGD opt(s, {0.1f, 0.9f});
  ds::Checkpoint ckpt(s, {&opt});
  ds::CheckpointManager manager(ckpt, dir, {2});
  EXPECT_EQ(manager.restore_latest()->at("step"), std::to_string(kPsSteps - 1));
  EXPECT_EQ(opt.iterations().value().data<int64_t>()[0],
            file.find("optimizer/iterations")->data<int64_t>()[0]);
  for (const ds::Variable& v : vars) {
    const ds::Tensor got = v.value();
    EXPECT_EQ(0, std::memcmp(got.data(), file.find(v.name())->data(), got.nbytes())) << v.name();
  }
}

INSTANTIATE_TEST_SUITE_P(Fault, PsCheckpointFault,
                         ::testing::Values(ds::FaultKind::kThrow, ds::FaultKind::kStall),
                         [](const ::testing::TestParamInfo<ds::FaultKind>& i) {
                           return std::string(ds::fault_kind_name(i.param));
                         });

}  // namespace
