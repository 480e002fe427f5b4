// Every collective of the in-process communicator against closed-form values:
// ranks {1,2,3,4,5,7} x sizes {0,1,7,1000,1<<20} x dtypes x ops x in-place.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "allreduce/reduce_kernels.h"
#include "dtype_util.h"
#include "harness.h"

namespace ds = diststrat;
using ds::testing::get_elem;
using ds::testing::set_elem;

namespace {

constexpr ds::ReduceOp kOps[] = {ds::ReduceOp::kSum, ds::ReduceOp::kMean, ds::ReduceOp::kMin,
                                 ds::ReduceOp::kMax, ds::ReduceOp::kProduct};

// Rank r's element i. Product uses {1, 2} so 7 ranks stay exact in f16.
double input(int r, size_t i, ds::ReduceOp op) {
  if (op == ds::ReduceOp::kProduct) return static_cast<double>((r + i) % 2 + 1);
  return static_cast<double>((r * 3 + i) % 5 + 1);
}

double expected(int ranks, size_t i, ds::ReduceOp op, ds::DType dtype) {
  double acc = input(0, i, op);
  for (int r = 1; r < ranks; ++r) {
    const double v = input(r, i, op);
    switch (op) {
      case ds::ReduceOp::kSum:
      case ds::ReduceOp::kMean:
        acc += v;
        break;
      case ds::ReduceOp::kProduct:
        acc *= v;
        break;
      case ds::ReduceOp::kMin:
        acc = std::min(acc, v);
        break;
      case ds::ReduceOp::kMax:
        acc = std::max(acc, v);
        break;
    }
  }
  if (op == ds::ReduceOp::kMean) {
    acc = ds::dtype_is_floating(dtype) ? acc / ranks : std::trunc(acc / ranks);
  }
  return acc;
}

struct Case {
  int ranks;
  size_t count;
};

class InProcessCollectives : public ::testing::TestWithParam<Case> {};

TEST_P(InProcessCollectives, AllReduceEveryDtypeOpAndPlacement) {
  const auto [ranks, count] = GetParam();
  ds::InProcessGroup group(ranks);
  for (ds::DType dtype : ds::testing::kAllDTypes) {
    const size_t esz = ds::dtype_size(dtype);
    for (ds::ReduceOp op : kOps) {
      for (bool in_place : {false, true}) {
        ds::testing::run_ranks(group, [&](ds::Communicator& c) {
          std::vector<char> in(count * esz + 1), out(count * esz + 1);
          for (size_t i = 0; i < count; ++i) set_elem(in.data(), dtype, i, input(c.rank(), i, op));
          void* dst = in_place ? in.data() : out.data();
          c.all_reduce(in.data(), dst, count, dtype, op, "t");
          for (size_t i = 0; i < count; ++i) {
            const double want = expected(ranks, i, op, dtype);
            const double got = get_elem(dst, dtype, i);
            ASSERT_NEAR(got, want, ds::testing::tolerance(dtype, want))
                << "rank " << c.rank() << " " << ds::dtype_name(dtype) << " "
                << ds::reduce_op_name(op) << " in_place=" << in_place << " i=" << i;
          }
        });
      }
    }
  }
}

TEST_P(InProcessCollectives, BroadcastAllGatherReduceScatter) {
  const auto [ranks, count] = GetParam();
  ds::InProcessGroup group(ranks);
  for (ds::DType dtype : ds::testing::kAllDTypes) {
    const size_t esz = ds::dtype_size(dtype);
    ds::testing::run_ranks(group, [&](ds::Communicator& c) {
      const int root = ranks - 1;
      std::vector<char> buf(count * esz + 1);
      for (size_t i = 0; i < count; ++i)
        set_elem(buf.data(), dtype, i, input(c.rank(), i, ds::ReduceOp::kSum));
      c.broadcast(buf.data(), count, dtype, root, "b");
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(get_elem(buf.data(), dtype, i), input(root, i, ds::ReduceOp::kSum));
      }

      // all_gather, out of place and in place.
      for (bool in_place : {false, true}) {
        std::vector<char> out(count * esz * ranks + 1), in(count * esz + 1);
        char* src = in_place ? out.data() + c.rank() * count * esz : in.data();
        for (size_t i = 0; i < count; ++i)
          set_elem(src, dtype, i, input(c.rank(), i, ds::ReduceOp::kSum));
        c.all_gather(src, out.data(), count, dtype, "g");
        for (int r = 0; r < ranks; ++r) {
          for (size_t i = 0; i < count; ++i) {
            ASSERT_EQ(get_elem(out.data(), dtype, r * count + i), input(r, i, ds::ReduceOp::kSum));
          }
        }
      }

      // reduce_scatter (sum), out of place and in place.
      for (bool in_place : {false, true}) {
        std::vector<char> in(count * esz * ranks + 1), out(count * esz + 1);
        for (size_t i = 0; i < count * ranks; ++i) {
          set_elem(in.data(), dtype, i, input(c.rank(), i, ds::ReduceOp::kSum));
        }
        char* dst = in_place ? in.data() + c.rank() * count * esz : out.data();
        c.reduce_scatter(in.data(), dst, count, dtype, ds::ReduceOp::kSum, "rs");
        for (size_t i = 0; i < count; ++i) {
          const double want = expected(ranks, c.rank() * count + i, ds::ReduceOp::kSum, dtype);
          ASSERT_NEAR(get_elem(dst, dtype, i), want, ds::testing::tolerance(dtype, want));
        }
      }
      c.barrier("end");
    });
  }
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (int ranks : {1, 2, 3, 4, 5, 7}) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{1} << 20}) {
      cases.push_back({ranks, count});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Sweep, InProcessCollectives, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) {
                           return "ranks" + std::to_string(info.param.ranks) + "_count" +
                                  std::to_string(info.param.count);
                         });

