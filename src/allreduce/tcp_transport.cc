// TCP transport (tcp_transport.h): destruction (goodbyes, bounded), set-up
// over an AddressExchange, tcp_node_of. The streams are in tcp_core.cc.

#include "allreduce/tcp_transport.h"

#include "allreduce/tcp_transport_impl.h"

namespace diststrat {
namespace tcp_impl {

TcpTransport::~TcpTransport() {
  Core& c = *core_;
  std::unique_lock<std::mutex> lock(c.mu);
  if (c.stop != Stop::kNone || c.pending > 0) {
    // Something is still pending (or the group is lost): the peers must not
    // wait for it.
    if (c.stop == Stop::kNone || c.stop == Stop::kBroken) c.stop = Stop::kDestroyed;
    c.shutdown_all_locked();
    c.wake();
    return;
  }
  // Flush what was queued, then a goodbye on every live connection, then
  // the end of our stream; wait (bounded) for the peers' ends so that no
  // reset loses bytes they have not read.
  for (int p = 0; p < c.size; ++p) {
    if (p == c.rank || c.peers[p].state != PeerState::kAlive) continue;
    OutMsg m;
    m.hdr = Header{kKindGoodbye, 0, 0};
    c.peers[p].out.push_back(m);
  }
  const auto until = Clock::now() + kGoodbyeGrace;
  std::vector<pollfd> fds;
  for (;;) {
    c.progress_locked();
    fds.clear();
    for (int p = 0; p < c.size; ++p) {
      Peer& peer = c.peers[p];
      if (p == c.rank || peer.fd < 0 || peer.state != PeerState::kAlive) continue;
      if (peer.out.empty()) shutdown(peer.fd, SHUT_WR);  // once flushed: our end of the stream
      fds.push_back({peer.fd, static_cast<short>(POLLIN | (peer.out.empty() ? 0 : POLLOUT)), 0});
    }
    if (fds.empty() || Clock::now() >= until) break;
    lock.unlock();
    poll(fds.data(), fds.size(), std::min(kMaxBlockMs, ms_until(until)));
    lock.lock();
  }
  c.stop = Stop::kDestroyed;
}

std::string numeric_host(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST] = {0};
  if (getnameinfo(sa, len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) return "";
  return host;
}

// Resolves host:port (numeric port) to a socket address.
bool resolve(const std::string& host, int port, sockaddr_storage* out, socklen_t* len,
             std::string* err) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0 || !res) {
    *err = gai_strerror(rc);
    return false;
  }
  std::memcpy(out, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return true;
}

// Reads or writes exactly n bytes on a blocking-by-poll socket before the deadline.
bool io_full(int fd, void* buf, size_t n, bool is_read, Clock::time_point deadline,
             std::string* err) {
  size_t done = 0;
  while (done < n) {
    ssize_t k = is_read ? recv(fd, static_cast<char*>(buf) + done, n - done, 0)
                        : send(fd, static_cast<char*>(buf) + done, n - done, MSG_NOSIGNAL);
    if (k > 0) {
      done += static_cast<size_t>(k);
      continue;
    }
    if (k == 0 && is_read) {
      *err = "the connection was closed";
      return false;
    }
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      *err = errno_text(errno);
      return false;
    }
    if (Clock::now() >= deadline) {
      *err = "the deadline passed";
      return false;
    }
    pollfd f{fd, static_cast<short>(is_read ? POLLIN : POLLOUT), 0};
    poll(&f, 1, std::min(kMaxBlockMs, ms_until(deadline)));
  }
  return true;
}

}  // namespace tcp_impl

using namespace tcp_impl;  // (this file's own parts)

