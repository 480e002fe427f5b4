// The Gloo transport (src/allreduce/gloo_transport.h): ranks as threads of
// this process, connected over 127.0.0.1 through the in-memory address
// exchange. Point to point (order per tag, many tags outstanding, zero bytes,
// 64 MiB, the deadline's error, mismatched byte counts), every collective of
// TransportCommunicator over it with 2, 3 and 4 ranks, a rank leaving in the
// middle of a collective, abort, a dropped request, destruction with
// requests pending, set-up errors. Ranks wait for each other with latches,
// never with sleeps.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/socket.h>

#include "diststrat/config.h"

#if DISTSTRAT_HAVE_GLOO

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "allreduce/gloo_transport.h"
#include "allreduce/transport.h"
#include "allreduce/transport_communicator.h"
#include "harness.h"

namespace ds = diststrat;
using namespace std::chrono_literals;
using ds::Clock;

namespace {

// Counts arrivals; wait() returns once `n` have arrived (a one-shot barrier).
class Latch {
 public:
  explicit Latch(int n) : left_(n) {}
  void arrive() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--left_ <= 0) cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return left_ <= 0; });
  }
  void arrive_and_wait() {
    arrive();
    wait();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int left_;
};

ds::GlooTransportOptions loopback(const std::string& group) {
  ds::GlooTransportOptions o;
  o.group = group;
  o.listen_host = "127.0.0.1";
  return o;
}

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// A group of n Gloo transports, set up together on n threads.
struct GlooGroup {
  explicit GlooGroup(int n) : transports(n), exchange(ds::make_in_memory_address_exchange()) {}
  std::vector<std::unique_ptr<ds::Transport>> transports;
  std::shared_ptr<ds::AddressExchange> exchange;
  std::string group = "test/" + std::to_string(next_id()++);

  void make(int r, ds::GlooTransportOptions o = {}) {
    if (o.group.empty()) o = loopback(group);
    transports[r] = ds::make_gloo_transport(r, size(), *exchange, o, Clock::now() + 20s);
  }
  int size() const { return static_cast<int>(transports.size()); }
  ds::Transport& at(int r) { return *transports[r]; }
  static std::atomic<int>& next_id() {
    static std::atomic<int> id{0};
    return id;
  }
};

// Sets up n transports on n threads and runs fn(rank, transport) on each;
// a rank leaves (destroys its transport) as soon as it is done, as a
// program's ranks do. The first rank's exception is re-raised; a failing
// rank aborts its transport so that the others fail fast.
void run_gloo(int n, const std::function<void(int, ds::Transport&)>& fn,
              const ds::GlooTransportOptions& options = {}) {
  GlooGroup g(n);
  ds::testing::run_threads(
      n,
      [&](int r) {
        g.make(r, options);
        fn(r, g.at(r));
        g.transports[r].reset();
      },
      [&](int r) {
        if (g.transports[r]) g.transports[r]->abort("rank " + std::to_string(r) + " failed");
      });
}

TEST(GlooTransport, OrderPerTagManyTagsOutstandingZeroBytesAnd64MiB) {
  constexpr int kPerTag = 4;
  const int tags[] = {5, 6, 7};
  constexpr size_t kBig = size_t{64} << 20;
  run_gloo(2, [&](int r, ds::Transport& t) {
    const auto deadline = Clock::now() + 60s;  // 64 MiB take seconds under the thread sanitizer
    if (r == 0) {
      // Every send outstanding at once, the tags interleaved.
      std::vector<int64_t> values;
      for (int i = 0; i < kPerTag; ++i)
        for (int tag : tags) values.push_back(tag * 100 + i);
      std::vector<ds::Request> sends;
      for (size_t k = 0; k < values.size(); ++k)
        sends.push_back(t.send(1, &values[k], sizeof(int64_t), tags[k % 3]));
      sends.push_back(t.send(1, nullptr, 0, 8));
      std::vector<int32_t> big(kBig / 4);
      ds::Request big_recv = t.recv(1, big.data(), kBig, 9);  // posted before its send
      ds::wait_all(sends, deadline);
      big_recv.wait(deadline);
      for (size_t i = 0; i < big.size(); i += 4099)
        ASSERT_EQ(big[i], static_cast<int32_t>(i * 7 + 1)) << "element " << i;
      ASSERT_EQ(big.back(), static_cast<int32_t>((big.size() - 1) * 7 + 1));
    } else {
      // The receives posted tag by tag in another order, waited last first.
      int64_t got[3][kPerTag] = {};
      std::vector<ds::Request> recvs;
      for (int k : {2, 0, 1})
        for (int i = 0; i < kPerTag; ++i)
          recvs.push_back(t.recv(0, &got[k][i], sizeof(int64_t), tags[k]));
      ds::Request empty = t.recv(0, nullptr, 0, 8);
      for (auto it = recvs.rbegin(); it != recvs.rend(); ++it) it->wait(deadline);
      empty.wait(deadline);
      for (int k = 0; k < 3; ++k)
        for (int i = 0; i < kPerTag; ++i) EXPECT_EQ(got[k][i], tags[k] * 100 + i);
      std::vector<int32_t> big(kBig / 4);
      for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<int32_t>(i * 7 + 1);
      t.send(0, big.data(), kBig, 9).wait(deadline);
    }
  });
}

