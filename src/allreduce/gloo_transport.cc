// The Gloo transport (gloo_transport.h) over the public parts of Gloo's TCP
// transport: Device, Context, Pair and UnboundBuffer. (Debian's libgloo-dev
// does not install gloo/common/memory.h, so tcp/pair.h, tcp/context.h and
// tcp/unbound_buffer.h cannot be included; everything here goes through the
// abstract classes.)
//
// What Gloo 0.5 (git 2022-05-18) does, as read in its sources, and how it
// is used here:
//  - UnboundBuffer::waitRecv/waitSend(rank, timeout) block until the transfer
//    completes, the buffer's pair failed (they rethrow gloo::IoException), or
//    abortWaitRecv/abortWaitSend set the buffer's abort flag (they return
//    false and clear it; the flag wins over a completion, which stays
//    counted for the next wait). When the timeout passes they close every
//    pair of the context ("Application timeout caused pair closure") and
//    throw. So waits here pass a timeout well past the caller's deadline
//    (a backstop only), and the watcher thread ends them at the deadline
//    with the abort flag. Before each such wait the flag is set and consumed
//    once (abort, then wait: returns false at once, or throws if the pair
//    failed), so that a false return always means this wait was interrupted.
//  - A pair that fails (EOF, reset, read or write error) records the
//    exception and passes it to the buffers of the operations queued on it
//    (posted recvs and sends waiting for the peer's go-ahead), not to one
//    whose bytes are being written or read at that moment, and not to
//    operations of other pairs. Hence the two control receives per peer
//    (see the header) that the watcher polls, and its interrupting of every
//    wait once the transport is broken.
//  - Pair::close() resets the connection (SO_LINGER 0) and signals nothing;
//    destroying a pair (getPair(p).reset(), or its context) closes it with
//    FIN after what was written. Abort, break and drop reset; a goodbye
//    destroys. Either waits for the next tick of the device loop (its
//    epoll_wait times out after 10 ms), and a wake-up between two ticks is
//    missed, so closes started together can still land a tick apart.
//  - A message for a destroyed unbound buffer (its weak reference expired):
//    the read stops before the payload and returns, and the device thread,
//    on level-triggered epoll, calls it again at once: the pair spins and no
//    later message on it gets through. A send whose buffer is gone stays
//    queued with EPOLLOUT registered: the same spin.
//  - Exceptions: gloo::IoException (socket errors, peer closed, timeouts),
//    gloo::InvalidOperationException (connect to self, address family
//    mismatch), gloo::EnforceNotMet (failed GLOO_ENFORCE: bad address bytes,
//    epoll_ctl on a closed pair, unknown interface), std::out_of_range
//    (getPair). Every Gloo call here is inside try/catch(std::exception) and
//    becomes a diststrat::Error. On Gloo's device thread an exception
//    terminates the process: the byte count in the slot keeps the one
//    reachable case (a send longer than its recv) from happening.
//  - Gloo writes with writev(2), which raises SIGPIPE on a connection its
//    peer reset (by default the end of the process); Gloo leaves that to the
//    program (its own tests ignore SIGPIPE process-wide). Writes happen on
//    Gloo's device thread and on the thread that posts a transfer: see
//    GlooSigpipeBlock.
//  - tcp::CreateDevice with a host name that getaddrinfo cannot resolve
//    walks an uninitialised result list (it compares the return code to -1,
//    but failures are other negative EAI_ codes): the name is resolved here
//    first. Address::str() prints the port in network byte order, also in
//    Gloo's error texts: addresses are formatted here, and gloo_text() drops
//    Gloo's from its messages.

#include "allreduce/gloo_transport.h"

#include <arpa/inet.h>
#include <gloo/transport/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <ifaddrs.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "core/user_text.h"

namespace diststrat {
namespace {

using GlooBuffer = gloo::transport::UnboundBuffer;

// User slots keep bit 31 clear (the byte count folds into 31 bits); the
// control slot (goodbye and failure receives) is bit 31 alone.
constexpr uint64_t kGlooControlSlot = uint64_t{1} << 31;
// How often the watcher polls the peers' control receives.
constexpr auto kGlooScanInterval = std::chrono::milliseconds(10);
// How long test() and the completion check of a failing wait give Gloo.
// Once the peer's connection is gone the transfer's state is final (done,
// or failed with it) and Gloo answers at once: the longer grace there only
// keeps a descheduled thread from missing a completion.
constexpr auto kGlooProbeGrace = std::chrono::milliseconds(2);
constexpr auto kGlooFinalProbeGrace = std::chrono::milliseconds(100);
// How long after the group broke a wait's error waits, so that it names
// every connection gone by then, and the transport waits before resetting
// its own connections (a connection it resets tells it nothing more): a
// rank that leaves closes its connections up to a tick of Gloo's device
// loop (10 ms) apart, and a rank that failed because of it may reset its
// own before the last of those arrives. Abort and a drop reset at once.
constexpr auto kGlooSettle = std::chrono::milliseconds(50);
// How long destruction waits for a peer to take its goodbye.
constexpr auto kGlooGoodbyeGrace = std::chrono::seconds(1);
// Added to the Gloo-side timeout of every wait: Gloo's own timeout (which
// closes every pair) fires only if the watcher failed to end the wait.
constexpr auto kGlooBackstop = std::chrono::seconds(30);
constexpr auto kGlooMaxWait = std::chrono::hours(1000);

uint64_t gloo_slot(int tag, size_t bytes) {
  const uint64_t b = bytes;
  const uint64_t folded = (b ^ (b >> 31) ^ (b >> 62)) & 0x7fffffffu;  // b itself below 2 GiB
  return (uint64_t{static_cast<uint32_t>(tag)} << 32) | folded;
}

// The Gloo-side timeout for a wait that the watcher ends at `until`.
std::chrono::milliseconds gloo_timeout(Clock::time_point until) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
  left = std::max(left, std::chrono::milliseconds(0));
  return std::min<std::chrono::milliseconds>(left, kGlooMaxWait) + kGlooBackstop;
}

// Gloo's device thread handles a connection only when it gets the pair's
// lock at once (try_lock), and on level-triggered epoll it tries again at
// once when it did not. A thread that posts a transfer holds that lock;
// when the device thread, woken by data arriving, preempts it on its core,
// the device thread spins until the scheduler's slice ends (measured: a
// 4-byte exchange between two transports on one core took 3 ms instead of
// 30 us). SCHED_BATCH threads do not preempt on wake-up, so the poster runs
// on and lets go first. The policy is inherited by the threads a thread
// creates: the device is created under this (and the caller's policy
// restored). Only SCHED_OTHER callers are changed (SCHED_BATCH needs no
// privilege); a real-time caller keeps its policy for the device thread.
class GlooDeviceThreadBatch {
 public:
  GlooDeviceThreadBatch() {
    if (sched_getscheduler(0) != SCHED_OTHER) return;
    sched_param p{};
    changed_ = sched_setscheduler(0, SCHED_BATCH, &p) == 0;
  }
  ~GlooDeviceThreadBatch() {
    if (!changed_) return;
    sched_param p{};
    sched_setscheduler(0, SCHED_OTHER, &p);
  }
  GlooDeviceThreadBatch(const GlooDeviceThreadBatch&) = delete;
  GlooDeviceThreadBatch& operator=(const GlooDeviceThreadBatch&) = delete;

