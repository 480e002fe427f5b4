#include <gtest/gtest.h>
#include <malloc.h>
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
// From the ASan runtime (GCC does not ship sanitizer/allocator_interface.h).
extern "C" size_t __sanitizer_get_current_allocated_bytes();
#endif

#include <cstring>
#include <mutex>
#include <set>

#include "runtime/variable_impl.h"
#include "diststrat/central_storage.h"
#include "diststrat/diststrat.h"
#include "training_util.h"

namespace ds = diststrat;

namespace {

using ds::testing::cpu_devices;

class CentralStorageEquivalence : public ::testing::TestWithParam<int> {};

TEST_P(CentralStorageEquivalence, SameWeightsAsSingleDeviceAfter20Steps) {
  const int replicas = GetParam();
  const ds::nn::Mlp mlp({784, 64, 32, 10});
  // 20 full batches of 64 and a short 21st of 3 rows (one replica of 4 gets none).
  const ds::Dataset data = ds::testing::synthetic(64 * 20 + 3, 11);
  const auto ref = ds::testing::reference_training(mlp, data, 64, 21, 0.05f, 0.9f);
  ds::CentralStorageStrategy strategy(cpu_devices(replicas));
  std::vector<ds::Variable> vars;
  ds::testing::train_under(strategy, mlp, data, 64, 21, 0.05f, 0.9f, &vars);
  ASSERT_EQ(vars.size(), ref.size());
  for (size_t i = 0; i < vars.size(); ++i) {
    ASSERT_EQ(vars[i].impl().copies.size(), 1u) << vars[i].name();
    EXPECT_LE(ds::testing::max_abs_diff(vars[i].value(), ref[i]), 1e-4) << vars[i].name();
    // The momentum slot exists once too.
    EXPECT_EQ(vars[i].impl().slot("momentum").size(), 1u);
  }
  // One update per step, not one per replica.
  EXPECT_EQ(strategy.variable("optimizer/iterations").value().data<int64_t>()[0], 21);
}

INSTANTIATE_TEST_SUITE_P(Replicas, CentralStorageEquivalence, ::testing::Values(1, 2, 4));

TEST(CentralStorage, EveryReplicaReadsTheSameStorage) {
  ds::CentralStorageStrategy strategy(cpu_devices(4));
  ds::Variable w = strategy.create_variable("w", ds::Shape{8, 3}, ds::DType::kFloat32,
                                            ds::init::GlorotUniform{3});
  std::mutex mu;
  std::set<const void*> seen;
  strategy.run([&](ds::ReplicaContext& ctx) {
    const ds::Tensor t = w.read(ctx);
    std::lock_guard<std::mutex> lock(mu);
    seen.insert(t.data());
  });
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(*seen.begin(), w.impl().copies[0].data());
  // A write through one replica's read is visible to every replica (one copy).
  strategy.run([&](ds::ReplicaContext& ctx) {
    if (ctx.replica_id() == 2) w.read(ctx).data<float>()[5] = 42.0f;
    ctx.barrier();
    EXPECT_EQ(w.read(ctx).data<float>()[5], 42.0f);
  });
}

// Bytes of heap in use (small blocks + mmapped large blocks). Under
// AddressSanitizer/ThreadSanitizer malloc is the sanitizer's, which mallinfo2 does not see: ask it.
size_t heap_in_use() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return __sanitizer_get_current_allocated_bytes();
#else
  const struct mallinfo2 mi = mallinfo2();
  return mi.uordblks + mi.hblkhd;
#endif
}

TEST(CentralStorage, OneAllocationPerVariableWhateverTheReplicaCount) {
  const int64_t rows = 1024, cols = 1024;  // 4 MiB
  const size_t bytes = rows * cols * sizeof(float);
  ds::CentralStorageStrategy central(cpu_devices(4));
  ds::MirroredStrategy mirrored(cpu_devices(4));
  auto grow = [&](ds::Strategy& s) {
    const size_t before = heap_in_use();
    ds::Variable v =
        s.create_variable("big", ds::Shape{rows, cols}, ds::DType::kFloat32, ds::init::Zeros{});
    return static_cast<double>(heap_in_use() - before);
  };
  const double central_bytes = grow(central);
  const double mirrored_bytes = grow(mirrored);
  // Central storage: one copy (plus bookkeeping); mirrored: one per replica.
  EXPECT_GE(central_bytes, 0.99 * bytes);
  EXPECT_LT(central_bytes, 1.1 * bytes);
  EXPECT_GE(mirrored_bytes, 3.9 * bytes);
}

TEST(CentralStorage, AdamSlotsAndStepLiveOnceAndMatchSingleDevice) {
  ds::CentralStorageStrategy strategy(cpu_devices(3));
  ds::Variable w =
      strategy.create_variable("w", ds::Shape{4}, ds::DType::kFloat32, ds::init::Constant{1.0});
  ds::Adam adam(strategy, {0.1f});
  for (int s = 1; s <= 5; ++s) {
    strategy.run([&](ds::ReplicaContext& ctx) {
      // Each replica contributes a third of grad(0.5 w^2) = w.
      ds::Tensor g = w.read(ctx).clone();
      for (int i = 0; i < 4; ++i) g.data<float>()[i] /= 3.0f;
      adam.apply_gradients(ctx, {{g, w}});
    });
  }
  ds::Tensor init(ds::Shape{4}, ds::DType::kFloat32);
  ds::init::Constant{1.0}(init);
  const ds::Tensor ref = ds::testing::adam_reference(adam, init, 5);
  EXPECT_LE(ds::testing::max_abs_diff(w.value(), ref), 1e-6);
  EXPECT_EQ(w.impl().slot("m").size(), 1u);
  EXPECT_EQ(adam.iterations().value().data<int64_t>()[0], 5);
}

TEST(CentralStorage, MismatchedVariablesAcrossReplicasIsAClearError) {
  ds::CentralStorageStrategy strategy(cpu_devices(2));
  ds::Variable a =
      strategy.create_variable("a", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::Variable b =
      strategy.create_variable("b", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::SGD sgd(strategy, {0.1f});
  try {
    strategy.run([&](ds::ReplicaContext& ctx) {
      ds::Tensor g(ds::Shape{2}, ds::DType::kFloat32);
      sgd.apply_gradients(ctx, {{g, ctx.replica_id() == 0 ? a : b}});
    });
    FAIL();
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(e.message().find("replica 1 passed variable 'b'"), std::string::npos) << e.message();
  }
}

TEST(CentralStorage, GpuParameterDeviceNeedsTheGpuBackend) {
  ds::CentralStorageOptions o;
  o.parameter_device = ds::Device::gpu(0);
  EXPECT_THROW(ds::CentralStorageStrategy s(o), ds::UnimplementedError);
}

}  // namespace
