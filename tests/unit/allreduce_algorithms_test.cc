// Every point-to-point algorithm over the in-process transport:
// ranks {1,2,3,4,5,7} x sizes {0,1,7,1000,1<<20} x dtypes x ops x in-place,
// against closed-form values (tests/common/collective_cases.h).
//
// To keep the sweep fast on a 2-core machine, sizes {0,1,7,1000} run every
// dtype x op x in-place, and 1<<20 runs f32 sum and bf16 mean (in place and
// not): the dtype/op dispatch is the same type-erased kernel call at every
// size, while the large size is what exercises the multi-segment paths
// (together with the "ring_small_segments" case, whose 64-byte segments
// force many segments even at 1000 elements).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <exception>
#include <functional>
#include <thread>

#include "../common/collective_cases.h"
#include "harness.h"
#include "allreduce/algorithm.h"
#include "allreduce/transport.h"
#include "allreduce/transport_communicator.h"
#include "diststrat/algorithm_registry.h"

namespace ds = diststrat;
namespace tc = diststrat::testing_cases;

namespace {

// Runs fn(rank's communicator) on n threads over an in-process transport and
// re-raises the first rank's exception.
void run_transport_ranks(int n, const ds::CommunicationOptions& options,
                         const std::function<void(ds::TransportCommunicator&)>& fn) {
  ds::InProcessTransportGroup group(n);
  ds::testing::run_threads(
      n,
      [&](int r) {
        ds::TransportCommunicator comm(group.at(r), options);
        fn(comm);
      },
      [&](int r) { group.at(r).abort("rank " + std::to_string(r) + " failed"); });
}

struct AlgoCase {
  const char* label;
  ds::Algorithm algorithm;
  size_t segment_bytes;
  int group_size;  // hierarchical: ranks per "node"
};

class TransportAllReduce : public ::testing::TestWithParam<std::tuple<AlgoCase, int>> {};

TEST_P(TransportAllReduce, SweepMatchesClosedForm) {
  const AlgoCase c = std::get<0>(GetParam());
  const int n = std::get<1>(GetParam());
  ds::CommunicationOptions o;
  o.algorithm = c.algorithm;
  o.segment_bytes = c.segment_bytes;
  o.hierarchical_group_size = c.group_size;
  o.timeout = std::chrono::seconds(60);
  std::atomic<int> failures{0};
  run_transport_ranks(n, o, [&](ds::TransportCommunicator& comm) {
    auto one = [&](size_t count, ds::DType dtype, ds::ReduceOp op, bool in_place) {
      std::vector<char> in = tc::make_input(comm.rank(), count, dtype, op);
      std::vector<char> out(in.size(), 0);
      void* dst = in_place ? in.data() : out.data();
      comm.all_reduce(in.data(), dst, count, dtype, op, "t");
      auto ok = tc::check_reduced(dst, count, dtype, op, n);
      if (!ok && failures++ < 5) {
        ADD_FAILURE() << c.label << " rank " << comm.rank() << " of " << n << ", count " << count
                      << (in_place ? " in place: " : ": ") << ok.message();
      }
    };
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}}) {
      for (ds::DType dtype : tc::all_dtypes()) {
        for (ds::ReduceOp op : tc::all_ops()) {
          for (bool in_place : {false, true}) one(count, dtype, op, in_place);
        }
      }
    }
    for (bool in_place : {false, true}) {
      one(1 << 20, ds::DType::kFloat32, ds::ReduceOp::kSum, in_place);
      one(1 << 20, ds::DType::kBFloat16, ds::ReduceOp::kMean, in_place);
    }
  });
}

const AlgoCase kAlgos[] = {
    {"ring", ds::Algorithm::kRing, 0, 0},
    {"ring_small_segments", ds::Algorithm::kRing, 64, 0},
    {"halving_doubling", ds::Algorithm::kHalvingDoubling, 0, 0},
    {"tree", ds::Algorithm::kTree, 0, 0},
    {"reduce_to_one", ds::Algorithm::kReduceToOne, 0, 0},
    {"hierarchical_by_2", ds::Algorithm::kHierarchical, 0, 2},
    {"hierarchical_by_3_small_segments", ds::Algorithm::kHierarchical, 64, 3},
    {"auto", ds::Algorithm::kAuto, 0, 0},
};

