// TCP transport (tcp_transport.h): set-up over an AddressExchange, the
// per-connection streams of (header, payload) messages, and the progress
// loop that the waiting thread runs itself.

#include "allreduce/tcp_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/user_text.h"

namespace diststrat {
namespace {

constexpr uint32_t kHelloMagic = 0x44535443;  // "DSTC"
constexpr uint32_t kKindData = 1;
constexpr uint32_t kKindGoodbye = 2;
// How a wait polls its sockets (as the MPI transport does): a few hundred
// tight polls (a peer on the same host usually answers within
// microseconds), then one every 50 us, then, once nothing has moved for
// 50 ms, a poll(2) that sleeps up to 1 ms. Not a poll(2) that sleeps until
// data comes: measured with allreduce_bench (8-byte ring all-reduce, 2
// ranks on one loaded host), a thread woken by its socket got the CPU back
// 4-8 ms later (p50), one woken by a 50 us timer at once (30-40 us p50,
// the same as MPI's 33-45 us).
constexpr int kSpinPolls = 200;
constexpr auto kPollSleep = std::chrono::microseconds(50);
constexpr auto kLongIdle = std::chrono::milliseconds(50);
// The longest a blocked wait sleeps before it looks again (a stop set by
// another thread wakes it at once through the event fd).
constexpr int kMaxBlockMs = 100;
constexpr auto kGoodbyeGrace = std::chrono::seconds(1);

struct Header {
  uint32_t kind;
  int32_t tag;
  uint64_t bytes;
};
static_assert(sizeof(Header) == 16, "wire header");

struct Hello {
  uint32_t magic;
  int32_t size;
  int32_t rank;
  uint32_t group_hash;
};

uint32_t hash32(const std::string& s) {
  uint32_t h = 2166136261u;
  for (unsigned char c : s) h = (h ^ c) * 16777619u;
  return h;
}

std::string errno_text(int e) { return std::strerror(e); }

int ms_until(Clock::time_point t) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now());
  return static_cast<int>(std::max<long long>(0, std::min<long long>(left.count(), 1 << 30)));
}

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK); }

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

class TcpRequest;

// A message that arrived before its recv: kept until a recv takes it.
struct Unexpected {
  int tag = 0;
  std::vector<char> data;
  size_t got = 0;
  bool complete = false;
  uint64_t seq = 0;  // arrival order across peers (probe_any)
};

// One queued outgoing message. `req` is null once its request is gone (its
// rest then lives in `owned`).
struct OutMsg {
  TcpRequest* req = nullptr;
  Header hdr{};
  const char* data = nullptr;
  size_t written = 0;  // of sizeof(Header) + hdr.bytes
  std::shared_ptr<std::vector<char>> owned;
};

enum class PeerState { kAlive, kLeft, kFailed };
enum class Stop { kNone, kAborted, kBroken, kDestroyed };

struct Peer {
  int fd = -1;
  std::string address;  // "host:port" it listened on
  std::string host;
  PeerState state = PeerState::kAlive;
  std::string detail;
  int order = 0;
  bool goodbye = false;  // its goodbye arrived
  std::deque<OutMsg> out;
  // The message being read: its header (hdr_got of 16 bytes), then its
  // payload into `in_req`'s buffer, an Unexpected, or nowhere (discarded).
  Header hdr{};
  size_t hdr_got = 0;
  bool in_payload = false;
  size_t payload_got = 0;
  TcpRequest* in_req = nullptr;
  Unexpected* in_unexp = nullptr;
  std::list<TcpRequest*> posted;  // recvs in the order posted
  std::list<std::unique_ptr<Unexpected>> unexpected;
};

struct Core {
  int rank = 0, size = 1;
  std::string group;
  std::mutex mu;
  std::deque<Peer> peers;  // (a deque: Peer does not move)
  int event_fd = -1;  // wakes blocked waits (abort from another thread)
  Stop stop = Stop::kNone;
  std::string stop_reason;
  int dead = 0;
  uint64_t next_seq = 0;
  int pending = 0;  // requests posted and not finished

  ~Core() {
    for (Peer& p : peers) {
      if (p.fd >= 0) close(p.fd);
    }
    if (event_fd >= 0) close(event_fd);
  }

