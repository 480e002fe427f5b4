// ParameterServerStrategy checkpoints under mpirun (np 2..4): a job saves
// through a CheckpointManager (each PS rank writes its shard file, the chief
// the index), stops, and a second job on a different number of PS ranks
// (np 4: 2 then 1) resumes on every worker: the restored state is the
// checkpoint's, byte for byte, and training continues from it.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <string>

#include "../unit/checkpoint_util.h"
#include "diststrat/diststrat.h"
#include "mpi_temp_dir.h"

namespace ds = diststrat;

namespace {

ds::ParameterServerOptions ps_options(int num_ps, int shards) {
  ds::ParameterServerOptions o;
  o.num_ps = num_ps;
  o.partitioner = ds::partitioners::FixedShards{shards};
  o.communication.timeout = std::chrono::seconds(60);
  return o;
}

TEST(MpiParameterServerCheckpoint, SaveStopAndResumeOnAnotherNumberOfPsRanks) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  // One directory for the job (one host here; a shared file system across hosts).
  const std::string dir = diststrat_test::job_temp_dir("diststrat_ps_ckpt_mpi_");
  const int ps_before = size >= 4 ? 2 : 1, workers_before = size - ps_before, steps_before = 3;
  {
    ds::ParameterServerStrategy s(ps_options(ps_before, 2));
    if (s.is_ps()) {
      s.join();
    } else {
      ds::testing::CheckpointedMlp m(s, 3, dir);
      for (int step = 1; step <= steps_before; ++step) {
        ds::testing::mlp_train(s, m.mlp, m.vars, m.adam, 8 * workers_before, 1, 10 + step);
        m.manager.save(step, {{"step", std::to_string(step)}});
      }
      // Nobody pushed since the save: the PS state is the checkpoint.
      if (s.cluster().is_chief()) {
        ds::testing::expect_state_is_file(m.ckpt, *m.manager.latest());
        EXPECT_EQ(m.adam.iterations().value().data<int64_t>()[0], steps_before * workers_before);
      }
      s.barrier("checked");
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const int workers_after = size - 1;
  {
    ds::ParameterServerStrategy s(ps_options(1, 3));
    if (s.is_ps()) {
      s.join();
    } else {
      ds::testing::CheckpointedMlp m(s, 99, dir);
      auto md = m.manager.restore_latest();
      ASSERT_TRUE(md.has_value());
      EXPECT_EQ(md->at("step"), std::to_string(steps_before)) << "rank " << rank;
      if (s.cluster().is_chief()) ds::testing::expect_state_is_file(m.ckpt, *m.manager.latest());
      s.barrier("checked");
      ds::testing::mlp_train(s, m.mlp, m.vars, m.adam, 8 * workers_after, 2, 20);
      m.manager.save(steps_before + 2, {{"step", std::to_string(steps_before + 2)}});
      if (s.cluster().is_chief()) {
        ds::testing::expect_state_is_file(m.ckpt, *m.manager.latest());
        EXPECT_EQ(m.adam.iterations().value().data<int64_t>()[0],
                  steps_before * workers_before + 2 * workers_after);
      }
      s.barrier("done");
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);  // dir: removed when rank 0 exits (job_temp_dir)
}

}  // namespace
