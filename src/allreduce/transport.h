// Transport: what collective algorithms and the parameter-server protocol are
// written against. Point-to-point, non-blocking byte transfers between ranks
// of one group, with completion handles whose waits carry deadlines.
//
// Rules:
//  - send/recv are non-blocking: they return a Request at once; the buffer
//    must stay valid and untouched until the request completes.
//  - Messages between one (sender, receiver, tag) triple arrive in the order
//    they were sent. A recv must name the exact byte count the matching send
//    carries; a mismatch is an InvalidArgumentError at the receiver.
//  - wait() never blocks past its deadline: it throws DeadlineExceededError
//    naming this rank, the peer and the tag. After abort() every pending and
//    future wait throws AbortedError.
//  - Dropping the last copy of a Request before it completes cancels it: the
//    transport never touches its buffer afterwards (a cancelled recv leaves
//    the message for a later recv). Algorithms rely on this when a wait
//    throws and they unwind, freeing scratch that other receives still name.
//  - One Transport object per rank; one thread uses it at a time unless the
//    implementation says otherwise.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "core/flight_recorder.h"
#include "diststrat/error.h"

namespace diststrat {

using Clock = std::chrono::steady_clock;

// Completion handle of one send or recv. Implementations subclass State.
class Request {
 public:
  struct State {
    virtual ~State() = default;
    // True once complete; throws the transfer's error if it failed.
    virtual bool test() = 0;
    // Blocks until complete or `deadline`; throws as documented above.
    virtual void wait(Clock::time_point deadline) = 0;
    // "send of 4096 bytes to rank 1 (tag 7)"
    virtual std::string describe() const = 0;
    // The rank at the other end (-1: unknown).
    virtual int peer() const { return -1; }
  };
  Request() = default;
  explicit Request(std::shared_ptr<State> s) : state_(std::move(s)) {}
  bool valid() const { return state_ != nullptr; }
  bool test() { return !state_ || state_->test(); }
  // (Notes the peer in the flight record's current call first: while it
  // waits, a record written then says whom this rank waits for.)
  void wait(Clock::time_point deadline) {
    if (!state_) return;
    flight::note_waiting(state_->peer());
    state_->wait(deadline);
  }
  std::string describe() const { return state_ ? state_->describe() : "empty request"; }

 private:
  std::shared_ptr<State> state_;
};

// What a request's deadline error adds after "rank P did not post the
// matching send in time": why a live peer can be late.
inline constexpr const char* kLatePeerCauses =
    ": it may be stopped (SIGSTOP, a debugger), busy elsewhere (a slower step, another "
    "collective), or unreachable (its host gone, a link down)";

// Waits for all requests, each against the same deadline.
void wait_all(std::vector<Request>& requests, Clock::time_point deadline);

// A message that arrived without a matching recv posted (any source), as the
// parameter-server service loop receives requests.
struct Envelope {
  int source = -1;
  int tag = 0;
  size_t bytes = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  virtual Request send(int peer, const void* data, size_t bytes, int tag) = 0;
  virtual Request recv(int peer, void* data, size_t bytes, int tag) = 0;

  // Checks, without blocking, for a message from any rank with any tag that
  // no posted recv has claimed; fills `env` and returns true if one waits.
  // Receive it with recv(env.source, ..., env.bytes, env.tag).
  virtual bool probe_any(Envelope* env) = 0;

  // Makes every pending and future wait on this rank's transport (and, where
  // the implementation can, its peers') fail with AbortedError(reason).
  virtual void abort(const std::string& reason) = 0;

  // True when peers share this process's address space (threads), so an
  // algorithm may read their buffers directly.
  virtual bool shared_address_space() const { return false; }
};

// A group of in-process transports for `size` threads: rank r's is at(r).
// Sends are zero-copy handshakes: a send completes when the receiver has
// copied the bytes out of the sender's buffer.
class InProcessTransportGroup {
 public:
  explicit InProcessTransportGroup(int size);
  ~InProcessTransportGroup();
  int size() const;
  Transport& at(int rank);

  struct State;

 private:
  std::shared_ptr<State> state_;  // shared with the requests, which may outlive the group
  std::vector<std::unique_ptr<Transport>> transports_;
};

}  // namespace diststrat