INSTANTIATE_TEST_SUITE_P(Algorithms, TransportAllReduce,
                         ::testing::Combine(::testing::ValuesIn(kAlgos),
                                            ::testing::Values(1, 2, 3, 4, 5, 7)),
                         [](const ::testing::TestParamInfo<std::tuple<AlgoCase, int>>& info) {
                           return std::string(std::get<0>(info.param).label) + "_" +
                                  std::to_string(std::get<1>(info.param)) + "_ranks";
                         });

// broadcast / all_gather / reduce_scatter / barrier over the transport.
class TransportCollectives : public ::testing::TestWithParam<std::tuple<size_t, int>> {};

TEST_P(TransportCollectives, BroadcastGatherScatterBarrier) {
  ds::CommunicationOptions o;
  o.segment_bytes = std::get<0>(GetParam());
  o.timeout = std::chrono::seconds(60);
  const int n = std::get<1>(GetParam());
  run_transport_ranks(n, o, [&](ds::TransportCommunicator& comm) {
    const int me = comm.rank();
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}}) {
      for (int root = 0; root < n; ++root) {
        std::vector<int64_t> b(count, -1);
        if (me == root)
          for (size_t i = 0; i < count; ++i) b[i] = static_cast<int64_t>(i * 5 + root);
        comm.broadcast(b.data(), count, ds::DType::kInt64, root, "b");
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(b[i], static_cast<int64_t>(i * 5 + root));
      }
      std::vector<float> mine(count), all(count * n, -1.f);
      for (size_t i = 0; i < count; ++i) mine[i] = static_cast<float>(me * 1000 + i);
      comm.all_gather(mine.data(), all.data(), count, ds::DType::kFloat32, "g");
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(all[r * count + i], r * 1000 + i);
      std::vector<float> inplace(count * n, -1.f);
      std::copy(mine.begin(), mine.end(), inplace.begin() + me * count);
      comm.all_gather(inplace.data() + me * count, inplace.data(), count, ds::DType::kFloat32, "g");
      ASSERT_EQ(inplace, all);
      for (ds::DType dtype : tc::all_dtypes()) {
        for (ds::ReduceOp op : tc::all_ops()) {
          std::vector<char> in = tc::make_input(me, count * n, dtype, op);
          std::vector<char> out(count * ds::dtype_size(dtype) + 1);
          comm.reduce_scatter(in.data(), out.data(), count, dtype, op, "rs");
          ASSERT_TRUE(tc::check_reduced(out.data(), count, dtype, op, n, me * count));
          // In place: out == in + rank * count.
          char* own = in.data() + me * count * ds::dtype_size(dtype);
          in = tc::make_input(me, count * n, dtype, op);
          own = in.data() + me * count * ds::dtype_size(dtype);
          comm.reduce_scatter(in.data(), own, count, dtype, op, "rs");
          ASSERT_TRUE(tc::check_reduced(own, count, dtype, op, n, me * count));
        }
      }
      comm.barrier("b");
    }
  });
}

INSTANTIATE_TEST_SUITE_P(RanksAndSegments, TransportCollectives,
                         ::testing::Combine(::testing::Values(size_t{0}, size_t{64}),
                                            ::testing::Values(1, 2, 3, 4, 5, 7)));