  std::string rank_text() const { return "rank " + std::to_string(rank); }
  std::string peer_text(int p) const {
    const std::string& a = peers[p].address;
    return "rank " + std::to_string(p) + (a.empty() ? "" : " (" + a + ")");
  }
  std::string dead_peers_locked() const {
    std::vector<int> order;
    for (int p = 0; p < size; ++p) {
      if (peers[p].state != PeerState::kAlive) order.push_back(p);
    }
    std::sort(order.begin(), order.end(),
              [&](int a, int b) { return peers[a].order < peers[b].order; });
    std::string s;
    for (PeerState st : {PeerState::kFailed, PeerState::kLeft}) {
      for (int p : order) {
        if (peers[p].state != st) continue;
        s += s.empty() ? "" : "; ";
        s += st == PeerState::kFailed
                 ? "the connection to " + peer_text(p) + " failed: " + peers[p].detail
                 : peer_text(p) + " had left the group";
      }
    }
    return s;
  }
  void wake() {
    if (event_fd < 0) return;
    uint64_t one = 1;
    ssize_t n = write(event_fd, &one, sizeof one);
    (void)n;
  }
  void shutdown_all_locked() {
    for (Peer& p : peers) {
      if (p.fd >= 0) shutdown(p.fd, SHUT_RDWR);
    }
  }
  void break_locked() {
    if (stop != Stop::kNone) return;
    stop = Stop::kBroken;
    stop_reason = dead_peers_locked();
  }
  void peer_gone_locked(int p, const std::string& what);
  void deliver_locked(Peer& peer, int p);
  bool read_peer_locked(int p);
  bool write_peer_locked(int p);
  bool progress_locked();
};

class TcpRequest : public Request::State {
 public:
  TcpRequest(std::shared_ptr<Core> core, bool is_recv, int peer, int tag, size_t bytes, char* data)
      : core_(std::move(core)),
        is_recv_(is_recv),
        peer_(peer),
        tag_(tag),
        bytes_(bytes),
        data_(data) {}
  ~TcpRequest() override;
  int peer() const override { return peer_; }
  bool test() override;
  void wait(Clock::time_point deadline) override;
  std::string describe() const override {
    return std::string(is_recv_ ? "recv of " : "send of ") + std::to_string(bytes_) +
           (is_recv_ ? " bytes from rank " : " bytes to rank ") + std::to_string(peer_) +
           " (tag " + std::to_string(tag_) + ")";
  }

  // Under the core's lock.
  void finish_locked() {
    if (done_ || failed_) return;
    done_ = true;
    --core_->pending;
  }
  void fail_locked(ErrorCode code, const std::string& what) {
    if (done_ || failed_) return;
    failed_ = true;
    code_ = code;
    error_ = what;
    --core_->pending;
  }
  bool finished() const { return done_ || failed_; }

  const std::shared_ptr<Core> core_;
  const bool is_recv_;
  const int peer_, tag_;
  const size_t bytes_;
  char* const data_;
  bool done_ = false, failed_ = false;
  ErrorCode code_ = ErrorCode::kInternal;
  std::string error_;

 private:
  // Completion or the error that ends this request (under the lock); false
  // while it may still complete.
  bool settled_locked(bool deadline_passed);
  [[noreturn]] void throw_locked(bool deadline_passed);
};

void Core::peer_gone_locked(int p, const std::string& what) {
  Peer& peer = peers[p];
  if (peer.state != PeerState::kAlive) return;
  peer.state = peer.goodbye ? PeerState::kLeft : PeerState::kFailed;
  peer.detail = what;
  peer.order = ++dead;
  if (peer.state == PeerState::kFailed) break_locked();
}