 private:
  bool changed_ = false;
};

// Blocks SIGPIPE in this thread while it lives, without touching the
// process's signal dispositions: a write to a reset connection then fails
// with EPIPE, which Gloo handles. A SIGPIPE raised meanwhile (pending on
// this thread) is consumed before the mask is restored. Gloo's device
// thread inherits the mask of the thread that creates the device, so
// creating it under this block keeps SIGPIPE blocked there for good.
class GlooSigpipeBlock {
 public:
  GlooSigpipeBlock() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
    sigset_t pending;
    sigemptyset(&pending);
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
  }
  ~GlooSigpipeBlock() {
    const int saved = errno;
    if (!was_pending_) {
      sigset_t pending;
      sigemptyset(&pending);
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        const timespec zero{0, 0};
        while (sigtimedwait(&pipe_, nullptr, &zero) == -1 && errno == EINTR) {
        }
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
    errno = saved;
  }
  GlooSigpipeBlock(const GlooSigpipeBlock&) = delete;
  GlooSigpipeBlock& operator=(const GlooSigpipeBlock&) = delete;

 private:
  sigset_t pipe_, old_;
  bool was_pending_ = false;
};

// Destroys a Gloo buffer. Gloo's device thread last touched it under its
// lock (completion or error, then the condition variable's signal) and lets
// go of it through a weak reference whose expiry the buffer's destructor
// polls with a relaxed load (in libgloo, which ThreadSanitizer does not
// see): taking the lock once more first orders those touches before the
// destruction of the condition variable. (Abort flag: a no-op now.)
void gloo_destroy(std::unique_ptr<GlooBuffer>& buf, bool is_recv) {
  if (!buf) return;
  if (is_recv) {
    buf->abortWaitRecv();
  } else {
    buf->abortWaitSend();
  }
  buf.reset();
}

// Gloo's error text for a message: without the peer addresses Gloo prints
// in it (" [127.0.0.1]:4567", the port in network byte order); the message
// names the rank and its address itself.
std::string gloo_text(const std::string& what) {
  std::string out;
  const size_t n = what.size();
  for (size_t i = 0; i < n;) {
    if (what[i] == ' ' && i + 1 < n && what[i + 1] == '[') {
      const size_t close = what.find(']', i + 2);
      if (close != std::string::npos && close + 2 < n && what[close + 1] == ':' &&
          std::isdigit(static_cast<unsigned char>(what[close + 2]))) {
        size_t j = close + 2;
        while (j < n && std::isdigit(static_cast<unsigned char>(what[j]))) ++j;
        i = j;
        continue;
      }
    }
    out += what[i++];
  }
  return echo(out.empty() ? "unknown Gloo error" : out);
}

// The IP address and port of a Gloo TCP address's bytes; false if they are
// none (not IPv4 or IPv6, or not an address at all).
bool gloo_address_parts(const std::vector<char>& bytes, std::string* host, int* port, bool* v6) {
  try {
    const gloo::transport::tcp::Address a(bytes);
    const sockaddr_storage& ss = a.getSockaddr();
    char text[INET6_ADDRSTRLEN] = "";
    if (ss.ss_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(&ss);
      inet_ntop(AF_INET, &in->sin_addr, text, sizeof text);
      *port = ntohs(in->sin_port);
      *v6 = false;
    } else if (ss.ss_family == AF_INET6) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&ss);
      inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof text);
      *port = ntohs(in6->sin6_port);
      *v6 = true;
    } else {
      return false;
    }
    *host = text;
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// "127.0.0.1" / "::1" from a Gloo TCP address's bytes ("" if it is none).
std::string gloo_address_host(const std::vector<char>& bytes) {
  std::string host;
  int port = 0;
  bool v6 = false;
  return gloo_address_parts(bytes, &host, &port, &v6) ? host : "";
}