// The user-facing registry: an algorithm of one's own, selected by name.
TEST(CustomAlgorithm, RegisteredAlgorithmRunsAndUnknownNameIsRejected) {
  auto registry = std::make_shared<ds::AlgorithmRegistry>();
  // A naive ring: n - 1 rounds of passing the running partial sums along.
  registry->add("naive_ring", [](ds::PeerChannel& ch, void* data, size_t count, ds::DType dtype,
                                 ds::ReduceOp) {
    const size_t bytes = count * ds::dtype_size(dtype);
    const int n = ch.size(), me = ch.rank();
    std::vector<char> pass(static_cast<const char*>(data), static_cast<const char*>(data) + bytes);
    std::vector<char> got(bytes);
    for (int step = 0; step < n - 1; ++step) {
      ch.send_recv((me + 1) % n, pass.data(), bytes, (me + n - 1) % n, got.data(), bytes);
      ch.reduce_into(data, got.data(), count);
      pass.swap(got);
    }
  });
  EXPECT_THROW(
      registry->add("naive_ring", [](ds::PeerChannel&, void*, size_t, ds::DType, ds::ReduceOp) {}),
      ds::InvalidArgumentError);
  ds::CommunicationOptions o;
  o.algorithm = ds::Algorithm::kCustom;
  o.custom_algorithm = "naive_ring";
  o.algorithm_registry = registry;
  for (int n : {1, 2, 3, 5}) {
    run_transport_ranks(n, o, [&](ds::TransportCommunicator& comm) {
      for (ds::ReduceOp op : tc::all_ops()) {
        std::vector<char> in = tc::make_input(comm.rank(), 1000, ds::DType::kFloat64, op);
        comm.all_reduce(in.data(), in.data(), 1000, ds::DType::kFloat64, op, "c");
        ASSERT_TRUE(tc::check_reduced(in.data(), 1000, ds::DType::kFloat64, op, n));
      }
    });
  }
  o.custom_algorithm = "no_such_algorithm";
  ds::InProcessTransportGroup group(1);
  EXPECT_THROW(ds::TransportCommunicator(group.at(0), o), ds::InvalidArgumentError);
}

TEST(AutoSelection, ThresholdsComeFromOptions) {
  ds::CommunicationOptions o;
  EXPECT_EQ(ds::algo::choose_auto(o, 1024, 4, 1), ds::Algorithm::kTree);
  EXPECT_EQ(ds::algo::choose_auto(o, 1024, 2, 1), ds::Algorithm::kHalvingDoubling);
  EXPECT_EQ(ds::algo::choose_auto(o, 8 << 20, 4, 1), ds::Algorithm::kRing);
  EXPECT_EQ(ds::algo::choose_auto(o, 8 << 20, 4, 2), ds::Algorithm::kHierarchical);
  o.auto_tiny_message_bytes = 1 << 10;
  o.auto_small_message_bytes = 16 << 20;
  EXPECT_EQ(ds::algo::choose_auto(o, 1024, 4, 1), ds::Algorithm::kTree);
  EXPECT_EQ(ds::algo::choose_auto(o, 8 << 20, 4, 1), ds::Algorithm::kHalvingDoubling);
  EXPECT_EQ(ds::algo::choose_auto(o, 32 << 20, 4, 1), ds::Algorithm::kRing);
}

TEST(TransportCommunicator, AbortMakesCallsFailWithAborted) {
  ds::CommunicationOptions o;
  o.timeout = std::chrono::seconds(10);
  run_transport_ranks(2, o, [&](ds::TransportCommunicator& comm) {
    float v = 1.f;
    comm.all_reduce(&v, &v, 1, ds::DType::kFloat32, ds::ReduceOp::kSum, "before");
    EXPECT_EQ(v, 2.f);
    comm.barrier();
    if (comm.rank() == 0) comm.abort("test abort");
    // Rank 0 fails at once; rank 1's transport peer (the in-process group)
    // is aborted too, so it fails instead of waiting out the deadline.
    EXPECT_THROW(comm.all_reduce(&v, &v, 1, ds::DType::kFloat32, ds::ReduceOp::kSum, "after"),
                 ds::AbortedError);
  });
}

