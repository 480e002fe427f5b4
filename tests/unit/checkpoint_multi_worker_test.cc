// Checkpoints under MultiWorkerMirroredStrategy with two workers as threads of
// one process (an InProcessGroup as the cross-process communicator): the
// default CheckpointParticipant protocol on the real strategy. The chief
// writes, every worker restores the chief's values (by broadcast), the
// preemption agreement is a collective. Compiles to nothing in a tree without
// the multi-worker strategy.
#if __has_include("diststrat/multi_worker_mirrored.h")

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "checkpoint_util.h"
#include "diststrat/diststrat.h"
#include "diststrat/multi_worker_mirrored.h"
#include "harness.h"
#include "../common/temp_dir.h"

namespace ds = diststrat;

TEST(CheckpointMultiWorker, ChiefWritesEveryWorkerRestoresAndAgreesOnPreemption) {
  const diststrat_test::TempDir temp("diststrat-ckpt-mw-");
  const std::string& dir = temp.path();
  ds::CommunicationOptions co;
  co.timeout = std::chrono::seconds(30);
  ds::InProcessGroup group(2, co);
  std::vector<std::vector<std::pair<std::string, ds::Tensor>>> saved(2), restored(2);
  std::vector<std::string> step(2);
  std::vector<int> stop(2);
  ds::testing::run_ranks(group, [&](ds::Communicator& comm) {
    const int w = comm.rank();
    ds::MultiWorkerOptions o;
    o.devices = {ds::Device::cpu(0), ds::Device::cpu(1)};
    o.communicator = &comm;
    ds::MultiWorkerMirroredStrategy s(o);
    ds::nn::Mlp mlp({8, 5, 3});
    std::vector<ds::Variable> vars = mlp.create_variables(s, 3 + w);
    ds::SGD opt(s, {0.1f, 0.9f});
    ds::Tensor x(ds::Shape{16, 8}, ds::DType::kFloat32), y(ds::Shape{16}, ds::DType::kInt32);
    ds::init::RandomNormal{0, 1, 5}(x);
    for (int i = 0; i < 16; ++i) y.data<int32_t>()[i] = i % 3;
    ds::DistributedDataset dist = s.distribute(ds::Dataset(x, y), 8, {false, 0, false});
    for (const ds::DistributedBatch& batch : dist) ds::testing::mlp_step(s, mlp, vars, opt, batch);
    ds::Checkpoint ckpt(s, {&opt});
    ds::CheckpointManager manager(ckpt, dir, {2});
    saved[w] = ckpt.state();
    manager.save(2, {{"step", "2"}});
    for (auto& v : vars) v.assign(ds::Tensor(v.shape(), v.dtype()));  // scramble
    step[w] = manager.restore_latest().value().at("step");
    restored[w] = ckpt.state();
    ds::PreemptionHandler preemption(s);
    stop[w] = preemption.should_stop(1);
  });
  EXPECT_EQ(step[0], "2");
  EXPECT_EQ(step[1], "2");
  EXPECT_EQ(stop[0] + stop[1], 0);
  ASSERT_EQ(saved[0].size(), 9u);  // 4 params + 4 momentum slots + iterations
  for (size_t k = 0; k < saved[0].size(); ++k) {
    const ds::Tensor& want = saved[0][k].second;
    const std::string& name = saved[0][k].first;
    EXPECT_EQ(0, std::memcmp(want.data(), saved[1][k].second.data(), want.nbytes())) << name;
    EXPECT_EQ(0, std::memcmp(want.data(), restored[0][k].second.data(), want.nbytes())) << name;
    EXPECT_EQ(0, std::memcmp(want.data(), restored[1][k].second.data(), want.nbytes())) << name;
  }
}

#endif  // __has_include("diststrat/multi_worker_mirrored.h")