// A recv posted after a large send, before any wait, is announced to the
// peer ahead of the send's data: Gloo writes a recv's go-ahead in the same
// queue as the data, so a go-ahead posted behind 128 MiB could not reach the
// peer until all of it had (each direction of a ring step then ran in turn,
// at half the link rate). Here rank 1's small send, which needs rank 0's
// go-ahead, completes while rank 0's large send is still arriving.
TEST(GlooTransport, ARecvPostedAfterALargeSendIsAnnouncedBeforeItsData) {
  constexpr size_t kBig = size_t{128} << 20;
  run_gloo(
      2, [&](int r, ds::Transport& t) {
        const auto deadline = Clock::now() + 120s;  // 128 MiB take seconds under the sanitizers
        std::vector<char> big(kBig, r == 0 ? 'a' : 'z');
        char small = r == 1 ? 's' : '-';
        if (r == 0) {
          ds::Request data = t.send(1, big.data(), kBig, 1);
          ds::Request go = t.recv(1, &small, 1, 2);  // posted after the large send
          go.wait(deadline);
          data.wait(deadline);
          EXPECT_EQ(small, 's');
        } else {
          ds::Request data = t.recv(0, big.data(), kBig, 1);
          t.send(0, &small, 1, 2).wait(deadline);
          EXPECT_FALSE(data.test())
              << "the peer's go-ahead for the small send came only after the large send's data";
          data.wait(deadline);
          EXPECT_EQ(big.front(), 'a');
          EXPECT_EQ(big.back(), 'a');
        }
      });
}

// The threads of this process whose scheduling policy is `policy`.
std::set<int> threads_with_policy(int policy) {
  std::set<int> tids;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    const int tid = std::atoi(e.path().filename().c_str());
    if (tid > 0 && sched_getscheduler(tid) == policy) tids.insert(tid);
  }
  return tids;
}

// Gloo's device thread runs SCHED_BATCH, so that it does not preempt a
// thread posting a transfer on its core: it would spin on the pair's lock,
// which that thread holds, until the time slice ended (a 4-byte exchange
// between two transports pinned to one core took 3 ms instead of 30 us).
// The thread that made the transport keeps its own policy.
TEST(GlooTransport, GloosDeviceThreadDoesNotPreemptOnWakeUp) {
  ASSERT_EQ(sched_getscheduler(0), SCHED_OTHER);
  const std::set<int> before = threads_with_policy(SCHED_BATCH);
  // Two ranks (one alone opens no device); rank 0's is made on this thread.
  GlooGroup pair(2);
  std::thread other([&] { pair.make(1); });
  pair.make(0);
  other.join();
  EXPECT_EQ(sched_getscheduler(0), SCHED_OTHER) << "the caller's policy was not restored";
  std::set<int> added;
  for (int tid : threads_with_policy(SCHED_BATCH))
    if (!before.count(tid)) added.insert(tid);
  EXPECT_GE(added.size(), 2u) << "Gloo's device threads (one per transport) are not SCHED_BATCH";
}