// Calls that differ across ranks, the odd one being the last rank: before any
// byte of the call moves, every rank throws the same InvalidArgumentError
// naming rank 0's call and the odd rank's; no output is written and the
// group stays usable. (Without the comparison, same-size mismatches such as
// the op, the dtype, the root or kMean vs kSum returned wrong numbers on
// every rank, and the others failed only at the deadline.)
TEST(TransportCommunicator, MismatchedCallsFailOnEveryRankBeforeAnyByteMoves) {
  const int n = 4, odd = n - 1;
  using Call = std::function<void(ds::TransportCommunicator&, bool, std::vector<float>&)>;
  struct Variant {
    const char* label;
    std::string rank0, odd_rank;  // how the message names each call
    Call call;
    std::function<void(ds::CommunicationOptions&)> odd_options = {};
    bool everyone = false;  // odd_options apply to every rank
  };
  auto reduce = [](size_t count, ds::DType dtype, ds::ReduceOp op) {
    return [=](ds::TransportCommunicator& c, bool, std::vector<float>& b) {
      c.all_reduce(b.data(), b.data(), count, dtype, op, "w/grad");
    };
  };
  auto by_rank = [](Call normal, Call odd_call) {
    return [=](ds::TransportCommunicator& c, bool is_odd, std::vector<float>& b) {
      (is_odd ? odd_call : normal)(c, is_odd, b);
    };
  };
  const ds::DType f32 = ds::DType::kFloat32, i32 = ds::DType::kInt32;
  const ds::ReduceOp sum = ds::ReduceOp::kSum;
  std::vector<Variant> variants{
      {"op", "all_reduce of 4 float32 sum (ring)", "all_reduce of 4 float32 max (ring)",
       by_rank(reduce(4, f32, sum), reduce(4, f32, ds::ReduceOp::kMax))},
      {"mean", "all_reduce of 4 float32 sum (ring)", "all_reduce of 4 float32 mean (ring)",
       by_rank(reduce(4, f32, sum), reduce(4, f32, ds::ReduceOp::kMean))},
      {"dtype", "all_reduce of 4 float32 sum (ring)", "all_reduce of 4 int32 sum (ring)",
       by_rank(reduce(4, f32, sum), reduce(4, i32, sum))},
      {"count", "all_reduce of 4 float32 sum (ring)", "all_reduce of 3 float32 sum (ring)",
       by_rank(reduce(4, f32, sum), reduce(3, f32, sum))},
      {"algorithm", "all_reduce of 4 float32 sum (ring)", "all_reduce of 4 float32 sum (tree)",
       reduce(4, f32, sum),
       [](ds::CommunicationOptions& o) { o.algorithm = ds::Algorithm::kTree; }},
      {"segments", "all_reduce of 4 float32 sum (ring) with 1048576-byte segments",
       "all_reduce of 4 float32 sum (ring) with 64-byte segments", reduce(4, f32, sum),
       [](ds::CommunicationOptions& o) { o.segment_bytes = 64; }},
      {"root", "broadcast of 4 float32 from root 0", "broadcast of 4 float32 from root 1",
       [](ds::TransportCommunicator& c, bool is_odd, std::vector<float>& b) {
         c.broadcast(b.data(), 4, ds::DType::kFloat32, is_odd ? 1 : 0, "w/grad");
       }},
      {"broadcast dtype", "broadcast of 4 float32 from root 0", "broadcast of 4 int32 from root 0",
       [](ds::TransportCommunicator& c, bool is_odd, std::vector<float>& b) {
         c.broadcast(b.data(), 4, is_odd ? ds::DType::kInt32 : ds::DType::kFloat32, 0, "w/grad");
       }},
      {"kind", "all_gather of 1 float32", "barrier",
       [n](ds::TransportCommunicator& c, bool is_odd, std::vector<float>& b) {
         std::vector<float> all(n, -1.f);
         if (is_odd) return c.barrier("w/grad");
         c.all_gather(b.data(), all.data(), 1, ds::DType::kFloat32, "w/grad");
         std::copy(all.begin(), all.begin() + 4, b.begin());
       }},
      {"reduce_scatter op", "reduce_scatter of 1 float32 sum", "reduce_scatter of 1 float32 min",
       [n](ds::TransportCommunicator& c, bool is_odd, std::vector<float>& b) {
         std::vector<float> in(n, 7.f);
         c.reduce_scatter(in.data(), b.data(), 1, ds::DType::kFloat32,
                          is_odd ? ds::ReduceOp::kMin : ds::ReduceOp::kSum, "w/grad");
       }},
  };
  // The op mismatch under every point-to-point algorithm.
  for (ds::Algorithm a : {ds::Algorithm::kHalvingDoubling, ds::Algorithm::kTree,
                          ds::Algorithm::kReduceToOne, ds::Algorithm::kHierarchical}) {
    const std::string name = ds::algorithm_name(a);
    variants.push_back({"op", "all_reduce of 4 float32 sum (" + name + ")",
                        "all_reduce of 4 float32 max (" + name + ")",
                        by_rank(reduce(4, f32, sum), reduce(4, f32, ds::ReduceOp::kMax))});
    variants.back().odd_options = [a](ds::CommunicationOptions& o) { o.algorithm = a; };
    variants.back().everyone = true;
  }
  for (size_t v = 0; v < variants.size(); ++v) {
    const Variant& var = variants[v];
    const bool everyone = var.everyone;
    SCOPED_TRACE(std::string(var.label) + " (variant " + std::to_string(v) + ")");
    ds::InProcessTransportGroup group(n);
    std::vector<std::string> messages(n);
    std::vector<std::vector<float>> after(n);
    ds::testing::run_threads(
        n,
        [&](int r) {
          ds::CommunicationOptions o;
          o.algorithm = ds::Algorithm::kRing;
          o.hierarchical_group_size = 2;
          o.timeout = std::chrono::seconds(20);
          if (var.odd_options && (r == odd || everyone)) var.odd_options(o);
          ds::TransportCommunicator comm(group.at(r), o);
          std::vector<float> b(4, static_cast<float>(r + 1));
          try {
            var.call(comm, r == odd, b);
          } catch (const ds::InvalidArgumentError& e) {
            messages[r] = e.message();
          }
          after[r] = b;
          // Usable afterwards (the same call on every rank), unless the ranks'
          // options differ for good.
          if (var.odd_options && !everyone) return;
          std::vector<float> ok(4, 1.f);
          comm.all_reduce(ok.data(), ok.data(), 4, ds::DType::kFloat32, ds::ReduceOp::kSum,
                          "after");
          EXPECT_EQ(ok[3], static_cast<float>(n));
        },
        [&](int r) { group.at(r).abort("rank " + std::to_string(r) + " failed"); });
    for (int r = 0; r < n; ++r) {
      const std::string& m = messages[r];
      EXPECT_NE(m.find("rank " + std::to_string(r) + ": "), std::string::npos) << m;
      EXPECT_NE(m.find("'w/grad'"), std::string::npos) << m;
      EXPECT_NE(m.find("ranks disagree on the call: rank 0 has " + var.rank0 + " 'w/grad', rank " +
                       std::to_string(odd) + " has " + var.odd_rank + " 'w/grad'"),
                std::string::npos)
          << m;
      EXPECT_EQ(after[r], std::vector<float>(4, static_cast<float>(r + 1))) << "rank " << r;
    }
  }
}