// "127.0.0.1:4567" / "[::1]:4567" from a Gloo TCP address's bytes.
std::string gloo_address_text(const std::vector<char>& bytes) {
  std::string host;
  int port = 0;
  bool v6 = false;
  if (!gloo_address_parts(bytes, &host, &port, &v6)) return "unknown address";
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

// A Gloo TCP address's bytes with only the address itself, the port and the
// sequence number: Gloo copies its whole sockaddr_storage, whose unused bytes
// it never cleared (they carried stack and heap addresses into the store).
std::vector<char> gloo_clean_address(const std::vector<char>& bytes) {
  const gloo::transport::tcp::Address a(bytes);
  const sockaddr_storage& ss = a.getSockaddr();
  sockaddr_storage clean;
  std::memset(&clean, 0, sizeof clean);
  if (ss.ss_family == AF_INET) {
    std::memcpy(&clean, &ss, sizeof(sockaddr_in));
    std::memset(reinterpret_cast<sockaddr_in*>(&clean)->sin_zero, 0,
                sizeof(reinterpret_cast<sockaddr_in*>(&clean)->sin_zero));
  } else if (ss.ss_family == AF_INET6) {
    std::memcpy(&clean, &ss, sizeof(sockaddr_in6));
  } else {
    return bytes;
  }
  return gloo::transport::tcp::Address(clean, a.getSeq()).bytes();
}

std::string gloo_hex(const std::vector<char>& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  s.reserve(bytes.size() * 2);
  for (char c : bytes) {
    const auto u = static_cast<unsigned char>(c);
    s += digits[u >> 4];
    s += digits[u & 15];
  }
  return s;
}

bool gloo_unhex(const std::string& s, std::vector<char>* out) {
  if (s.size() % 2) return false;
  auto nibble = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  out->clear();
  for (size_t i = 0; i < s.size(); i += 2) {
    const int hi = nibble(s[i]), lo = nibble(s[i + 1]);
    if (hi < 0 || lo < 0) return false;
    out->push_back(static_cast<char>(hi << 4 | lo));
  }
  return true;
}

std::vector<std::string> gloo_split(const std::string& s) {
  std::vector<std::string> words;
  size_t i = 0;
  while (i < s.size()) {
    const size_t j = std::min(s.find(' ', i), s.size());
    if (j > i) words.push_back(s.substr(i, j - i));
    i = j + 1;
  }
  return words;
}

// One wait that the watcher may have to end: a send's or recv's Gloo wait
// (ended with the abort flag), or a set-up connect (ended by closing the pair).
struct GlooWaiter {
  enum Kind { kRecv, kSend, kConnect } kind = kRecv;
  GlooBuffer* buf = nullptr;
  int peer = -1;
  Clock::time_point until;  // the deadline, or the end of a probe's grace
  bool probe = false;       // ends at `until` only, whatever else happened
  bool interrupted = false;
};

class GlooRequest;

// State shared by a transport, its requests (which may outlive it) and its
// watcher. `mu` guards everything below it; it is never taken while a Gloo
// buffer's or pair's lock is held (Gloo takes those inside its own calls).
struct GlooCore {
  GlooCore(int rank, int size, std::string group)
      : rank(rank), size(size), group(std::move(group)), peers(size), hosts(size) {}

  enum class Stop { kNone, kAborted, kDropped, kBroken };
  enum class PeerState { kAlive, kLeft, kFailed };
  struct Peer {
    PeerState state = PeerState::kAlive;
    std::string address;  // where it listened for this rank ("host:port")
    std::string detail;   // Gloo's error when its connection failed
    int order = 0;        // when its connection was found gone (1, 2, ...)
    // The control receives: one completes on its goodbye, one fails with
    // its connection.
    std::unique_ptr<GlooBuffer> goodbye, failure;
    char byte = 0;
  };

  const int rank, size;
  const std::string group;

  std::mutex mu;
  std::condition_variable cv;  // wakes the watcher
  Stop stop = Stop::kNone;
  std::string stop_reason;
  Clock::time_point broken_at;  // when stop became kBroken
  bool destroyed = false;       // the transport is gone (and its watcher)
  bool ready = false;           // set-up done, control receives posted
  std::vector<Peer> peers;
  std::vector<GlooWaiter*> waiters;
  bool close_requested = false;  // abort / break / drop: reset every connection
  bool pairs_closed = false;
  bool watcher_stop = false;
  Clock::time_point watcher_wake = Clock::time_point::max();
  int live_requests = 0;  // posted, not seen complete, not dropped
  int dead_peers = 0;
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::transport::Context> ctx;
  std::thread closer;  // resets the connections (close_all_pairs), joined at destruction
  // Every rank's advertised IP address (set-up), this rank's too: which
  // ranks share a host (gloo_node_of).
  std::vector<std::string> hosts;
  // Sends not yet handed to Gloo, oldest first (see GlooTransport::post).
  // Only the thread using the transport touches them; their own mutex, so
  // that posting never runs under `mu`.
  std::mutex deferred_mu;
  std::vector<std::weak_ptr<GlooRequest>> deferred_sends;

  std::string rank_text() const { return "rank " + std::to_string(rank); }
  std::string peer_text(int p) const {
    const std::string& a = peers[p].address;
    return "rank " + std::to_string(p) + (a.empty() ? "" : " (" + a + ")");
  }

  bool should_stop_locked(int peer) const {
    return stop != Stop::kNone || destroyed || peers[peer].state != PeerState::kAlive;
  }
  bool should_stop(int peer) {
    std::lock_guard<std::mutex> lock(mu);
    return should_stop_locked(peer);
  }

  void mark_dead_locked(int p, PeerState state, const std::string& what) {
    peers[p].state = state;
    peers[p].detail = gloo_text(what);
    peers[p].order = ++dead_peers;
  }

  // "the connection to rank 0 (h:p) failed: ...; rank 3 (h:p) had left the
  // group": failed peers, then those that left, each in the order found.
  std::string dead_peers_locked() const {
    std::vector<int> order(size);
    for (int p = 0; p < size; ++p) order[p] = p;
    std::sort(order.begin(), order.end(),
              [&](int a, int b) { return peers[a].order < peers[b].order; });
    std::string s;
    for (PeerState state : {PeerState::kFailed, PeerState::kLeft}) {
      for (int p : order) {
        if (peers[p].state != state) continue;
        s += s.empty() ? "" : "; ";
        s += state == PeerState::kFailed
                 ? "the connection to " + peer_text(p) + " failed: " + peers[p].detail
                 : peer_text(p) + " had left the group";
      }
    }
    return s;
  }

  void break_locked() {
    stop = Stop::kBroken;
    stop_reason = dead_peers_locked();
    broken_at = Clock::now();
    close_requested = true;
  }

  // A failure control receive that throws: the peer's connection is gone.
  static bool control_failed(GlooBuffer* buf, std::string* what) {
    try {
      buf->abortWaitRecv();
      buf->waitRecv(nullptr, kGlooBackstop);  // the abort flag ends it at once
      return false;
    } catch (const std::exception& e) {
      *what = e.what();
      return true;
    }
  }

  // Polls every live peer's control receives: a dead connection is a peer
  // that left (its goodbye arrived first) or failed (the transport breaks).
  // Also once this transport is broken, so that its errors name every rank
  // gone (a connection this transport reset itself signals nothing).
  void scan_locked() {
    if (!ready || destroyed) return;
    bool failed = false;
    for (int p = 0; p < size; ++p) {
      Peer& peer = peers[p];
      if (p == rank || peer.state != PeerState::kAlive || !peer.failure) continue;
      std::string what;
      if (!control_failed(peer.failure.get(), &what)) continue;
      // The pair is closed, so the goodbye receive has completed or failed:
      // this wait returns (or throws) at once.
      bool graceful = false;
      try {
        graceful = peer.goodbye->waitRecv(nullptr, kGlooBackstop);
      } catch (const std::exception&) {
      }
      mark_dead_locked(p, graceful ? PeerState::kLeft : PeerState::kFailed, what);
      failed = failed || !graceful;
    }
    if (failed && stop == Stop::kNone) break_locked();
  }

  // Ends the waits that are due; returns when the next one will be. Pairs
  // whose connect must end are added to `to_close` (the watcher closes them;
  // other callers pass null and leave connects to it).
  Clock::time_point interrupt_due_locked(Clock::time_point now, std::vector<int>* to_close) {
    Clock::time_point next = Clock::time_point::max();
    for (GlooWaiter* w : waiters) {
      if (w->interrupted) continue;
      bool due = destroyed || now >= w->until;
      if (!w->probe && w->kind != GlooWaiter::kConnect) due = due || should_stop_locked(w->peer);
      if (!due) {
        next = std::min(next, w->until);
        continue;
      }
      if (w->kind == GlooWaiter::kConnect) {
        if (!to_close) continue;
        to_close->push_back(w->peer);
      } else if (w->kind == GlooWaiter::kRecv) {
        w->buf->abortWaitRecv();
      } else {
        w->buf->abortWaitSend();
      }
      w->interrupted = true;
    }
    return next;
  }

  // Something changed that may end waits: end those now, and have the
  // watcher act (close connections) without waiting for its next tick.
  void changed_locked() {
    interrupt_due_locked(Clock::now(), nullptr);
    cv.notify_all();
  }

  // Registers a wait. A non-probe wait is refused (false) when it should not
  // start: a stop condition holds or `until` has passed.
  bool add_waiter(GlooWaiter* w) {
    std::lock_guard<std::mutex> lock(mu);
    if (!w->probe && w->kind != GlooWaiter::kConnect &&
        (should_stop_locked(w->peer) || Clock::now() >= w->until)) {
      return false;
    }
    if (destroyed) return false;
    waiters.push_back(w);
    if (w->until < watcher_wake) cv.notify_all();
    return true;
  }
  void remove_waiter(GlooWaiter* w) {
    std::lock_guard<std::mutex> lock(mu);
    waiters.erase(std::remove(waiters.begin(), waiters.end(), w), waiters.end());
  }

  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu);
    if (destroyed) return;
    if (stop != Stop::kAborted) {
      stop = Stop::kAborted;
      stop_reason = reason;
    }
    close_requested = true;
    changed_locked();
  }

  // A transfer's own Gloo wait or post threw: its pair failed (or its peer
  // left). Gloo passes the error to the pair's queued operations one by one
  // before it marks the pair closed, all under the pair's lock; close() takes
  // that lock (and does nothing on a closed pair), so after it the control
  // receives say whether the peer left or failed.
  void transfer_failed(int peer, const std::string& what) {
    std::shared_ptr<gloo::transport::Context> c;
    {
      std::lock_guard<std::mutex> lock(mu);
      c = ctx;
    }
    if (c) {
      try {
        auto& pair = c->getPair(peer);
        if (pair) pair->close();
      } catch (const std::exception&) {
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    scan_locked();
    if (peers[peer].state == PeerState::kAlive && !destroyed && !close_requested) {
      mark_dead_locked(peer, PeerState::kFailed, what);
      if (stop == Stop::kNone) break_locked();
    }
    changed_locked();
  }

  // A request was destroyed with its transfer still queued in Gloo.
  void request_dropped(int peer, const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    if (stop != Stop::kNone || destroyed || peers[peer].state != PeerState::kAlive) return;
    stop = Stop::kDropped;
    stop_reason = "a request was dropped before completion (" + what +
                  "); Gloo cannot cancel a posted transfer, so this group's transport is unusable";
    close_requested = true;
    changed_locked();
  }

  void request_finished() {
    std::lock_guard<std::mutex> lock(mu);
    --live_requests;
  }

  // Whether a wait that must stop may still find its transfer complete: not
  // after abort or a drop (their waits throw AbortedError), nor once the
  // watcher is gone.
  bool completion_counts() {
    std::lock_guard<std::mutex> lock(mu);
    return stop != Stop::kAborted && stop != Stop::kDropped && !destroyed;
  }

  // Runs fn(p) for every peer's pair, up to 16 at a time: closing a pair
  // waits for a tick of Gloo's device loop (up to 10 ms), and the peers
  // should all see a departure at once.
  template <typename Fn>
  void for_each_pair(Fn fn) {
    std::vector<int> ps;
    for (int p = 0; p < size; ++p) {
      if (p != rank && ctx) ps.push_back(p);
    }
    const size_t k = std::min<size_t>(ps.size(), 16);
    auto some = [&](size_t first) {
      for (size_t i = first; i < ps.size(); i += k) {
        try {
          fn(ps[i]);
        } catch (const std::exception&) {
        }
      }
    };
    // Started together (behind `go`), so that the closes meet one tick.
    std::mutex go_mu;
    std::condition_variable go_cv;
    bool go = false;
    auto start = [&](size_t first) {
      {
        std::unique_lock<std::mutex> lock(go_mu);
        go_cv.wait(lock, [&] { return go; });
      }
      some(first);
    };
    std::vector<std::thread> helpers;
    size_t started = 1;
    try {
      for (; started < k; ++started) helpers.emplace_back(start, started);
    } catch (const std::exception&) {  // no thread: the rest here
    }
    {
      std::lock_guard<std::mutex> lock(go_mu);
      go = true;
    }
    go_cv.notify_all();
    for (size_t j = started; j < k; ++j) some(j);
    if (k > 0) some(0);
    for (auto& h : helpers) h.join();
  }

  // Resets every connection (abort, break, drop): the peers see it at once.
  void close_all_pairs() {
    for_each_pair([&](int p) {
      auto& pair = ctx->getPair(p);
      if (pair) pair->close();
    });
  }

  // Destroys every pair: a FIN after what was written (the goodbyes).
  void destroy_pairs() {
    for_each_pair([&](int p) { ctx->getPair(p).reset(); });
  }

  void watch() {
    std::unique_lock<std::mutex> lock(mu);
    while (!watcher_stop) {
      const auto now = Clock::now();
      scan_locked();
      std::vector<int> to_close;
      Clock::time_point next = interrupt_due_locked(now, &to_close);
      const bool settling = stop == Stop::kBroken && now < broken_at + kGlooSettle;
      if (settling) next = std::min(next, broken_at + kGlooSettle);
      if (close_requested && !pairs_closed && ready && !settling) {
        // On its own thread: the watcher stays free to end waits meanwhile.
        pairs_closed = true;
        try {
          closer = std::thread([this] { close_all_pairs(); });
        } catch (const std::exception&) {
          pairs_closed = false;  // shutdown closes them
        }
      }
      if (!to_close.empty()) {
        lock.unlock();  // set-up only; closing waits for a tick of Gloo's device loop
        for (int p : to_close) {
          try {
            ctx->getPair(p)->close();
          } catch (const std::exception&) {
          }
        }
        lock.lock();
        continue;
      }
      watcher_wake = std::min(next, now + kGlooScanInterval);
      cv.wait_until(lock, watcher_wake);
      watcher_wake = Clock::time_point::max();
    }
  }
};

using GlooStop = GlooCore::Stop;
using GlooPeerState = GlooCore::PeerState;

class GlooRequest : public Request::State {
 public:
  GlooRequest(std::shared_ptr<GlooCore> core, bool is_recv, int peer, int tag, size_t bytes,
              bool control = false)
      : core_(std::move(core)),
        is_recv_(is_recv),
        peer_(peer),
        tag_(tag),
        bytes_(bytes),
        control_(control) {}
  int peer() const override { return peer_; }

  // Dropped before it completed: Gloo must never reach the caller's buffer
  // again (destroying the Gloo buffer waits until its device thread lets go
  // of it and expires its references), and its connection is unusable.
  ~GlooRequest() override {
    // A send still deferred counts too: its peer would wait for it in vain.
    if ((buf_ || deferred_) && !done_ && !failed_ && !control_)
      core_->request_dropped(peer_, describe());
    gloo_destroy(buf_, is_recv_);
    if (live_) core_->request_finished();
  }

  // A send whose post waits for the transport's next wait or test.
  void defer(void* data, uint64_t slot) {
    deferred_ = true;
    deferred_data_ = data;
    deferred_slot_ = slot;
  }

  // Posts a deferred send now (unless the transport must stop: then its
  // wait throws why).
  void post_deferred() {
    if (!deferred_) return;
    deferred_ = false;
    if (!core_->should_stop(peer_)) post(deferred_data_, deferred_slot_);
  }

  // Posts the transfer (send/recv only call this when no stop condition
  // held). A failure here is the request's, thrown by its wait.
  void post(void* data, uint64_t slot) {
    void* p = data ? data : &dummy_;
    GlooSigpipeBlock no_sigpipe;  // posting writes to the socket
    try {
      buf_ = core_->ctx->createUnboundBuffer(p, bytes_);
      if (is_recv_) {
        buf_->recv(peer_, slot, 0, bytes_);
      } else {
        buf_->send(peer_, slot, 0, bytes_);
      }
    } catch (const std::exception& e) {
      failed(e.what());
      return;
    }
    if (!control_) {
      std::lock_guard<std::mutex> lock(core_->mu);
      ++core_->live_requests;
      live_ = true;
    }
  }

  bool test() override {
    if (done_) return true;
    flush_deferred_sends();
    const bool stopping = !buf_ || failed_ || core_->should_stop(peer_);
    if (buf_ && !failed_ && (!stopping || core_->completion_counts()) && probe()) {
      complete();
      return true;
    }
    if (stopping || failed_) throw_failure(false);
    return false;
  }

  void wait(Clock::time_point deadline) override {
    if (done_) return;
    flush_deferred_sends();
    for (bool first = true;; first = false) {
      const bool late = Clock::now() >= deadline;
      if (!buf_ || failed_ || late || core_->should_stop(peer_)) {
        // Completion first: a transfer that is done counts as done, also
        // when its peer has left since or the group broke. (Not when this
        // wait itself ran into its deadline: then the watcher ended it on
        // time; nor after abort or a drop.)
        if (buf_ && !failed_ && (first || !late) && core_->completion_counts() && probe()) {
          complete();
          return;
        }
        throw_failure(late);
      }
      if (gloo_wait(false, deadline) == Outcome::kComplete) {
        complete();
        return;
      }
    }
  }

  // Posts every deferred send of the transport, oldest first.
  void flush_deferred_sends() { flush_deferred_sends(*core_); }
  static void flush_deferred_sends(GlooCore& core) {
    std::vector<std::weak_ptr<GlooRequest>> sends;
    {
      std::lock_guard<std::mutex> lock(core.deferred_mu);
      if (core.deferred_sends.empty()) return;
      sends.swap(core.deferred_sends);
    }
    for (auto& w : sends) {
      if (auto r = w.lock()) r->post_deferred();
    }
  }

  std::string describe() const override {
    return std::string(is_recv_ ? "recv of " : "send of ") + std::to_string(bytes_) +
           (is_recv_ ? " bytes from rank " : " bytes to rank ") + std::to_string(peer_) + " (tag " +
           std::to_string(tag_) + ")";
  }

 private:
  enum class Outcome { kComplete, kInterrupted, kFailed };

  // One Gloo wait that the watcher ends at `until` (a probe: only then).
  Outcome gloo_wait(bool probe, Clock::time_point until) {
    // Set and consume the abort flag, so that it is clear: a false return
    // below then means the watcher ended this wait.
    try {
      if (is_recv_) {
        buf_->abortWaitRecv();
        buf_->waitRecv(nullptr, kGlooBackstop);
      } else {
        buf_->abortWaitSend();
        buf_->waitSend(nullptr, kGlooBackstop);
      }
    } catch (const std::exception& e) {
      failed(e.what());
      return Outcome::kFailed;
    }
    GlooWaiter w;
    w.kind = is_recv_ ? GlooWaiter::kRecv : GlooWaiter::kSend;
    w.buf = buf_.get();
    w.peer = peer_;
    w.until = until;
    w.probe = probe;
    if (!core_->add_waiter(&w)) return Outcome::kInterrupted;
    bool ok = false;
    std::string what;
    try {
      ok = is_recv_ ? buf_->waitRecv(nullptr, gloo_timeout(until))
                    : buf_->waitSend(nullptr, gloo_timeout(until));
    } catch (const std::exception& e) {
      what = e.what();
      if (what.empty()) what = "unknown Gloo error";
    }
    core_->remove_waiter(&w);
    if (!what.empty()) {
      failed(what);
      return Outcome::kFailed;
    }
    return ok ? Outcome::kComplete : Outcome::kInterrupted;
  }

  // Whether the transfer completes within the grace.
  bool probe() {
    bool final_state = false;
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      if (core_->destroyed) return false;
      final_state = core_->peers[peer_].state != GlooPeerState::kAlive;
    }
    const auto grace = final_state ? kGlooFinalProbeGrace : kGlooProbeGrace;
    return gloo_wait(true, Clock::now() + grace) == Outcome::kComplete;
  }

  void complete() {
    done_ = true;
    release();
  }

  // The transfer's pair failed: Gloo no longer reaches its buffer, which can
  // go (and the request no longer counts as pending).
  void failed(const std::string& what) {
    failed_ = true;
    failure_ = gloo_text(what);
    core_->transfer_failed(peer_, what);
    release();
  }

  void release() {
    gloo_destroy(buf_, is_recv_);  // also lets go of Gloo's context
    if (live_) {
      live_ = false;
      core_->request_finished();
    }
  }

  // The error of a transfer that cannot complete, the most telling first.
  [[noreturn]] void throw_failure(bool deadline_passed) {
    const std::string head = core_->rank_text() + ": " + describe();
    ErrorCode code = ErrorCode::kDeadlineExceeded;
    std::string message;
    bool peer_gone = false;
    {
      std::unique_lock<std::mutex> lock(core_->mu);
      if (core_->stop == GlooStop::kBroken && !core_->destroyed) {
        const auto settled = core_->broken_at + kGlooSettle;
        lock.unlock();
        std::this_thread::sleep_until(settled);
        lock.lock();
      }
      core_->scan_locked();  // name every peer whose connection is gone by now
      const GlooCore::Peer& peer = core_->peers[peer_];
      const std::string who = core_->peer_text(peer_);
      peer_gone = peer.state != GlooPeerState::kAlive;
      if (core_->stop == GlooStop::kAborted || core_->stop == GlooStop::kDropped) {
        code = ErrorCode::kAborted;
        message = head + " aborted: " + core_->stop_reason;
      } else if (peer.state == GlooPeerState::kLeft) {
        code = ErrorCode::kUnavailable;
        message = head + " failed: " + who +
                  " left the group (its transport was destroyed) before it completed";
        // The group's work needed a rank that is gone: it cannot finish.
        // Break, so that the ranks waiting on this one learn it too.
        if (core_->stop == GlooStop::kNone) {
          core_->break_locked();
          core_->changed_locked();
        }
      } else if (peer.state == GlooPeerState::kFailed || core_->stop == GlooStop::kBroken) {
        // Every connection found gone, the first (the cause, most often) first.
        code = ErrorCode::kUnavailable;
        message = head + " failed: the group is broken: " + core_->dead_peers_locked();
      } else if (core_->destroyed) {
        code = ErrorCode::kAborted;
        message = head + " aborted: the Gloo transport was destroyed before it completed";
      } else if (failed_ || !deadline_passed) {
        code = ErrorCode::kInternal;
        message = head + " failed in Gloo: " + (failure_.empty() ? "unknown error" : failure_);
      } else {
        message = head + " did not complete before the deadline: rank " + std::to_string(peer_) +
                  " did not post the matching " + (is_recv_ ? "send" : "recv") + " of " +
                  std::to_string(bytes_) + " bytes with tag " + std::to_string(tag_) + " in time" +
                  kLatePeerCauses +
                  "; or it posted one of another byte count (over Gloo a send and a recv of "
                  "different byte counts never match)";
      }
    }
    // Its peer's connection is closed: Gloo no longer reaches the buffer.
    if (peer_gone) release();
    throw_error(code, message);
  }

  std::shared_ptr<GlooCore> core_;
  const bool is_recv_;
  const int peer_, tag_;
  const size_t bytes_;
  const bool control_;  // a goodbye: neither counted nor a drop
  std::unique_ptr<GlooBuffer> buf_;
  bool done_ = false;
  bool failed_ = false;
  bool live_ = false;
  std::string failure_;
  char dummy_ = 0;         // zero-byte transfers point here
  bool deferred_ = false;  // a send not yet posted: see GlooTransport::post
  void* deferred_data_ = nullptr;
  uint64_t deferred_slot_ = 0;
};