std::unique_ptr<Transport> make_tcp_transport(int rank, int size, AddressExchange& exchange,
                                              const TcpTransportOptions& options,
                                              Clock::time_point deadline) {
  DISTSTRAT_CHECK(size >= 1, kInvalidArgument, "TCP transport: group size ", size, " < 1");
  DISTSTRAT_CHECK(rank >= 0 && rank < size, kInvalidArgument, "TCP transport: rank ", rank,
                  " is outside the group of ", size);
  DISTSTRAT_CHECK(!options.group.empty(), kInvalidArgument, "TCP transport: the group is empty");
  auto core = std::make_shared<Core>();
  core->rank = rank;
  core->size = size;
  core->group = options.group;
  core->failure_breaks_group = options.peer_failure_breaks_group;
  core->peers.resize(size);
  const std::string who =
      "rank " + std::to_string(rank) + " (TCP transport, group '" + echo(options.group) + "')";
  core->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (size == 1) return std::make_unique<TcpTransport>(core);

  // 1. Listen and publish.
  std::string host = options.listen_host;
  if (host.empty()) {
    char name[256] = {0};
    gethostname(name, sizeof name - 1);
    host = name;
  }
  sockaddr_storage addr{};
  socklen_t addr_len = 0;
  std::string err;
  DISTSTRAT_CHECK(resolve(host, 0, &addr, &addr_len, &err), kInvalidArgument, who,
                  ": the listen host '", echo(host), "' does not resolve: ", err);
  const int lfd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  DISTSTRAT_CHECK(lfd >= 0, kUnavailable, who, ": socket(): ", errno_text(errno));
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } lclose{lfd};
  if (bind(lfd, reinterpret_cast<sockaddr*>(&addr), addr_len) != 0 ||
      listen(lfd, std::max(size, 128)) != 0) {
    throw UnavailableError(who + ": cannot listen on " + echo(host) + ": " + errno_text(errno) +
                           " (listen_host must be an address of this host)");
  }
  set_nonblocking(lfd);
  sockaddr_storage bound{};
  socklen_t bound_len = sizeof bound;
  getsockname(lfd, reinterpret_cast<sockaddr*>(&bound), &bound_len);
  const int my_port =
      ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                        : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  const std::string my_host = numeric_host(reinterpret_cast<sockaddr*>(&bound), bound_len);
  const std::string prefix = options.group + "/tcp/";
  const std::string value =
      "ds-tcp/1 " + std::to_string(size) + " " + my_host + " " + std::to_string(my_port);
  core->peers[rank].host = my_host;
  core->peers[rank].address =
      (my_host.find(':') != std::string::npos ? "[" + my_host + "]" : my_host) + ":" +
      std::to_string(my_port);

  // 2. Publish, then every peer's address.
  std::vector<int> missing;
  const std::vector<std::optional<std::string>> values =
      exchange_addresses(exchange, prefix, rank, size, value, deadline, who, &missing);
  std::vector<int> ports(size, 0);
  for (int p = 0; p < size; ++p) {
    if (p == rank || !values[p]) continue;
    const std::string& v = *values[p];
    const std::string key = prefix + std::to_string(p);
    std::istringstream in(v);
    std::string magic, h;
    int n = 0, port = 0;
    in >> magic >> n >> h >> port;
    DISTSTRAT_CHECK(magic == "ds-tcp/1" && port > 0 && port < 65536 && !h.empty(), kInvalidArgument,
                    who, ": rank ", p, " published '", echo(v, 60), "' under '", echo(key),
                    "', not a TCP transport address");
    DISTSTRAT_CHECK(n == size, kInvalidArgument, who, ": rank ", p, " set up a group of ", n,
                    " ranks, this rank one of ", size);
    core->peers[p].host = h;
    ports[p] = port;
    core->peers[p].address =
        (h.find(':') != std::string::npos ? "[" + h + "]" : h) + ":" + std::to_string(port);
  }
  throw_if_unpublished(missing, prefix, who);

  const Hello mine{kHelloMagic, size, rank, hash32(options.group)};
  // 3. Connect to the higher ranks.
  for (int p = rank + 1; p < size; ++p) {
    sockaddr_storage to{};
    socklen_t to_len = 0;
    DISTSTRAT_CHECK(resolve(core->peers[p].host, ports[p], &to, &to_len, &err), kInvalidArgument,
                    who, ": ", core->peer_text(p), " does not resolve: ", err);
    const int fd = socket(to.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    DISTSTRAT_CHECK(fd >= 0, kUnavailable, who, ": socket(): ", errno_text(errno));
    core->peers[p].fd = fd;
    set_nonblocking(fd);
    set_nodelay(fd);
    int rc = connect(fd, reinterpret_cast<sockaddr*>(&to), to_len);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd f{fd, POLLOUT, 0};
      while (poll(&f, 1, ms_until(deadline)) < 0 && errno == EINTR) {
      }
      DISTSTRAT_CHECK(f.revents != 0, kDeadlineExceeded, who, ": connecting to ",
                      core->peer_text(p), " did not finish before the deadline");
      int so = 0;
      socklen_t so_len = sizeof so;
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &so_len);
      rc = so == 0 ? 0 : -1;
      errno = so;
    }
    if (rc != 0) {
      throw UnavailableError(who + ": connecting to " + core->peer_text(p) +
                             " failed: " + errno_text(errno));
    }
    Hello h = mine;
    if (!io_full(fd, &h, sizeof h, false, deadline, &err)) {
      throw UnavailableError(who + ": saying hello to " + core->peer_text(p) + " failed: " + err);
    }
  }
  // 4. Accept the lower ranks.
  int expected = rank;
  while (expected > 0) {
    pollfd f{lfd, POLLIN, 0};
    const int rc = poll(&f, 1, std::min(kMaxBlockMs, ms_until(deadline)));
    if (rc <= 0) {
      if (Clock::now() < deadline) continue;
      std::vector<int> absent;
      for (int p = 0; p < rank; ++p) {
        if (core->peers[p].fd < 0) absent.push_back(p);
      }
      throw DeadlineExceededError(who + ": " + ranks_phrase(absent) +
                                  " did not connect before the deadline");
    }
    const int fd = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    set_nonblocking(fd);
    set_nodelay(fd);
    Hello h{};
    if (!io_full(fd, &h, sizeof h, true,
                 std::min(deadline, Clock::now() + std::chrono::seconds(10)), &err) ||
        h.magic != kHelloMagic || h.group_hash != mine.group_hash || h.size != size || h.rank < 0 ||
        h.rank >= rank || core->peers[h.rank].fd >= 0) {
      close(fd);  // not a rank of this group (a stray connection): ignored
      continue;
    }
    core->peers[h.rank].fd = fd;
    --expected;
  }
  return std::make_unique<TcpTransport>(core);
}

std::vector<int> tcp_node_of(const Transport& transport) {
  const auto* t = dynamic_cast<const TcpTransport*>(&transport);
  if (!t) return {};
  const Core& c = *t->core();
  std::vector<int> node_of(c.size, -1);
  int nodes = 0;
  for (int r = 0; r < c.size; ++r) {
    if (node_of[r] >= 0) continue;
    for (int s = r; s < c.size; ++s) {
      if (node_of[s] < 0 && c.peers[s].host == c.peers[r].host) node_of[s] = nodes;
    }
    ++nodes;
  }
  return node_of;
}

}  // namespace diststrat
