// The PS service's event loop: receiving and sequencing requests, their
// queues, replies, liveness of the workers, abort and failure, and the
// dispatch to the handlers (service_shards.cc, service_coordination.cc,
// service_checkpoint.cc). What a request may say is checked on arrival
// (service_arrival.cc).
#include "parameter_server/service.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>
#include <random>
#include <thread>

#include <sys/mman.h>

#include "core/user_text.h"
#include "parameter_server/update_rule.h"

namespace diststrat {
namespace ps {

namespace {

// Sleeps a little longer each idle round, so an idle PS does not take a core
// from the workers it shares a host with, and a busy one answers at once.
class Backoff {
 public:
  void reset() { idle_ = 0; }
  // `busy`: a transfer is in flight, so stay responsive.
  void idle(bool busy) {
    ++idle_;
    if (idle_ < 16) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(busy || idle_ < 64 ? 20 : 200));
    }
  }

 private:
  int idle_ = 0;
};

// `n` zero bytes that take no memory: an anonymous read-only mapping, all of
// whose pages are the kernel's zero page. The padding of an error reply, so
// that a large reply the request expects costs the PS no memory.
class ZeroBytes {
 public:
  explicit ZeroBytes(size_t n) : n_(n) {
    p_ = ::mmap(nullptr, n, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p_ == MAP_FAILED) p_ = nullptr;
  }
  ~ZeroBytes() {
    if (p_) ::munmap(p_, n_);
  }
  ZeroBytes(const ZeroBytes&) = delete;
  ZeroBytes& operator=(const ZeroBytes&) = delete;
  const void* data() const { return p_; }

 private:
  void* p_ = nullptr;
  size_t n_;
};

}  // namespace

Service::Service(Transport& transport, ServiceOptions options, const Logger& logger)
    : t_(transport), options_(std::move(options)), logger_(logger) {
  // Distinct for every start of a PS (a restarted one rejects what was sent
  // to its predecessor): the time, and randomness for two starts at once.
  std::random_device rd;
  incarnation_ =
      static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) ^
      (static_cast<uint64_t>(rd()) << 32) ^ rd();
  if (incarnation_ == 0) incarnation_ = 1;
  const auto now = this->now();
  for (size_t i = 0; i < options_.worker_ranks.size(); ++i) {
    WorkerState w;
    w.rank = options_.worker_ranks[i];
    w.index = static_cast<int>(i);
    w.last_heard = now;
    worker_of_rank_[w.rank] = static_cast<int>(i);
    workers_.push_back(std::move(w));
  }
  last_tick_ = now;
}

Service::~Service() = default;

std::string Service::who() const { return "PS rank " + std::to_string(t_.rank()); }

std::string Service::from(const WorkerState& w, uint16_t op) const {
  return who() + ": " + (valid_op(op) ? op_name(static_cast<Op>(op)) : "request") +
         " from worker " + std::to_string(w.index);
}

void Service::tick() {
  const Clock::time_point t = now();
  const Clock::duration gap = t - last_tick_;
  last_tick_ = t;
  if (gap <= kMaxPollGap) return;
  // The loop did not run for a while (stopped, starved, a long save): that
  // time is nobody's silence and no request's wait. Shift every start of
  // silence and of waiting forward by what exceeds a normal poll gap.
  const Clock::duration excess = gap - kMaxPollGap;
  for (WorkerState& w : workers_) {
    w.last_heard += excess;
    for (Pending& p : w.queue) p.arrived += excess;
  }
  for (Outgoing& o : outgoing_) o.posted += excess;
}