class GlooTransport : public Transport {
 public:
  explicit GlooTransport(std::shared_ptr<GlooCore> core) : core_(std::move(core)) {
    watcher_ = std::thread([c = core_.get()] { c->watch(); });
  }

  ~GlooTransport() override {
    // The goodbyes are written here, on the owner's thread, maybe to a peer
    // that is gone (a worker that finished was killed by SIGPIPE at exit).
    GlooSigpipeBlock no_sigpipe;
    try {
      shutdown();
    } catch (...) {
    }
    stop_threads();  // again, in case shutdown() threw before it got there
  }

  int rank() const override { return core_->rank; }
  int size() const override { return core_->size; }

  // Ranks that advertised the same address share a node; nodes are numbered
  // in the order of their lowest rank. An address not known ("") is a node
  // of its own.
  std::vector<int> node_of() const {
    std::vector<int> node(core_->size);
    std::map<std::string, int> seen;
    int next = 0;
    for (int r = 0; r < core_->size; ++r) {
      const std::string& h = core_->hosts[r];
      if (h.empty()) {
        node[r] = next++;
        continue;
      }
      auto it = seen.find(h);
      node[r] = it != seen.end() ? it->second : (seen[h] = next++);
    }
    return node;
  }

  Request send(int peer, const void* data, size_t bytes, int tag) override {
    check_peer(peer, "send to");
    return post(false, peer, const_cast<void*>(data), bytes, tag);
  }

