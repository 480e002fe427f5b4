// Checkpoint round trips under the strategies not covered elsewhere
// (checkpoint_test.cc: Mirrored and the multi-process protocol;
// checkpoint_multi_worker_test.cc: MultiWorker as threads; tests/mpi: under
// mpirun; ps_checkpoint_test.cc: ParameterServer): CentralStorage restores
// bit-exact and keeps training identically.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <memory>

#include "checkpoint_util.h"
#include "diststrat/diststrat.h"
#include "../common/temp_dir.h"

namespace ds = diststrat;

namespace {

using diststrat_test::temp_dir;
constexpr char kStrategiesTempPrefix[] =
    "diststrat_ckpt_strat_";  // removed at exit (tests/common/temp_dir.h)

// A model under any strategy: an MLP, SGD with momentum, its checkpoint.
struct Trainee {
  Trainee(std::unique_ptr<ds::Strategy> s, uint64_t seed)
      : strategy(std::move(s)),
        mlp({6, 5, 3}),
        params(mlp.create_variables(*strategy, seed)),
        opt(*strategy, {0.1f, 0.9f}),
        ckpt(*strategy, {&opt}) {}
  void train(int steps, uint64_t seed) {
    ds::testing::mlp_train(*strategy, mlp, params, opt, 8, steps, seed);
  }
  std::unique_ptr<ds::Strategy> strategy;
  ds::nn::Mlp mlp;
  std::vector<ds::Variable> params;
  ds::SGD opt;
  ds::Checkpoint ckpt;
};

void expect_same_state(const Trainee& a, const Trainee& b) {
  ds::testing::expect_same_state(a.ckpt, b.ckpt);
}

// Train, save, restore into a differently initialised model: the same state
// (weights, slots, step counter), and training continues identically.
void round_trip(const std::function<std::unique_ptr<ds::Strategy>()>& make) {
  const std::string path = temp_dir(kStrategiesTempPrefix) + "/rt.safetensors";
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
