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
#include "mpi_temp_dir.h"

namespace ds = diststrat;

namespace {

struct MwTrainee {
  explicit MwTrainee(uint64_t seed)
      : strategy(opts()),
        mlp({6, 5, 3}),
        params(mlp.create_variables(strategy, seed)),
        opt(strategy, {0.1f, 0.9f}),
        ckpt(strategy, {&opt}) {}
  static ds::MultiWorkerOptions opts() {
    ds::MultiWorkerOptions o;
    o.devices = {ds::Device::cpu(0)};
    o.communication.timeout = std::chrono::seconds(60);
    return o;
  }
  void train(int steps, uint64_t seed) {
    ds::testing::mlp_train(strategy, mlp, params, opt, 4 * strategy.num_replicas_in_sync(), steps,
                           seed);
  }
  ds::MultiWorkerMirroredStrategy strategy;
  ds::nn::Mlp mlp;
  std::vector<ds::Variable> params;
  ds::SGD opt;
  ds::Checkpoint ckpt;
};

void expect_same_state(const MwTrainee& a, const MwTrainee& b) {
  ds::testing::expect_same_state(a.ckpt, b.ckpt);
}

}  // namespace

TEST(CheckpointMpi, MultiWorkerChiefWritesEveryProcessRestoresBitExact) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::string path = diststrat_test::job_temp_dir("diststrat_ckpt_mpi_") + "/mw.safetensors";

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

// Sync-on-read counters (the metric: rows seen, summed over every
// replica of every process) survive 5 save/restore cycles unchanged, for
// every aggregation, and a cross-replica assign reads back what was assigned.
TEST(CheckpointMpi, MultiWorkerSyncOnReadCountersSurviveFiveSaveRestoreCycles) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::string dir = diststrat_test::job_temp_dir("diststrat_onread_mpi_");
  ds::MultiWorkerOptions o = MwTrainee::opts();
  o.devices = {ds::Device::cpu(0), ds::Device::cpu(1)};
  ds::MultiWorkerMirroredStrategy s(o);
  const int n = s.num_replicas_in_sync();
  std::vector<ds::Variable> vars;
  for (auto agg : {ds::VariableAggregation::kSum, ds::VariableAggregation::kMean,
                   ds::VariableAggregation::kOnlyFirstReplica}) {
    ds::VariableOptions vo;
    vo.synchronization = ds::VariableSynchronization::kOnRead;
    vo.aggregation = agg;
    vo.trainable = false;
    const std::string suffix = std::to_string(static_cast<int>(agg));
    vars.push_back(s.create_variable("rows/f32/" + suffix, ds::Shape{}, ds::DType::kFloat32,
                                     ds::init::Zeros{}, vo));
    vars.push_back(s.create_variable("rows/i64/" + suffix, ds::Shape{}, ds::DType::kInt64,
                                     ds::init::Zeros{}, vo));
  }
  auto scalar = [](const ds::Tensor& t) {
    return t.dtype() == ds::DType::kFloat32 ? double(t.data<float>()[0])
                                            : double(t.data<int64_t>()[0]);
  };
  s.run([&](ds::ReplicaContext& ctx) {
    for (ds::Variable& v : vars) {
      ds::Tensor t = v.read(ctx);
      if (t.dtype() == ds::DType::kFloat32)
        t.data<float>()[0] += 5.0f + float(ctx.replica_id());
      else
        t.data<int64_t>()[0] += 5 + ctx.replica_id();
    }
  });
  std::vector<double> before;
  for (ds::Variable& v : vars) before.push_back(scalar(v.value()));
  EXPECT_EQ(before[0], 5.0 * n + n * (n - 1) / 2.0);  // sum
  EXPECT_EQ(before[2], 5.0 + (n - 1) / 2.0);          // mean
  EXPECT_EQ(before[4], 5.0);                          // replica 0's
  ds::Checkpoint ckpt(s);
  for (int cycle = 0; cycle < 5; ++cycle) {
    const std::string path = std::string(dir) + "/c" + std::to_string(cycle) + ".safetensors";
    ckpt.save(path);
    ckpt.restore(path);
    for (size_t k = 0; k < vars.size(); ++k) {
      EXPECT_EQ(scalar(vars[k].value()), before[k])
          << "rank " << rank << " cycle " << cycle << " '" << vars[k].name() << "'";
    }
  }
  for (ds::Variable& v : vars) {
    ds::Tensor ten(ds::Shape{}, v.dtype());
    if (v.dtype() == ds::DType::kFloat32)
      ten.data<float>()[0] = 10.0f;
    else
      ten.data<int64_t>()[0] = 10;
    v.assign(ten);
    EXPECT_EQ(scalar(v.value()), 10.0) << "rank " << rank << " '" << v.name() << "': assign(10)";
  }
}