  Request recv(int peer, void* data, size_t bytes, int tag) override {
    check_peer(peer, "recv from");
    return post(true, peer, data, bytes, tag);
  }

  bool probe_any(Envelope*) override {
    throw UnimplementedError(core_->rank_text() +
                             ": probe_any is not supported by the Gloo transport (Gloo's TCP "
                             "pairs cannot show a message no recv has claimed); run the "
                             "parameter server over the MPI or the in-process transport");
  }

  void abort(const std::string& reason) override {
    GlooSigpipeBlock no_sigpipe;
    core_->abort(reason);
  }

  // Steps 1-3 of the header's set-up.
  void connect(AddressExchange& exchange, const GlooTransportOptions& options,
               Clock::time_point deadline);

 private:
  // A recv is posted at once. A send is posted at the transport's next
  // wait or test, after the recvs posted meanwhile: Gloo writes a recv's
  // go-ahead to the peer in the same queue as our data, so a go-ahead posted
  // after a large send waits until that send has gone out, and the peer's
  // data cannot flow our way meanwhile (a ring step ran at half the link
  // rate, each direction in turn). The data of a send cannot leave before
  // the peer's go-ahead anyway, so the deferral costs nothing.
  Request post(bool is_recv, int peer, void* data, size_t bytes, int tag) {
    auto req = std::make_shared<GlooRequest>(core_, is_recv, peer, tag, bytes);
    if (is_recv) {
      if (!core_->should_stop(peer)) req->post(data, gloo_slot(tag, bytes));
    } else {
      req->defer(data, gloo_slot(tag, bytes));
      std::lock_guard<std::mutex> lock(core_->deferred_mu);
      core_->deferred_sends.push_back(req);
    }
    return Request(std::move(req));
  }

