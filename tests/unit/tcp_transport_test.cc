// The TCP transport (src/allreduce/tcp_transport.h): ranks as threads of
// this process over 127.0.0.1 through the in-memory address exchange. Order
// per tag with messages that arrive before their recvs, zero bytes, a large
// message, probe_any, the deadline's and a size mismatch's errors, a peer
// that aborts or leaves, a dropped recv, collectives of TransportCommunicator
// over it, set-up that names a rank that never came.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "allreduce/tcp_transport.h"
#include "allreduce/transport.h"
#include "allreduce/transport_communicator.h"
#include "harness.h"

namespace ds = diststrat;
using namespace std::chrono_literals;
using ds::Clock;

namespace {

class Latch {
 public:
  explicit Latch(int n) : left_(n) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mu_);
    if (--left_ <= 0) cv_.notify_all();
    cv_.wait(lock, [&] { return left_ <= 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int left_;
};

std::string next_group() {
  static std::atomic<int> id{0};
  return "tcp-test/" + std::to_string(id++);
}

// Sets up n transports on n threads and runs fn(rank, transport) on each; a
// rank destroys its transport when done. The first exception is re-raised;
// a failing rank aborts its transport so that the others fail fast.
// peer_failure_breaks_group: TcpTransportOptions'.
void run_tcp(int n, const std::function<void(int, ds::Transport&)>& fn,
             bool peer_failure_breaks_group = true) {
  auto exchange = ds::make_in_memory_address_exchange();
  ds::TcpTransportOptions o;
  o.group = next_group();
  o.listen_host = "127.0.0.1";
  o.peer_failure_breaks_group = peer_failure_breaks_group;
  std::vector<std::unique_ptr<ds::Transport>> ts(n);
  ds::testing::run_threads(
      n,
      [&](int r) {
        ts[r] = ds::make_tcp_transport(r, n, *exchange, o, Clock::now() + 20s);
        fn(r, *ts[r]);
        ts[r].reset();
      },
      [&](int r) {
        if (ts[r]) ts[r]->abort("rank " + std::to_string(r) + " failed");
      });
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ds::Error& e) {
    return std::string("[") + ds::error_code_name(e.code()) + "] " + e.message();
  }
  return "no error";
}

TEST(TcpTransport, OrderPerTagEarlyMessagesZeroBytesAndALargeOne) {
  constexpr int kPerTag = 4;
  const int tags[] = {5, 6, 7};
  constexpr size_t kBig = size_t{8} << 20;
  run_tcp(2, [&](int r, ds::Transport& t) {
    const auto deadline = Clock::now() + 30s;
    if (r == 0) {
      std::vector<int64_t> values;
      for (int i = 0; i < kPerTag; ++i)
        for (int tag : tags) values.push_back(tag * 100 + i);
      std::vector<ds::Request> sends;
      for (size_t k = 0; k < values.size(); ++k)
        sends.push_back(t.send(1, &values[k], sizeof(int64_t), tags[k % 3]));
      sends.push_back(t.send(1, nullptr, 0, 8));
      std::vector<int32_t> big(kBig / 4);
      ds::Request big_recv = t.recv(1, big.data(), kBig, 9);
      ds::wait_all(sends, deadline);
      big_recv.wait(deadline);
      for (size_t i = 0; i < big.size(); i += 4099)
        ASSERT_EQ(big[i], static_cast<int32_t>(i * 7 + 1)) << "element " << i;
    } else {
      // The large send first (rank 0 reads it while it waits for its own
      // sends), then the receives, tag by tag in another order, waited last
      // first: most of rank 0's messages arrived before their recvs.
      std::vector<int32_t> big(kBig / 4);
      for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<int32_t>(i * 7 + 1);
      ds::Request big_send = t.send(0, big.data(), kBig, 9);
      std::this_thread::sleep_for(20ms);
      int64_t got[3][kPerTag] = {};
      std::vector<ds::Request> recvs;
      for (int k : {2, 0, 1})
        for (int i = 0; i < kPerTag; ++i)
          recvs.push_back(t.recv(0, &got[k][i], sizeof(int64_t), tags[k]));
      ds::Request empty = t.recv(0, nullptr, 0, 8);
      for (auto it = recvs.rbegin(); it != recvs.rend(); ++it) it->wait(deadline);
      empty.wait(deadline);
      big_send.wait(deadline);
      for (int k = 0; k < 3; ++k)
        for (int i = 0; i < kPerTag; ++i) EXPECT_EQ(got[k][i], tags[k] * 100 + i);
    }
  });
}

// The parameter-server service's receive loop: probe_any names the oldest
// message that no posted recv claims (any peer, any tag) with its size.
TEST(TcpTransport, ProbeAnyNamesUnclaimedMessagesOldestFirst) {
  run_tcp(3, [&](int r, ds::Transport& t) {
    const auto deadline = Clock::now() + 20s;
    if (r == 0) {
      ds::Envelope env;
      // Rank 1 sends 3 bytes (tag 4) then 5 bytes (tag 4), rank 2 7 bytes (tag 6).
      std::vector<std::pair<int, size_t>> seen;
      int64_t claimed = 0;
      ds::Request claim = t.recv(1, &claimed, 0, 11);  // a recv that claims nothing of theirs
      while (seen.size() < 3 && Clock::now() < deadline) {
        if (!t.probe_any(&env)) {
          std::this_thread::sleep_for(1ms);
          continue;
        }
        std::vector<char> buf(env.bytes);
        t.recv(env.source, buf.data(), env.bytes, env.tag).wait(deadline);
        seen.emplace_back(env.source * 100 + env.tag, env.bytes);
        if (env.source == 1) {
          EXPECT_EQ(buf[0], static_cast<char>(env.bytes));
        }
      }
      ASSERT_EQ(seen.size(), 3u);
      // Rank 1's two messages in their order (sizes 3 then 5); rank 2's anywhere.
      std::vector<size_t> from1;
      for (auto& s : seen) {
        if (s.first == 104) from1.push_back(s.second);
        if (s.first == 206) EXPECT_EQ(s.second, 7u);
      }
      EXPECT_EQ(from1, (std::vector<size_t>{3, 5}));
      t.send(1, nullptr, 0, 11).wait(deadline);
      EXPECT_FALSE(t.probe_any(&env));
      claim.wait(deadline);  // (rank 1 answers with the 0-byte message tag 11)
    } else if (r == 1) {
      char a[3] = {3, 3, 3}, b[5] = {5, 5, 5, 5, 5};
      t.send(0, a, 3, 4).wait(deadline);
      t.send(0, b, 5, 4).wait(deadline);
      t.recv(0, nullptr, 0, 11).wait(deadline);
      t.send(0, nullptr, 0, 11).wait(deadline);
    } else {
      char c[7] = {};
      t.send(0, c, 7, 6).wait(deadline);
    }
  });
}

TEST(TcpTransport, DeadlineAndSizeMismatchErrorsNameRankPeerTagAndBytes) {
  run_tcp(2, [&](int r, ds::Transport& t) {
    if (r == 0) {
      int64_t x = 0;
      const auto t0 = Clock::now();
      const std::string m = message_of([&] { t.recv(1, &x, 8, 3).wait(Clock::now() + 200ms); });
      EXPECT_LT(Clock::now() - t0, 2s);
      EXPECT_NE(m.find("[kDeadlineExceeded] rank 0: recv of 8 bytes from rank 1 (tag 3)"),
                std::string::npos)
          << m;
      // The mismatch: rank 1 sends 4 bytes with tag 5, this rank expects 8.
      const std::string mm = message_of([&] { t.recv(1, &x, 8, 5).wait(Clock::now() + 20s); });
      EXPECT_NE(mm.find("[kInvalidArgument] rank 0: recv of 8 bytes from rank 1 (tag 5): the "
                        "message from rank 1"),
                std::string::npos)
          << mm;
      EXPECT_NE(mm.find("has 4 bytes"), std::string::npos) << mm;
      t.send(1, nullptr, 0, 6).wait(Clock::now() + 20s);
    } else {
      int32_t four = 4;
      t.send(0, &four, 4, 5).wait(Clock::now() + 20s);
      t.recv(0, nullptr, 0, 6).wait(Clock::now() + 20s);
    }
  });
}

// Rank 1 aborts (its connections end without a goodbye): rank 0's waits on
// rank 1 fail at once naming it, and so do its waits on rank 2 (the group
// is broken). A rank that leaves (its transport destroyed after its work)
// fails only what still needed it, with "left the group".
TEST(TcpTransport, APeerThatAbortsBreaksTheGroupOneThatLeavesIsNamed) {
  run_tcp(3, [&](int r, ds::Transport& t) {
    if (r == 1) {
      t.abort("rank 1 gives up");
      return;
    }
    if (r == 2) {
      int64_t x = 0;
      const std::string m = message_of([&] { t.recv(1, &x, 8, 1).wait(Clock::now() + 20s); });
      EXPECT_NE(m.find("[kUnavailable]"), std::string::npos) << m;
      EXPECT_NE(m.find("rank 1 (127.0.0.1:"), std::string::npos) << m;
      return;
    }
    int64_t x = 0;
    const auto t0 = Clock::now();
    const std::string m1 = message_of([&] { t.recv(1, &x, 8, 1).wait(Clock::now() + 20s); });
    const std::string m2 = message_of([&] { t.recv(2, &x, 8, 1).wait(Clock::now() + 20s); });
    EXPECT_LT(Clock::now() - t0, 5s);
    EXPECT_NE(m1.find("[kUnavailable] rank 0: recv of 8 bytes from rank 1 (tag 1) failed: the "
                      "group is broken: the connection to rank 1 (127.0.0.1:"),
              std::string::npos)
        << m1;
    EXPECT_NE(m2.find("[kUnavailable] rank 0: recv of 8 bytes from rank 2 (tag 1) failed"),
              std::string::npos)
        << m2;
  });
  run_tcp(2, [&](int r, ds::Transport& t) {
    if (r == 1) {
      int64_t v = 42;
      t.send(0, &v, 8, 1).wait(Clock::now() + 20s);
      return;  // leaves: its transport is destroyed with nothing pending
    }
    int64_t x = 0;
    std::this_thread::sleep_for(100ms);
    t.recv(1, &x, 8, 1).wait(Clock::now() + 20s);  // sent before it left: still there
    EXPECT_EQ(x, 42);
    const std::string m = message_of([&] { t.recv(1, &x, 8, 2).wait(Clock::now() + 20s); });
    EXPECT_NE(m.find("[kUnavailable] rank 0: recv of 8 bytes from rank 1 (tag 2) failed: rank 1 "
                     "(127.0.0.1:"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("left the group"), std::string::npos) << m;
  });
}

// peer_failure_breaks_group = false (a parameter-server job that outlives a
// dead worker): a peer whose connection ends without a goodbye fails only
// the transfers with it, naming it; the others go on. Before the option,
// rank 0's exchange with rank 2 failed too ("the group is broken").
TEST(TcpTransport, WithoutBreakingTheGroupADeadPeerFailsOnlyItsOwnTransfers) {
  Latch failed(2);
  run_tcp(
      3,
      [&](int r, ds::Transport& t) {
        if (r == 1) {
          t.abort("rank 1 dies");  // its connections end without a goodbye
          return;
        }
        int64_t x = 0;
        const std::string m = message_of([&] { t.recv(1, &x, 8, 1).wait(Clock::now() + 20s); });
        EXPECT_NE(m.find("[kUnavailable] rank " + std::to_string(r) +
                         ": recv of 8 bytes from rank 1 (tag 1) failed: the connection to rank 1 "
                         "(127.0.0.1:"),
                  std::string::npos)
            << m;
        EXPECT_EQ(m.find("the group is broken"), std::string::npos) << m;
        failed.arrive_and_wait();
        // Ranks 0 and 2 still talk, both ways.
        const int peer = 2 - r;
        int64_t mine = 100 + r, theirs = 0;
        ds::Request s = t.send(peer, &mine, 8, 2);
        t.recv(peer, &theirs, 8, 2).wait(Clock::now() + 20s);
        s.wait(Clock::now() + 20s);
        EXPECT_EQ(theirs, 100 + peer);
        ds::Envelope env;
        EXPECT_FALSE(t.probe_any(&env));  // probing does not throw either
      },
      /*peer_failure_breaks_group=*/false);
}

// A recv dropped before its message came leaves the message for a later recv.
TEST(TcpTransport, ADroppedRecvLeavesItsMessageForTheNext) {
  run_tcp(2, [&](int r, ds::Transport& t) {
    const auto deadline = Clock::now() + 20s;
    if (r == 0) {
      int64_t a = 0, b = 0;
      { ds::Request dropped = t.recv(1, &a, 8, 1); }
      t.send(1, nullptr, 0, 2).wait(deadline);
      t.recv(1, &b, 8, 1).wait(deadline);
      EXPECT_EQ(a, 0);
      EXPECT_EQ(b, 7);
    } else {
      t.recv(0, nullptr, 0, 2).wait(deadline);
      int64_t v = 7;
      t.send(0, &v, 8, 1).wait(deadline);
    }
  });
}

// A send dropped while partly written: its rest is copied and finished, so
// the stream stays whole (the caller may reuse the buffer at once) and the
// next message arrives intact.
TEST(TcpTransport, ASendDroppedPartlyWrittenStillArrivesWhole) {
  constexpr size_t kBig = size_t{16} << 20;  // more than the sockets hold
  run_tcp(2, [&](int r, ds::Transport& t) {
    const auto deadline = Clock::now() + 30s;
    if (r == 0) {
      std::vector<uint8_t> big(kBig);
      for (size_t i = 0; i < kBig; ++i) big[i] = static_cast<uint8_t>(i * 31 + 7);
      {
        ds::Request dropped = t.send(1, big.data(), kBig, 1);
        EXPECT_FALSE(dropped.test());  // rank 1 reads nothing yet: partly written
      }
      std::fill(big.begin(), big.end(), 0);
      int64_t v = 99;
      t.send(1, &v, 8, 2).wait(deadline);
      t.send(1, nullptr, 0, 3).wait(deadline);
      t.recv(1, nullptr, 0, 4).wait(deadline);
    } else {
      t.recv(0, nullptr, 0, 3).wait(deadline);  // rank 0 has dropped its send by now
      std::vector<uint8_t> big(kBig);
      int64_t v = 0;
      t.recv(0, big.data(), kBig, 1).wait(deadline);
      t.recv(0, &v, 8, 2).wait(deadline);
      for (size_t i = 0; i < kBig; i += 4093)
        ASSERT_EQ(big[i], static_cast<uint8_t>(i * 31 + 7)) << "byte " << i;
      ASSERT_EQ(big[kBig - 1], static_cast<uint8_t>((kBig - 1) * 31 + 7));
      EXPECT_EQ(v, 99);
      t.send(0, nullptr, 0, 4).wait(deadline);
    }
  });
}

class TcpTransportCollectives : public ::testing::TestWithParam<int> {};

float element(int r, size_t i) {
  return static_cast<float>((r + 1) * static_cast<int>(i % 13) + r);
}

TEST_P(TcpTransportCollectives, AllReduceBroadcastBarrierExact) {
  const int n = GetParam();
  run_tcp(n, [&](int r, ds::Transport& t) {
    for (ds::Algorithm a : {ds::Algorithm::kRing, ds::Algorithm::kHalvingDoubling,
                            ds::Algorithm::kTree, ds::Algorithm::kAuto}) {
      ds::CommunicationOptions o;
      o.algorithm = a;
      o.timeout = 20s;
      ds::TransportCommunicator comm(t, o, ds::tcp_node_of(t));
      for (size_t count : {size_t{0}, size_t{1}, size_t{1000}, size_t{70000}}) {
        std::vector<float> in(count), out(count, -1.f);
        for (size_t i = 0; i < count; ++i) in[i] = element(r, i);
        comm.all_reduce(in.data(), out.data(), count, ds::DType::kFloat32, ds::ReduceOp::kSum, "x");
        for (size_t i = 0; i < count; ++i) {
          float want = 0;
          for (int q = 0; q < n; ++q) want += element(q, i);
          ASSERT_EQ(out[i], want) << ds::algorithm_name(a) << " count " << count << " element " << i
                                  << " on rank " << r;
        }
      }
      std::vector<float> b(100, -1.f);
      if (r == n - 1)
        for (size_t i = 0; i < b.size(); ++i) b[i] = element(r, i);
      comm.broadcast(b.data(), b.size(), ds::DType::kFloat32, n - 1, "b");
      for (size_t i = 0; i < b.size(); ++i) ASSERT_EQ(b[i], element(n - 1, i));
      comm.barrier("end");
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, TcpTransportCollectives, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "_ranks";
                         });

TEST(TcpTransport, SetUpNamesTheRankThatNeverCameAndOneRankNeedsNoPeers) {
  auto exchange = ds::make_in_memory_address_exchange();
  ds::TcpTransportOptions o;
  o.group = next_group();
  o.listen_host = "127.0.0.1";
  const auto t0 = Clock::now();
  const std::string m =
      message_of([&] { ds::make_tcp_transport(0, 3, *exchange, o, Clock::now() + 500ms); });
  EXPECT_LT(Clock::now() - t0, 5s);
  EXPECT_NE(m.find("[kDeadlineExceeded] rank 0 (TCP transport, group 'tcp-test/"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("ranks 1, 2 never published their addresses"), std::string::npos) << m;
  o.group = next_group();
  auto one = ds::make_tcp_transport(0, 1, *exchange, o, Clock::now() + 1s);
  EXPECT_EQ(one->size(), 1);
  EXPECT_EQ(ds::tcp_node_of(*one), std::vector<int>{0});
  EXPECT_NE(message_of([&] {
              ds::make_tcp_transport(2, 2, *exchange, o, Clock::now() + 1s);
            }).find("[kInvalidArgument]"),
            std::string::npos);
}

// The exchange's own failures (a store that went away, a rank that claims
// another's key) come back naming this rank, its group and the key, as the
// Gloo transport's set-up says them (allreduce/address_exchange.h).
TEST(TcpTransport, SetUpNamesTheKeyWhenTheExchangeFails) {
  struct BrokenExchange : ds::AddressExchange {
    bool publish_fails = false;
    void publish(const std::string&, const std::string&, Clock::time_point) override {
      if (publish_fails) throw ds::UnavailableError("the store went away");
    }
    std::string wait_for(const std::string&, Clock::time_point) override {
      throw ds::UnavailableError("the store went away");
    }
  } exchange;
  ds::TcpTransportOptions o;
  o.group = next_group();
  o.listen_host = "127.0.0.1";
  std::string m = message_of([&] { ds::make_tcp_transport(0, 2, exchange, o, Clock::now() + 1s); });
  EXPECT_NE(m.find("[kUnavailable] rank 0 (TCP transport, group '" + o.group +
                   "'): reading rank 1's addresses ('" + o.group +
                   "/tcp/1') failed: the store went away"),
            std::string::npos)
      << m;
  exchange.publish_fails = true;
  m = message_of([&] { ds::make_tcp_transport(1, 2, exchange, o, Clock::now() + 1s); });
  EXPECT_NE(m.find("[kUnavailable] rank 1 (TCP transport, group '" + o.group +
                   "'): publishing its addresses under '" + o.group +
                   "/tcp/1' failed: the store went away"),
            std::string::npos)
      << m;
}

}  // namespace
