// Strategy::reduce(op, PerReplica<Tensor>, axis) (TensorFlow's
// reduce(op, value, axis)) and reduce of PerReplica<int64_t>, under every
// strategy, against closed forms over every replica's values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "diststrat/diststrat.h"
#include "strategy_configs.h"

namespace ds = diststrat;
using Config = ds::testing::StrategyConfig;

namespace {

const std::vector<Config> kAxisConfigs = {
    {"mirrored", 1, 1},     {"mirrored", 1, 3},     {"central_storage", 1, 2},
    {"multi_worker", 2, 2}, {"multi_worker", 3, 1}, {"parameter_server", 1, 2},
};

// Replica r's per-example values: r + 1 rows (uneven, like a short last
// batch), row i = 10 * r + i - 3 (so some are negative).
ds::Tensor rows_of(int r) {
  ds::Tensor t(ds::Shape{r + 1}, ds::DType::kFloat32);
  for (int i = 0; i <= r; ++i) t.data<float>()[i] = float(10 * r + i - 3);
  return t;
}

// Replica r's [2, 3] block: element (i, j) = r + 3 * i + j.
ds::Tensor block_of(int r, ds::DType dtype) {
  ds::Tensor t(ds::Shape{2, 3}, dtype);
  for (int k = 0; k < 6; ++k) {
    if (dtype == ds::DType::kFloat32)
      t.data<float>()[k] = float(r + k);
    else
      t.data<int64_t>()[k] = r + k;
  }
  return t;
}

}  // namespace

TEST(ReduceAxis, AxisZeroCoversEveryRowOfEveryReplica) {
  for (const Config& c : kAxisConfigs) {
    ds::testing::with_strategy(c, [&](ds::Strategy& s, int worker) {
      const int n = s.num_replicas_in_sync();
      std::vector<float> all;
      for (int r = 0; r < n; ++r) {
        const ds::Tensor t = rows_of(r);
        all.insert(all.end(), t.data<float>(), t.data<float>() + t.num_elements());
      }
      double sum = 0;
      for (float v : all) sum += v;
      ds::PerReplica<ds::Tensor> loss =
          s.run([&](ds::ReplicaContext& ctx) { return rows_of(ctx.replica_id()); });
      const std::string where = c.label() + " worker " + std::to_string(worker);
      const ds::Tensor got_sum = s.reduce(ds::ReduceOp::kSum, loss, 0);
      ASSERT_EQ(got_sum.shape(), ds::Shape{}) << where;
      EXPECT_FLOAT_EQ(got_sum.data<float>()[0], float(sum)) << where;
      // The mean of every row (weighted by rows), not the mean of replica means.
      EXPECT_FLOAT_EQ(s.reduce(ds::ReduceOp::kMean, loss, 0).data<float>()[0],
                      float(sum / all.size()))
          << where;
      EXPECT_EQ(s.reduce(ds::ReduceOp::kMax, loss, -1).data<float>()[0],
                *std::max_element(all.begin(), all.end()))
          << where;
      EXPECT_EQ(s.reduce(ds::ReduceOp::kMin, loss, 0).data<float>()[0],
                *std::min_element(all.begin(), all.end()))
          << where;
    });
  }
}

