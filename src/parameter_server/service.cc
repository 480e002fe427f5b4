// The PS service's event loop: the loop itself, the workers' queues and the
// order they are served in, liveness of the workers, abort and failure, and
// the dispatch to the handlers (service_shards.cc, service_coordination.cc,
// service_checkpoint.cc). Requests come in and replies go out in
// service_messages.cc; what a request may say is checked on arrival
// (service_arrival.cc).
#include "parameter_server/service.h"

#include <algorithm>
#include <thread>

#include "core/random_id.h"
#include "core/user_text.h"

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

}  // namespace

Service::Service(Transport& transport, ServiceOptions options, const Logger& logger)
    : t_(transport), options_(std::move(options)), logger_(logger) {
  // Distinct for every start of a PS (a restarted one rejects what was sent
  // to its predecessor): the time, and randomness for two starts at once.
  incarnation_ = random_id();
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
    logger_.warning(who(), ": ", worker,
                    " left after the failure: ", echo(p.request.abort.reason, 2000));
    return;
  }
  failure_ = worker + " failed: " + echo(p.request.abort.reason, 2000);
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
  const int64_t step = p.request.push.steps_after - 1;  // the push carries the steps after it
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
