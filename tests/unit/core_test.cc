#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <thread>
#include <vector>

#include "core/thread_pool.h"
#include "runtime/work_state.h"
#include "diststrat/diststrat.h"

namespace ds = diststrat;

TEST(Error, CodesAndSubclasses) {
  try {
    ds::throw_error(ds::ErrorCode::kDeadlineExceeded, "rank 1 never came");
    FAIL();
  } catch (const ds::DeadlineExceededError& e) {
    EXPECT_EQ(e.code(), ds::ErrorCode::kDeadlineExceeded);
    EXPECT_EQ(e.message(), "rank 1 never came");
    EXPECT_NE(std::string(e.what()).find("kDeadlineExceeded"), std::string::npos);
  }
}

TEST(Error, CheckRecordsExpressionAndValues) {
  try {
    const int a = 3, b = 4;
    DISTSTRAT_CHECK_EQ(a, b, "all_reduce 'w'");
    FAIL();
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_EQ(e.message(), "all_reduce 'w': a == b failed: 3 vs 4");
  }
}

// A collective's error is finished on the communication thread and read by
// every waiter on its own thread; each waiter throws its own copy, the
// finisher's exception object never crosses threads, and the last one to
// drop the state may be any of them (TSan found the shared-exception version
// racy: the exception's reference count lives in uninstrumented libstdc++).
TEST(Work, AnErrorFinishedOnAnotherThreadReachesEveryWaiterAsItsOwnCopy) {
  for (int round = 0; round < 200; ++round) {
    auto state = std::make_shared<ds::Work::State>();
    std::vector<std::thread> waiters;
    std::vector<std::string> seen(3);
    for (int w = 0; w < 3; ++w) {
      waiters.emplace_back([work = ds::Work(state), &seen, w]() mutable {
        try {
          work.wait();
        } catch (const ds::DeadlineExceededError& e) {
          seen[w] = e.message();
        }
        work = ds::Work();  // drop this waiter's reference at once
      });
    }
    std::thread finisher([raw = state.get()] {
      raw->finish(std::make_exception_ptr(ds::DeadlineExceededError("rank 1 never came")));
    });
    state.reset();  // the waiters (and nobody else) hold the state now
    finisher.join();
    for (auto& t : waiters) t.join();
    for (const std::string& m : seen) ASSERT_EQ(m, "rank 1 never came");
  }
  // A non-diststrat exception keeps its text (as an InternalError).
  ds::Work failed = ds::Work::completed(std::make_exception_ptr(std::runtime_error("boom")));
  try {
    failed.wait();
    FAIL();
  } catch (const ds::InternalError& e) {
    EXPECT_EQ(e.message(), "boom");
  }
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(ds::dtype_size(ds::DType::kFloat32), 4u);
  EXPECT_EQ(ds::dtype_size(ds::DType::kBFloat16), 2u);
  EXPECT_EQ(ds::dtype_size(ds::DType::kInt64), 8u);
  for (auto d : {ds::DType::kFloat32, ds::DType::kFloat64, ds::DType::kFloat16,
                 ds::DType::kBFloat16, ds::DType::kInt32, ds::DType::kInt64}) {
    EXPECT_EQ(ds::dtype_from_name(ds::dtype_name(d)), d);
    EXPECT_EQ(ds::dtype_from_name(ds::dtype_safetensors_name(d)), d);
  }
  EXPECT_THROW(ds::dtype_from_name("uint7"), ds::InvalidArgumentError);
}

TEST(DType, HalfRoundTripsExactValuesAndRoundsToNearestEven) {
  for (float f : {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 6.103515625e-05f, 5.960464477539063e-08f,
                  1024.0f, 0.333251953125f}) {
    EXPECT_EQ(static_cast<float>(ds::Half(f)), f) << f;
  }
  EXPECT_TRUE(std::isinf(static_cast<float>(ds::Half(70000.0f))));
  EXPECT_TRUE(std::isnan(static_cast<float>(ds::Half(std::nanf("")))));
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1).
  EXPECT_EQ(static_cast<float>(ds::Half(1.0f + 0x1p-11f)), 1.0f);
  EXPECT_EQ(static_cast<float>(ds::Half(1.0f + 3 * 0x1p-11f)), 1.0f + 0x1p-9f);
  // Every half bit pattern survives half -> float -> half.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float f = ds::Half::to_float(static_cast<uint16_t>(bits));
    if (std::isnan(f)) continue;
    ASSERT_EQ(ds::Half::from_float(f), bits) << bits;
  }
}

TEST(DType, BFloat16) {
  EXPECT_EQ(static_cast<float>(ds::BFloat16(1.0f)), 1.0f);
  EXPECT_EQ(static_cast<float>(ds::BFloat16(-3.0f)), -3.0f);
  EXPECT_EQ(static_cast<float>(ds::BFloat16(1.0f + 0x1p-8f)), 1.0f);  // tie to even
  EXPECT_NEAR(static_cast<float>(ds::BFloat16(3.14159f)), 3.14159f, 0.02f);
}