// A complete message at the head of `peer.unexpected` meets the oldest
// posted recv of its tag (in order: an older incomplete one blocks it).
void Core::deliver_locked(Peer& peer, int p) {
  bool moved = true;
  while (moved) {
    moved = false;
    for (auto it = peer.unexpected.begin(); it != peer.unexpected.end(); ++it) {
      Unexpected& u = **it;
      // Only the oldest message of a tag may be taken.
      bool oldest = true;
      for (auto jt = peer.unexpected.begin(); jt != it; ++jt) {
        if ((*jt)->tag == u.tag) oldest = false;
      }
      if (!oldest || !u.complete) continue;
      auto rt = std::find_if(peer.posted.begin(), peer.posted.end(),
                             [&](TcpRequest* r) { return r->tag_ == u.tag; });
      if (rt == peer.posted.end()) continue;
      TcpRequest* r = *rt;
      peer.posted.erase(rt);
      if (r->bytes_ != u.data.size()) {
        r->fail_locked(ErrorCode::kInvalidArgument,
                       rank_text() + ": " + r->describe() + ": the message from " + peer_text(p) +
                           " has " + std::to_string(u.data.size()) +
                           " bytes (sender and receiver disagree on its size)");
      } else {
        if (!u.data.empty()) std::memcpy(r->data_, u.data.data(), u.data.size());
        r->finish_locked();
      }
      peer.unexpected.erase(it);
      moved = true;
      break;
    }
  }
}

// Reads what the connection to p has; false when nothing moved.
bool Core::read_peer_locked(int p) {
  Peer& peer = peers[p];
  if (peer.fd < 0 || peer.state != PeerState::kAlive) return false;
  bool moved = false;
  char sink[65536];
  for (;;) {
    char* dst;
    size_t want;
    if (!peer.in_payload) {
      dst = reinterpret_cast<char*>(&peer.hdr) + peer.hdr_got;
      want = sizeof(Header) - peer.hdr_got;
    } else {
      const size_t left = peer.hdr.bytes - peer.payload_got;
      if (peer.in_req) {
        dst = peer.in_req->data_ + peer.payload_got;
        want = left;
      } else if (peer.in_unexp) {
        dst = peer.in_unexp->data.data() + peer.payload_got;
        want = left;
      } else {
        dst = sink;
        want = std::min(left, sizeof sink);
      }
    }
    ssize_t n = want == 0 ? 0 : recv(peer.fd, dst, want, 0);
    if (want > 0) {
      if (n == 0) {
        peer_gone_locked(p, "the connection was closed");
        return true;
      }
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return moved;
        peer_gone_locked(p, errno_text(errno));
        return true;
      }
      moved = true;
    }
    if (!peer.in_payload) {
      peer.hdr_got += static_cast<size_t>(n);
      if (peer.hdr_got < sizeof(Header)) continue;
      peer.hdr_got = 0;
      if (peer.hdr.kind == kKindGoodbye) {
        peer.goodbye = true;
        continue;
      }
      if (peer.hdr.kind != kKindData) {
        peer_gone_locked(p, "it sent a message of unknown kind " + std::to_string(peer.hdr.kind) +
                                " (not this transport's stream)");
        return true;
      }
      peer.in_payload = true;
      peer.payload_got = 0;
      peer.in_req = nullptr;
      peer.in_unexp = nullptr;
      const int tag = peer.hdr.tag;
      const bool older = std::any_of(peer.unexpected.begin(), peer.unexpected.end(),
                                     [&](const auto& u) { return u->tag == tag; });
      auto rt = older ? peer.posted.end()
                      : std::find_if(peer.posted.begin(), peer.posted.end(),
                                     [&](TcpRequest* r) { return r->tag_ == tag; });
      if (rt != peer.posted.end()) {
        TcpRequest* r = *rt;
        peer.posted.erase(rt);
        if (r->bytes_ == peer.hdr.bytes) {
          peer.in_req = r;
        } else {
          r->fail_locked(ErrorCode::kInvalidArgument,
                         rank_text() + ": " + r->describe() + ": the message from " +
                             peer_text(p) + " has " + std::to_string(peer.hdr.bytes) +
                             " bytes (sender and receiver disagree on its size)");
        }
      } else {
        auto u = std::make_unique<Unexpected>();
        u->tag = tag;
        u->seq = next_seq++;
        try {
          u->data.resize(peer.hdr.bytes);
        } catch (const std::exception&) {
          peer_gone_locked(p, "no memory for its message of " + std::to_string(peer.hdr.bytes) +
                                  " bytes");
          return true;
        }
        peer.in_unexp = u.get();
        peer.unexpected.push_back(std::move(u));
      }
    } else {
      peer.payload_got += static_cast<size_t>(n);
    }
    if (peer.in_payload && peer.payload_got == peer.hdr.bytes) {
      peer.in_payload = false;
      if (peer.in_req) peer.in_req->finish_locked();
      if (peer.in_unexp) {
        peer.in_unexp->complete = true;
        deliver_locked(peer, p);
      }
      peer.in_req = nullptr;
      peer.in_unexp = nullptr;
      moved = true;
    }
  }
}

