// The chief's key-value store over TCP (tcp_store.h): a poll(2) loop on one
// thread with non-blocking sockets, so that a slow or hostile peer never
// holds up the others; the client side, every wait under the caller's
// deadline.
#include "runtime/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "core/user_text.h"
#include "diststrat/error.h"

namespace diststrat {

namespace {

constexpr char kMagic[4] = {'D', 'S', 'K', 'V'};
constexpr size_t kHeader = 11;       // magic, op, key_len u16, value_len u32
constexpr size_t kAnswerHeader = 9;  // magic, status, len u32
constexpr size_t kMaxKey = 200;
// A job's Gloo addresses are ~273 bytes per peer under one key: 1 MiB is
// ~3800 ranks, and still bounds what one peer can make the chief hold.
constexpr size_t kMaxValue = 1 << 20;
constexpr size_t kMaxReason = 1024;
constexpr size_t kMaxConnections = 256;
constexpr size_t kMaxKeys = 4096;
// All values together: 4096 keys of 1 MiB would be 4 GiB of the chief's
// memory for anyone who connects. 256 MiB holds the Gloo addresses of ~990
// ranks (n keys of ~273 n bytes).
constexpr size_t kMaxStored = size_t(256) << 20;
constexpr auto kMidRequestSilence = std::chrono::seconds(10);
constexpr auto kIdle = std::chrono::minutes(5);

uint32_t get_u32(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return (uint32_t(u[0]) << 24) | (uint32_t(u[1]) << 16) | (uint32_t(u[2]) << 8) | u[3];
}
void put_u32(std::string* s, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) s->push_back(static_cast<char>((v >> shift) & 0xff));
}
std::string answer(char status, const std::string& payload) {
  std::string a(kMagic, 4);
  a.push_back(status);
  put_u32(&a, static_cast<uint32_t>(payload.size()));
  return a + payload;
}

// The IPv4 address of `host` ("" = any). Throws InvalidArgumentError.
in_addr resolve_v4(const std::string& host, const std::string& who) {
  in_addr a{};
  if (host.empty()) {
    a.s_addr = htonl(INADDR_ANY);
    return a;
  }
  if (inet_pton(AF_INET, host.c_str(), &a) == 1) return a;
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  DISTSTRAT_CHECK(rc == 0 && res, kInvalidArgument, who, ": host '", echo(host),
                  "' does not resolve to an IPv4 address (", gai_strerror(rc), ")");
  a = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return a;
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL, 0) | O_NONBLOCK); }

}  // namespace

bool is_tcp_store_key(const std::string& key) {
  if (key.empty() || key.size() > kMaxKey) return false;
  return std::all_of(key.begin(), key.end(), [](unsigned char c) {
    return std::isalnum(c) || c == '.' || c == '_' || c == '/' || c == '-';
  });
}

// ---- server ----------------------------------------------------------------

struct TcpStoreServer::State {
  struct Conn {
    int fd = -1;
    std::string in, out;
    bool closing = false;  // close once `out` is written
    Clock::time_point last = Clock::now();
  };
  std::string who;
  int listen_fd = -1;
  int wake[2] = {-1, -1};
  int port = 0;
  std::map<std::string, std::string> keys;  // the loop thread's only
  size_t stored = 0;                        // bytes of keys' values; the loop thread's only
  std::vector<Conn> conns;                  // the loop thread's only
  std::atomic<bool> stop{false};
  std::atomic<int> refused{0};
  mutable std::mutex mu;
  std::string last_refusal;  // under mu
  std::string last_error;    // under mu: the server's own trouble (poll, accept, memory)
  Clock::time_point accept_paused_until{};  // the loop thread's only
  std::thread thread;