// The caller's name is part of the comparison: a rank that skips one
// collective of a sequence (its step_7 would meet the others' step_6, and
// every later call would pair different tensors of the same shape) fails at
// the first mispaired call on every rank, naming both names. Before the name
// was compared, the skipping rank finished "successfully" and the others
// failed at the deadline of the last call, naming the wrong collective.
TEST(TransportCommunicator, ASkippedCollectiveIsAnErrorAtTheFirstMispairedCall) {
  const int n = 3, skipper = n - 1;
  ds::InProcessTransportGroup group(n);
  std::vector<std::string> messages(n);
  std::vector<int> failed_at(n, -1);
  ds::testing::run_threads(
      n,
      [&](int r) {
        ds::CommunicationOptions o;
        o.timeout = std::chrono::seconds(20);
        ds::TransportCommunicator comm(group.at(r), o);
        for (int step = 0; step < 10; ++step) {
          if (r == skipper && step == 6) continue;
          float x = 1.f;
          try {
            comm.all_reduce(&x, &x, 1, ds::DType::kFloat32, ds::ReduceOp::kSum,
                            "step_" + std::to_string(step));
          } catch (const ds::InvalidArgumentError& e) {
            messages[r] = e.message();
            failed_at[r] = step;
            return;
          }
          EXPECT_EQ(x, static_cast<float>(n)) << "rank " << r << " step " << step;
        }
      },
      [&](int r) { group.at(r).abort("rank " + std::to_string(r) + " failed"); });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(failed_at[r], r == skipper ? 7 : 6) << "rank " << r << ": " << messages[r];
    EXPECT_NE(messages[r].find("ranks disagree on the call: rank 0 has all_reduce of 1 float32 "
                               "sum (tree) 'step_6', rank 2 has all_reduce of 1 float32 sum "
                               "(tree) 'step_7'"),
              std::string::npos)
        << messages[r];
  }
}

