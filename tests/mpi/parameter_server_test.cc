// ParameterServerStrategy under mpirun: the last rank is the PS, the others
// are workers; dense and row-sparse pushes from every worker reach the PS.
#include <gtest/gtest.h>
#include <mpi.h>

#include <vector>

#include "diststrat/diststrat.h"

namespace ds = diststrat;

namespace {

TEST(MpiParameterServer, EveryWorkersPushesAreAppliedOnce) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int workers = size - 1, steps = 10;
  {
    ds::ParameterServerOptions o;
    o.num_ps = 1;
    o.max_staleness = 1;
    o.communication.timeout = std::chrono::seconds(60);
    ds::ParameterServerStrategy s(o);
    ASSERT_EQ(s.is_ps(), rank == size - 1);
    if (s.is_ps()) {
      EXPECT_EQ(s.cluster().task_type, "ps");
      s.join();
      // Two variables and the step counter live here.
      EXPECT_EQ(s.local_shards().size(), 3u);
    } else {
      EXPECT_EQ(s.cluster().num_workers, workers);
      EXPECT_EQ(s.num_replicas_in_sync(), workers);
      ds::Variable w = s.create_variable("w", ds::Shape{1000}, ds::DType::kFloat32,
                                         ds::init::Constant{1.0});
      ds::Variable emb = s.create_row_sparse_variable("emb", ds::Shape{64, 4}, ds::DType::kFloat32,
                                                      ds::init::Zeros{});
      ds::SGD sgd(s, {0.01f});
      for (int i = 0; i < steps; ++i) {
        s.run([&](ds::ReplicaContext& ctx) {
          ds::Tensor g(ds::Shape{1000}, ds::DType::kFloat32);
          ds::init::Constant{1.0}(g);
          // Each worker owns row `rank` of the table.
          ds::Tensor ids(ds::Shape{1}, ds::DType::kInt64);
          ids.data<int64_t>()[0] = rank;
          ds::Tensor rows(ds::Shape{1, 4}, ds::DType::kFloat32);
          ds::init::Constant{-1.0}(rows);
          s.apply_gradients(ctx, sgd, {{g, w}}, {{emb, ids, rows}});
        });
      }
      s.flush();
      s.barrier("check");
      // Every worker's 10 steps were applied exactly once.
      const float expect = 1.0f - 0.01f * steps * workers;
      EXPECT_NEAR(w.value().data<float>()[999], expect, 1e-4);
      ds::Tensor all(ds::Shape{workers}, ds::DType::kInt64);
      for (int r = 0; r < workers; ++r) all.data<int64_t>()[r] = r;
      const ds::Tensor got = s.gather_rows(emb, all);
      for (int r = 0; r < workers; ++r) EXPECT_NEAR(got.data<float>()[r * 4], 0.01f * steps, 1e-5);
      const ds::ParameterServerStats st = s.stats();
      EXPECT_EQ(st.pushes_applied, int64_t{steps} * workers);
      EXPECT_EQ(st.pushes_rejected, 0);
      EXPECT_LE(st.max_step_gap, 2);  // max_staleness + 1
      EXPECT_EQ(sgd.iterations().value().data<int64_t>()[0], int64_t{steps} * workers);
      s.barrier("done reading");  // nobody shuts down while another still reads
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
