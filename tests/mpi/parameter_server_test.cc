// ParameterServerStrategy under mpirun: the last rank is the PS, the others
// are workers; dense and row-sparse pushes from every worker reach the PS;
// max_staleness 0 trains exactly as synchronous SGD; cluster() reports the
// tasks TF_CONFIG names.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../unit/least_squares_util.h"
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
      ds::Variable w =
          s.create_variable("w", ds::Shape{1000}, ds::DType::kFloat32, ds::init::Constant{1.0});
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

// The issue-13 scenario (mpirun -np 3, 1 PS, max_staleness 0, plain SGD):
// the final weights equal synchronous SGD over the same global batches in
// every one of 10 jobs, with random pauses varying the interleaving.
TEST(MpiParameterServer, LockstepEqualsSynchronousSgdInEveryRun) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  using ds::testing::LeastSquares;
  const int workers = size - 1, steps = 6, runs = 10;
  const float lr = 0.3f;
  const LeastSquares b(steps, 5);
  const std::vector<float> ref = b.synchronous_sgd(steps, lr);
  std::mt19937_64 rng(77 + rank);
  auto pause = [&] {
    const int us = static_cast<int>(rng() % 2000);
    if (us > 700) std::this_thread::sleep_for(std::chrono::microseconds(us));
  };
  int equal = 0;
  double worst = 0;
  for (int run = 0; run < runs; ++run) {
    ds::ParameterServerOptions o;
    o.max_staleness = 0;
    o.communication.timeout = std::chrono::seconds(60);
    ds::ParameterServerStrategy s(o);
    if (s.is_ps()) {
      s.join();
      continue;
    }
    if (rank > 0) pause();
    ds::Variable w = s.create_variable("w", ds::Shape{LeastSquares::kDim}, ds::DType::kFloat32,
                                       ds::init::Constant{LeastSquares::kInit});
    ds::SGD sgd(s, {lr});
    const int lo = LeastSquares::first_row(rank, workers),
              hi = LeastSquares::first_row(rank + 1, workers);
    for (int t = 0; t < steps; ++t) {
      pause();
      s.run([&](ds::ReplicaContext& ctx) {
        const std::vector<float> g = b.grad(t, lo, hi, w.read(ctx).data<float>());
        ds::Tensor gt(ds::Shape{LeastSquares::kDim}, ds::DType::kFloat32);
        std::copy(g.begin(), g.end(), gt.data<float>());
        sgd.apply_gradients(ctx, {{gt, w}});
      });
    }
    s.flush();
    s.barrier("trained");
    const ds::Tensor v = w.value();
    double diff = 0;
    for (int j = 0; j < LeastSquares::kDim; ++j)
      diff = std::max(diff, std::fabs(double(v.data<float>()[j]) - ref[j]));
    worst = std::max(worst, diff);
    if (diff <= 1e-5) ++equal;
    s.barrier("read");
  }
  if (rank != size - 1) {
    EXPECT_EQ(equal, runs) << "worker " << rank << ": " << equal << " of " << runs
                           << " jobs equal synchronous SGD; worst max |diff| " << worst;
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// A TF_CONFIG with a chief (rank order chief, worker, ps): every rank's
// cluster() reports its TF_CONFIG task, as resolve_cluster() does.
TEST(MpiParameterServer, ClusterReportsTheTasksOfTfConfig) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int workers = size - 2;  // plus the chief and one PS
  std::string jobs = "\"chief\": [\"localhost:7000\"], \"ps\": [\"localhost:7999\"]";
  if (workers > 0) {
    jobs += ", \"worker\": [";
    for (int i = 0; i < workers; ++i)
      jobs += std::string(i ? ", " : "") + "\"localhost:" + std::to_string(7001 + i) + "\"";
    jobs += "]";
  }
  std::string type = "worker";
  int index = rank - 1;
  if (rank == 0) {
    type = "chief";
    index = 0;
  } else if (rank == size - 1) {
    type = "ps";
    index = 0;
  }
  const std::string tf_config = "{\"cluster\": {" + jobs + "}, \"task\": {\"type\": \"" + type +
                                "\", \"index\": " + std::to_string(index) + "}}";
  ::setenv("TF_CONFIG", tf_config.c_str(), 1);
  {
    const ds::ResolvedCluster resolved = ds::resolve_cluster();
    ds::ParameterServerOptions o;
    o.communication.timeout = std::chrono::seconds(60);
    ds::ParameterServerStrategy s(o);
    const ds::ClusterInfo c = s.cluster();
    EXPECT_EQ(c.task_type, type) << "rank " << rank << " of " << tf_config;
    EXPECT_EQ(c.task_index, index) << "rank " << rank;
    EXPECT_EQ(c.task_type, resolved.info.task_type);
    EXPECT_EQ(c.task_index, resolved.info.task_index);
    EXPECT_EQ(c.rank, rank);
    EXPECT_EQ(c.world_size, size);
    EXPECT_EQ(c.num_workers, size - 1);
    EXPECT_EQ(c.worker_index, resolved.info.worker_index);
    EXPECT_EQ(c.is_chief(), rank == 0);
    EXPECT_EQ(s.is_ps(), rank == size - 1);
    if (s.is_ps()) {
      s.join();
    } else {
      EXPECT_EQ(c.worker_index, rank);
      EXPECT_EQ(s.first_local_replica(), rank);
    }
  }
  ::unsetenv("TF_CONFIG");
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