  // `status` 'E' for a peer that broke the protocol, 'R' for one closed
  // through no fault of its own (room, idle): its client connects again.
  void refuse(Conn& c, const std::string& why, char status = 'E') {
    const std::string reason =
        who + (status == 'E' ? ": request refused: " : ": connection closed: ") + why;
    c.out += answer(status, reason.substr(0, kMaxReason));
    c.in.clear();
    c.closing = true;
    ++refused;
    std::lock_guard<std::mutex> lock(mu);
    last_refusal = reason;
  }
  void note_error(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    last_error = who + ": " + what;
  }
  // Handles the next complete request in c.in once the last answer is sent:
  // one answer waits per connection, so a peer that pipelines requests and
  // reads nothing is held back by TCP, not by the chief's memory. Refuses
  // the connection at the first header or key that breaks the protocol.
  void serve(Conn& c) {
    while (!c.closing && !c.in.empty() && c.out.empty()) {
      const size_t have = std::min(c.in.size(), sizeof kMagic);
      if (std::memcmp(c.in.data(), kMagic, have) != 0) {
        return refuse(c, "not the diststrat store protocol (bad magic)");
      }
      if (c.in.size() < kHeader) return;
      const char op = c.in[4];
      const size_t key_len = (size_t(uint8_t(c.in[5])) << 8) | uint8_t(c.in[6]);
      const size_t value_len = get_u32(c.in.data() + 7);
      if (op != 'P' && op != 'G') return refuse(c, "unknown operation");
      if (key_len == 0 || key_len > kMaxKey) {
        return refuse(c, "key of " + std::to_string(key_len) + " bytes (1-200)");
      }
      if (value_len > kMaxValue || (op == 'G' && value_len != 0)) {
        return refuse(c, "value of " + std::to_string(value_len) + " bytes (at most " +
                             std::to_string(kMaxValue) + ")");
      }
      const size_t key_have = std::min(c.in.size() - kHeader, key_len);
      const std::string partial = c.in.substr(kHeader, key_have);
      if (!std::all_of(partial.begin(), partial.end(), [](unsigned char ch) {
            return std::isalnum(ch) || ch == '.' || ch == '_' || ch == '/' || ch == '-';
          })) {
        return refuse(c, "a key that is not [A-Za-z0-9._/-]");
      }
      if (c.in.size() < kHeader + key_len + value_len) return;
      const std::string key = c.in.substr(kHeader, key_len);
      std::string value = c.in.substr(kHeader + key_len, value_len);
      c.in.erase(0, kHeader + key_len + value_len);
      if (op == 'G') {
        auto it = keys.find(key);
        c.out += it == keys.end() ? answer('N', "") : answer('V', it->second);
      } else {
        auto it = keys.find(key);
        if (it != keys.end()) {
          c.out += answer(it->second == value ? 'O' : 'C', "");
        } else if (keys.size() >= kMaxKeys) {
          return refuse(c, "the store holds " + std::to_string(kMaxKeys) + " keys already");
        } else if (stored + value.size() > kMaxStored) {
          return refuse(c, "the store holds " + std::to_string(stored) +
                               " bytes of values (at most " + std::to_string(kMaxStored) + ")");
        } else {
          stored += value.size();
          keys.emplace(key, std::move(value));
          c.out += answer('O', "");
        }
      }
    }
  }
  void accept_all() {
    for (;;) {
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        // Out of descriptors the listener stays readable: not polled for a
        // while (the connections waiting are taken once some are closed)
        // instead of a thread spinning on it.
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          note_error(std::string("accept: ") + std::strerror(errno) + " (new connections wait)");
          accept_paused_until = Clock::now() + std::chrono::milliseconds(100);
        }
        return;
      }
      Conn c;
      c.fd = fd;
      const auto live =
          std::count_if(conns.begin(), conns.end(), [](const Conn& x) { return x.fd >= 0; });
      if (static_cast<size_t>(live) >= kMaxConnections) {
        // Full: the connection silent the longest makes room, so that idle
        // connections opened by anyone cannot keep the job's processes out.
        // (Closed here, removed by the loop: its poll entries stay in step.)
        Conn* oldest = nullptr;
        for (Conn& x : conns) {
          if (x.fd >= 0 && (!oldest || x.last < oldest->last)) oldest = &x;
        }
        refuse(*oldest,
               "more than " + std::to_string(kMaxConnections) +
                   " connections; the one silent the longest is closed (connect again)",
               'R');
        (void)::send(oldest->fd, oldest->out.data(), oldest->out.size(),
                     MSG_NOSIGNAL | MSG_DONTWAIT);
        ::close(oldest->fd);
        oldest->fd = -1;
      }
      conns.push_back(std::move(c));
    }
  }
  // No exception leaves the thread (it would end the chief through
  // std::terminate): one that a connection causes closes that connection,
  // any other is recorded and the loop goes on.
  void loop() {
    std::vector<pollfd> fds;
    while (!stop.load()) {
      try {
        pass(fds);
      } catch (const std::exception& e) {
        note_error(std::string("serving: ") + e.what());
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  }
  void pass(std::vector<pollfd>& fds) {
    char buf[16 << 10];
    fds.clear();
    fds.push_back({wake[0], POLLIN, 0});
    fds.push_back({Clock::now() < accept_paused_until ? -1 : listen_fd, POLLIN, 0});
    for (const Conn& c : conns) {
      // Reading waits while an answer does.
      fds.push_back({c.fd, static_cast<short>(c.out.empty() ? POLLIN : POLLOUT), 0});
    }
    if (::poll(fds.data(), fds.size(), 100) < 0) {
      if (errno == EINTR) return;
      // Recorded (the clients' "did not answer" is explained by it) and
      // tried again: the store does not end quietly.
      note_error(std::string("poll: ") + std::strerror(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      return;
    }
    if (fds[1].revents & POLLIN) accept_all();
    const Clock::time_point now = Clock::now();
    for (size_t i = 0; i + 2 < fds.size(); ++i) {
      Conn& c = conns[i];
      bool dead = (fds[i + 2].revents & (POLLERR | POLLNVAL)) != 0;
      try {
        if (!dead && c.out.empty() && (fds[i + 2].revents & (POLLIN | POLLHUP))) {
          const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
          if (n > 0 && !c.closing) {
            c.in.append(buf, static_cast<size_t>(n));
            c.last = now;
            serve(c);
          } else if (n == 0 && !c.in.empty() && !c.closing) {
            // Half a request, then the peer closed its side: told why (its
            // reading side may still be open), counted like any refusal.
            refuse(c, "the peer closed its side after " + std::to_string(c.in.size()) +
                          " bytes of a request");
          } else if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
            dead = true;
          }
        }
        if (!dead && (fds[i + 2].revents & POLLHUP) && !c.out.empty()) dead = true;
        if (!dead && !c.out.empty()) {
          const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
          if (n > 0) {
            c.out.erase(0, static_cast<size_t>(n));
            c.last = now;
            serve(c);  // the next request already here
          } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
            dead = true;
          }
        }
      } catch (const std::exception& e) {
        note_error(std::string("serving a connection (closed): ") + e.what());
        dead = true;
      }
      const bool idle = c.in.empty() && c.out.empty();
      if (!dead && !c.closing && now - c.last > (idle ? kIdle : kMidRequestSilence)) {
        if (idle) {
          refuse(c, "idle too long (connect again)", 'R');
        } else {
          refuse(c, c.out.empty() ? "a request left unfinished for 10 s"
                                  : "an answer left unread for 10 s");
        }
      }
      // A refused peer that does not read its answer is not waited for.
      if (c.closing && (c.out.empty() || now - c.last > kMidRequestSilence)) dead = true;
      if (dead) {
        ::close(c.fd);
        c.fd = -1;
      }
    }
    conns.erase(std::remove_if(conns.begin(), conns.end(), [](const Conn& c) { return c.fd < 0; }),
                conns.end());
  }
};

TcpStoreServer::TcpStoreServer(const std::string& host, int port, const std::string& who)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.who = who + " at " + host + ":" + std::to_string(port);
  DISTSTRAT_CHECK(port >= 0 && port <= 65535, kInvalidArgument, s.who, ": port out of range");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr = resolve_v4(host, s.who);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  s.listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  DISTSTRAT_CHECK(s.listen_fd >= 0, kUnavailable, s.who, ": socket: ", std::strerror(errno));
  const int one = 1;
  ::setsockopt(s.listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(s.listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(s.listen_fd, 128) != 0) {
    const int e = errno;
    ::close(s.listen_fd);
    throw UnavailableError(s.who + ": cannot listen: " + std::strerror(e) +
                           (e == EADDRINUSE      ? " (another process holds the port)"
                            : e == EADDRNOTAVAIL ? " (not an address of this host)"
                                                 : ""));
  }
  socklen_t len = sizeof addr;
  ::getsockname(s.listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
  s.port = ntohs(addr.sin_port);
  set_nonblocking(s.listen_fd);
  if (::pipe2(s.wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    ::close(s.listen_fd);
    throw UnavailableError(s.who + ": pipe: " + std::strerror(errno));
  }
  s.thread = std::thread([&s] { s.loop(); });
}

TcpStoreServer::~TcpStoreServer() {
  State& s = *state_;
  s.stop = true;
  (void)!::write(s.wake[1], "x", 1);
  s.thread.join();
  for (const State::Conn& c : s.conns) ::close(c.fd);
  ::close(s.listen_fd);
  ::close(s.wake[0]);
  ::close(s.wake[1]);
}

int TcpStoreServer::port() const { return state_->port; }
int TcpStoreServer::refused() const { return state_->refused.load(); }
std::string TcpStoreServer::last_refusal() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->last_refusal;
}
std::string TcpStoreServer::last_error() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->last_error;
}

// ---- client ----------------------------------------------------------------

TcpStoreClient::TcpStoreClient(std::string host, int port, std::string who, std::string server)
    : host_(std::move(host)), port_(port), who_(std::move(who)), server_(std::move(server)) {}

TcpStoreClient::~TcpStoreClient() { close_fd(); }

void TcpStoreClient::close_fd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

namespace {
// Waits for `events` on fd until `deadline`; false at the deadline.
bool poll_until(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 100)));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) return true;  // the next call reports it
  }
}
}  // namespace