  void check_peer(int peer, const char* what) const {
    DISTSTRAT_CHECK(0 <= peer && peer < core_->size && peer != core_->rank, kInvalidArgument,
                    core_->rank_text(), ": Gloo ", what, " rank ", peer, " in a group of ",
                    core_->size);
  }

  void shutdown();
  void say_goodbye();
  void stop_threads() noexcept {
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      core_->destroyed = true;
      core_->watcher_stop = true;
      core_->changed_locked();
    }
    if (watcher_.joinable()) watcher_.join();
    if (core_->closer.joinable()) core_->closer.join();
  }

  std::shared_ptr<GlooCore> core_;
  std::thread watcher_;
};

void GlooTransport::shutdown() {
  // Sends still deferred are pending work: posted, they make the transport
  // abort below (as they did before deferral), not leave without them.
  GlooRequest::flush_deferred_sends(*core_);
  bool graceful = false;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (core_->ready && core_->stop == GlooStop::kNone) {
      if (core_->live_requests == 0) {
        graceful = true;
      } else {
        core_->stop = GlooStop::kAborted;
        core_->stop_reason = "the Gloo transport was destroyed with " +
                             std::to_string(core_->live_requests) + " requests pending";
        core_->close_requested = true;
        core_->changed_locked();
      }
    }
  }
  if (graceful) say_goodbye();
  stop_threads();
  bool close_all = false;
  std::vector<std::unique_ptr<GlooBuffer>> controls;
  std::shared_ptr<gloo::transport::Context> ctx;
  std::shared_ptr<gloo::transport::Device> device;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    close_all = core_->close_requested && !core_->pairs_closed && core_->ready;
    core_->pairs_closed = true;
    for (auto& peer : core_->peers) {
      controls.push_back(std::move(peer.goodbye));
      controls.push_back(std::move(peer.failure));
    }
  }
  if (close_all) core_->close_all_pairs();
  // The pairs first (a request still pending may keep the context, not its
  // pairs): then Gloo's device thread is done with the control receives.
  core_->destroy_pairs();
  for (auto& c : controls) gloo_destroy(c, true);
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    ctx = std::move(core_->ctx);
    device = std::move(core_->device);
  }
  // Unless requests still pending hold it, the context goes here, and
  // Gloo's device loop with it.
  ctx.reset();
  device.reset();
}