// Messages from kernels::kStreamingBytes on write their outputs with
// streaming stores: the direct algorithm at that size, out of place, in
// place and with outputs off a cache-line boundary (the streaming copy's
// unaligned head and tail).
TEST(InProcessStreaming, DirectAllReduceMatchesClosedForm) {
  const size_t count = ds::kernels::kStreamingBytes / sizeof(float) + 13;
  for (int ranks : {2, 3}) {
    ds::InProcessGroup group(ranks);
    for (int placement : {0, 1, 2}) {  // out of place, in place, out at +4 bytes
      ds::testing::run_ranks(group, [&](ds::Communicator& c) {
        std::vector<float> in(count + 1), out(count + 1);
        for (size_t i = 0; i < count; ++i)
          in[i] = static_cast<float>(input(c.rank(), i, ds::ReduceOp::kSum));
        float* dst = placement == 1 ? in.data() : placement == 2 ? out.data() + 1 : out.data();
        c.all_reduce(in.data(), dst, count, ds::DType::kFloat32, ds::ReduceOp::kSum, "big");
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(dst[i], expected(ranks, i, ds::ReduceOp::kSum, ds::DType::kFloat32))
              << "rank " << c.rank() << " of " << ranks << " placement " << placement << " i=" << i;
        }
      });
    }
  }
}

TEST(InProcessFailures, MissingRankGivesDeadlineExceededNamingIt) {
  ds::CommunicationOptions opts;
  opts.timeout = std::chrono::milliseconds(200);
  ds::InProcessGroup group(3, opts);
  std::vector<std::string> messages(3);
  std::vector<ds::ErrorCode> codes(3, ds::ErrorCode::kInternal);
  std::vector<std::thread> threads;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      if (r == 2) return;  // never joins
      float x = 1;
      try {
        group.at(r).all_reduce(&x, &x, 1, ds::DType::kFloat32, ds::ReduceOp::kSum, "grad/w");
      } catch (const ds::Error& e) {
        codes[r] = e.code();
        messages[r] = e.message();
      }
    });
  }
  for (auto& t : threads) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 2.0);
  // The first rank to time out names rank 2; the other is aborted by it or
  // times out itself — either way it fails promptly and names the collective.
  int deadline = 0;
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(codes[r] == ds::ErrorCode::kDeadlineExceeded ||
                codes[r] == ds::ErrorCode::kAborted);
    EXPECT_NE(messages[r].find("rank 2 did not arrive"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("grad/w"), std::string::npos) << messages[r];
    deadline += codes[r] == ds::ErrorCode::kDeadlineExceeded;
  }
  EXPECT_GE(deadline, 1);
}

TEST(InProcessFailures, MismatchedCountOrDtypeIsAnErrorOnEveryRank) {
  ds::InProcessGroup group(3);
  for (int variant = 0; variant < 2; ++variant) {
    std::vector<std::string> messages(3);
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r) {
      threads.emplace_back([&, r] {
        std::vector<double> buf(8, 1.0);
        size_t count = 8;
        ds::DType dtype = ds::DType::kFloat64;
        if (r == 1 && variant == 0) count = 7;
        if (r == 1 && variant == 1) dtype = ds::DType::kInt64;
        try {
          group.at(r).all_reduce(buf.data(), buf.data(), count, dtype, ds::ReduceOp::kSum,
                                 "layer/bias");
        } catch (const ds::InvalidArgumentError& e) {
          messages[r] = e.message();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < 3; ++r) {
      EXPECT_NE(messages[r].find("rank 1 called"), std::string::npos) << messages[r];
      EXPECT_NE(messages[r].find("layer/bias"), std::string::npos) << messages[r];
    }
    // The group stays usable after a detected mismatch.
    ds::testing::run_ranks(group, [](ds::Communicator& c) {
      int32_t v = c.rank();
      c.all_reduce(&v, 1, ds::ReduceOp::kSum);
      ASSERT_EQ(v, 3);
    });
  }
}

TEST(InProcessFailures, AbortWakesWaitersAtOnce) {
  ds::InProcessGroup group(2);
  std::string message;
  std::thread waiter([&] {
    try {
      group.at(0).barrier("step");
    } catch (const ds::AbortedError& e) {
      message = e.message();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  group.at(1).abort("replica 1 failed: out of memory");
  waiter.join();
  EXPECT_NE(message.find("replica 1 failed: out of memory"), std::string::npos) << message;
  group.at(0).reset();
  ds::testing::run_ranks(group, [](ds::Communicator& c) { c.barrier(); });
}

TEST(InProcessFailures, BadRootIsRejected) {
  ds::InProcessGroup group(1);
  float x = 0;
  EXPECT_THROW(group.at(0).broadcast(&x, 1, ds::DType::kFloat32, 3, "x"), ds::InvalidArgumentError);
}

}  // namespace