void TcpStoreClient::connect(Clock::time_point deadline) {
  const std::string where = server_ + " at " + host_ + ":" + std::to_string(port_);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port_));
  std::string last = "no answer";
  while (Clock::now() < deadline) {
    // The chief's name may not resolve yet (a pod's DNS record comes with
    // the pod), or may change (a restarted pod): looked up again after a
    // failure, at most once a second and never past the deadline. One
    // lookup is not bounded by the deadline: it may overshoot it by the
    // resolver's own timeout (resolv.conf's timeout x attempts).
    if ((!resolved_ || stale_) && Clock::now() >= next_lookup_) {
      next_lookup_ = Clock::now() + std::chrono::seconds(1);
      try {
        addr_ = resolve_v4(host_, "host").s_addr;
        resolved_ = true;
        stale_ = false;
      } catch (const InvalidArgumentError& e) {
        last = e.message();
      }
    }
    if (!resolved_) {
      std::this_thread::sleep_until(std::min(deadline, next_lookup_));
      continue;
    }
    addr.sin_addr.s_addr = addr_;
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    DISTSTRAT_CHECK(fd_ >= 0, kUnavailable, who_, ": socket: ", std::strerror(errno));
    int rc = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    if (rc != 0 && errno == EINPROGRESS) {
      if (poll_until(fd_, POLLOUT, deadline)) {
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      } else {
        errno = ETIMEDOUT;
      }
    }
    if (rc == 0) {
      const int one = 1;
      ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return;
    }
    last = std::strerror(errno);
    close_fd();
    stale_ = true;  // looked up again within a second, tried meanwhile as it was
    // The chief may not be up yet: ask again.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  throw DeadlineExceededError(who_ + ": " + where + " did not accept a connection before the " +
                              "deadline (" + last + "): is that process started, and is the " +
                              "address right?");
}

