// What enters a collective or a cross-replica reduction is checked before
// anything is reduced: tensors on a device the replica does not have,
// PerReplica values of the wrong count or undefined, int64 sums that
// overflow. Under every strategy (the checks live in the strategy layer).
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "diststrat/diststrat.h"
#include "strategy_configs.h"
#include "../common/compare.h"

namespace ds = diststrat;
using Config = ds::testing::StrategyConfig;

namespace {

using diststrat_test::contains;
const std::vector<Config> kValidationConfigs = {
    {"mirrored", 1, 2},     {"central_storage", 1, 2},  {"multi_worker", 2, 1},
    {"multi_worker", 2, 2}, {"parameter_server", 1, 2},
};

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const ds::Error& e) {
    EXPECT_EQ(e.code(), ds::ErrorCode::kInvalidArgument) << e.what();
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(CollectiveValidation, TensorsClaimingAGpuAreRejectedOnCpuReplicas) {
  for (const Config& c : kValidationConfigs) {
    ds::testing::with_strategy(c, [&](ds::Strategy& s, int) {
      const std::string where = c.label();
      s.run([&](ds::ReplicaContext& ctx) {
        float buf[2] = {1, 2};
        ds::Tensor fake =
            ds::Tensor::wrap(buf, ds::Shape{2}, ds::DType::kFloat32, ds::Device::gpu(3));
        std::vector<ds::Tensor> v{fake};
        const std::string e = error_of([&] { ctx.all_reduce(ds::ReduceOp::kSum, v, {"grad/w"}); });
        EXPECT_TRUE(contains(e, "all_reduce") && contains(e, "grad/w") &&
                    contains(e, "/device:GPU:3") && contains(e, ctx.device().to_string()))
            << where << ": " << e;
        const std::string g = error_of([&] { ctx.all_gather(fake, "rows"); });
        EXPECT_TRUE(contains(g, "all_gather") && contains(g, "rows") &&
                    contains(g, "/device:GPU:3"))
            << where << ": " << g;
        const std::string a =
            error_of([&] { ctx.all_reduce_async(ds::ReduceOp::kSum, {fake}, {"async"}).wait(); });
        EXPECT_TRUE(contains(a, "async") && contains(a, "/device:GPU:3")) << where << ": " << a;
        // buf was not touched by a host reduction.
        EXPECT_EQ(buf[0], 1.0f) << where;
      });
    });
  }
}

TEST(CollectiveValidation, Int64SumOverflowIsAnErrorAndMeanIsExact) {
  for (const Config& c : kValidationConfigs) {
    ds::testing::with_strategy(c, [&](ds::Strategy& s, int) {
      const std::string where = c.label();
      const int64_t kMax = std::numeric_limits<int64_t>::max();
      const int64_t kMin = std::numeric_limits<int64_t>::min();
      ds::PerReplica<int64_t> big = s.run([&](ds::ReplicaContext&) { return kMax; });
      const std::string e = error_of([&] { s.reduce(ds::ReduceOp::kSum, big); });
      EXPECT_TRUE(contains(e, "int64 sum overflows") && contains(e, "reduce sum"))
          << where << ": " << e;
      EXPECT_EQ(s.reduce(ds::ReduceOp::kMean, big), kMax) << where;
      ds::PerReplica<int64_t> small = s.run([&](ds::ReplicaContext&) { return kMin; });
      EXPECT_EQ(s.reduce(ds::ReduceOp::kMean, small), kMin) << where;
      EXPECT_TRUE(
          contains(error_of([&] { s.reduce(ds::ReduceOp::kSum, small); }), "int64 sum overflows"))
          << where;
      // Mixed signs: no overflow, truncation toward zero.
      ds::PerReplica<int64_t> mixed =
          s.run([&](ds::ReplicaContext& ctx) { return ctx.replica_id() == 0 ? kMax : -kMax + 1; });
      const int64_t n = s.num_replicas_in_sync();
      if (n == 2) {
        EXPECT_EQ(s.reduce(ds::ReduceOp::kSum, mixed), 1) << where;
        EXPECT_EQ(s.reduce(ds::ReduceOp::kMean, mixed), 0) << where;
      }
    });
  }
}

// kProduct of int64 counts is exact too: a product outside int64 is an
// error, not a wrapped number (it used to wrap through the reduce kernel).
TEST(CollectiveValidation, Int64ProductOverflowIsAnErrorAndExactOtherwise) {
  for (const Config& c : kValidationConfigs) {
    ds::testing::with_strategy(c, [&](ds::Strategy& s, int) {
      const std::string where = c.label();
      const int64_t n = s.num_replicas_in_sync();
      if (n < 2) return;
      ds::PerReplica<int64_t> big = s.run([&](ds::ReplicaContext&) { return int64_t(1) << 40; });
      const std::string e = error_of([&] { s.reduce(ds::ReduceOp::kProduct, big); });
      EXPECT_TRUE(contains(e, "int64 product overflows") && contains(e, "reduce product"))
          << where << ": " << e;
      // 3 * (-2)^(n-1) fits and keeps its sign.
      ds::PerReplica<int64_t> small = s.run([&](ds::ReplicaContext& ctx) {
        return ctx.replica_id() == 0 ? int64_t(3) : int64_t(-2);
      });
      int64_t want = 3;
      for (int64_t r = 1; r < n; ++r) want *= -2;
      EXPECT_EQ(s.reduce(ds::ReduceOp::kProduct, small), want) << where;
      // One factor of zero: zero, whatever the others (no overflow error).
      ds::PerReplica<int64_t> zero = s.run([&](ds::ReplicaContext& ctx) {
        return ctx.replica_id() == 0 ? int64_t(0) : std::numeric_limits<int64_t>::max();
      });
      EXPECT_EQ(s.reduce(ds::ReduceOp::kProduct, zero), 0) << where;
    });
  }
}

TEST(CollectiveValidation, PerReplicaOfTheWrongSizeIsRejected) {
  ds::MirroredStrategy s(ds::testing::cpu_devices(2));
  ds::Tensor t(ds::Shape{2}, ds::DType::kFloat32);
  t.zero();
  const ds::PerReplica<ds::Tensor> one_tensor({t});
  for (const std::string& e :
       {error_of([&] { s.reduce(ds::ReduceOp::kSum, one_tensor); }),
        error_of([&] { s.reduce(ds::ReduceOp::kSum, one_tensor, 0); }),
        error_of([&] { s.gather(one_tensor); }),
        error_of([&] { s.reduce(ds::ReduceOp::kSum, ds::PerReplica<int64_t>({int64_t(5)})); }),
        error_of([&] { s.reduce(ds::ReduceOp::kSum, ds::PerReplica<double>({5.0})); }),
        error_of([&] {
          s.reduce(ds::ReduceOp::kSum, ds::PerReplica<float>({5.0f, 1.f, 2.f}));
        })}) {
    EXPECT_TRUE(contains(e, "values") && contains(e, "local replicas") && contains(e, "2")) << e;
    EXPECT_TRUE(contains(e, "1 value") || contains(e, "3 values")) << e;
  }
}

TEST(CollectiveValidation, UndefinedAndMixedValuesAreNamed) {
  ds::MirroredStrategy s(ds::testing::cpu_devices(2));
  ds::Tensor f(ds::Shape{2}, ds::DType::kFloat32);
  f.zero();
  ds::Tensor i(ds::Shape{2}, ds::DType::kInt64);
  i.zero();
  const ds::PerReplica<ds::Tensor> undefined({f, ds::Tensor()});
  for (const std::string& e : {error_of([&] { s.reduce(ds::ReduceOp::kSum, undefined, 0); }),
                               error_of([&] { s.reduce(ds::ReduceOp::kSum, undefined); }),
                               error_of([&] { s.gather(undefined); })}) {
    EXPECT_TRUE(contains(e, "replica 1") && contains(e, "undefined tensor")) << e;
  }
  const std::string mixed = error_of([&] {
    s.reduce(ds::ReduceOp::kSum, ds::PerReplica<ds::Tensor>({f, i}), 0);
  });
  EXPECT_TRUE(contains(mixed, "reduce") && !contains(mixed, "gather:")) << mixed;
}
