// Checkpoints under mpirun (np 2..4) with MultiWorkerMirroredStrategy: the
// chief writes one file; every process restores it (the chief reads and
// broadcasts) into a differently initialised model, getting the chief's
// state bit-exact, and training then continues identically.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "../unit/checkpoint_util.h"
#include "diststrat/diststrat.h"

namespace ds = diststrat;

namespace {

struct MwTrainee {
  explicit MwTrainee(uint64_t seed)
      : strategy(opts()), mlp({6, 5, 3}), params(mlp.create_variables(strategy, seed)),
        opt(strategy, {0.1f, 0.9f}), ckpt(strategy, {&opt}) {}
  static ds::MultiWorkerOptions opts() {
    ds::MultiWorkerOptions o;
    o.devices = {ds::Device::cpu(0)};
    o.communication.timeout = std::chrono::seconds(60);
    return o;
  }
  void train(int steps, uint64_t seed) {
    const int64_t n = 4 * strategy.num_replicas_in_sync();
    ds::Tensor x(ds::Shape{n, 6}, ds::DType::kFloat32), y(ds::Shape{n}, ds::DType::kInt32);
    ds::init::RandomNormal{0.0, 1.0, seed}(x);
    for (int64_t i = 0; i < n; ++i) y.data<int32_t>()[i] = static_cast<int32_t>(i % 3);
    ds::DistributedDataset dist = strategy.distribute(ds::Dataset(x, y), n, {false, 0, false});
    for (int s = 0; s < steps; ++s) {
      for (const ds::DistributedBatch& b : dist) ds::testing::mlp_step(strategy, mlp, params, opt, b);
    }
  }
  ds::MultiWorkerMirroredStrategy strategy;
  ds::nn::Mlp mlp;
  std::vector<ds::Variable> params;
  ds::SGD opt;
  ds::Checkpoint ckpt;
};

void expect_same_state(const MwTrainee& a, const MwTrainee& b) {
  const auto sa = a.ckpt.state(), sb = b.ckpt.state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first);
    ASSERT_EQ(sa[i].second.nbytes(), sb[i].second.nbytes()) << sa[i].first;
    EXPECT_EQ(0, std::memcmp(sa[i].second.data(), sb[i].second.data(), sa[i].second.nbytes()))
        << sa[i].first;
  }
}

}  // namespace

TEST(CheckpointMpi, MultiWorkerChiefWritesEveryProcessRestoresBitExact) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  char dir[64] = "/tmp/diststrat_ckpt_mpi_XXXXXX";
  if (rank == 0) ASSERT_NE(::mkdtemp(dir), nullptr);
  MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
  const std::string path = std::string(dir) + "/mw.safetensors";

  MwTrainee a(3);
  a.train(3, 11);
  a.ckpt.save(path, {{"epoch", "1"}});
  MwTrainee b(100 + static_cast<uint64_t>(rank));  // different weights on every rank
  EXPECT_EQ(b.ckpt.restore(path), (ds::CheckpointMetadata{{"epoch", "1"}}));
  expect_same_state(a, b);
  EXPECT_EQ(b.opt.iterations().value().data<int64_t>()[0], 3);
  a.train(2, 12);
  b.train(2, 12);
  expect_same_state(a, b);
  // Every rank ends with the chief's values.
  const ds::Tensor w = b.params[0].value();
  std::vector<float> chief(w.data<float>(), w.data<float>() + w.num_elements());
  MPI_Bcast(chief.data(), static_cast<int>(chief.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
  EXPECT_EQ(0, std::memcmp(chief.data(), w.data(), w.nbytes()));
}