// Writes what the connection to p takes; false when nothing moved.
bool Core::write_peer_locked(int p) {
  Peer& peer = peers[p];
  bool moved = false;
  while (!peer.out.empty() && peer.fd >= 0 && peer.state == PeerState::kAlive) {
    OutMsg& m = peer.out.front();
    const size_t total = sizeof(Header) + m.hdr.bytes;
    iovec iov[2];
    int n_iov = 0;
    if (m.written < sizeof(Header)) {
      iov[n_iov].iov_base = reinterpret_cast<char*>(&m.hdr) + m.written;
      iov[n_iov].iov_len = sizeof(Header) - m.written;
      ++n_iov;
      if (m.hdr.bytes > 0) {
        iov[n_iov].iov_base = const_cast<char*>(m.data);
        iov[n_iov].iov_len = m.hdr.bytes;
        ++n_iov;
      }
    } else {
      const size_t off = m.written - sizeof(Header);
      iov[n_iov].iov_base = const_cast<char*>(m.data + off);
      iov[n_iov].iov_len = m.hdr.bytes - off;
      ++n_iov;
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n_iov;
    const ssize_t n = sendmsg(peer.fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return moved;
      peer_gone_locked(p, errno_text(errno));
      return true;
    }
    moved = true;
    m.written += static_cast<size_t>(n);
    if (m.written < total) continue;
    if (m.req) m.req->finish_locked();
    peer.out.pop_front();
  }
  return moved;
}

bool Core::progress_locked() {
  if (stop == Stop::kDestroyed) return false;
  bool moved = false;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    moved = write_peer_locked(p) || moved;
    moved = read_peer_locked(p) || moved;
  }
  return moved;
}

TcpRequest::~TcpRequest() {
  std::lock_guard<std::mutex> lock(core_->mu);
  if (finished()) return;
  --core_->pending;
  Peer& peer = core_->peers[peer_];
  if (!is_recv_) {
    for (auto it = peer.out.begin(); it != peer.out.end(); ++it) {
      if (it->req != this) continue;
      if (it->written == 0) {
        peer.out.erase(it);
      } else {
        // Partly written: the rest must follow, or the stream is torn.
        const size_t off = it->written > sizeof(Header) ? it->written - sizeof(Header) : 0;
        auto rest = std::make_shared<std::vector<char>>(bytes_);
        if (bytes_ > off) std::memcpy(rest->data() + off, data_ + off, bytes_ - off);
        it->owned = rest;
        it->data = rest->data();
        it->req = nullptr;
      }
      return;
    }
    return;
  }
  peer.posted.remove(this);
  if (peer.in_req == this) {
    peer.in_req = nullptr;  // the rest of its message is discarded
    if (core_->stop == Stop::kNone) {
      core_->stop = Stop::kAborted;
      core_->stop_reason = "a recv was dropped mid-message (" + describe() +
                           "); its message is lost, so this group's transport is unusable";
      core_->shutdown_all_locked();
      core_->wake();
    }
  }
}

bool TcpRequest::settled_locked(bool deadline_passed) {
  if (done_) return true;
  if (failed_) throw_error(code_, error_);
  const Peer& peer = core_->peers[peer_];
  if (core_->stop != Stop::kNone || peer.state != PeerState::kAlive || deadline_passed)
    throw_locked(deadline_passed);
  return false;
}