void Service::run() {
  Backoff backoff;
  while (!stop_) {
    tick();
    bool progressed = receive_new();
    progressed |= process_queues();
    reap_outgoing();
    check_liveness();
    if (finished()) break;
    if (progressed) {
      backoff.reset();
    } else {
      backoff.idle(!outgoing_.empty() || waiting_for_payload());
    }
  }
  // Let the last replies reach their workers before the transport goes away.
  const auto deadline = Clock::now() + options_.timeout;
  while (!outgoing_.empty() && Clock::now() < deadline && !stop_) {
    reap_outgoing();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

bool Service::waiting_for_payload() const {
  for (const WorkerState& w : workers_) {
    if (!w.queue.empty() && !w.queue.front().payload_ready) return true;
  }
  return false;
}

bool Service::finished() const {
  for (const WorkerState& w : workers_) {
    if (!w.done && !w.gone) return false;
    if (!w.queue.empty()) return false;
  }
  return outgoing_.empty();
}

void Service::discard(const Envelope& env) {
  // Into a buffer of exactly the message's size, for a short while: a
  // shorter recv would be a truncation, and Open MPI writes a truncated
  // message (past the eager size) beyond the buffer.
  std::vector<char> sink(env.bytes);
  Request r = t_.recv(env.source, sink.data(), sink.size(), env.tag);
  try {
    r.wait(Clock::now() + options_.timeout);
  } catch (const Error&) {
  }
}

void Service::receive_payload(WorkerState& w, const Envelope& env) {
  // A payload message belongs to the worker's latest request (messages of
  // one sender are probed in the order they were sent): the back of its
  // queue, if that still waits for payload.
  Pending* p = !w.queue.empty() && !w.queue.back().payload_ready ? &w.queue.back() : nullptr;
  if (!p) {
    // The payload of a request rejected on arrival (or more than a request
    // declared): the worker's stream goes on after it.
    discard(env);
    logger_.warning(who(), ": dropped a payload message of ", env.bytes, " bytes from worker ",
                    w.index, " (rank ", w.rank, ") that no accepted request declared");
    return;
  }
  const size_t left = p->payload.size() - p->received;
  if (env.bytes == 0 || env.bytes > left) {
    discard(env);
    p->error = "its payload message of " + std::to_string(env.bytes) + " bytes does not fit the " +
               std::to_string(left) + " bytes still expected of the " +
               std::to_string(p->payload.size()) + " it declared";
    p->payload_ready = true;
    return;
  }
  // Exactly the message's size, checked against what the request declared,
  // so a worker that sends more than it claimed cannot make the transport
  // write past the buffer.
  Request r = t_.recv(env.source, p->payload.data() + p->received, env.bytes, env.tag);
  try {
    r.wait(Clock::now() + options_.timeout);
  } catch (const Error& e) {
    p->error = e.message();
    p->payload_ready = true;
    return;
  }
  p->received += env.bytes;
  p->payload_ready = p->received == p->payload.size();
}

bool Service::receive_new() {
  bool any = false;
  Envelope env;
  while (t_.probe_any(&env)) {
    any = true;
    auto it = worker_of_rank_.find(env.source);
    if (it == worker_of_rank_.end() || (env.tag != kRequestTag && env.tag != kRequestPayloadTag)) {
      discard(env);
      logger_.error(who(), ": dropped a message of ", env.bytes, " bytes with tag ", env.tag,
                    " from rank ", env.source, " (not a worker request)");
      continue;
    }
    WorkerState& w = workers_[it->second];
    w.last_heard = now();
    if (w.gone && !w.done) {
      std::lock_guard<std::mutex> lock(mu_);
      w.gone = false;
      logger_.warning(who(), ": worker ", w.index, " is back");
    }
    if (env.tag == kRequestPayloadTag) {
      receive_payload(w, env);
      continue;
    }
    if (!w.queue.empty() && !w.queue.back().payload_ready) {
      // A new request while the last one still waits for payload: the
      // worker sent less than it declared.
      Pending& last = w.queue.back();
      last.error = "only " + std::to_string(last.received) + " of the " +
                   std::to_string(last.payload.size()) +
                   " payload bytes it declared arrived before the worker's next request";
      last.payload_ready = true;
    }
    RequestHeader unknown;
    unknown.seq = -1;
    if (env.bytes > kMaxControlBytes) {
      discard(env);
      send_reply(w.rank, unknown, static_cast<int>(ErrorCode::kInvalidArgument), {},
                 who() + ": request from worker " + std::to_string(w.index) + " (rank " +
                     std::to_string(w.rank) + ") of " + std::to_string(env.bytes) +
                     " bytes (at most " + std::to_string(kMaxControlBytes) + ")");
      continue;
    }
    std::vector<char> control(env.bytes);
    Request r = t_.recv(env.source, control.data(), env.bytes, env.tag);
    r.wait(Clock::now() + options_.timeout);
    Pending p;
    p.arrived = Clock::now();
    if (control.size() >= sizeof(RequestHeader))
      std::memcpy(&p.header, control.data(), sizeof(RequestHeader));
    try {
      p.request = decode_request(control.data(), control.size());
      DISTSTRAT_CHECK(p.request.header.worker == w.index, kInvalidArgument,
                      "the header names worker ", p.request.header.worker);
      std::lock_guard<std::mutex> lock(mu_);
      check_sequence(w, p.request.header);
      check_on_arrival(w, p.request);
      if (p.request.op == Op::kBroadcast) w.broadcast_arrived = p.request.count;
    } catch (const Error& e) {
      // Nothing was allocated for it and nothing changes; its payload, if
      // the worker sends one, is dropped when it comes.
      RequestHeader h = control.size() >= sizeof(RequestHeader) ? p.header : unknown;
      // Pad the reply only for a reply size that could be real (the
      // worker's recv is posted for it); ZeroBytes costs no memory.
      if (h.magic != kMagic || h.reply_bytes < 0 || h.reply_bytes > kMaxMessageBytes)
        h.reply_bytes = 0;
      if (p.request.op == Op::kPush || h.op == static_cast<uint16_t>(Op::kPush)) {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.pushes_rejected;
      }
      const std::string what = control.size() >= sizeof(RequestHeader)
                                   ? from(w, p.header.op)
                                   : who() + ": request from worker " + std::to_string(w.index) +
                                         " (rank " + std::to_string(w.rank) + ")";
      logger_.warning(what, " rejected: ", e.message());
      send_reply(w.rank, h, static_cast<int>(e.code()), {}, what + ": " + e.message());
      continue;
    }
    p.header = p.request.header;
    if (p.header.payload_bytes > 0) {
      try {
        p.payload.resize(static_cast<size_t>(p.header.payload_bytes));
      } catch (const std::bad_alloc&) {
        send_reply(w.rank, p.header, static_cast<int>(ErrorCode::kResourceExhausted), {},
                   from(w, p.header.op) + ": no memory for its payload of " +
                       std::to_string(p.header.payload_bytes) + " bytes");
        continue;
      }
      // Its parts are received as they are probed (receive_payload).
    } else {
      p.payload_ready = true;
    }
    w.queue.push_back(std::move(p));
  }
  return any;
}

void Service::check_sequence(WorkerState& w, const RequestHeader& h) {
  if (h.ps_incarnation != 0 && h.ps_incarnation != incarnation_) {
    throw FailedPreconditionError(
        "sequence " + std::to_string(h.seq) + " was addressed to PS incarnation " +
        std::to_string(h.ps_incarnation) + ", this PS is incarnation " +
        std::to_string(incarnation_) + " (it restarted): stale, not applied");
  }
  DISTSTRAT_CHECK(h.op != static_cast<uint16_t>(Op::kPush) || h.ps_incarnation == incarnation_,
                  kFailedPrecondition, "a push that does not carry this PS's incarnation (",
                  incarnation_, ", the push carries ", h.ps_incarnation, "): not applied");
  if (h.incarnation < w.incarnation) {
    throw FailedPreconditionError("sequence " + std::to_string(h.seq) + " of worker incarnation " +
                                  std::to_string(h.incarnation) + ", an earlier one than " +
                                  std::to_string(w.incarnation) +
                                  " (the worker restarted): stale, not applied");
  }
  if (h.incarnation > w.incarnation) {
    if (w.incarnation != 0) {
      logger_.warning(who(), ": worker ", w.index, " restarted (incarnation ", w.incarnation,
                      " -> ", h.incarnation, ")");
    }
    w.incarnation = h.incarnation;
    w.last_seq = 0;
  }
  DISTSTRAT_CHECK(
      h.seq > w.last_seq, kInvalidArgument, "sequence number ", h.seq, " was ",
      h.seq == w.last_seq ? "already taken (a replay)" : "taken or skipped already (stale)",
      "; the last one taken from this worker is ", w.last_seq, ": not applied");
  w.last_seq = h.seq;
}

int64_t Service::broadcast_bytes_held() const {
  int64_t held = 0;
  for (const auto& [count, bytes] : broadcasts_) held += static_cast<int64_t>(bytes.size());
  for (const WorkerState& o : workers_) {
    for (const Pending& p : o.queue) {
      if (p.request.op == Op::kBroadcast && p.request.root) held += p.request.bytes;
    }
  }
  return held;
}

void Service::set_checkpoint_dir(const std::string& dir) {
  std::lock_guard<std::mutex> lock(mu_);
  options_.checkpoint_dir = dir;
}

bool Service::process_queues() {
  bool any = false;
  const size_t n = workers_.size();
  for (size_t k = 0; k < n; ++k) {
    WorkerState& w = workers_[(next_worker_ + k) % n];
    while (!w.queue.empty()) {
      Pending& p = w.queue.front();
      const Op op = p.request.op;
      const std::string what = from(w, p.header.op);
      if (!p.error.empty()) {
        logger_.warning(what, " rejected: ", p.error);
        if (op == Op::kPush) {
          std::lock_guard<std::mutex> lock(mu_);
          ++stats_.pushes_rejected;
        }
        send_reply(w.rank, p.header, static_cast<int>(ErrorCode::kInvalidArgument), {},
                   what + ": " + p.error);
        w.queue.pop_front();
        any = true;
        continue;
      }
      if (!p.payload_ready) {
        // Every part of the payload has this deadline (in the loop's
        // running time, see tick()): a worker that stalled between its
        // two messages, or whose payload is shorter than it claimed (the
        // later parts of a multi-part receive never come), fails this
        // request instead of holding its queue forever.
        tick();  // (a stop of this process just before is no wait of the request)
        if (Clock::now() - p.arrived <= options_.timeout) break;
        logger_.error(what, ": its payload of ", p.header.payload_bytes,
                      " bytes did not arrive from rank ", w.rank, " within ",
                      options_.timeout.count(), " ms");
        send_reply(w.rank, p.header, static_cast<int>(ErrorCode::kDeadlineExceeded), {},
                   what + ": its payload of " + std::to_string(p.header.payload_bytes) +
                       " bytes did not arrive from rank " + std::to_string(w.rank) + " within " +
                       std::to_string(options_.timeout.count()) + " ms");
        // Its parts that still come are dropped (receive_payload).
        w.queue.pop_front();
        any = true;
        continue;
      }
      Reply reply;
      Outcome outcome;
      try {
        std::lock_guard<std::mutex> lock(mu_);
        outcome = handle(w, p, reply);
      } catch (const Error& e) {
        if (op == Op::kPush) {
          std::lock_guard<std::mutex> lock(mu_);
          ++stats_.pushes_rejected;
        }
        logger_.warning(what, " rejected: ", e.message());
        send_reply(w.rank, p.header, static_cast<int>(e.code()), {}, what + ": " + e.message());
        w.queue.pop_front();
        any = true;
        continue;
      } catch (const std::exception& e) {
        send_reply(w.rank, p.header, static_cast<int>(ErrorCode::kInternal), {},
                   what + ": " + e.what());
        w.queue.pop_front();
        any = true;
        continue;
      }
      if (outcome == Outcome::kDeferred) break;
      send_reply(w.rank, p.header, -1, std::move(reply.payload), "");
      // Silence counts from our answer: a worker held by a deferred request
      // (a staleness wait) was waiting on us, not silent.
      w.last_heard = now();
      w.queue.pop_front();
      any = true;
    }
  }
  next_worker_ = (next_worker_ + 1) % std::max<size_t>(n, 1);
  return any;
}

void Service::send_reply(int rank, const RequestHeader& request, int status,
                         std::vector<char> payload, std::string error) {
  // Callers pass a reply_bytes that was checked (or 0 when it cannot be).
  const size_t expected = static_cast<size_t>(
      std::min<int64_t>(kMaxMessageBytes, std::max<int64_t>(0, request.reply_bytes)));
  if (status == -1 && payload.size() != expected) {
    status = static_cast<int>(ErrorCode::kInternal);
    error = who() + ": a reply of " + std::to_string(payload.size()) +
            " bytes where the request expects " + std::to_string(expected);
  }
  if (status != -1 && error.empty())
    error = who() + ": " + error_code_name(static_cast<ErrorCode>(status));
  if (error.size() > static_cast<size_t>(kMaxStringBytes))
    error.resize(static_cast<size_t>(kMaxStringBytes));
  std::shared_ptr<const void> pad;
  size_t pad_bytes = 0;
  if (status != -1) {
    // The request's reply payload is padded with zeros: small ones from
    // memory, large ones from a mapping that costs none.
    if (expected <= (size_t{1} << 16)) {
      payload.assign(expected, 0);
    } else {
      payload.clear();
      auto zeros = std::make_shared<ZeroBytes>(expected);
      if (zeros->data()) {
        pad = zeros;
        pad_bytes = expected;
      }
    }
  }
  Outgoing o;
  o.rank = rank;
  o.posted = Clock::now();
  o.header = std::make_shared<ReplyHeader>();
  o.header->seq = request.seq;
  o.header->status = status;
  o.header->incarnation = incarnation_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    o.header->version = stats_.version;
  }
  o.header->payload_bytes = static_cast<int64_t>(pad ? pad_bytes : payload.size());
  o.header->error_bytes = static_cast<int64_t>(error.size());
  o.requests.push_back(t_.send(rank, o.header.get(), sizeof(ReplyHeader), kReplyTag));
  if (!error.empty()) {
    o.error = std::make_shared<std::string>(error);
    o.requests.push_back(t_.send(rank, o.error->data(), o.error->size(), kReplyErrorTag));
  }
  if (pad) {
    o.payload = pad;
    o.requests.push_back(t_.send(rank, static_cast<const ZeroBytes*>(pad.get())->data(), pad_bytes,
                                 kReplyPayloadTag));
  } else if (!payload.empty()) {
    auto bytes = std::make_shared<std::vector<char>>(std::move(payload));
    o.payload = bytes;
    o.requests.push_back(t_.send(rank, bytes->data(), bytes->size(), kReplyPayloadTag));
  }
  outgoing_.push_back(std::move(o));
}

void Service::reap_outgoing() {
  for (auto it = outgoing_.begin(); it != outgoing_.end();) {
    bool done = true;
    try {
      for (Request& r : it->requests) done = done && r.test();
    } catch (const Error& e) {
      logger_.error(who(), ": a reply failed: ", e.message());
    }
    if (!done) {
      tick();
      if (Clock::now() - it->posted > options_.timeout) {
        // The worker never takes it (gone, or it never posted the recv):
        // a send has a deadline too, or the loop could never finish.
        auto w = worker_of_rank_.find(it->rank);
        logger_.error(who(), ": a reply to worker ", w == worker_of_rank_.end() ? -1 : w->second,
                      " (rank ", it->rank, ") was not taken within ", options_.timeout.count(),
                      " ms; given up");
        it->requests.clear();  // cancels them
        abandoned_.push_back(std::move(*it));
        done = true;
      }
    }
    it = done ? outgoing_.erase(it) : std::next(it);
  }
}

void Service::check_liveness() {
  // The time of this tick, not a fresh reading: a stop between the two
  // would be counted as silence.
  tick();
  const auto now = last_tick_;
  for (WorkerState& w : workers_) {
    if (w.done || w.gone || !w.queue.empty()) continue;  // a queued request means it waits on us
    if (now - w.last_heard > options_.worker_timeout) {
      std::lock_guard<std::mutex> lock(mu_);
      w.gone = true;
      logger_.error(who(), ": worker ", w.index, " (rank ", w.rank, ") sent nothing for ",
                    options_.worker_timeout.count(), " ms; it no longer holds back the others");
    }
  }
}

int Service::slowest_other(int except) const {
  int slowest = -1;
  for (const WorkerState& w : workers_) {
    if (w.index == except || w.done || w.gone) continue;
    if (slowest < 0 || w.steps < workers_[slowest].steps) slowest = w.index;
  }
  return slowest;
}

void Service::handle_abort(WorkerState& w, const Pending& p) {
  w.done = true;
  const std::string worker =
      "worker " + std::to_string(w.index) + " (rank " + std::to_string(w.rank) + ")";
  if (!failure_.empty()) {
    logger_.warning(who(), ": ", worker, " left after the failure: ", echo(p.request.reason, 2000));
    return;
  }
  failure_ = worker + " failed: " + echo(p.request.reason, 2000);
  logger_.error(who(), ": ", failure_, "; the other workers' requests fail from now on");
}

void Service::fail(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_.empty()) return;
  failure_ = who() + " failed: " + reason;
  logger_.error(failure_, "; every worker's request fails from now on");
}