// The same in an InProcessGroup (its own comparison of descriptors).
TEST(InProcessGroup, ASkippedCollectiveIsAnErrorAtTheFirstMispairedCall) {
  const int n = 3, skipper = 1;
  ds::CommunicationOptions o;
  o.timeout = std::chrono::seconds(20);
  ds::InProcessGroup group(n, o);
  std::vector<std::string> messages(n);
  ds::testing::run_threads(
      n,
      [&](int r) {
        for (int step = 0; step < 10; ++step) {
          if (r == skipper && step == 6) continue;
          float x = 1.f;
          try {
            group.at(r).all_reduce(&x, 1, ds::ReduceOp::kSum, "step_" + std::to_string(step));
          } catch (const ds::InvalidArgumentError& e) {
            messages[r] = e.message();
            return;
          }
        }
      },
      [&](int r) { group.at(r).abort("rank " + std::to_string(r) + " failed"); });
  for (int r = 0; r < n; ++r) {
    EXPECT_NE(messages[r].find("mismatched collective #6: rank 0 called all_reduce of 1 float32 "
                               "sum 'step_6' but rank 1 called all_reduce of 1 float32 sum "
                               "'step_7'"),
              std::string::npos)
        << "rank " << r << ": " << messages[r];
  }
}

// A rank that never joins: the others fail with DeadlineExceeded within the
// deadline; the rank that waits on it directly names it.
TEST(TransportDeadline, RankThatNeverJoinsIsNamed) {
  for (ds::Algorithm a : {ds::Algorithm::kRing, ds::Algorithm::kHalvingDoubling,
                          ds::Algorithm::kTree, ds::Algorithm::kReduceToOne}) {
    const int n = 3, missing = 2;
    ds::InProcessTransportGroup group(n);
    ds::CommunicationOptions o;
    o.algorithm = a;
    o.timeout = std::chrono::milliseconds(200);
    std::vector<std::string> messages(n);
    std::vector<int> deadline_errors(n, 0);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      if (r == missing) continue;
      threads.emplace_back([&, r] {
        ds::TransportCommunicator comm(group.at(r), o);
        std::vector<float> v(1000, 1.f);
        try {
          comm.all_reduce(v.data(), v.data(), v.size(), ds::DType::kFloat32, ds::ReduceOp::kSum,
                          "grad");
        } catch (const ds::DeadlineExceededError& e) {
          deadline_errors[r] = 1;
          messages[r] = e.message();
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
    bool named = false;
    for (int r = 0; r < n; ++r) {
      if (r == missing) continue;
      EXPECT_EQ(deadline_errors[r], 1) << ds::algorithm_name(a) << " rank " << r;
      EXPECT_NE(messages[r].find("'grad'"), std::string::npos) << messages[r];
      named |= messages[r].find("rank " + std::to_string(missing) + " ") != std::string::npos;
    }
    EXPECT_TRUE(named) << ds::algorithm_name(a) << ": " << messages[0] << " | " << messages[1];
  }
}

}  // namespace