void TcpRequest::throw_locked(bool deadline_passed) {
  const std::string head = core_->rank_text() + ": " + describe();
  Peer& peer = core_->peers[peer_];
  const std::string who = core_->peer_text(peer_);
  switch (core_->stop) {
    case Stop::kAborted:
      throw AbortedError(head + " aborted: " + core_->stop_reason);
    case Stop::kDestroyed:
      throw AbortedError(head + " aborted: the TCP transport was destroyed before it completed");
    case Stop::kBroken:
      throw UnavailableError(head + " failed: the group is broken: " + core_->stop_reason);
    case Stop::kNone:
      break;
  }
  if (peer.state == PeerState::kLeft) {
    // The group's work needed a rank that is gone: it cannot finish.
    const std::string why = head + " failed: " + who +
                            " left the group (its transport was destroyed) before it completed";
    core_->stop = Stop::kBroken;
    core_->stop_reason = core_->dead_peers_locked();
    throw UnavailableError(why);
  }
  if (peer.state == PeerState::kFailed) {
    throw UnavailableError(head + " failed: the group is broken: " + core_->dead_peers_locked());
  }
  (void)deadline_passed;
  throw DeadlineExceededError(
      head + " did not complete before the deadline: rank " + std::to_string(peer_) +
      (is_recv_ ? " did not send the matching message of " : " did not take the message of ") +
      std::to_string(bytes_) + " bytes with tag " + std::to_string(tag_) + " in time" +
      kLatePeerCauses);
}

bool TcpRequest::test() {
  std::lock_guard<std::mutex> lock(core_->mu);
  if (finished()) return settled_locked(false);
  core_->progress_locked();
  return settled_locked(false);
}

void TcpRequest::wait(Clock::time_point deadline) {
  std::vector<pollfd> fds;
  int idle = 0;
  Clock::time_point moved_at = Clock::now();
  for (;;) {
    bool long_idle = false;
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      if (finished()) {
        settled_locked(false);
        return;
      }
      const bool moved = core_->progress_locked();
      if (settled_locked(false)) return;
      const auto now = Clock::now();
      if (now >= deadline) settled_locked(true);
      if (moved) {
        idle = 0;
        moved_at = now;
        continue;
      }
      if (++idle < kSpinPolls) continue;
      long_idle = now - moved_at > kLongIdle;
      if (long_idle) {
        fds.clear();
        for (int p = 0; p < core_->size; ++p) {
          const Peer& peer = core_->peers[p];
          if (p == core_->rank || peer.fd < 0 || peer.state != PeerState::kAlive) continue;
          fds.push_back(
              {peer.fd, static_cast<short>(POLLIN | (peer.out.empty() ? 0 : POLLOUT)), 0});
        }
        fds.push_back({core_->event_fd, POLLIN, 0});
      }
    }
    // (See kSpinPolls: a timer's wake-up, not the socket's.)
    if (long_idle) {
      poll(fds.data(), fds.size(), std::min(1, ms_until(deadline)));
    } else {
      std::this_thread::sleep_for(kPollSleep);
    }
  }
}

class TcpTransport : public Transport {
 public:
  explicit TcpTransport(std::shared_ptr<Core> core) : core_(std::move(core)) {}
  ~TcpTransport() override;

  int rank() const override { return core_->rank; }
  int size() const override { return core_->size; }

  Request send(int peer, const void* data, size_t bytes, int tag) override {
    check_peer(peer, "send to");
    auto r = std::make_shared<TcpRequest>(core_, false, peer, tag, bytes,
                                          static_cast<char*>(const_cast<void*>(data)));
    std::lock_guard<std::mutex> lock(core_->mu);
    ++core_->pending;
    Peer& p = core_->peers[peer];
    if (core_->stop != Stop::kNone || p.state != PeerState::kAlive) return Request(r);
    OutMsg m;
    m.req = r.get();
    m.hdr = Header{kKindData, tag, bytes};
    m.data = static_cast<const char*>(data);
    p.out.push_back(std::move(m));
    if (p.out.size() == 1) core_->write_peer_locked(peer);
    return Request(r);
  }

  Request recv(int peer, void* data, size_t bytes, int tag) override {
    check_peer(peer, "recv from");
    auto r = std::make_shared<TcpRequest>(core_, true, peer, tag, bytes, static_cast<char*>(data));
    std::lock_guard<std::mutex> lock(core_->mu);
    ++core_->pending;
    Peer& p = core_->peers[peer];
    p.posted.push_back(r.get());
    core_->deliver_locked(p, peer);
    return Request(r);
  }