std::string Service::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

Service::Outcome Service::handle(WorkerState& w, Pending& p, Reply& reply) {
  // p.request was decoded and checked on arrival (receive_new); the
  // handlers check again what the shards or the payload decide.
  if (!failure_.empty() && p.request.op != Op::kDone && p.request.op != Op::kAbort) {
    // A worker failed: the job is ending, so every other worker's request
    // (a deferred one too, retried here) fails at once, naming it.
    throw AbortedError("the job is ending: " + failure_);
  }
  switch (p.request.op) {
    case Op::kCreate:
      return handle_create(w, p);
    case Op::kPull:
      return handle_pull(w, p, reply);
    case Op::kPush:
      if (lockstep_holds(w, p)) return Outcome::kDeferred;
      handle_push(w, p);
      return Outcome::kServed;
    case Op::kAssign:
      handle_assign(w, p);
      return Outcome::kServed;
    case Op::kBarrier:
      return handle_barrier(w, p);
    case Op::kStats:
      handle_stats(reply);
      return Outcome::kServed;
    case Op::kDone:
      w.done = true;
      return Outcome::kServed;
    case Op::kAbort:
      handle_abort(w, p);
      return Outcome::kServed;
    case Op::kAlive:
      return Outcome::kServed;  // its arrival was what counted (receive_new)
    case Op::kBroadcast:
      return handle_broadcast(w, p, reply);
    case Op::kStopCheck:
      handle_stop_check(w, p, reply);
      return Outcome::kServed;
    case Op::kSave:
      handle_save(p, reply);
      return Outcome::kServed;
    case Op::kReadSlots:
      handle_read_slots(p, reply);
      return Outcome::kServed;
    case Op::kRestore:
      handle_restore(p);
      return Outcome::kServed;
    case Op::kMetric:
      handle_metric(p, reply);
      return Outcome::kServed;
    case Op::kRule:
      return handle_rule(w, p);
  }
  throw InvalidArgumentError("unknown op " + std::to_string(p.header.op));
}

// max_staleness 0 is lockstep: every step's gradients are computed on the
// same weights. The pull rule (handle_pull) makes a worker's step c start
// after every live worker's step c - 1 push is applied; this holds a step-c
// push until every other live worker's step-c push has reached the head of
// its queue too, so no step-c update is applied while another worker still
// pulls or reads the weights of step c (its reads precede its push).
bool Service::lockstep_holds(WorkerState& w, const Pending& p) {
  if (options_.max_staleness != 0) return false;
  const int64_t step = p.request.steps_after - 1;  // the push carries the steps after it
  w.push_reached = std::max(w.push_reached, step);
  for (const WorkerState& o : workers_) {
    if (&o == &w || o.done || o.gone || o.push_reached >= step) continue;
    if (Clock::now() - p.arrived > options_.timeout) {
      throw DeadlineExceededError(
          "lockstep push of step " + std::to_string(step) + " from worker " +
          std::to_string(w.index) + " waited past the deadline for worker " +
          std::to_string(o.index) + " (at step " + std::to_string(o.steps) + ", max_staleness 0)");
    }
    return true;
  }
  return false;
}

}  // namespace ps
}  // namespace diststrat
