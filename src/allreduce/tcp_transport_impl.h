// The TCP transport's parts (tcp_transport.h), for the files that implement
// it:
//   tcp_core.cc       the streams of one transport: reading and matching
//                     messages, writing queued sends, the waits and errors of
//                     one request
//   tcp_transport.cc  the Transport itself: destruction, set-up over the
//                     address exchange, tcp_node_of
#pragma once

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
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "allreduce/tcp_transport.h"
#include "allreduce/transport.h"
#include "core/user_text.h"

namespace diststrat {
namespace tcp_impl {

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

inline uint32_t hash32(const std::string& s) {
  uint32_t h = 2166136261u;
  for (unsigned char c : s) h = (h ^ c) * 16777619u;
  return h;
}

inline std::string errno_text(int e) { return std::strerror(e); }

inline int ms_until(Clock::time_point t) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now());
  return static_cast<int>(std::max<long long>(0, std::min<long long>(left.count(), 1 << 30)));
}

inline void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK); }

inline void set_nodelay(int fd) {
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
  int event_fd = -1;       // wakes blocked waits (abort from another thread)
  Stop stop = Stop::kNone;
  std::string stop_reason;
  int dead = 0;
  uint64_t next_seq = 0;
  int pending = 0;  // requests posted and not finished
  // TcpTransportOptions::peer_failure_breaks_group.
  bool failure_breaks_group = true;

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
           (is_recv_ ? " bytes from rank " : " bytes to rank ") + std::to_string(peer_) + " (tag " +
           std::to_string(tag_) + ")";
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
        const size_t posted =
            static_cast<size_t>(std::count_if(peer.posted.begin(), peer.posted.end(),
                                              [&](TcpRequest* r) { return r->tag_ == u->tag; }));
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
        throw UnavailableError(core_->rank_text() + ": probe failed: the group is broken: " +
                               core_->dead_peers_locked());
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

}  // namespace tcp_impl
}  // namespace diststrat