  bool probe_any(Envelope* env) override {
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->progress_locked();
    const Unexpected* best = nullptr;
    int best_peer = -1;
    for (int p = 0; p < core_->size; ++p) {
      const Peer& peer = core_->peers[p];
      for (const auto& u : peer.unexpected) {
        // Claimed by a posted recv: as many of its tag as recvs of it wait.
        size_t older = 0;
        for (const auto& v : peer.unexpected) {
          if (v.get() == u.get()) break;
          if (v->tag == u->tag) ++older;
        }
        const size_t posted = static_cast<size_t>(std::count_if(
            peer.posted.begin(), peer.posted.end(), [&](TcpRequest* r) { return r->tag_ == u->tag; }));
        if (older < posted) continue;
        if (!best || u->seq < best->seq) {
          best = u.get();
          best_peer = p;
        }
      }
    }
    if (!best) {
      // A broken or aborted transport says so here too, as a wait would.
      if (core_->stop == Stop::kAborted)
        throw AbortedError(core_->rank_text() + ": probe aborted: " + core_->stop_reason);
      if (core_->stop == Stop::kBroken)
        throw UnavailableError(core_->rank_text() +
                               ": probe failed: the group is broken: " + core_->stop_reason);
      return false;
    }
    env->source = best_peer;
    env->tag = best->tag;
    env->bytes = best->data.size();
    return true;
  }

  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (core_->stop == Stop::kNone || core_->stop == Stop::kBroken) {
      core_->stop = Stop::kAborted;
      core_->stop_reason = reason;
    }
    core_->shutdown_all_locked();
    core_->wake();
  }

  const std::shared_ptr<Core>& core() const { return core_; }

 private:
  void check_peer(int peer, const char* what) const {
    DISTSTRAT_CHECK(peer >= 0 && peer < core_->size && peer != core_->rank, kInvalidArgument,
                    core_->rank_text(), ": ", what, " rank ", peer, " (the group has ranks 0-",
                    core_->size - 1, "; not this rank)");
  }

  std::shared_ptr<Core> core_;
};

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

}  // namespace

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
  core->peers.resize(size);
  const std::string who = "rank " + std::to_string(rank) + " (TCP transport, group '" +
                          echo(options.group) + "')";
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
  const int my_port = ntohs(bound.ss_family == AF_INET6
                                ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  const std::string my_host = numeric_host(reinterpret_cast<sockaddr*>(&bound), bound_len);
  const std::string prefix = options.group + "/tcp/";
  exchange.publish(prefix + std::to_string(rank),
                   "ds-tcp/1 " + std::to_string(size) + " " + my_host + " " +
                       std::to_string(my_port),
                   deadline);
  core->peers[rank].host = my_host;
  core->peers[rank].address =
      (my_host.find(':') != std::string::npos ? "[" + my_host + "]" : my_host) + ":" +
      std::to_string(my_port);

  // 2. Every peer's address.
  std::vector<int> missing;
  std::vector<int> ports(size, 0);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const std::string key = prefix + std::to_string(p);
    std::string v;
    try {
      v = exchange.wait_for(key, deadline);
    } catch (const DeadlineExceededError&) {
      missing.push_back(p);
      continue;
    }
    std::istringstream in(v);
    std::string magic, h;
    int n = 0, port = 0;
    in >> magic >> n >> h >> port;
    DISTSTRAT_CHECK(magic == "ds-tcp/1" && port > 0 && port < 65536 && !h.empty(),
                    kInvalidArgument, who, ": rank ", p, " published '", echo(v, 60),
                    "' under '", echo(key), "', not a TCP transport address");
    DISTSTRAT_CHECK(n == size, kInvalidArgument, who, ": rank ", p, " set up a group of ", n,
                    " ranks, this rank one of ", size);
    core->peers[p].host = h;
    ports[p] = port;
    core->peers[p].address =
        (h.find(':') != std::string::npos ? "[" + h + "]" : h) + ":" + std::to_string(port);
  }
  DISTSTRAT_CHECK(missing.empty(), kDeadlineExceeded, who, ": ", ranks_phrase(missing),
                  " never published ", missing.size() == 1 ? "its" : "their",
                  " addresses (keys '", echo(prefix), "<rank>') before the deadline");

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
    if (!io_full(fd, &h, sizeof h, true, std::min(deadline, Clock::now() + std::chrono::seconds(10)),
                 &err) ||
        h.magic != kHelloMagic || h.group_hash != mine.group_hash || h.size != size ||
        h.rank < 0 || h.rank >= rank || core->peers[h.rank].fd >= 0) {
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