TEST(ReduceAxis, InnerAxesReduceEachValueAfterTheReplicas) {
  for (const Config& c : kAxisConfigs) {
    ds::testing::with_strategy(c, [&](ds::Strategy& s, int worker) {
      const int n = s.num_replicas_in_sync();
      const std::string where = c.label() + " worker " + std::to_string(worker);
      for (ds::DType dtype : {ds::DType::kFloat32, ds::DType::kInt64}) {
        ds::PerReplica<ds::Tensor> v =
            s.run([&](ds::ReplicaContext& ctx) { return block_of(ctx.replica_id(), dtype); });
        // Sum over replicas of (r + 3i + j) = S + n (3i + j), S = n (n - 1) / 2.
        const double S = n * (n - 1) / 2.0;
        auto value = [&](const ds::Tensor& t, int k) {
          return dtype == ds::DType::kFloat32 ? double(t.data<float>()[k])
                                              : double(t.data<int64_t>()[k]);
        };
        for (int axis : {1, -1}) {
          const ds::Tensor sum = s.reduce(ds::ReduceOp::kSum, v, axis);
          ASSERT_EQ(sum.shape(), ds::Shape{2}) << where;
          for (int i = 0; i < 2; ++i) {
            // Sum over j of (S + n (3i + j)) = 3 S + n (9 i + 3).
            EXPECT_EQ(value(sum, i), 3 * S + n * (9.0 * i + 3)) << where << " axis " << axis;
          }
        }
        const ds::Tensor mean = s.reduce(ds::ReduceOp::kMean, v, 1);
        for (int i = 0; i < 2; ++i) {
          const double exact = (3 * S + n * (9.0 * i + 3)) / (3.0 * n);
          const double want = dtype == ds::DType::kFloat32 ? exact : std::trunc(exact);
          EXPECT_NEAR(value(mean, i), want, 1e-5) << where << " " << ds::dtype_name(dtype);
        }
        const ds::Tensor max0 = s.reduce(ds::ReduceOp::kMax, v, 0);  // over rows and replicas
        ASSERT_EQ(max0.shape(), ds::Shape{3}) << where;
        for (int j = 0; j < 3; ++j) EXPECT_EQ(value(max0, j), (n - 1) + 3 + j) << where;
      }
      ds::PerReplica<ds::Tensor> v = s.run(
          [&](ds::ReplicaContext& ctx) { return block_of(ctx.replica_id(), ds::DType::kFloat32); });
      EXPECT_THROW(s.reduce(ds::ReduceOp::kSum, v, 2), ds::InvalidArgumentError) << where;
      EXPECT_THROW(s.reduce(ds::ReduceOp::kSum, v, -3), ds::InvalidArgumentError) << where;
    });
  }
}

TEST(ReduceAxis, EmptyAxisIsASumOfNothingOrAnError) {
  ds::MirroredStrategy s(ds::testing::cpu_devices(2));
  ds::PerReplica<ds::Tensor> none = s.run([&](ds::ReplicaContext&) {
    return ds::Tensor(ds::Shape{0, 2}, ds::DType::kFloat32);
  });
  const ds::Tensor sum = s.reduce(ds::ReduceOp::kSum, none, 0);
  ASSERT_EQ(sum.shape(), ds::Shape{2});
  EXPECT_EQ(sum.data<float>()[1], 0.0f);
  EXPECT_THROW(s.reduce(ds::ReduceOp::kMean, none, 0), ds::InvalidArgumentError);
  EXPECT_THROW(s.reduce(ds::ReduceOp::kMax, none, 0), ds::InvalidArgumentError);
}

TEST(ReduceInt64, CountsAreExactUnderEveryStrategy) {
  for (const Config& c : kAxisConfigs) {
    ds::testing::with_strategy(c, [&](ds::Strategy& s, int worker) {
      const int64_t n = s.num_replicas_in_sync();
      const std::string where = c.label() + " worker " + std::to_string(worker);
      // Values above 2^53, where a double would round: 2^60 + replica id.
      const int64_t big = int64_t(1) << 60;
      ds::PerReplica<int64_t> counts =
          s.run([&](ds::ReplicaContext& ctx) { return big / 16 + int64_t(ctx.replica_id()); });
      EXPECT_EQ(s.reduce(ds::ReduceOp::kSum, counts), n * (big / 16) + n * (n - 1) / 2) << where;
      EXPECT_EQ(s.reduce(ds::ReduceOp::kMax, counts), big / 16 + n - 1) << where;
      EXPECT_EQ(s.reduce(ds::ReduceOp::kMin, counts), big / 16) << where;
      // Mean: (n * big/16 + n(n-1)/2) / n, truncated.
      EXPECT_EQ(s.reduce(ds::ReduceOp::kMean, counts), big / 16 + (n - 1) / 2) << where;
      ds::PerReplica<int64_t> rows =
          s.run([&](ds::ReplicaContext& ctx) { return int64_t(ctx.replica_id() + 1); });
      EXPECT_EQ(s.reduce(ds::ReduceOp::kProduct, rows), [&] {
        int64_t p = 1;
        for (int64_t r = 1; r <= n; ++r) p *= r;
        return p;
      }()) << where;
    });
  }
}