// A zero-byte message on the control slot to every peer still there, then
// the wait (bounded) until each is written, so that the FIN follows it.
void GlooTransport::say_goodbye() {
  std::vector<std::shared_ptr<GlooRequest>> goodbyes;
  for (int p = 0; p < core_->size; ++p) {
    if (p == core_->rank || core_->should_stop(p)) continue;
    auto g = std::make_shared<GlooRequest>(core_, false, p, 0, 0, /*control=*/true);
    g->post(nullptr, kGlooControlSlot);
    goodbyes.push_back(std::move(g));
  }
  const auto deadline = Clock::now() + kGlooGoodbyeGrace;
  for (auto& g : goodbyes) {
    try {
      g->wait(deadline);
    } catch (const Error&) {
      // That peer left or failed meanwhile, or does not take it: it will see
      // the connection close instead.
    }
  }
}

// Whether `host` resolves (Gloo's own lookup crashes when it does not).
std::string gloo_resolve_error(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &result);
  if (rc != 0) return gai_strerror(rc);
  freeaddrinfo(result);
  return "";
}

// Empty when `name` is an interface with an IPv4 or IPv6 address, else why not.
std::string gloo_interface_error(const std::string& name) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return std::string("getifaddrs failed: ") + std::strerror(errno);
  bool found = false;
  std::vector<std::string> names;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr) continue;
    const int family = i->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    if (name == i->ifa_name) found = true;
    if (std::find(names.begin(), names.end(), i->ifa_name) == names.end())
      names.push_back(i->ifa_name);
  }
  freeifaddrs(list);
  if (found) return "";
  std::string have;
  for (const auto& n : names) have += (have.empty() ? "" : ", ") + n;
  return "no network interface of that name has an IPv4 or IPv6 address (those that do: " + have +
         ")";
}

