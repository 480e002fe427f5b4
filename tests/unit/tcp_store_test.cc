// The chief's store of a job started without a launcher (src/runtime/tcp_store.h):
// put and get, a key claimed twice, and what the network may send it: a
// peer speaking another protocol, sizes over the limits, a bad key, a
// request left half-sent are refused (or dropped) while real clients are
// served on; a client facing a server that is not one, or none, fails with
// a diststrat::Error within its deadline.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "diststrat/error.h"
#include "runtime/tcp_store.h"

namespace diststrat {
namespace {

using std::chrono::milliseconds;

Clock::time_point in(milliseconds ms) { return Clock::now() + ms; }

// A raw TCP connection to 127.0.0.1:port.
int dial(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  return fd;
}

// Everything the server sends until it closes (or 5 s pass).
std::string read_until_closed(int fd) {
  std::string out;
  char buf[4096];
  const auto end = in(milliseconds(5000));
  while (Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return out;
    out.append(buf, static_cast<size_t>(n));
  }
  ADD_FAILURE() << "the server did not close the connection";
  return out;
}

std::string header(char op, uint16_t key_len, uint32_t value_len) {
  std::string h = "DSKV";
  h.push_back(op);
  h.push_back(static_cast<char>(key_len >> 8));
  h.push_back(static_cast<char>(key_len & 0xff));
  for (int s = 24; s >= 0; s -= 8) h.push_back(static_cast<char>((value_len >> s) & 0xff));
  return h;
}

TcpStoreClient client_of(const TcpStoreServer& s) {
  return TcpStoreClient("127.0.0.1", s.port(), "rank 1", "the test's store");
}

TEST(TcpStore, PutsAndGets) {
  TcpStoreServer server("127.0.0.1", 0, "the test's store");
  TcpStoreClient a = client_of(server), b = client_of(server);
  EXPECT_FALSE(b.get("world/gloo/0", in(milliseconds(2000))).has_value());
  a.publish("world/gloo/0", std::string(65536, 'x'), in(milliseconds(2000)));
  EXPECT_EQ(b.wait_for("world/gloo/0", in(milliseconds(2000))), std::string(65536, 'x'));
  a.publish("world/gloo/0", std::string(65536, 'x'), in(milliseconds(2000)));  // same: fine
  try {
    b.publish("world/gloo/0", "another", in(milliseconds(2000)));
    FAIL() << "a second value for one key was taken";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("two processes claim one task"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(a.publish("bad key", "v", in(milliseconds(2000))), InvalidArgumentError);
  EXPECT_EQ(server.refused(), 0);
}

TEST(TcpStore, WaitForNamesTheKeyAtTheDeadline) {
  TcpStoreServer server("127.0.0.1", 0, "the test's store");
  TcpStoreClient a = client_of(server);
  const auto t0 = Clock::now();
  try {
    a.wait_for("world/gloo/2", in(milliseconds(300)));
    FAIL();
  } catch (const DeadlineExceededError& e) {
    EXPECT_NE(std::string(e.what()).find("'world/gloo/2' was not published"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(Clock::now() - t0, milliseconds(2000));
}

// Each of these is refused with an 'E' answer naming why, the connection is
// closed, and a real client is served before and after.
TEST(TcpStore, RefusesWhatIsNotItsProtocolAndServesOthersOn) {
  TcpStoreServer server("127.0.0.1", 0, "the test's store");
  TcpStoreClient good = client_of(server);
  good.publish("world/gloo/0", "addresses", in(milliseconds(2000)));
  const struct {
    std::string bytes, why;
  } cases[] = {
      {"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad magic"},
      {header('X', 3, 0) + "abc", "unknown operation"},
      {header('P', 0, 1) + "v", "key of 0 bytes"},
      {header('P', 4, 0xffffffffu) + "abcd", "value of 4294967295 bytes"},
      {header('G', 3, 5) + "abc", "value of 5 bytes"},
      {header('P', 5, 1) + "a b\n\x01v", "not [A-Za-z0-9._/-]"},
      {std::string("\x00\x00\x00\x00\xff\xff\xff\xff\xff\xff\xff", 11), "bad magic"},
  };
  int refused = 0;
  for (const auto& c : cases) {
    const int fd = dial(server.port());
    ASSERT_EQ(::send(fd, c.bytes.data(), c.bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(c.bytes.size()));
    const std::string answer = read_until_closed(fd);
    ::close(fd);
    EXPECT_EQ(answer.substr(0, 5), "DSKVE") << c.why;
    EXPECT_NE(answer.find(c.why), std::string::npos) << answer;
    EXPECT_EQ(server.refused(), ++refused);
    EXPECT_NE(server.last_refusal().find(c.why), std::string::npos) << server.last_refusal();
    // The job's clients notice nothing.
    EXPECT_EQ(good.wait_for("world/gloo/0", in(milliseconds(2000))), "addresses");
  }
  // A peer that sends half a request and goes silent holds nobody up.
  const int stalled = dial(server.port());
  ASSERT_EQ(::send(stalled, "DSKVP", 5, MSG_NOSIGNAL), 5);
  TcpStoreClient other = client_of(server);
  other.publish("world/gloo/1", "more", in(milliseconds(2000)));
  EXPECT_EQ(good.wait_for("world/gloo/1", in(milliseconds(2000))), "more");
  ::close(stalled);
  // One that sends half a request and closes its side is told why, counted
  // and recorded like the others (it was closed without a word).
  const int half = dial(server.port());
  const std::string partial = header('P', 8, 4) + "worl";
  ASSERT_EQ(::send(half, partial.data(), partial.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(partial.size()));
  ::shutdown(half, SHUT_WR);
  const std::string answer = read_until_closed(half);
  ::close(half);
  EXPECT_EQ(answer.substr(0, 5), "DSKVE") << answer;
  EXPECT_NE(answer.find("the peer closed its side after 15 bytes of a request"), std::string::npos)
      << answer;
  refused += 2;  // (the stalled peer's 5 bytes, closed before, too)
  EXPECT_EQ(server.refused(), refused);
  EXPECT_NE(server.last_refusal().find("after 15 bytes of a request"), std::string::npos)
      << server.last_refusal();
  EXPECT_EQ(good.wait_for("world/gloo/1", in(milliseconds(2000))), "more");
}

// Idle connections opened by anyone do not keep the job's processes out: at
// 256 the one silent the longest is closed for the next.
TEST(TcpStore, IdleConnectionsMakeRoomForTheJobsOwn) {
  TcpStoreServer server("127.0.0.1", 0, "the test's store");
  std::vector<int> idle;
  for (int i = 0; i < 300; ++i) idle.push_back(dial(server.port()));
  TcpStoreClient c = client_of(server);
  c.publish("world/gloo/0", "addresses", in(milliseconds(5000)));
  EXPECT_EQ(c.wait_for("world/gloo/0", in(milliseconds(5000))), "addresses");
  EXPECT_GE(server.refused(), 300 + 1 - 256);
  EXPECT_NE(server.last_refusal().find("the one silent the longest is closed"), std::string::npos)
      << server.last_refusal();
  for (int fd : idle) ::close(fd);
}

// A client whose connection the server closed to make room (257 connections)
// connects again: the job's own process is not failed by an outsider.
TEST(TcpStore, AClientWhoseConnectionWasClosedForRoomConnectsAgain) {
  TcpStoreServer server("127.0.0.1", 0, "the test's store");
  TcpStoreClient owner = client_of(server), waiter = client_of(server);
  owner.publish("world/gloo/0", "addresses", in(milliseconds(5000)));
  EXPECT_FALSE(waiter.get("world/gloo/1", in(milliseconds(5000))).has_value());
  // The waiter's connection is now the one silent the longest.
  std::vector<int> idle;
  for (int i = 0; i < 300; ++i) idle.push_back(dial(server.port()));
  const auto end = in(milliseconds(5000));
  while (server.refused() < 300 + 2 - 256 && Clock::now() < end) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  ASSERT_GE(server.refused(), 300 + 2 - 256);
  EXPECT_EQ(waiter.wait_for("world/gloo/0", in(milliseconds(5000))), "addresses");
  for (int fd : idle) ::close(fd);
}

// A job of 250 ranks publishes ~273 bytes of Gloo address per peer under one key.
TEST(TcpStore, AValueForTwoHundredFiftyPeersIsTaken) {
  TcpStoreServer server("127.0.0.1", 0, "the test's store");
  TcpStoreClient a = client_of(server), b = client_of(server);
  const std::string value(250 * 280, 'a');
  a.publish("world/gloo/0", value, in(milliseconds(5000)));
  EXPECT_EQ(b.wait_for("world/gloo/0", in(milliseconds(5000))), value);
  EXPECT_EQ(server.refused(), 0);
}

// Values are bounded in all, not only each: 256 MiB.
TEST(TcpStore, ValuesAreBoundedInAll) {
  TcpStoreServer server("127.0.0.1", 0, "the test's store");
  TcpStoreClient a = client_of(server);
  const std::string mib(1 << 20, 'v');
  for (int i = 0; i < 256; ++i) a.publish("k" + std::to_string(i), mib, in(milliseconds(20000)));
  try {
    a.publish("k256", mib, in(milliseconds(5000)));
    FAIL() << "257 MiB of values taken";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("bytes of values (at most 268435456)"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(a.get("k0", in(milliseconds(5000))), mib);  // served on
}

long rss_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

// A peer that pipelines gets of a 64 KiB value and reads nothing gets one
// answer at a time (TCP holds it back), not the chief's memory.
TEST(TcpStore, APeerThatDoesNotReadItsAnswersIsHeldBack) {
  TcpStoreServer server("127.0.0.1", 0, "the test's store");
  TcpStoreClient a = client_of(server);
  a.publish("x", std::string(64 << 10, 'v'), in(milliseconds(5000)));
  const long before = rss_kib();
  ASSERT_GT(before, 0);
  const int fd = dial(server.port());
  const std::string get = header('G', 1, 0) + "x";
  std::string burst;
  for (int i = 0; i < 256; ++i) burst += get;
  size_t sent = 0;
  const auto end = in(milliseconds(2000));
  while (Clock::now() < end) {
    const ssize_t n = ::send(fd, burst.data(), burst.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else {
      std::this_thread::sleep_for(milliseconds(1));
    }
  }
  const long grown_mib = (rss_kib() - before) / 1024;
  EXPECT_LT(grown_mib, 64) << "after " << sent << " bytes of requests";
  EXPECT_EQ(a.wait_for("x", in(milliseconds(5000))), std::string(64 << 10, 'v'));
  ::close(fd);
}

// Out of descriptors, the server records why and takes the waiting
// connection once descriptors are free again.
TEST(TcpStore, OutOfDescriptorsTheWaitingConnectionIsTakenLater) {
  TcpStoreServer server("127.0.0.1", 0, "the test's store");
  TcpStoreClient a = client_of(server);
  a.publish("world/gloo/0", "addresses", in(milliseconds(5000)));
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  rlimit low = old;
  low.rlim_cur = std::min<rlim_t>(old.rlim_cur, 4096);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<int> filler;  // every descriptor but one
  for (;;) {
    const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) break;
    filler.push_back(fd);
  }
  ASSERT_FALSE(filler.empty());
  ::close(filler.back());
  filler.pop_back();
  const int fd = dial(server.port());  // the last one: the server has none to accept with
  const auto end = in(milliseconds(5000));
  while (server.last_error().find("accept") == std::string::npos && Clock::now() < end) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  const std::string error = server.last_error();
  for (int f : filler) ::close(f);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
  EXPECT_NE(error.find("accept: Too many open files"), std::string::npos) << error;
  const std::string get = header('G', 12, 0) + "world/gloo/0";
  ASSERT_EQ(::send(fd, get.data(), get.size(), MSG_NOSIGNAL), static_cast<ssize_t>(get.size()));
  std::string answer;
  char buf[256];
  const auto answered = in(milliseconds(5000));
  while (answer.size() < 9 + 9 && Clock::now() < answered) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    answer.append(buf, static_cast<size_t>(n));
  }
  EXPECT_EQ(answer, std::string("DSKVV\x00\x00\x00\x09", 9) + "addresses");
  ::close(fd);
}

// A listening socket that answers every connection with `reply` (or nothing).
class FakeServer {
 public:
  explicit FakeServer(std::string reply) : reply_(std::move(reply)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(::listen(fd_, 8), 0);
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 5000) <= 0) return;
      conn_ = ::accept(fd_, nullptr, nullptr);
      if (!reply_.empty()) (void)::send(conn_, reply_.data(), reply_.size(), MSG_NOSIGNAL);
    });
  }
  ~FakeServer() {
    thread_.join();
    if (conn_ >= 0) ::close(conn_);
    ::close(fd_);
  }
  int port() const { return port_; }

 private:
  std::string reply_;
  int fd_ = -1, conn_ = -1, port_ = 0;
  std::thread thread_;
};

TEST(TcpStore, ClientRefusesAnAnswerThatIsNotTheProtocol) {
  for (const std::string& reply : {std::string("HTTP/1.1 400 Bad Request\r\n\r\n"),
                                   std::string("DSKVV\x7f\xff\xff\xff", 9),  // a value over 1 MiB
                                   std::string("DSKVZ\x00\x00\x00\x00", 9)}) {  // an unknown status
    FakeServer fake(reply);
    TcpStoreClient c("127.0.0.1", fake.port(), "rank 1", "the chief's store");
    try {
      c.get("world/gloo/0", in(milliseconds(2000)));
      FAIL() << "took " << reply;
    } catch (const DataLossError& e) {
      EXPECT_NE(std::string(e.what()).find("not the diststrat store protocol"), std::string::npos)
          << e.what();
    }
  }
}

TEST(TcpStore, ClientGivesUpAtTheDeadlineOnASilentServerOrNone) {
  {
    FakeServer silent("");
    TcpStoreClient c("127.0.0.1", silent.port(), "rank 1", "the chief's store");
    const auto t0 = Clock::now();
    EXPECT_THROW(c.get("k", in(milliseconds(300))), DeadlineExceededError);
    EXPECT_LT(Clock::now() - t0, milliseconds(2000));
  }
  int port = 0;
  {
    TcpStoreServer gone("127.0.0.1", 0, "x");
    port = gone.port();
  }
  TcpStoreClient c("127.0.0.1", port, "rank 1", "the chief's store (chief[0])");
  try {
    c.publish("k", "v", in(milliseconds(300)));
    FAIL();
  } catch (const DeadlineExceededError& e) {
    EXPECT_NE(std::string(e.what()).find("the chief's store (chief[0]) at 127.0.0.1:"),
              std::string::npos)
        << e.what();
  }
}

TEST(TcpStore, APortInUseIsNamed) {
  TcpStoreServer first("127.0.0.1", 0, "the chief's store");
  try {
    TcpStoreServer second("127.0.0.1", first.port(), "the chief's store");
    FAIL();
  } catch (const UnavailableError& e) {
    EXPECT_NE(std::string(e.what()).find("another process holds the port"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace diststrat