TEST(Device, ParseAndPrint) {
  EXPECT_EQ(ds::Device::parse("cpu:1"), ds::Device::cpu(1));
  EXPECT_EQ(ds::Device::parse("/device:GPU:3"), ds::Device::gpu(3));
  EXPECT_EQ(ds::Device::gpu(2).to_string(), "/device:GPU:2");
  EXPECT_THROW(ds::Device::parse("tpu:0"), ds::InvalidArgumentError);
  EXPECT_THROW(ds::Device::parse("cpu:x"), ds::InvalidArgumentError);
}

TEST(Tensor, OwningZeroFilledAndClone) {
  ds::Tensor t(ds::Shape{3, 4}, ds::DType::kFloat32);
  EXPECT_TRUE(t.owns_memory());
  EXPECT_EQ(t.num_elements(), 12);
  EXPECT_EQ(t.nbytes(), 48u);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(t.data<float>()[i], 0.0f);
  t.data<float>()[5] = 2.0f;
  ds::Tensor c = t.clone();
  t.data<float>()[5] = 7.0f;
  EXPECT_EQ(c.data<float>()[5], 2.0f);
  EXPECT_THROW(t.data<double>(), ds::InvalidArgumentError);
}

TEST(Tensor, WrapIsAViewOfUserMemory) {
  std::vector<int32_t> buf{1, 2, 3, 4, 5, 6};
  ds::Tensor t = ds::Tensor::wrap(buf.data(), ds::Shape{2, 3}, ds::DType::kInt32);
  EXPECT_FALSE(t.owns_memory());
  t.data<int32_t>()[0] = 42;
  EXPECT_EQ(buf[0], 42);
  ds::Tensor row = t.slice_rows(1, 2);
  EXPECT_EQ(row.shape(), ds::Shape({1, 3}));
  EXPECT_EQ(row.data<int32_t>()[0], 4);
  EXPECT_THROW(t.slice_rows(1, 3), ds::InvalidArgumentError);
  EXPECT_THROW(t.reshape(ds::Shape{4}), ds::InvalidArgumentError);
  EXPECT_EQ(t.reshape(ds::Shape{6}).data<int32_t>()[5], 6);
}

TEST(Tensor, NegativeDimsAndGpuAllocationAreRejected) {
  EXPECT_THROW(ds::Shape({2, -1}), ds::InvalidArgumentError);
  // GPU memory only exists inside a GPU strategy's replica scope.
  EXPECT_THROW(ds::Tensor(ds::Shape{2}, ds::DType::kFloat32, ds::Device::gpu(0)),
               ds::FailedPreconditionError);
}

TEST(Logger, LevelFromOptionAndEnvironment) {
  std::vector<std::string> lines;
  {
    ::unsetenv("DISTSTRAT_LOG_LEVEL");
    ds::Logger log(ds::LogLevel::kWarning, "[t]");
    log.set_sink([&](ds::LogLevel, const std::string& m) { lines.push_back(m); });
    log.info("hidden");
    log.warning("shown ", 1);
    ASSERT_EQ(lines.size(), 1u);
    EXPECT_EQ(lines[0], "[t] shown 1");
  }
  ::setenv("DISTSTRAT_LOG_LEVEL", "debug", 1);
  ds::Logger log(ds::LogLevel::kError);
  EXPECT_EQ(log.level(), ds::LogLevel::kDebug);
  ::unsetenv("DISTSTRAT_LOG_LEVEL");
  EXPECT_THROW(ds::parse_log_level("loud"), ds::InvalidArgumentError);
}

TEST(ThreadPool, RunsOnPersistentThreadsAndReportsErrors) {
  ds::ThreadPool pool(3);
  std::vector<std::thread::id> first(3), second(3);
  pool.run_all([&](int i) { first[i] = std::this_thread::get_id(); });
  auto errors = pool.run_all([&](int i) {
    second[i] = std::this_thread::get_id();
    if (i == 1) throw std::runtime_error("boom");
  });
  EXPECT_EQ(first, second);
  EXPECT_EQ(errors.errors[0], nullptr);
  EXPECT_NE(errors.errors[1], nullptr);
  EXPECT_TRUE(errors.unfinished.empty());
}

TEST(Initializers, DeterministicPerSeed) {
  ds::Tensor a(ds::Shape{64, 32}, ds::DType::kFloat32), b(ds::Shape{64, 32}, ds::DType::kFloat32);
  ds::init::GlorotUniform{7}(a);
  ds::init::GlorotUniform{7}(b);
  const float limit = std::sqrt(6.0f / 96.0f);
  for (int i = 0; i < a.num_elements(); ++i) {
    ASSERT_EQ(a.data<float>()[i], b.data<float>()[i]);
    ASSERT_LE(std::fabs(a.data<float>()[i]), limit);
  }
  ds::init::GlorotUniform{8}(b);
  EXPECT_NE(a.data<float>()[0], b.data<float>()[0]);
}
