// Checkpoint round trips under the strategies not covered elsewhere
// (checkpoint_test.cc: Mirrored and the multi-process protocol;
// checkpoint_multi_worker_test.cc: MultiWorker as threads; tests/mpi: under
// mpirun): CentralStorage restores bit-exact and keeps training identically;
// ParameterServer refuses every checkpoint operation (UnimplementedError)
// and writes nothing.
#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <memory>

#include "checkpoint_util.h"
#include "diststrat/diststrat.h"

namespace ds = diststrat;

namespace {

std::string temp_dir() {
  char tmpl[] = "/tmp/diststrat_ckpt_strat_XXXXXX";
  return mkdtemp(tmpl);
}

int count_entries(const std::string& dir) {
  int n = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) n += std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..");
    ::closedir(d);
  }
  return n;
}

// A model under any strategy: an MLP, SGD with momentum, its checkpoint.
struct Trainee {
  Trainee(std::unique_ptr<ds::Strategy> s, uint64_t seed)
      : strategy(std::move(s)), mlp({6, 5, 3}), params(mlp.create_variables(*strategy, seed)),
        opt(*strategy, {0.1f, 0.9f}), ckpt(*strategy, {&opt}) {}
  void train(int steps, uint64_t seed) { ds::testing::mlp_train(*strategy, mlp, params, opt, 8, steps, seed); }
  std::unique_ptr<ds::Strategy> strategy;
  ds::nn::Mlp mlp;
  std::vector<ds::Variable> params;
  ds::SGD opt;
  ds::Checkpoint ckpt;
};

void expect_same_state(const Trainee& a, const Trainee& b) { ds::testing::expect_same_state(a.ckpt, b.ckpt); }

// Train, save, restore into a differently initialised model: the same state
// (weights, slots, step counter), and training continues identically.
void round_trip(const std::function<std::unique_ptr<ds::Strategy>()>& make) {
  const std::string path = temp_dir() + "/rt.safetensors";
  Trainee a(make(), 3);
  a.train(3, 11);
  a.ckpt.save(path, {{"epoch", "2"}});
  Trainee b(make(), 99);
  EXPECT_EQ(b.ckpt.restore(path), (ds::CheckpointMetadata{{"epoch", "2"}}));
  expect_same_state(a, b);
  EXPECT_EQ(b.opt.iterations().value().data<int64_t>()[0], 3);
  a.train(2, 12);
  b.train(2, 12);
  expect_same_state(a, b);
}

}  // namespace

TEST(CheckpointStrategies, CentralStorageRoundTripIsBitExactAndTrainingContinuesIdentically) {
  round_trip([] {
    return std::make_unique<ds::CentralStorageStrategy>(
        std::vector<ds::Device>{ds::Device::cpu(0), ds::Device::cpu(1)});
  });
}

TEST(CheckpointStrategies, ParameterServerRefusesCheckpointsAndWritesNothing) {
  ds::ParameterServerOptions o;
  o.num_ps = 2;  // PS ranks as threads of this process
  o.partitioner = ds::partitioners::FixedShards{2};
  o.max_staleness = 0;
  Trainee t(std::make_unique<ds::ParameterServerStrategy>(o), 3);
  t.train(2, 11);
  const std::string dir = temp_dir();
  auto expect_unimplemented = [&](const std::function<void()>& fn, const std::string& what) {
    try {
      fn();
      ADD_FAILURE() << what << ": no error";
    } catch (const ds::UnimplementedError& e) {
      EXPECT_NE(std::string(e.what()).find("ParameterServerStrategy"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank "), std::string::npos) << e.what();
    }
  };
  expect_unimplemented([&] { t.ckpt.save(dir + "/x.safetensors"); }, "save");
  expect_unimplemented([&] { t.ckpt.restore(dir + "/x.safetensors"); }, "restore");
  expect_unimplemented([&] { t.ckpt.state(); }, "state");
  expect_unimplemented([&] { ds::CheckpointManager m(t.ckpt, dir + "/managed"); }, "manager");
  EXPECT_EQ(count_entries(dir), 0);  // no file, no directory
  // The strategy keeps training after the refusals.
  t.train(1, 12);
  static_cast<ds::ParameterServerStrategy&>(*t.strategy).flush();
  EXPECT_EQ(t.opt.iterations().value().data<int64_t>()[0], 3);
}
