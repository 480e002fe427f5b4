// MultiWorkerMirroredStrategy under mpirun (np 2..4): every process is a
// worker. With DISTSTRAT_VIRTUAL_NODE_SIZE set (the tcp ctest) the ranks form
// virtual nodes and the hierarchical path runs: shared memory inside a node,
// MPI across nodes.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "runtime/variable_impl.h"
#include "../unit/training_util.h"
#include "diststrat/diststrat.h"
#include "mpi_test_util.h"

namespace ds = diststrat;

namespace {

using diststrat_test::virtual_nodes;
using diststrat_test::world_rank;
using diststrat_test::world_size;

ds::MultiWorkerOptions options(int local,
                               std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  ds::MultiWorkerOptions o;
  for (int i = 0; i < local; ++i) o.devices.push_back(ds::Device::cpu(i));
  o.communication.timeout = timeout;
  o.communication.bytes_per_pack = 16 << 10;
  return o;
}

class MultiWorkerMpiEquivalence : public ::testing::TestWithParam<int> {};

TEST_P(MultiWorkerMpiEquivalence, SameWeightsAsSingleDeviceAfter20Steps) {
  const int local = GetParam();
  const ds::nn::Mlp mlp({784, 64, 32, 10});
  const ds::Dataset data = ds::testing::synthetic(64 * 20 + 3, 11);
  const auto ref = ds::testing::reference_training(mlp, data, 64, 21, 0.05f, 0.9f);
  ds::MultiWorkerMirroredStrategy s(options(local));
  ASSERT_EQ(s.num_replicas_in_sync(), world_size() * local);
  ASSERT_EQ(s.cluster().worker_index, world_rank());
  if (virtual_nodes() &&
      world_size() % std::atoi(std::getenv("DISTSTRAT_VIRTUAL_NODE_SIZE")) == 0 &&
      world_size() > std::atoi(std::getenv("DISTSTRAT_VIRTUAL_NODE_SIZE"))) {
    EXPECT_TRUE(s.hierarchical());
    EXPECT_GT(s.placement().num_nodes, 1);
  }
  std::vector<ds::Variable> vars;
  ds::testing::train_under(s, mlp, data, 64, 21, 0.05f, 0.9f, &vars);
  for (size_t i = 0; i < vars.size(); ++i) {
    for (const ds::Tensor& copy : vars[i].impl().copies) {
      EXPECT_LE(ds::testing::max_abs_diff(copy, ref[i]), 1e-4) << vars[i].name();
    }
    // Bit-identical on every worker: compare with worker 0's copy.
    ds::Tensor w0 = vars[i].impl().copies[0].clone();
    s.broadcast(w0, 0, "check " + vars[i].name());
    EXPECT_EQ(0, std::memcmp(w0.data(), vars[i].impl().copies[0].data(), w0.nbytes()));
  }
}

INSTANTIATE_TEST_SUITE_P(LocalDevices, MultiWorkerMpiEquivalence, ::testing::Values(1, 2));

TEST(MultiWorkerMpi, FusionOddSizesMixedDtypesEveryPackSize) {
  const std::vector<int64_t> sizes = {1, 7, 0, 1000, 3, 4097, 17, 1, 64, 255, 2, 9};
  const ds::DType dtypes[] = {ds::DType::kFloat32, ds::DType::kFloat64, ds::DType::kInt32,
                              ds::DType::kInt64};
  for (size_t bpp : {size_t{0}, size_t{12}, size_t{1} << 30}) {
    ds::MultiWorkerOptions o = options(2);
    o.communication.bytes_per_pack = bpp;
    ds::MultiWorkerMirroredStrategy s(o);
    const int R = s.num_replicas_in_sync();
    s.run([&](ds::ReplicaContext& ctx) {
      std::vector<ds::Tensor> ts;
      for (size_t k = 0; k < sizes.size(); ++k) {
        ds::Tensor t(ds::Shape{sizes[k]}, dtypes[(k / 3) % 4]);
        for (int64_t i = 0; i < sizes[k]; ++i) {
          const double v = ctx.replica_id() + 1 + (i % 7);
          ds::testing::set_element(t, i, v);
        }
        ts.push_back(t);
      }
      ctx.all_reduce_async(ds::ReduceOp::kSum, ts).wait();
      for (size_t k = 0; k < sizes.size(); ++k) {
        for (int64_t i = 0; i < sizes[k]; ++i) {
          const double expect = R * (R + 1) / 2.0 + R * (i % 7);
          const double got = ds::testing::get_element(ts[k], i);
          ASSERT_EQ(got, expect) << "bytes_per_pack " << bpp << " tensor " << k << " element " << i;
        }
      }
    });
    EXPECT_LE(s.stats().buffer_allocations, 1);
  }
}

TEST(MultiWorkerMpi, MismatchIsAnErrorOnEveryRankNamingTheTensor) {
  const char* variants[] = {"name", "shape", "fewer"};
  const char* expected[] = {"'b/grad' float32[4]", "'w/grad' float32[5]", "enqueued no tensor #1"};
  const int odd_rank = world_size() - 1;
  ds::MultiWorkerMirroredStrategy s(options(1));
  for (int v = 0; v < 3; ++v) {
    const std::string what = variants[v];
    try {
      s.run([&](ds::ReplicaContext&) {});  // keep ranks in step between variants
      s.run([&](ds::ReplicaContext& ctx) {
        const bool odd = world_rank() == odd_rank;
        std::vector<ds::Tensor> ts{ds::Tensor(ds::Shape{3}, ds::DType::kFloat32)};
        std::vector<std::string> names{"a/grad"};
        if (!(odd && what == "fewer")) {
          ts.emplace_back(ds::Shape{odd && what == "shape" ? 5 : 4}, ds::DType::kFloat32);
          names.push_back(odd && what == "name" ? "b/grad" : "w/grad");
        }
        ctx.all_reduce(ds::ReduceOp::kSum, ts, names);
      });
      ADD_FAILURE() << what << ": no error";
    } catch (const ds::InvalidArgumentError& e) {
      EXPECT_NE(e.message().find(expected[v]), std::string::npos) << e.message();
      EXPECT_NE(e.message().find("rank " + std::to_string(odd_rank)), std::string::npos)
          << e.message();
    }
  }
  // Still in step afterwards.
  auto sum = s.run([](ds::ReplicaContext& ctx) {
    ds::Tensor t(ds::Shape{1}, ds::DType::kInt32);
    t.data<int32_t>()[0] = 1;
    return ctx.all_reduce(ds::ReduceOp::kSum, t, "after").data<int32_t>()[0];
  });
  EXPECT_EQ(sum[0], world_size());
}

TEST(MultiWorkerMpi, CompressionStaysWithinTolerance) {
  for (auto comp : {ds::Compression::kFloat16, ds::Compression::kBFloat16}) {
    ds::MultiWorkerOptions o = options(1);
    o.communication.compression = comp;
    ds::MultiWorkerMirroredStrategy s(o);
    const int n = world_size();
    s.run([&](ds::ReplicaContext& ctx) {
      ds::Tensor t(ds::Shape{1000}, ds::DType::kFloat32);
      for (int i = 0; i < 1000; ++i) t.data<float>()[i] = 0.001f * (i + 1) + 0.1234567f;
      std::vector<ds::Tensor> v{t};
      ctx.all_reduce(ds::ReduceOp::kSum, v, {"g"});
      double worst = 0;
      for (int i = 0; i < 1000; ++i) {
        const double exact = n * (0.001 * (i + 1) + 0.1234567);
        worst = std::max(worst, std::fabs(t.data<float>()[i] - exact) / exact);
      }
      EXPECT_LE(worst, comp == ds::Compression::kFloat16 ? 2e-3 : 1.6e-2);
      EXPECT_GT(worst, 1e-7) << "compression did not reach the wire";
    });
  }
}

TEST(MultiWorkerMpi, ClusterFromTheLauncherAndFromTfConfig) {
  const int n = world_size(), me = world_rank();
  ds::ResolvedCluster r = ds::resolve_cluster({});
  EXPECT_EQ(r.source, ds::ClusterSource::kMpi);
  EXPECT_EQ(r.info.rank, me);
  EXPECT_EQ(r.info.world_size, n);
  EXPECT_EQ(r.info.is_chief(), me == 0);
  EXPECT_EQ(r.placement.rank, me);
  if (!virtual_nodes()) {
    EXPECT_EQ(r.placement.num_nodes, 1);  // one host
    EXPECT_EQ(r.placement.local_size, n);
    EXPECT_EQ(r.placement.local_rank, me);
  }
  ds::ClusterConfig grouped;
  grouped.virtual_node_size = 1;
  if (!virtual_nodes()) EXPECT_EQ(ds::resolve_cluster(grouped).placement.num_nodes, n);

  // TF_CONFIG with a chief: rank 0 is the chief, the others worker[rank - 1].
  std::string workers;
  for (int w = 1; w < n; ++w)
    workers += std::string(w > 1 ? "," : "") + "\"w" + std::to_string(w) + ":1\"";
  const std::string type = me == 0 ? "chief" : "worker";
  const int index = me == 0 ? 0 : me - 1;
  const std::string tf = R"({"cluster":{"chief":["c:1"],"worker":[)" + workers +
                         R"(]},"task":{"type":")" + type + R"(","index":)" + std::to_string(index) +
                         "}}";
  setenv("TF_CONFIG", tf.c_str(), 1);
  r = ds::resolve_cluster({});
  EXPECT_EQ(r.source, ds::ClusterSource::kTfConfig);
  EXPECT_EQ(r.info.task_type, type);
  EXPECT_EQ(r.info.worker_index, me);
  {
    ds::MultiWorkerMirroredStrategy s(options(1));
    EXPECT_EQ(s.cluster().task_type, type);
    EXPECT_EQ(s.num_replicas_in_sync(), n);
  }
  // A TF_CONFIG whose task does not match the launcher's rank is rejected:
  // by the ranks it does not match, and (issue 14.1) by rank 0, which it
  // matches, naming rank 1: set-up is agreed, nobody goes on alone.
  const std::string wrong = R"({"cluster":{"chief":["c:1"],"worker":[)" + workers +
                            R"(]},"task":{"type":"chief","index":0}})";
  setenv("TF_CONFIG", wrong.c_str(), 1);
  try {
    ds::resolve_cluster({});  // collective: every rank calls it
    ADD_FAILURE() << "accepted";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(me, 0);
    EXPECT_NE(e.message().find("MPI rank " + std::to_string(me)), std::string::npos) << e.message();
  } catch (const ds::AbortedError& e) {
    EXPECT_EQ(me, 0);
    EXPECT_NE(
        e.message().find("rank 0: resolve_cluster aborted: rank 1 failed: [kInvalidArgument]"),
        std::string::npos)
        << e.message();
  }
  // The same through the strategy's constructor: every rank fails together.
  EXPECT_THROW(ds::MultiWorkerMirroredStrategy{options(1)}, ds::Error);
  unsetenv("TF_CONFIG");
  MPI_Barrier(MPI_COMM_WORLD);
}

// Last: the strategy is unusable after a deadline. The last rank stops
// participating; the others fail with DeadlineExceeded within the deadline.
TEST(MultiWorkerMpi, ZZ_ARankThatStopsIsDeadlineExceeded) {
  const auto timeout = std::chrono::milliseconds(1000);
  const int stopper = world_size() - 1;
  {
    ds::MultiWorkerMirroredStrategy s(options(1, timeout));
    if (world_rank() != stopper) {
      const auto t0 = std::chrono::steady_clock::now();
      try {
        s.run([&](ds::ReplicaContext& ctx) {
          std::vector<ds::Tensor> v{ds::Tensor(ds::Shape{8}, ds::DType::kFloat32)};
          ctx.all_reduce(ds::ReduceOp::kSum, v, {"dense/kernel/grad"});
        });
        ADD_FAILURE() << "no error";
      } catch (const ds::DeadlineExceededError& e) {
        std::fprintf(stderr, "[rank %d] %s\n", world_rank(), e.what());
        EXPECT_NE(e.message().find("rank " + std::to_string(stopper) + " did not arrive"),
                  std::string::npos)
            << e.message();
        EXPECT_NE(e.message().find("fused all_reduce call #0"), std::string::npos) << e.message();
      } catch (const ds::AbortedError& e) {
        std::fprintf(stderr, "[rank %d] %s\n", world_rank(), e.what());
        EXPECT_NE(e.message().find("rank " + std::to_string(stopper) + " did not arrive"),
                  std::string::npos)
            << e.message();
      }
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_LT(secs, 1.0 + 3.0) << "deadline was 1 s";
      EXPECT_THROW(s.barrier("after"), ds::AbortedError);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

}  // namespace