// Ranks that listen on the same address are one node, whatever their rank
// order (elastic groups number their workers in arrival order): hosts
// 127.0.0.1, 127.0.0.2, 127.0.0.1 are nodes 0, 1, 0, and a hierarchical
// all-reduce over that map is exact.
TEST(GlooTransport, RanksThatShareAnAddressAreOneNode) {
  GlooGroup g(3);
  const char* hosts[] = {"127.0.0.1", "127.0.0.2", "127.0.0.1"};
  std::vector<std::vector<int>> maps(3);
  std::vector<float> sums(3);
  ds::testing::run_threads(
      3,
      [&](int r) {
        ds::GlooTransportOptions o = loopback(g.group);
        o.listen_host = hosts[r];
        g.make(r, o);
        maps[r] = ds::gloo_node_of(g.at(r));
        ds::CommunicationOptions co;
        co.algorithm = ds::Algorithm::kHierarchical;
        ds::TransportCommunicator c(g.at(r), co, maps[r]);
        float v = static_cast<float>(r + 1);
        c.all_reduce(&v, &v, 1, ds::DType::kFloat32, ds::ReduceOp::kSum, "nodes");
        sums[r] = v;
        g.transports[r].reset();
      },
      [&](int r) {
        if (g.transports[r]) g.transports[r]->abort("rank " + std::to_string(r) + " failed");
      });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(maps[r], (std::vector<int>{0, 1, 0})) << "rank " << r;
    EXPECT_EQ(sums[r], 6.0f) << "rank " << r;
  }
  ds::InProcessTransportGroup other(1);
  EXPECT_TRUE(ds::gloo_node_of(other.at(0)).empty());
}

TEST(GlooTransport, InterfaceOptionBindsItsAddress) {
  ds::GlooTransportOptions o;
  o.interface = "lo";
  GlooGroup g(2);
  o.group = g.group;
  ds::testing::run_threads(
      2,
      [&](int r) {
        g.make(r, o);
        int v = r == 0 ? 42 : 0;
        if (r == 0) {
          g.at(0).send(1, &v, sizeof v, 1).wait(Clock::now() + 10s);
        } else {
          g.at(1).recv(0, &v, sizeof v, 1).wait(Clock::now() + 10s);
          EXPECT_EQ(v, 42);
        }
        g.transports[r].reset();
      },
      [](int) {});
}

