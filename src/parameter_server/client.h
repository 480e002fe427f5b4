// The worker's side of the parameter-server protocol (see wire.h): posts
// requests to PS ranks without blocking and completes their replies in
// order. Not thread-safe: the strategy serializes calls with a mutex.
#pragma once

#include <chrono>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/flight_recorder.h"
#include "allreduce/transport.h"
#include "parameter_server/wire.h"

namespace diststrat {
namespace ps {

class Client {
 public:
  struct Call {
    int ps = 0;  // index into ps_ranks
    int64_t seq = 0;
    std::string what;  // "push of step 3 to PS rank 2"
    std::vector<char> control;
    std::shared_ptr<const void> payload_owner;  // keeps the payload alive
    ReplyHeader reply;
    std::string error_text;
    void* reply_dst = nullptr;
    size_t reply_bytes = 0;
    std::exception_ptr pending_error;  // raised once the padding payload is in
    Request send_control, send_payload, recv_header, recv_error, recv_payload;
    enum class Stage { kHeader, kError, kPayload, kDone } stage = Stage::kHeader;
    bool detached = false;  // nobody waits: an error is kept for later
    std::exception_ptr error;
    uint64_t flight_seq = 0;  // its entry in the flight recorder
  };
  using CallPtr = std::shared_ptr<Call>;

  Client(Transport& transport, std::vector<int> ps_ranks, int worker_index,
         std::chrono::milliseconds timeout);
  // Waits briefly for the sends of failed calls that were still in flight
  // (see finish()); their memory is released afterwards.
  ~Client();

  int num_ps() const { return static_cast<int>(ps_ranks_.size()); }
  int ps_rank(int ps) const { return ps_ranks_[ps]; }
  int worker_index() const { return worker_index_; }
  // This client's incarnation (see wire.h): the system clock's microseconds
  // when it was made, so a restarted worker's is larger.
  uint64_t incarnation() const { return incarnation_; }

  // Posts one request. `payload` (payload_bytes) must stay valid while
  // payload_owner lives; the reply's payload (reply_bytes exactly) lands in
  // reply_dst.
  CallPtr post(int ps, Op op, const std::vector<char>& body,
               std::shared_ptr<const void> payload_owner, const void* payload, size_t payload_bytes,
               void* reply_dst, size_t reply_bytes, std::string what);
  // Completes `call` (and every call posted before it to the same PS);
  // rethrows its error. The wait is bounded by the timeout, or by `deadline`.
  void wait(const CallPtr& call);
  void wait(const CallPtr& call, Clock::time_point deadline);
  // Marks `call` as fire-and-forget: its error is kept and raised by
  // throw_deferred().
  void detach(const CallPtr& call) { call->detached = true; }
  // Completes what has arrived, without blocking.
  void poll();
  // Completes every outstanding call.
  void drain();
  // Rethrows (once) the first error of a detached call.
  void throw_deferred();
  // Returns (once) the first error of a detached call, or null.
  std::exception_ptr take_deferred();
  bool has_outstanding() const;
  // When the last request was posted (construction, before the first).
  Clock::time_point last_post() const { return last_post_; }
  // Why PS `ps` is unreachable ("" while it is not): the transport failed
  // under one of its calls (a deadline, an abort), so the stream of
  // requests and replies with it cannot go on. Every outstanding and later
  // call to it fails at once with UnavailableError naming that first
  // failure: a failed PS costs one deadline, not one per call.
  const std::string& broken(int ps) const { return broken_[ps]; }
  // Fault injection: the next push's header goes out with its magic
  // damaged, as a corrupted message would (the PS must reject it).
  void corrupt_next_push() { corrupt_next_push_ = true; }
  // Fault injection: the next push's header claims 1 GiB + 8 bytes more
  // payload than it sends (a payload the PS would receive in parts).
  void oversize_next_push() { oversize_next_push_ = true; }

 private:
  // Advances `c`; blocks up to `deadline` when `block`. True once done.
  bool advance(Call& c, bool block, Clock::time_point deadline);
  void finish(Call& c, std::exception_ptr error);
  // UnavailableError for `c`: its PS is broken().
  std::exception_ptr unreachable(const Call& c) const;
  Clock::time_point deadline() const;

  Transport& t_;
  std::vector<int> ps_ranks_;
  int worker_index_;
  // Every request in the flight recorder, as the calls of a group of its own
  // ("ps-client w<index>": never compared with another rank's), so that a
  // hang's verdict can say a worker waits in a push or pull.
  flight::Recorder recorder_;
  std::chrono::milliseconds timeout_;
  int64_t next_seq_ = 1;
  uint64_t incarnation_ = 0;
  std::vector<uint64_t> ps_incarnation_;  // per PS, from its replies (0: not heard yet)
  bool corrupt_next_push_ = false;
  bool oversize_next_push_ = false;
  std::vector<std::deque<CallPtr>> fifo_;  // per PS, in posting order
  std::vector<std::string> broken_;        // per PS, see broken()
  Clock::time_point last_post_ = Clock::now();
  std::vector<std::exception_ptr> deferred_;
  // Sends of failed calls that had not completed: the transport may still
  // read their control block and payload (the PS consumes even a request it
  // rejects), so that memory lives here until the sends complete.
  struct Orphan {
    Request send_control, send_payload;
    std::vector<char> control;
    std::shared_ptr<const void> payload_owner;
  };
  std::vector<Orphan> orphans_;
  void release_sent_orphans();
};

}  // namespace ps
}  // namespace diststrat