void GlooTransport::connect(AddressExchange& exchange, const GlooTransportOptions& options,
                            Clock::time_point deadline) {
  GlooCore& c = *core_;
  const std::string who = "make_gloo_transport: rank " + std::to_string(c.rank) + " of " +
                          std::to_string(c.size) + " (group '" + echo(c.group) + "')";
  const std::string prefix = c.group + "/gloo/";

  // 1. The device and a listening socket per peer.
  gloo::transport::tcp::attr attr;
  if (!options.interface.empty()) {
    const std::string why = gloo_interface_error(options.interface);
    DISTSTRAT_CHECK(why.empty(), kInvalidArgument, who, ": interface '", echo(options.interface),
                    "': ", why);
    attr.iface = options.interface;
  } else {
    std::string host = options.listen_host;
    if (host.empty()) {
      char name[HOST_NAME_MAX + 1] = {};
      DISTSTRAT_CHECK(gethostname(name, sizeof name - 1) == 0, kUnavailable, who,
                      ": gethostname failed: ", std::strerror(errno));
      host = name;
    }
    const std::string why = gloo_resolve_error(host);
    DISTSTRAT_CHECK(why.empty(), kInvalidArgument, who, ": ",
                    options.listen_host.empty() ? "this host's name '" : "listen_host '",
                    echo(host), "' does not resolve (", why, ")",
                    options.listen_host.empty() ? "; set listen_host or interface" : "");
    attr.hostname = host;
  }
  const std::string where = options.interface.empty() ? "host '" + echo(attr.hostname) + "'"
                                                      : "interface '" + echo(attr.iface) + "'";
  std::vector<std::vector<char>> mine(c.size);
  try {
    GlooSigpipeBlock no_sigpipe;  // for good on Gloo's device thread
    {
      GlooDeviceThreadBatch batch;  // for good on Gloo's device thread
      c.device = gloo::transport::tcp::CreateDevice(attr);
    }
    c.ctx = c.device->createContext(c.rank, c.size);
    // Gloo's connect gives up after 5x this; the watcher ends it at the deadline.
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    c.ctx->setTimeout(
        std::clamp<std::chrono::milliseconds>(left, std::chrono::milliseconds(1), kGlooMaxWait));
    for (int p = 0; p < c.size; ++p) {
      if (p != c.rank) mine[p] = gloo_clean_address(c.ctx->createPair(p)->address().bytes());
    }
    if (c.size > 1) c.hosts[c.rank] = gloo_address_host(mine[c.rank == 0 ? 1 : 0]);
  } catch (const std::exception& e) {
    throw InvalidArgumentError(who + ": Gloo could not listen on " + where + ": " +
                               gloo_text(e.what()));
  }
  std::string value = "gloo-tcp/1 " + std::to_string(c.size);
  for (int p = 0; p < c.size; ++p)
    value += " " + (p == c.rank ? std::string("-") : gloo_hex(mine[p]));

  // 2. Publish, then every peer's addresses.
  const std::string my_key = prefix + std::to_string(c.rank);
  try {
    exchange.publish(my_key, value, deadline);
  } catch (const Error& e) {
    throw_error(e.code(), who + ": publishing its addresses under '" + echo(my_key) +
                              "' failed: " + e.message());
  }
  std::vector<std::vector<char>> theirs(c.size);
  std::vector<int> missing;
  for (int p = 0; p < c.size; ++p) {
    if (p == c.rank) continue;
    const std::string key = prefix + std::to_string(p);
    std::string v;
    try {
      v = exchange.wait_for(key, deadline);
    } catch (const DeadlineExceededError&) {
      missing.push_back(p);
      continue;
    } catch (const Error& e) {
      throw_error(e.code(), who + ": reading rank " + std::to_string(p) + "'s addresses ('" +
                                echo(key) + "') failed: " + e.message());
    }
    const std::vector<std::string> words = gloo_split(v);
    DISTSTRAT_CHECK(words.size() >= 2 && words[0] == "gloo-tcp/1", kInvalidArgument, who, ": rank ",
                    p, " published '", echo(v, 60), "' under '", echo(key),
                    "', not Gloo transport addresses");
    DISTSTRAT_CHECK(words[1] == std::to_string(c.size) && words.size() == size_t(c.size) + 2,
                    kInvalidArgument, who, ": rank ", p, " set up a group of ", echo(words[1]),
                    " ranks, this rank one of ", c.size);
    DISTSTRAT_CHECK(gloo_unhex(words[2 + c.rank], &theirs[p]) && theirs[p].size() == mine[p].size(),
                    kInvalidArgument, who, ": rank ", p, "'s address for this rank ('",
                    echo(words[2 + c.rank], 60), "') is not a Gloo TCP address");
    c.peers[p].address = gloo_address_text(theirs[p]);
    c.hosts[p] = gloo_address_host(theirs[p]);
  }
  DISTSTRAT_CHECK(missing.empty(), kDeadlineExceeded, who, ": ", ranks_phrase(missing),
                  " never published ", missing.size() == 1 ? "its" : "their", " addresses (keys '",
                  echo(prefix), "<rank>') before the deadline");

  // 3. Connect each pair, then post its control receives.
  std::vector<int> not_connected;
  for (int p = 0; p < c.size; ++p) {
    if (p == c.rank) continue;
    GlooWaiter w;
    w.kind = GlooWaiter::kConnect;
    w.peer = p;
    w.until = deadline;
    core_->add_waiter(&w);
    std::string what;
    try {
      c.ctx->getPair(p)->connect(theirs[p]);
    } catch (const std::exception& e) {
      what = e.what();
      if (what.empty()) what = "unknown Gloo error";
    }
    core_->remove_waiter(&w);
    if (w.interrupted) {
      not_connected.push_back(p);
    } else if (!what.empty()) {
      throw UnavailableError(who + ": connecting to " + c.peer_text(p) +
                             " failed: " + gloo_text(what));
    }
  }
  DISTSTRAT_CHECK(not_connected.empty(), kDeadlineExceeded, who, ": ", ranks_phrase(not_connected),
                  " did not connect before the deadline");
  GlooSigpipeBlock no_sigpipe;  // posting writes to the socket
  for (int p = 0; p < c.size; ++p) {
    if (p == c.rank) continue;
    GlooCore::Peer& peer = c.peers[p];
    try {
      peer.goodbye = c.ctx->createUnboundBuffer(&peer.byte, 0);
      peer.goodbye->recv(p, kGlooControlSlot, 0, 0);
      peer.failure = c.ctx->createUnboundBuffer(&peer.byte, 0);
      peer.failure->recv(p, kGlooControlSlot, 0, 0);
    } catch (const std::exception& e) {
      throw UnavailableError(who + ": the connection to " + c.peer_text(p) +
                             " failed during set-up: " + gloo_text(e.what()));
    }
  }
}

class InMemoryAddressExchange : public AddressExchange {
 public:
  void publish(const std::string& key, const std::string& value, Clock::time_point) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = values_.find(key);
      DISTSTRAT_CHECK(it == values_.end() || it->second == value, kInvalidArgument,
                      "address exchange: '", echo(key),
                      "' is already published with another value (two ranks with one number?)");
      values_[key] = value;
    }
    cv_.notify_all();
  }

  std::string wait_for(const std::string& key, Clock::time_point deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [&] { return values_.count(key) > 0; });
    auto it = values_.find(key);
    DISTSTRAT_CHECK(it != values_.end(), kDeadlineExceeded, "address exchange: '", echo(key),
                    "' was not published before the deadline");
    return it->second;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> values_;
};

}  // namespace

std::shared_ptr<AddressExchange> make_in_memory_address_exchange() {
  return std::make_shared<InMemoryAddressExchange>();
}

std::vector<int> gloo_node_of(const Transport& transport) {
  const auto* t = dynamic_cast<const GlooTransport*>(&transport);
  if (!t) return {};
  return t->node_of();
}

std::unique_ptr<Transport> make_gloo_transport(int rank, int size, AddressExchange& exchange,
                                               const GlooTransportOptions& options,
                                               Clock::time_point deadline) {
  DISTSTRAT_CHECK(size >= 1, kInvalidArgument, "make_gloo_transport: size ", size,
                  " (a group has at least one rank)");
  DISTSTRAT_CHECK(0 <= rank && rank < size, kInvalidArgument, "make_gloo_transport: rank ", rank,
                  " in a group of ", size);
  DISTSTRAT_CHECK(!options.group.empty(), kInvalidArgument, "make_gloo_transport: rank ", rank,
                  ": options.group is empty (it names the group's keys, e.g. \"job/g7\")");
  DISTSTRAT_CHECK(options.listen_host.empty() || options.interface.empty(), kInvalidArgument,
                  "make_gloo_transport: rank ", rank, ": both listen_host '",
                  echo(options.listen_host), "' and interface '", echo(options.interface),
                  "' are set; give one");
  auto core = std::make_shared<GlooCore>(rank, size, options.group);
  auto transport = std::make_unique<GlooTransport>(core);
  if (size > 1) transport->connect(exchange, options, deadline);
  {
    std::lock_guard<std::mutex> lock(core->mu);
    core->ready = true;
  }
  return transport;
}

}  // namespace diststrat