// What a rank publishes is its address, port and sequence number, nothing
// else: Gloo's address bytes carried its sockaddr_storage's unused bytes
// (stack and heap addresses, seen by an outside trial in a Redis store).
TEST(GlooTransport, PublishedAddressesCarryNoStrayBytes) {
  GlooGroup g(2);
  ds::testing::run_threads(
      2, [&](int r) { g.make(r); }, [](int) {});
  const std::string v = g.exchange->wait_for(g.group + "/gloo/0", Clock::now() + 5s);
  // "gloo-tcp/1 2 - HEX": rank 0's address for rank 1.
  const std::string hex = v.substr(v.rfind(' ') + 1);
  ASSERT_EQ(hex.size() % 2, 0u) << v;
  std::vector<unsigned char> bytes;
  for (size_t i = 0; i < hex.size(); i += 2) {
    bytes.push_back(static_cast<unsigned char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  // sockaddr_in (16 bytes: family, port, address, 8 zero bytes), then zeros
  // up to the sequence number at the end of the sockaddr_storage.
  ASSERT_GE(bytes.size(), sizeof(sockaddr_storage));
  for (size_t i = 8; i < sizeof(sockaddr_storage); ++i) {
    EXPECT_EQ(bytes[i], 0) << "byte " << i << " of " << hex;
  }
  for (auto& t : g.transports) t.reset();
}

// A wait that runs out names this rank, the peer and the tag, and returns at
// the deadline. A send and a recv of different byte counts never meet (Gloo
// would end the process on its device thread): both run out instead.
TEST(GlooTransport, DeadlineErrorsNameRankPeerTagAndSizeMismatchNeverMeets) {
  Latch waited(2);
  run_gloo(2, [&](int r, ds::Transport& t) {
    std::vector<ds::Request> keep;
    if (r == 1) {
      int never = 0;
      ds::Request late = t.recv(0, &never, sizeof never, 7);
      const auto start = Clock::now();
      try {
        late.wait(start + 200ms);
        ADD_FAILURE() << "the wait did not throw";
      } catch (const ds::DeadlineExceededError& e) {
        EXPECT_GE(ms_since(start), 190);
        EXPECT_LT(ms_since(start), 1200);
        EXPECT_NE(e.message().find("rank 1:"), std::string::npos) << e.message();
        EXPECT_NE(e.message().find("from rank 0"), std::string::npos) << e.message();
        EXPECT_NE(e.message().find("(tag 7)"), std::string::npos) << e.message();
        // Why a live peer is late: stopped, busy, or unreachable.
        EXPECT_NE(e.message().find("rank 0 did not post the matching send of 4 bytes"),
                  std::string::npos)
            << e.message();
        EXPECT_NE(e.message().find("stopped (SIGSTOP"), std::string::npos) << e.message();
      }
      keep.push_back(late);
    }
    // Rank 0 sends 8 bytes, rank 1 expects 4.
    int64_t eight = 5;
    int32_t four = -1;
    ds::Request mismatched = r == 0 ? t.send(1, &eight, 8, 9) : t.recv(0, &four, 4, 9);
    try {
      mismatched.wait(Clock::now() + 300ms);
      ADD_FAILURE() << "rank " << r << ": the mismatched transfer completed";
    } catch (const ds::DeadlineExceededError& e) {
      EXPECT_NE(e.message().find("different byte counts"), std::string::npos) << e.message();
    }
    if (r == 1) {
      EXPECT_EQ(four, -1);
    }
    keep.push_back(mismatched);
    // Both ranks are past their waits before either drops its requests
    // (which finishes the group).
    waited.arrive_and_wait();
  });
}

struct CollectiveCase {
  ds::Algorithm algorithm;
  size_t segment_bytes;
};

class GlooTransportCollectives : public ::testing::TestWithParam<int> {};

// Rank r's element i: the sum over ranks is exact in float.
float element(int r, size_t i) {
  return static_cast<float>((r + 1) * static_cast<int>(i % 13) + r);
}

TEST_P(GlooTransportCollectives, EveryAlgorithmAndCollectiveExact) {
  const int n = GetParam();
  const CollectiveCase cases[] = {
      {ds::Algorithm::kRing, 0},
      {ds::Algorithm::kRing, 4096},
      {ds::Algorithm::kHalvingDoubling, 0},
      {ds::Algorithm::kTree, 0},
      {ds::Algorithm::kReduceToOne, 0},
      {ds::Algorithm::kAuto, 0},
  };
  run_gloo(n, [&](int r, ds::Transport& t) {
    for (const CollectiveCase& c : cases) {
      ds::CommunicationOptions o;
      o.algorithm = c.algorithm;
      o.segment_bytes = c.segment_bytes;
      o.timeout = 20s;
      ds::TransportCommunicator comm(t, o);
      for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{70000}}) {
        std::vector<float> in(count), out(count, -1.f);
        for (size_t i = 0; i < count; ++i) in[i] = element(r, i);
        comm.all_reduce(in.data(), out.data(), count, ds::DType::kFloat32, ds::ReduceOp::kSum, "x");
        for (size_t i = 0; i < count; ++i) {
          float want = 0;
          for (int q = 0; q < n; ++q) want += element(q, i);
          ASSERT_EQ(out[i], want) << ds::algorithm_name(c.algorithm) << " count " << count
                                  << " element " << i << " on rank " << r;
        }
      }
    }
    ds::CommunicationOptions o;
    o.timeout = 20s;
    ds::TransportCommunicator comm(t, o);
    for (size_t count : {size_t{1}, size_t{1000}}) {
      for (int root = 0; root < n; ++root) {
        std::vector<float> b(count, -1.f);
        if (r == root)
          for (size_t i = 0; i < count; ++i) b[i] = element(root, i);
        comm.broadcast(b.data(), count, ds::DType::kFloat32, root, "b");
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(b[i], element(root, i));
      }
      std::vector<float> mine(count), all(count * n, -1.f);
      for (size_t i = 0; i < count; ++i) mine[i] = element(r, i);
      comm.all_gather(mine.data(), all.data(), count, ds::DType::kFloat32, "g");
      for (int q = 0; q < n; ++q)
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(all[q * count + i], element(q, i));
      std::vector<float> full(count * n), part(count, -1.f);
      for (size_t i = 0; i < full.size(); ++i) full[i] = element(r, i);
      comm.reduce_scatter(full.data(), part.data(), count, ds::DType::kFloat32, ds::ReduceOp::kSum,
                          "s");
      for (size_t i = 0; i < count; ++i) {
        float want = 0;
        for (int q = 0; q < n; ++q) want += element(q, r * count + i);
        ASSERT_EQ(part[i], want);
      }
      comm.barrier("end");
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, GlooTransportCollectives, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "_ranks";
                         });

// Rank 3 destroys its transport while ranks 0-2 run an all-reduce that needs
// it: each of them fails within a second (not at its 30 s deadline), with an
// error that names rank 3, whether it waited on rank 3 itself or on a rank
// that failed because of it.
TEST(GlooTransport, ARankLeavingMidCollectiveFailsTheOthersPromptly) {
  constexpr int n = 4;
  GlooGroup g(n);
  Latch calling(n - 1);
  std::atomic<int64_t> left_at{0};
  std::vector<std::string> errors(n);
  std::vector<double> after_ms(n, -1);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      g.make(r);
      if (r == n - 1) {
        calling.wait();
        left_at = Clock::now().time_since_epoch().count();
        g.transports[r].reset();
        return;
      }
      ds::CommunicationOptions o;
      o.timeout = 30s;
      ds::TransportCommunicator comm(g.at(r), o);
      std::vector<float> x(1000, 1.f);
      calling.arrive();
      try {
        comm.all_reduce(x.data(), x.data(), x.size(), ds::DType::kFloat32, ds::ReduceOp::kSum, "w");
        errors[r] = "(completed)";
      } catch (const ds::Error& e) {
        errors[r] = e.what();
      }
      after_ms[r] = ms_since(Clock::time_point(Clock::duration(left_at.load())));
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n - 1; ++r) {
    // "rank 3 (127.0.0.1:port) left the group" or "... had left the group"
    EXPECT_NE(errors[r].find("rank 3 (127.0.0.1:"), std::string::npos)
        << "rank " << r << ": " << errors[r];
    EXPECT_LT(after_ms[r], 1000) << "rank " << r << ": " << errors[r];
  }
}

// Rank 2 leaves while rank 0 waits for a message from it, and rank 1 waits
// only for one from rank 0 (a healthy rank): rank 0 fails at once (the
// group's work needed rank 2, so its transport breaks and resets its
// connections) and rank 1 right after it, not at its 30 s deadline.
TEST(GlooTransport, ARankWaitingOnAHealthyRankFailsWhenADepartureBreaksTheGroup) {
  constexpr int n = 3;
  GlooGroup g(n);
  Latch posted(n);
  std::atomic<int64_t> left_at{0};
  std::vector<std::string> errors(n);
  std::vector<double> after_ms(n, -1);
  ds::testing::run_threads(
      n,
      [&](int r) {
        g.make(r);
        if (r == 2) {
          posted.arrive_and_wait();
          left_at = Clock::now().time_since_epoch().count();
          g.transports[2].reset();
          return;
        }
        int64_t v = 0;
        ds::Request pending = g.at(r).recv(r == 0 ? 2 : 0, &v, sizeof v, 1);
        posted.arrive();
        try {
          pending.wait(Clock::now() + 30s);
          errors[r] = "(completed)";
        } catch (const ds::UnavailableError& e) {
          errors[r] = e.message();
        }
        after_ms[r] = ms_since(Clock::time_point(Clock::duration(left_at.load())));
      },
      [](int) {});
  EXPECT_NE(errors[0].find("rank 2 (127.0.0.1:"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("left the group"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("the connection to rank 0 (127.0.0.1:"), std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find("rank 2 (127.0.0.1:"), std::string::npos) << errors[1];
  for (int r = 0; r < 2; ++r) EXPECT_LT(after_ms[r], 1000) << "rank " << r << ": " << errors[r];
}

// A rank that leaves after it finished (its transport destroyed with nothing
// pending says goodbye) fails nothing that did not need it: a transfer from
// it that completed before is still complete when waited afterwards, and
// the other ranks go on exchanging. A new transfer with it fails at once
// (and finishes the group, whose work needed the rank that left).
TEST(GlooTransport, ARankThatLeavesAfterFinishingFailsNothingThatDidNotNeedIt) {
  constexpr int n = 3;
  GlooGroup g(n);
  Latch left(n), exchanged(n - 1);
  ds::testing::run_threads(
      n,
      [&](int r) {
        g.make(r);
        const auto deadline = Clock::now() + 20s;
        if (r == 0) {
          const int64_t v = 11;
          g.at(0).send(1, &v, sizeof v, 1).wait(deadline);
          g.transports[0].reset();
          left.arrive();
          return;
        }
        int64_t got = 0;
        ds::Request early;  // rank 0 sends to rank 1 only
        if (r == 1) early = g.at(1).recv(0, &got, sizeof got, 1);
        left.arrive_and_wait();
        if (r == 1) {
          early.wait(deadline);
          EXPECT_EQ(got, 11);
        }
        int64_t mine = 100 + r, theirs = 0;
        ds::Request s = g.at(r).send(3 - r, &mine, sizeof mine, 3);
        g.at(r).recv(3 - r, &theirs, sizeof theirs, 3).wait(deadline);
        s.wait(deadline);
        EXPECT_EQ(theirs, 100 + (3 - r));
        exchanged.arrive_and_wait();
        if (r == 1) {
          const auto t0 = Clock::now();
          int64_t x = 0;
          try {
            g.at(1).send(0, &x, sizeof x, 2).wait(deadline);
            ADD_FAILURE() << "a send to the rank that left completed";
          } catch (const ds::UnavailableError& e) {
            EXPECT_NE(e.message().find("rank 0 (127.0.0.1:"), std::string::npos) << e.message();
            EXPECT_NE(e.message().find("left the group"), std::string::npos) << e.message();
          }
          EXPECT_LT(ms_since(t0), 1000);
        }
        g.transports[r].reset();
      },
      [](int) {});
}

// abort(): this rank's waits throw AbortedError with the reason at once
// (also one already blocked in another thread's wait), its later
// operations too; the peers' waits fail promptly with UnavailableError, also
// a wait on a recv from a third, healthy rank (the group is broken).
TEST(GlooTransport, AbortFailsItselfAtOnceAndItsPeersPromptly) {
  constexpr int n = 3;
  GlooGroup g(n);
  Latch waiting(n);
  std::atomic<int64_t> aborted_at{0};
  std::vector<std::string> errors(n);
  std::vector<double> after_ms(n, -1);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      g.make(r);
      ds::Transport& t = g.at(r);
      int a = 0, b = 0;
      // Nobody sends these: rank 0 waits on rank 1, rank 1 on rank 2 (which
      // stays healthy), rank 2 on rank 0.
      const int from = r == 0 ? 1 : r == 1 ? 2 : 0;
      ds::Request pending = t.recv(from, &a, sizeof a, 1);
      ds::Request other =
          t.recv((from + 1) % n == r ? (from + 2) % n : (from + 1) % n, &b, sizeof b, 2);
      std::thread aborter;
      if (r == 0) {
        aborter = std::thread([&] {
          waiting.wait();
          aborted_at = Clock::now().time_since_epoch().count();
          g.at(0).abort("test abort");
        });
      }
      waiting.arrive();
      try {
        pending.wait(Clock::now() + 30s);
        errors[r] = "(completed)";
      } catch (const ds::Error& e) {
        errors[r] = std::string(ds::error_code_name(e.code())) + ": " + e.message();
      }
      after_ms[r] = ms_since(Clock::time_point(Clock::duration(aborted_at.load())));
      if (r == 0) {
        aborter.join();
        EXPECT_THROW(other.wait(Clock::now() + 30s), ds::AbortedError);
        int c = 0;
        EXPECT_THROW(t.send(1, &c, sizeof c, 3).wait(Clock::now() + 30s), ds::AbortedError);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_NE(errors[0].find("kAborted"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("test abort"), std::string::npos) << errors[0];
  for (int r = 1; r < n; ++r) {
    EXPECT_NE(errors[r].find("kUnavailable"), std::string::npos)
        << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("rank 0"), std::string::npos) << "rank " << r << ": " << errors[r];
  }
  for (int r = 0; r < n; ++r) EXPECT_LT(after_ms[r], 1000) << "rank " << r << ": " << errors[r];
}

// Gloo writes with writev(2), which raises SIGPIPE on a connection that
// the peer reset (by default the end of the process): writes into rank 1's
// reset connections, from this thread's posts and from Gloo's device thread
// flushing a large send, fail as errors instead. (A write lands in that
// window in about one round in twenty: ten rounds.)
TEST(GlooTransport, WritesToAResetConnectionRaiseNoSigpipe) {
  constexpr size_t kBig = size_t{16} << 20;
  for (int round = 0; round < 10; ++round) {
    GlooGroup g(2);
    Latch posted(2), gone(2);
    ds::testing::run_threads(
        2,
        [&](int r) {
          g.make(r);
          std::vector<char> big(kBig, 1);
          if (r == 1) {
            ds::Request pending = g.at(1).recv(0, big.data(), kBig, 1);
            posted.arrive_and_wait();
            g.transports[1].reset();  // pending: resets the connections
            gone.arrive_and_wait();
            return;
          }
          ds::Request send = g.at(0).send(1, big.data(), kBig, 1);
          posted.arrive_and_wait();
          gone.arrive_and_wait();
          const auto deadline = Clock::now() + 10s;
          int64_t x = 0;
          for (int i = 0; i < 200; ++i) {
            try {
              g.at(0).send(1, &x, sizeof x, 2).wait(deadline);
            } catch (const ds::UnavailableError&) {
              break;
            }
          }
          try {
            send.wait(deadline);  // done if all of it reached the kernel before the reset
          } catch (const ds::UnavailableError&) {
          }
        },
        [](int) {});
  }
}

// A request dropped before it completed: Gloo never writes its buffer
// afterwards (the message that arrives for it is not delivered; under ASan a
// freed buffer would show it), and the transport is finished: later waits
// throw AbortedError, the peer's transfers end promptly.
TEST(GlooTransport, ADroppedRequestIsNeverWrittenAndFinishesTheTransport) {
  Latch dropped(2), sent(2);
  run_gloo(2, [&](int r, ds::Transport& t) {
    if (r == 1) {
      std::vector<int64_t> canary(4, -7);
      t.recv(0, canary.data(), 32, 4);  // dropped at once
      {
        auto heap = std::make_unique<int64_t[]>(4);
        t.recv(0, heap.get(), 32, 5);
      }  // the request, then its buffer, are gone
      dropped.arrive_and_wait();
      sent.arrive_and_wait();
      for (int64_t v : canary) EXPECT_EQ(v, -7);
      int64_t later[4];
      try {
        t.recv(0, later, 32, 6).wait(Clock::now() + 10s);
        ADD_FAILURE() << "a recv after the drop completed";
      } catch (const ds::AbortedError& e) {
        EXPECT_NE(e.message().find("dropped before completion"), std::string::npos) << e.message();
      }
    } else {
      dropped.arrive_and_wait();
      const int64_t data[4] = {1, 2, 3, 4};
      const auto start = Clock::now();
      for (int tag : {4, 5}) {
        try {
          t.send(1, data, 32, tag).wait(Clock::now() + 10s);
        } catch (const ds::UnavailableError&) {
          // Rank 1 closed its connections: fine, as long as it is prompt.
        }
      }
      EXPECT_LT(ms_since(start), 1000);
      sent.arrive_and_wait();
      int64_t later[4];
      const auto t0 = Clock::now();
      EXPECT_THROW(t.recv(1, later, 32, 7).wait(Clock::now() + 10s), ds::UnavailableError);
      EXPECT_LT(ms_since(t0), 1000);
    }
  });
}

// Destroying a transport with a request pending aborts it first: bounded,
// the request's later wait throws AbortedError, the peer fails promptly.
TEST(GlooTransport, DestructionWithRequestsPendingAbortsAndIsBounded) {
  GlooGroup g(2);
  Latch posted(2);
  std::atomic<int64_t> destroyed_at{0};
  ds::testing::run_threads(
      2,
      [&](int r) {
        g.make(r);
        int v = 0;
        ds::Request pending = g.at(r).recv(1 - r, &v, sizeof v, 1);
        posted.arrive_and_wait();
        if (r == 0) {
          const auto start = Clock::now();
          destroyed_at = start.time_since_epoch().count();
          g.transports[0].reset();
          EXPECT_LT(ms_since(start), 1000);
          EXPECT_THROW(pending.wait(Clock::now() + 10s), ds::AbortedError);
        } else {
          EXPECT_THROW(pending.wait(Clock::now() + 30s), ds::UnavailableError);
          EXPECT_LT(ms_since(Clock::time_point(Clock::duration(destroyed_at.load()))), 1000);
          g.transports[1].reset();
        }
      },
      [](int) {});
}

TEST(GlooTransport, OneRankNeedsNoPeersAndProbeAnyIsUnimplemented) {
  auto exchange = ds::make_in_memory_address_exchange();
  auto t = ds::make_gloo_transport(0, 1, *exchange, loopback("test/solo"), Clock::now() + 1s);
  ds::Envelope env;
  try {
    t->probe_any(&env);
    ADD_FAILURE() << "probe_any returned";
  } catch (const ds::UnimplementedError& e) {
    EXPECT_NE(e.message().find("Gloo"), std::string::npos) << e.message();
  }
  ds::TransportCommunicator comm(*t, ds::CommunicationOptions{});
  float x = 3;
  comm.all_reduce(&x, &x, 1, ds::DType::kFloat32, ds::ReduceOp::kSum, "x");
  EXPECT_EQ(x, 3.f);
  int v = 0;
  EXPECT_THROW(t->send(0, &v, sizeof v, 1), ds::InvalidArgumentError);  // to itself
}

// Rank 2 never shows up: ranks 0 and 1 fail at the deadline, naming it.
TEST(GlooTransport, SetUpFailsAtTheDeadlineNamingTheRankThatNeverCame) {
  auto exchange = ds::make_in_memory_address_exchange();
  std::vector<std::string> errors(2);
  std::vector<double> took(2);
  const auto start = Clock::now();
  const auto deadline = start + 400ms;
  ds::testing::run_threads(
      2,
      [&](int r) {
        try {
          ds::make_gloo_transport(r, 3, *exchange, loopback("test/missing"), deadline);
          errors[r] = "(set up)";
        } catch (const ds::DeadlineExceededError& e) {
          errors[r] = e.message();
        }
        took[r] = ms_since(start);
      },
      [](int) {});
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rank " + std::to_string(r) + " of 3"), std::string::npos)
        << errors[r];
    EXPECT_NE(errors[r].find("rank 2 never published"), std::string::npos) << errors[r];
    EXPECT_GE(took[r], 390);
    EXPECT_LT(took[r], 1400);
  }
}

// Rank 1 counted its groups differently (its "world" failed and was made
// again as "world.1"): rank 0 names both group names at the deadline.
TEST(GlooTransport, GroupsMadeInDifferentOrdersAreNamed) {
  auto exchange = ds::make_in_memory_address_exchange();
  exchange->publish("world.1/gloo/1", "gloo-tcp/1 2 00 -", Clock::now() + 1s);
  try {
    ds::make_gloo_transport(0, 2, *exchange, loopback("world"), Clock::now() + 300ms);
    FAIL() << "set up";
  } catch (const ds::FailedPreconditionError& e) {
    EXPECT_NE(e.message().find("in group 'world' but did in group 'world.1'"), std::string::npos)
        << e.message();
    EXPECT_NE(e.message().find("made their groups in different orders"), std::string::npos)
        << e.message();
  }
}

TEST(GlooTransport, BadOptionsAreInvalidArgument) {
  auto exchange = ds::make_in_memory_address_exchange();
  const auto deadline = Clock::now() + 5s;
  auto make = [&](int rank, int size, const ds::GlooTransportOptions& o) {
    ds::make_gloo_transport(rank, size, *exchange, o, deadline);
  };
  ds::GlooTransportOptions both = loopback("test/bad");
  both.interface = "lo";
  EXPECT_THROW(make(0, 2, both), ds::InvalidArgumentError);
  EXPECT_THROW(make(0, 2, loopback("")), ds::InvalidArgumentError);
  EXPECT_THROW(make(-1, 2, loopback("test/bad")), ds::InvalidArgumentError);
  EXPECT_THROW(make(2, 2, loopback("test/bad")), ds::InvalidArgumentError);
  EXPECT_THROW(make(0, 0, loopback("test/bad")), ds::InvalidArgumentError);
  ds::GlooTransportOptions no_such_interface;
  no_such_interface.group = "test/bad";
  no_such_interface.interface = "nosuchif0";
  EXPECT_THROW(make(0, 2, no_such_interface), ds::InvalidArgumentError);
  ds::GlooTransportOptions no_such_host = loopback("test/bad");
  no_such_host.listen_host = "no-such-host.invalid";
  EXPECT_THROW(make(0, 2, no_such_host), ds::InvalidArgumentError);
}

}  // namespace

#endif  // DISTSTRAT_HAVE_GLOO
