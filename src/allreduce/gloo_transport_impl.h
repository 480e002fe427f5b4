// The Gloo transport (gloo_transport.h), declared for the files that
// implement it over the public parts of Gloo's TCP transport: Device,
// Context, Pair and UnboundBuffer. (Debian's libgloo-dev does not install
// gloo/common/memory.h, so tcp/pair.h, tcp/context.h and tcp/unbound_buffer.h
// cannot be included; everything here goes through the abstract classes.)
// One job a file:
//   gloo_support.cc    slots, timeouts, signal and scheduling guards, Gloo's
//                      error texts and addresses, name and interface checks
//   gloo_core.cc       GlooCore: the state a transport, its requests and its
//                      watcher share; peer failures, stops, the watcher loop
//   gloo_request.cc    GlooRequest: one send or recv, its waits and errors
//   gloo_transport.cc  GlooTransport: set-up (connect), goodbye, shutdown;
//                      make_gloo_transport and the in-memory address exchange
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
#pragma once

#include <gloo/transport/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <signal.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "allreduce/gloo_transport.h"

namespace diststrat {
namespace gloo_impl {

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

// The slot of a user transfer: the tag, and the byte count folded into 31 bits.
uint64_t gloo_slot(int tag, size_t bytes);

// The Gloo-side timeout for a wait that the watcher ends at `until`.
std::chrono::milliseconds gloo_timeout(Clock::time_point until);

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
  GlooDeviceThreadBatch();
  ~GlooDeviceThreadBatch();
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
  GlooSigpipeBlock();
  ~GlooSigpipeBlock();
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
void gloo_destroy(std::unique_ptr<GlooBuffer>& buf, bool is_recv);

// Gloo's error text for a message: without the peer addresses Gloo prints
// in it (" [127.0.0.1]:4567", the port in network byte order); the message
// names the rank and its address itself.
std::string gloo_text(const std::string& what);

// The IP address and port of a Gloo TCP address's bytes; false if they are
// none (not IPv4 or IPv6, or not an address at all).
bool gloo_address_parts(const std::vector<char>& bytes, std::string* host, int* port, bool* v6);

// "127.0.0.1" / "::1" from a Gloo TCP address's bytes ("" if it is none).
std::string gloo_address_host(const std::vector<char>& bytes);

// "127.0.0.1:4567" / "[::1]:4567" from a Gloo TCP address's bytes.
std::string gloo_address_text(const std::vector<char>& bytes);

// A Gloo TCP address's bytes with only the address itself, the port and the
// sequence number: Gloo copies its whole sockaddr_storage, whose unused bytes
// it never cleared (they carried stack and heap addresses into the store).
std::vector<char> gloo_clean_address(const std::vector<char>& bytes);

std::string gloo_hex(const std::vector<char>& bytes);
bool gloo_unhex(const std::string& s, std::vector<char>* out);
std::vector<std::string> gloo_split(const std::string& s);

// Whether `host` resolves (Gloo's own lookup crashes when it does not).
std::string gloo_resolve_error(const std::string& host);

// Empty when `name` is an interface with an IPv4 or IPv6 address, else why not.
std::string gloo_interface_error(const std::string& name);

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

  void mark_dead_locked(int p, PeerState state, const std::string& what);

  // "the connection to rank 0 (h:p) failed: ...; rank 3 (h:p) had left the
  // group": failed peers, then those that left, each in the order found.
  std::string dead_peers_locked() const;

  void break_locked();

  // A failure control receive that throws: the peer's connection is gone.
  static bool control_failed(GlooBuffer* buf, std::string* what);

  // Polls every live peer's control receives: a dead connection is a peer
  // that left (its goodbye arrived first) or failed (the transport breaks).
  // Also once this transport is broken, so that its errors name every rank
  // gone (a connection this transport reset itself signals nothing).
  void scan_locked();

  // Ends the waits that are due; returns when the next one will be. Pairs
  // whose connect must end are added to `to_close` (the watcher closes them;
  // other callers pass null and leave connects to it).
  Clock::time_point interrupt_due_locked(Clock::time_point now, std::vector<int>* to_close);

  // Something changed that may end waits: end those now, and have the
  // watcher act (close connections) without waiting for its next tick.
  void changed_locked();

  // Registers a wait. A non-probe wait is refused (false) when it should not
  // start: a stop condition holds or `until` has passed.
  bool add_waiter(GlooWaiter* w);
  void remove_waiter(GlooWaiter* w);

  void abort(const std::string& reason);

  // A transfer's own Gloo wait or post threw: its pair failed (or its peer
  // left). Gloo passes the error to the pair's queued operations one by one
  // before it marks the pair closed, all under the pair's lock; close() takes
  // that lock (and does nothing on a closed pair), so after it the control
  // receives say whether the peer left or failed.
  void transfer_failed(int peer, const std::string& what);

  // A request was destroyed with its transfer still queued in Gloo.
  void request_dropped(int peer, const std::string& what);

  void request_finished();

  // Whether a wait that must stop may still find its transfer complete: not
  // after abort or a drop (their waits throw AbortedError), nor once the
  // watcher is gone.
  bool completion_counts();

  // Runs fn(p) for every peer's pair, up to 16 at a time: closing a pair
  // waits for a tick of Gloo's device loop (up to 10 ms), and the peers
  // should all see a departure at once. (Defined in gloo_core.cc, its only user.)
  template <typename Fn>
  void for_each_pair(Fn fn);

  // Resets every connection (abort, break, drop): the peers see it at once.
  void close_all_pairs();

  // Destroys every pair: a FIN after what was written (the goodbyes).
  void destroy_pairs();

  // The watcher thread's loop: polls the control receives, ends due waits,
  // resets the connections once asked to.
  void watch();
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
  ~GlooRequest() override;

  // A send whose post waits for the transport's next wait or test.
  void defer(void* data, uint64_t slot) {
    deferred_ = true;
    deferred_data_ = data;
    deferred_slot_ = slot;
  }

  // Posts a deferred send now (unless the transport must stop: then its
  // wait throws why).
  void post_deferred();

  // Posts the transfer (send/recv only call this when no stop condition
  // held). A failure here is the request's, thrown by its wait.
  void post(void* data, uint64_t slot);

  bool test() override;
  void wait(Clock::time_point deadline) override;

  // Posts every deferred send of the transport, oldest first.
  void flush_deferred_sends() { flush_deferred_sends(*core_); }
  static void flush_deferred_sends(GlooCore& core);

  std::string describe() const override;

 private:
  enum class Outcome { kComplete, kInterrupted, kFailed };

  // One Gloo wait that the watcher ends at `until` (a probe: only then).
  Outcome gloo_wait(bool probe, Clock::time_point until);

  // Whether the transfer completes within the grace.
  bool probe();

  void complete();

  // The transfer's pair failed: Gloo no longer reaches its buffer, which can
  // go (and the request no longer counts as pending).
  void failed(const std::string& what);

  void release();

  // The error of a transfer that cannot complete, the most telling first.
  [[noreturn]] void throw_failure(bool deadline_passed);

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

}  // namespace gloo_impl
}  // namespace diststrat