char TcpStoreClient::call(char op, const std::string& key, const std::string& value,
                          Clock::time_point deadline, std::string* payload) {
  // A connection that broke (the chief restarted its store, a reset) is made
  // again until the deadline: a put of the same value and a get are safe to
  // repeat. At the deadline the last error stands.
  for (;;) {
    try {
      return call_once(op, key, value, deadline, payload);
    } catch (const UnavailableError& e) {
      if (Clock::now() + std::chrono::milliseconds(50) >= deadline) {
        throw DeadlineExceededError(e.message() + " (and no new connection before the deadline)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
}

char TcpStoreClient::call_once(char op, const std::string& key, const std::string& value,
                               Clock::time_point deadline, std::string* payload) {
  DISTSTRAT_CHECK(is_tcp_store_key(key) && value.size() <= kMaxValue, kInvalidArgument, who_,
                  ": store key '", echo(key, 60), "' (1-200 of [A-Za-z0-9._/-]) or a value of ",
                  value.size(), " bytes (at most ", kMaxValue, ")");
  const std::string where = server_ + " at " + host_ + ":" + std::to_string(port_);
  std::string req(kMagic, 4);
  req.push_back(op);
  req.push_back(static_cast<char>(key.size() >> 8));
  req.push_back(static_cast<char>(key.size() & 0xff));
  put_u32(&req, static_cast<uint32_t>(value.size()));
  req += key;
  req += value;
  if (fd_ < 0) connect(deadline);
  const auto fail = [&](const std::string& why) {
    close_fd();
    throw UnavailableError(who_ + ": " + where + ": " + why);
  };
  size_t sent = 0;
  while (sent < req.size()) {
    if (!poll_until(fd_, POLLOUT, deadline)) {
      close_fd();
      throw DeadlineExceededError(who_ + ": " + where + " took no request before the deadline");
    }
    const ssize_t n = ::send(fd_, req.data() + sent, req.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EINTR)
      fail(std::string("send: ") + std::strerror(errno));
    if (n > 0) sent += static_cast<size_t>(n);
  }
  // The answer: header first, its sizes checked before the payload is read.
  std::string in;
  size_t want = kAnswerHeader;
  char buf[4096];
  while (in.size() < want) {
    if (!poll_until(fd_, POLLIN, deadline)) {
      close_fd();
      throw DeadlineExceededError(who_ + ": " + where + " did not answer before the deadline");
    }
    const ssize_t n = ::recv(fd_, buf, std::min(sizeof buf, want - in.size()), 0);
    if (n == 0) fail("closed the connection mid-answer");
    if (n < 0 && errno != EAGAIN && errno != EINTR)
      fail(std::string("recv: ") + std::strerror(errno));
    if (n <= 0) continue;
    in.append(buf, static_cast<size_t>(n));
    if (in.size() == kAnswerHeader && want == kAnswerHeader) {
      const char status = in[4];
      const uint32_t len = get_u32(in.data() + 5);
      const bool known = std::string("OVNCER").find(status) != std::string::npos;
      if (std::memcmp(in.data(), kMagic, 4) != 0 || !known ||
          len > (status == 'V'                    ? kMaxValue
                 : status == 'E' || status == 'R' ? kMaxReason
                                                  : 0)) {
        close_fd();
        throw DataLossError(who_ + ": " + where +
                            " answered with bytes that are not the diststrat store protocol "
                            "(is the address a diststrat chief's?)");
      }
      want += len;
    }
  }
  const char status = in[4];
  *payload = in.substr(kAnswerHeader);
  if (status == 'R')
    fail("closed this connection (" + echo(*payload) + ")");  // call() connects again
  if (status == 'E') {
    close_fd();
    throw InvalidArgumentError(who_ + ": " + where + " refused the request: " + echo(*payload));
  }
  return status;
}

void TcpStoreClient::publish(const std::string& key, const std::string& value,
                             Clock::time_point deadline) {
  std::string payload;
  const char status = call('P', key, value, deadline, &payload);
  DISTSTRAT_CHECK(status != 'C', kInvalidArgument, who_, ": '", echo(key), "' is in ", server_,
                  " already with another value: two processes claim one task (check every "
                  "process's TF_CONFIG task)");
  DISTSTRAT_CHECK(status == 'O', kDataLoss, who_, ": ", server_, " answered a put with '",
                  echo(std::string(1, status)), "'");
}

std::optional<std::string> TcpStoreClient::get(const std::string& key, Clock::time_point deadline) {
  std::string payload;
  const char status = call('G', key, "", deadline, &payload);
  if (status == 'N') return std::nullopt;
  DISTSTRAT_CHECK(status == 'V', kDataLoss, who_, ": ", server_, " answered a get with '",
                  echo(std::string(1, status)), "'");
  return payload;
}

std::string TcpStoreClient::wait_for(const std::string& key, Clock::time_point deadline) {
  return wait_for(key, deadline, nullptr);
}

std::string TcpStoreClient::wait_for(const std::string& key, Clock::time_point deadline,
                                     const std::function<void()>& between_looks) {
  for (;;) {
    // Past the deadline one short look still answers for a key that is there.
    const Clock::time_point d = std::max(deadline, Clock::now() + std::chrono::milliseconds(200));
    if (std::optional<std::string> v = get(key, d)) return *v;
    if (between_looks) between_looks();
    if (Clock::now() >= deadline) {
      throw DeadlineExceededError(who_ + ": '" + echo(key) + "' was not published in " + server_ +
                                  " before the deadline");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace diststrat
