#include "parameter_server/service.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <new>
#include <random>
#include <thread>

#include <sys/mman.h>

#include "core/user_text.h"
#include "io/checkpoint_identity.h"
#include "io/checkpoint_internal.h"
#include "parameter_server/update_rule.h"

namespace diststrat {
namespace ps {

namespace {

bool valid_dtype(int32_t d) { return d >= 0 && d <= static_cast<int32_t>(DType::kInt64); }

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

int64_t row_elems(const Shape& s) {
  int64_t n = 1;
  for (size_t i = 1; i < s.rank(); ++i) n *= s[i];
  return n;
}

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

// What the PS knows of a shard when it checks a request on arrival: a
// created shard, or one the worker's own queued create declares.
struct ShardInfo {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;  // of the shard
  int64_t full_rows = 0;
};

int64_t shard_bytes(const ShardInfo& s, const std::string& what) {
  return checked_bytes(s.shape, dtype_size(s.dtype), what);
}

int64_t row_bytes_of(const ShardInfo& s, const std::string& what) {
  std::vector<int64_t> d = s.shape.dims();
  if (!d.empty()) d[0] = 1;
  return checked_bytes(Shape(d), dtype_size(s.dtype), what);
}

// The checks of one entry against its shard, shared by the arrival check
// and the handlers (so that both say the same).
void check_push_entry(const Entry& e, const ShardInfo& s) {
  DISTSTRAT_CHECK(e.dtype == static_cast<int32_t>(DType::kFloat32) && s.dtype == DType::kFloat32,
                  kInvalidArgument, "push to '", e.name, "': gradient dtype ",
                  valid_dtype(e.dtype) ? dtype_name(static_cast<DType>(e.dtype)) : "invalid",
                  ", variable dtype ", dtype_name(s.dtype), "; optimizers update float32");
  if (e.sparse) {
    std::vector<int64_t> want = s.shape.dims();
    DISTSTRAT_CHECK(!want.empty(), kInvalidArgument, "row push to scalar '", e.name, "'");
    want[0] = e.num_ids;
    DISTSTRAT_CHECK(e.num_ids >= 0 && e.shape == Shape(want), kInvalidArgument, "push to '", e.name,
                    "' shard ", e.shard_index, ": row gradient ", e.shape.to_string(), " for ",
                    e.num_ids, " ids does not match the rows ", Shape(want).to_string());
  } else {
    DISTSTRAT_CHECK(e.shape == s.shape, kInvalidArgument, "push to '", e.name, "' shard ",
                    e.shard_index, ": gradient shape ", e.shape.to_string(),
                    " does not match the shard's ", s.shape.to_string());
  }
}

void check_value_entry(const char* op, const Entry& e, const ShardInfo& s) {
  DISTSTRAT_CHECK(!e.sparse && e.dtype == static_cast<int32_t>(s.dtype) && e.shape == s.shape,
                  kInvalidArgument, op, " '", e.name, "' shard ", e.shard_index, ": value ",
                  valid_dtype(e.dtype) ? dtype_name(static_cast<DType>(e.dtype)) : "invalid",
                  e.shape.to_string(), " does not match ", dtype_name(s.dtype),
                  s.shape.to_string());
}

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

void Service::check_on_arrival(const WorkerState& w, const DecodedRequest& q) const {
  // The shard an entry names: a created one, or one this worker's queued
  // create declares (its requests are served after that create).
  auto info = [&](const Entry& e, const std::string& what) {
    ShardInfo s;
    auto it = shards_.find({e.var_id, e.shard_index});
    if (it != shards_.end()) {
      s.name = it->second.name;
      s.dtype = it->second.dtype;
      s.shape = it->second.value.shape();
      s.full_rows = it->second.full_shape.rank() ? it->second.full_shape[0] : 0;
    } else {
      const CreateSpec* spec = nullptr;
      for (const Pending& p : w.queue) {
        if (p.request.op == Op::kCreate && p.request.create.var_id == e.var_id &&
            p.request.create.shard_index == e.shard_index) {
          spec = &p.request.create;
        }
      }
      if (!spec) {
        throw NotFoundError(what + ": unknown variable '" + e.name + "' (id " +
                            std::to_string(e.var_id) + ", shard " + std::to_string(e.shard_index) +
                            ") on this PS");
      }
      s.name = spec->name;
      s.dtype = static_cast<DType>(spec->dtype);
      s.shape = spec->shard_shape;
      s.full_rows = spec->full_shape.rank() ? spec->full_shape[0] : 0;
    }
    DISTSTRAT_CHECK(s.name == e.name, kInvalidArgument, what, ": variable id ", e.var_id, " is '",
                    s.name, "' here, not '", e.name, "'");
    return s;
  };
  const std::string what = op_name(q.op);
  int64_t reply = -1;  // the reply size the shards fix (-1: the decoder checked it)
  switch (q.op) {
    case Op::kPull:
      reply = 0;
      for (const Entry& e : q.entries) {
        const ShardInfo s = info(e, "pull");
        if (e.sparse) {
          DISTSTRAT_CHECK(s.shape.rank() >= 1, kInvalidArgument, "row pull of scalar '", e.name,
                          "'");
          reply = checked_add(
              reply, checked_mul(e.num_ids, row_bytes_of(s, "pull"), "pull of '" + e.name + "'"),
              "pull");
        } else {
          reply = checked_add(reply, shard_bytes(s, "pull"), "pull");
        }
      }
      break;
    case Op::kPush:
      for (const Entry& e : q.entries) check_push_entry(e, info(e, "push"));
      break;
    case Op::kAssign:
      for (const Entry& e : q.entries) check_value_entry("assign to", e, info(e, "assign"));
      break;
    case Op::kReadSlots:
      reply = 0;
      for (const Entry& e : q.entries) {
        const ShardInfo s = info(e, "slot read");
        DISTSTRAT_CHECK(s.dtype == DType::kFloat32, kInvalidArgument, "slot read of '", e.name,
                        "': the variable is ", dtype_name(s.dtype),
                        ", only float32 variables have slots");
        reply = checked_add(reply, checked_bytes(s.shape, sizeof(float), "slot read"), "slot read");
      }
      break;
    case Op::kRestore:
      for (size_t i = 0; i < q.entries.size(); ++i) {
        const Entry& e = q.entries[i];
        const ShardInfo s = info(e, "restore");
        check_value_entry("restore of", e, s);
        DISTSTRAT_CHECK(q.restore[i].slots.empty() || s.dtype == DType::kFloat32, kInvalidArgument,
                        "restore of '", e.name, "': slots for a ", dtype_name(s.dtype),
                        " variable");
      }
      break;
    case Op::kStats:
      reply = static_cast<int64_t>((7 + workers_.size()) * sizeof(int64_t));
      break;
    case Op::kCreate:
      // Only the chief defines a variable's value (and so its memory here).
      DISTSTRAT_CHECK(!q.create.has_value || w.index == 0, kInvalidArgument, "create of '",
                      q.create.name, "' with an initial value from worker ", w.index,
                      ": only the chief (worker 0) sends one");
      break;
    case Op::kRule:
      DISTSTRAT_CHECK(
          !q.replace || w.index == 0, kFailedPrecondition, "worker ", w.index,
          " changes an update rule: only the chief (worker 0) may (update_hyperparameters)");
      for (const Entry& e : q.entries) {
        const ShardInfo s = info(e, "update rule");
        DISTSTRAT_CHECK(s.dtype == DType::kFloat32, kInvalidArgument, "update rule of '", e.name,
                        "': the variable is ", dtype_name(s.dtype), "; optimizers update float32");
      }
      break;
    case Op::kBroadcast: {
      const std::string b = "broadcast " + std::to_string(q.count);
      DISTSTRAT_CHECK(q.count == w.broadcast_arrived + 1, kInvalidArgument, b, " from worker ",
                      w.index, ": its last broadcast was ", w.broadcast_arrived,
                      " (they count up by one)");
      if (q.root) {
        DISTSTRAT_CHECK(q.bytes <= options_.max_broadcast_bytes - broadcast_bytes_held(),
                        kResourceExhausted, b, ": the root (worker ", w.index, ") sends ", q.bytes,
                        " bytes; this PS holds at most ", options_.max_broadcast_bytes,
                        " broadcast bytes (max_broadcast_bytes), ", broadcast_bytes_held(),
                        " are held");
      } else {
        DISTSTRAT_CHECK(q.bytes <= options_.max_broadcast_bytes, kResourceExhausted, b, ": worker ",
                        w.index, " expects ", q.bytes,
                        " bytes, more than a broadcast may carry (max_broadcast_bytes ",
                        options_.max_broadcast_bytes, ")");
        auto it = broadcasts_.find(q.count);
        DISTSTRAT_CHECK(
            it == broadcasts_.end() || static_cast<int64_t>(it->second.size()) == q.bytes,
            kInvalidArgument, b, ": worker ", w.index, " expects ", q.bytes,
            " bytes, the root sent ", it == broadcasts_.end() ? 0 : it->second.size());
      }
      // Against the other side's requests of this broadcast that are queued.
      for (const WorkerState& o : workers_) {
        for (const Pending& p : o.queue) {
          if (&o == &w || p.request.op != Op::kBroadcast || p.request.count != q.count) continue;
          DISTSTRAT_CHECK(p.request.root != q.root || !q.root, kInvalidArgument, b, ": worker ",
                          w.index, " and worker ", o.index, " both send as its root");
          DISTSTRAT_CHECK(p.request.root == q.root || p.request.bytes == q.bytes, kInvalidArgument,
                          b, ": worker ", w.index, q.root ? " (the root) sends " : " expects ",
                          q.bytes, " bytes, worker ", o.index,
                          p.request.root ? " (the root) sends " : " expects ", p.request.bytes);
        }
      }
      break;
    }
    default:
      break;
  }
  DISTSTRAT_CHECK(reply < 0 || q.header.reply_bytes == reply, kInvalidArgument, what,
                  ": the header expects a reply of ", q.header.reply_bytes,
                  " bytes, the request's is ", reply);
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

Service::Shard& Service::find_shard(const Entry& e, const std::string& what) {
  auto it = shards_.find({e.var_id, e.shard_index});
  if (it == shards_.end()) {
    throw NotFoundError(what + ": unknown variable '" + e.name + "' (id " +
                        std::to_string(e.var_id) + ", shard " + std::to_string(e.shard_index) +
                        ") on this PS");
  }
  DISTSTRAT_CHECK(it->second.name == e.name, kInvalidArgument, what, ": variable id ", e.var_id,
                  " is '", it->second.name, "' here, not '", e.name, "'");
  return it->second;
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

Service::Outcome Service::handle_create(WorkerState& w, Pending& p) {
  const CreateSpec& c = p.request.create;  // dtype, shard and rows checked by decode_request
  Shard spec;
  const int64_t var_id = c.var_id;
  spec.name = c.name;
  const std::string name = spec.name;
  spec.dtype = static_cast<DType>(c.dtype);
  spec.full_shape = c.full_shape;
  const int64_t shard_index = c.shard_index;
  spec.num_shards = c.num_shards;
  spec.row_offset = c.row_offset;
  spec.rows = c.rows;
  const bool has_value = c.has_value;
  const Shape shard_shape = c.shard_shape;
  const size_t bytes = static_cast<size_t>(shard_shape.num_elements()) * dtype_size(spec.dtype);
  DISTSTRAT_CHECK(!has_value || p.payload.size() == bytes, kInvalidArgument, "variable '",
                  spec.name, "' shard ", shard_index, ": initial value has ", p.payload.size(),
                  " bytes, expected ", bytes);

  auto it = shards_.find({var_id, shard_index});
  if (it == shards_.end()) {
    spec.value = Tensor(shard_shape, spec.dtype);
    auto restored = restored_.find({spec.name, shard_index});
    if (restored != restored_.end()) {
      ShardSnapshot& s = restored->second;
      DISTSTRAT_CHECK(s.value.shape() == shard_shape && s.value.dtype() == spec.dtype &&
                          s.row_offset == spec.row_offset,
                      kInvalidArgument, "variable '", spec.name, "' shard ", shard_index,
                      ": the restored shard ", s.value.debug_string(), " at row ", s.row_offset,
                      " does not match ", dtype_name(spec.dtype), shard_shape.to_string(),
                      " at row ", spec.row_offset);
      spec.value.copy_from(s.value);
      spec.slots = s.slots;
      spec.step = s.step;
      spec.initialized = true;
      restored_.erase(restored);
    }
    it = shards_.emplace(std::make_pair(var_id, shard_index), std::move(spec)).first;
  } else {
    const Shard& have = it->second;
    DISTSTRAT_CHECK(have.name == spec.name && have.dtype == spec.dtype &&
                        have.full_shape == spec.full_shape && have.num_shards == spec.num_shards &&
                        have.row_offset == spec.row_offset && have.rows == spec.rows,
                    kInvalidArgument, "variable id ", var_id, " shard ", shard_index, " is '",
                    have.name, "' ", dtype_name(have.dtype), have.full_shape.to_string(), " (rows ",
                    have.row_offset, "+", have.rows, " of ", have.num_shards,
                    " shards) here, but worker ", w.index, " declares '", spec.name, "' ",
                    dtype_name(spec.dtype), spec.full_shape.to_string(), " (rows ", spec.row_offset,
                    "+", spec.rows, " of ", spec.num_shards,
                    " shards): workers must create the same variables in the same order");
  }
  Shard& shard = it->second;
  if (has_value && !shard.initialized) {
    if (bytes) std::memcpy(shard.value.data(), p.payload.data(), bytes);
    shard.initialized = true;
  }
  if (!shard.initialized) {
    if (Clock::now() - p.arrived > options_.timeout) {
      throw DeadlineExceededError("variable '" + name +
                                  "': the chief (worker 0) never sent its "
                                  "initial value");
    }
    return Outcome::kDeferred;
  }
  return Outcome::kServed;
}

Service::Outcome Service::handle_pull(WorkerState& w, Pending& p, Reply& reply) {
  const int64_t clock = p.request.clock;
  if (clock >= 0 && options_.max_staleness >= 0) {
    const int slowest = slowest_other(w.index);
    if (slowest >= 0 && clock - workers_[slowest].steps > options_.max_staleness) {
      if (Clock::now() - p.arrived > options_.timeout) {
        throw DeadlineExceededError(
            "worker " + std::to_string(w.index) + " at step " + std::to_string(clock) +
            " waited past the deadline for worker " + std::to_string(slowest) + " (at step " +
            std::to_string(workers_[slowest].steps) + ", max_staleness " +
            std::to_string(options_.max_staleness) + ")");
      }
      return Outcome::kDeferred;
    }
  }
  const std::vector<Entry>& entries = p.request.entries;
  std::vector<Shard*> shards;
  int64_t ids_bytes = 0,
          out_bytes = 0;  // overflow-checked (the decoder and the arrival check agree)
  for (const Entry& e : entries) {
    Shard& s = find_shard(e, "pull");
    shards.push_back(&s);
    const int64_t row_bytes = checked_mul(row_elems(s.value.shape()), dtype_size(s.dtype), "pull");
    if (e.sparse) {
      DISTSTRAT_CHECK(s.value.shape().rank() >= 1, kInvalidArgument, "row pull of scalar '", e.name,
                      "'");
      ids_bytes =
          checked_add(ids_bytes, checked_mul(e.num_ids, int64_t{sizeof(int64_t)}, "pull"), "pull");
      out_bytes = checked_add(out_bytes, checked_mul(e.num_ids, row_bytes, "pull"), "pull");
    } else {
      out_bytes = checked_add(out_bytes, static_cast<int64_t>(s.value.nbytes()), "pull");
    }
  }
  DISTSTRAT_CHECK(static_cast<int64_t>(p.payload.size()) == ids_bytes, kInvalidArgument,
                  "pull: payload has ", p.payload.size(), " bytes of row ids, the entries declare ",
                  ids_bytes);
  DISTSTRAT_CHECK(out_bytes == p.header.reply_bytes, kInvalidArgument, "pull: the reply is ",
                  out_bytes, " bytes, the request expects ", p.header.reply_bytes);
  // Validate every id before producing anything.
  const int64_t* ids = reinterpret_cast<const int64_t*>(p.payload.data());
  for (size_t i = 0, k = 0; i < entries.size(); ++i) {
    if (!entries[i].sparse) continue;
    const Shard& s = *shards[i];
    for (int64_t j = 0; j < entries[i].num_ids; ++j, ++k) {
      DISTSTRAT_CHECK(ids[k] >= s.row_offset && ids[k] < s.row_offset + s.rows, kInvalidArgument,
                      "pull of '", s.name, "': row id ", ids[k], " is out of range [", s.row_offset,
                      ", ", s.row_offset + s.rows, ") of shard ", entries[i].shard_index,
                      " (the variable has ", s.full_shape[0], " rows)");
    }
  }
  reply.payload.resize(static_cast<size_t>(out_bytes));
  char* out = reply.payload.data();
  for (size_t i = 0, k = 0; i < entries.size(); ++i) {
    const Shard& s = *shards[i];
    const char* src = static_cast<const char*>(s.value.data());
    if (!entries[i].sparse) {
      if (s.value.nbytes()) std::memcpy(out, src, s.value.nbytes());
      out += s.value.nbytes();
      continue;
    }
    const size_t row_bytes = static_cast<size_t>(row_elems(s.value.shape())) * dtype_size(s.dtype);
    for (int64_t j = 0; j < entries[i].num_ids; ++j, ++k) {
      std::memcpy(out, src + static_cast<size_t>(ids[k] - s.row_offset) * row_bytes, row_bytes);
      out += row_bytes;
    }
  }
  return Outcome::kServed;
}

void Service::handle_push(WorkerState& w, Pending& p) {
  const DecodedRequest& q = p.request;  // sizes checked on arrival, without overflow
  const int64_t steps_after = q.steps_after;
  const int64_t pulled_version = q.pulled_version;
  const int64_t iter_var = q.iter_var;
  const std::string& iter_name = q.iter_name;

  // Validate the whole push before changing anything.
  struct Item {
    const Entry* e;
    Shard* s;
    const int64_t* ids;
    const float* values;
    // The row ids, copied out of the payload: they follow float data there, so
    // they are only 4-byte aligned (reading them in place is undefined
    // behaviour; found by UBSan).
    std::shared_ptr<std::vector<int64_t>> id_storage;
  };
  std::vector<Item> items;
  size_t offset = 0;
  for (const Entry& e : q.entries) {
    Shard& s = find_shard(e, "push");
    DISTSTRAT_CHECK(e.dtype == static_cast<int32_t>(DType::kFloat32) && s.dtype == DType::kFloat32,
                    kInvalidArgument, "push to '", e.name, "': gradient dtype ",
                    valid_dtype(e.dtype) ? dtype_name(static_cast<DType>(e.dtype)) : "invalid",
                    ", variable dtype ", dtype_name(s.dtype), "; optimizers update float32");
    Item it{&e, &s, nullptr, nullptr, nullptr};
    if (e.sparse) {
      std::vector<int64_t> want = s.value.shape().dims();
      DISTSTRAT_CHECK(!want.empty(), kInvalidArgument, "row push to scalar '", e.name, "'");
      want[0] = e.num_ids;
      DISTSTRAT_CHECK(e.num_ids >= 0 && e.shape == Shape(want), kInvalidArgument, "push to '",
                      e.name, "' shard ", e.shard_index, ": row gradient ", e.shape.to_string(),
                      " for ", e.num_ids, " ids does not match the rows ", Shape(want).to_string());
      const size_t id_bytes = static_cast<size_t>(e.num_ids) * sizeof(int64_t);
      DISTSTRAT_CHECK(offset + id_bytes <= p.payload.size(), kInvalidArgument, "push to '", e.name,
                      "': payload too short for its row ids");
      it.id_storage = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(e.num_ids));
      if (id_bytes) std::memcpy(it.id_storage->data(), p.payload.data() + offset, id_bytes);
      it.ids = it.id_storage->data();
      offset += id_bytes;
      for (int64_t j = 0; j < e.num_ids; ++j) {
        DISTSTRAT_CHECK(it.ids[j] >= s.row_offset && it.ids[j] < s.row_offset + s.rows,
                        kInvalidArgument, "push to '", e.name, "': row id ", it.ids[j],
                        " is out of range [", s.row_offset, ", ", s.row_offset + s.rows,
                        ") of shard ", e.shard_index, " (the variable has ", s.full_shape[0],
                        " rows)");
      }
    } else {
      DISTSTRAT_CHECK(e.shape == s.value.shape(), kInvalidArgument, "push to '", e.name, "' shard ",
                      e.shard_index, ": gradient shape ", e.shape.to_string(),
                      " does not match the shard's ", s.value.shape().to_string());
    }
    const size_t value_bytes = static_cast<size_t>(e.shape.num_elements()) * sizeof(float);
    DISTSTRAT_CHECK(offset + value_bytes <= p.payload.size(), kInvalidArgument, "push to '", e.name,
                    "': payload too short for its gradient");
    it.values = reinterpret_cast<const float*>(p.payload.data() + offset);
    offset += value_bytes;
    items.push_back(it);
  }
  DISTSTRAT_CHECK(offset == p.payload.size(), kInvalidArgument, "push: payload has ",
                  p.payload.size(), " bytes, the entries declare ", offset);
  for (const Item& it : items) {
    // The rule is the shard's own (kRule), never the push's.
    DISTSTRAT_CHECK(it.s->rule != nullptr, kFailedPrecondition, "push to '", it.e->name, "' shard ",
                    it.e->shard_index,
                    ": no update rule was declared for it (the chief declares it before its "
                    "first push)");
    // A non-finite gradient never reaches a variable.
    const int64_t n = it.e->shape.num_elements();
    for (int64_t k = 0; k < n; ++k) {
      if (std::isfinite(it.values[k])) continue;
      if (options_.skip_nonfinite_gradients) {
        ++stats_.pushes_nonfinite;
        logger_.warning(who(), ": push from worker ", w.index, " skipped: gradient of '",
                        it.e->name, "' has ", it.values[k], " at element ", k, " (",
                        stats_.pushes_nonfinite, " pushes skipped so far)");
        w.steps = std::max(w.steps, steps_after);  // its step is done, with nothing applied
        return;
      }
      std::ostringstream v;
      v << it.values[k];
      throw InvalidArgumentError("push to '" + it.e->name + "': gradient element " +
                                 std::to_string(k) + " is " + v.str() +
                                 " (not finite); nothing of the push was applied");
    }
  }
  Shard* iterations = nullptr;
  if (iter_var >= 0) {
    Entry e;
    e.var_id = iter_var;
    e.name = iter_name;
    iterations = &find_shard(e, "push");
    DISTSTRAT_CHECK(iterations->dtype == DType::kInt64 && iterations->value.num_elements() == 1,
                    kInvalidArgument, "push: step counter '", iter_name, "' is ",
                    iterations->value.debug_string(), ", not an int64 scalar");
  }

  // Apply: one step of the rule per shard, over the shard or just its rows.
  for (const Item& it : items) {
    Shard& s = *it.s;
    const UpdateRule* rule = s.rule.get();
    const std::vector<std::string> slot_names = rule->slot_names();
    std::vector<float*> slots;
    for (const std::string& name : slot_names) {
      auto sl = s.slots.find(name);
      if (sl == s.slots.end())
        sl = s.slots.emplace(name, Tensor(s.value.shape(), DType::kFloat32)).first;
      slots.push_back(sl->second.data<float>());
    }
    const int64_t step = ++s.step;
    float* var = s.value.data<float>();
    if (!it.e->sparse) {
      rule->update(var, it.values, slots.data(), static_cast<size_t>(s.value.num_elements()), step);
      continue;
    }
    const int64_t re = row_elems(s.value.shape());
    std::vector<float*> row_slots(slots.size());
    for (int64_t j = 0; j < it.e->num_ids; ++j) {
      const int64_t row = it.ids[j] - s.row_offset;
      for (size_t k = 0; k < slots.size(); ++k) row_slots[k] = slots[k] + row * re;
      rule->update(var + row * re, it.values + j * re, row_slots.data(), static_cast<size_t>(re),
                   step);
    }
  }
  if (iterations) ++iterations->value.data<int64_t>()[0];

  if (pulled_version >= 0) {
    const int64_t staleness = std::max<int64_t>(0, stats_.version - pulled_version);
    stats_.staleness_sum += staleness;
    stats_.staleness_max = std::max(stats_.staleness_max, staleness);
  }
  ++stats_.version;
  w.steps = std::max(w.steps, steps_after);
  const int slowest = slowest_other(w.index);
  if (slowest >= 0) {
    stats_.max_step_gap = std::max(stats_.max_step_gap, w.steps - workers_[slowest].steps);
  }
}

void Service::handle_assign(WorkerState&, Pending& p) {
  std::vector<std::pair<Shard*, size_t>> items;
  size_t offset = 0;
  for (const Entry& e : p.request.entries) {
    Shard& s = find_shard(e, "assign");
    DISTSTRAT_CHECK(
        !e.sparse && e.dtype == static_cast<int32_t>(s.dtype) && e.shape == s.value.shape(),
        kInvalidArgument, "assign to '", e.name, "' shard ", e.shard_index, ": value ",
        valid_dtype(e.dtype) ? dtype_name(static_cast<DType>(e.dtype)) : "invalid",
        e.shape.to_string(), " does not match ", s.value.debug_string());
    items.emplace_back(&s, offset);
    offset += s.value.nbytes();
  }
  DISTSTRAT_CHECK(offset == p.payload.size(), kInvalidArgument, "assign: payload has ",
                  p.payload.size(), " bytes, the entries declare ", offset);
  for (auto& [s, off] : items) {
    if (s->value.nbytes()) std::memcpy(s->value.data(), p.payload.data() + off, s->value.nbytes());
    s->initialized = true;
  }
}

Service::Outcome Service::handle_barrier(WorkerState& w, Pending& p) {
  const int64_t count = p.request.count;
  w.barrier_count = std::max(w.barrier_count, count);
  std::string missing;
  for (const WorkerState& o : workers_) {
    if (o.done || o.gone || o.barrier_count >= count) continue;
    missing += (missing.empty() ? "" : ", ") + std::to_string(o.index);
  }
  if (missing.empty()) return Outcome::kServed;
  if (Clock::now() - p.arrived > options_.timeout) {
    throw DeadlineExceededError("barrier " + std::to_string(count) + ": worker(s) " + missing +
                                " never arrived");
  }
  return Outcome::kDeferred;
}

Service::Outcome Service::handle_broadcast(WorkerState& w, Pending& p, Reply& reply) {
  const int64_t count = p.request.count;
  const bool root = p.request.root;
  if (root) {
    broadcasts_.emplace(count, p.payload);
  } else {
    auto it = broadcasts_.find(count);
    if (it == broadcasts_.end()) {
      if (Clock::now() - p.arrived > options_.timeout) {
        throw DeadlineExceededError("broadcast " + std::to_string(count) + ": worker " +
                                    std::to_string(w.index) +
                                    " waited past the deadline for the root");
      }
      return Outcome::kDeferred;
    }
    DISTSTRAT_CHECK(static_cast<int64_t>(it->second.size()) == p.header.reply_bytes,
                    kInvalidArgument, "broadcast ", count, ": the root sent ", it->second.size(),
                    " bytes, worker ", w.index, " expects ", p.header.reply_bytes);
    reply.payload = it->second;
  }
  w.broadcast_count = std::max(w.broadcast_count, count);
  // Forget what every live worker has.
  int64_t done_upto = INT64_MAX;
  for (const WorkerState& o : workers_) {
    if (!o.done && !o.gone) done_upto = std::min(done_upto, o.broadcast_count);
  }
  broadcasts_.erase(broadcasts_.begin(), broadcasts_.upper_bound(done_upto));
  return Outcome::kServed;
}

void Service::handle_stop_check(WorkerState& w, Pending& p, Reply& reply) {
  const int64_t step = p.request.step;
  const bool signalled = p.request.signalled;
  w.checked_step = std::max(w.checked_step, step);
  if (stop_at_ < 0 && (signalled || ckpt::preemption_signalled())) {
    // Every worker answered "go on" for the steps it has asked about, so the
    // stop is the asker's step or, if another live worker is ahead, the step
    // after that worker's: everyone can still stop there.
    stop_at_ = step;
    for (const WorkerState& o : workers_) {
      if (&o != &w && !o.done && !o.gone) stop_at_ = std::max(stop_at_, o.checked_step + 1);
    }
    logger_.warning(who(), ": preemption (",
                    signalled ? "worker " + std::to_string(w.index) : "this process",
                    " signalled): every worker stops at step ", stop_at_);
  }
  Writer wr;
  wr.put<int64_t>(stop_at_ >= 0 && step >= stop_at_ ? 1 : 0);
  reply.payload = std::move(wr.bytes());
}

void Service::handle_save(Pending& p, Reply& reply) {
  // The request names a stem only (decode_request: no '/', no ".."); the
  // directory, PS index and count are this PS's own.
  std::string dir = options_.checkpoint_dir;
  if (dir.empty()) {
    // Not configured: the worker's directory, still under a derived name
    // (so no file but a shard file of this PS is ever replaced).
    DISTSTRAT_CHECK(!p.request.dir.empty(), kFailedPrecondition, who(),
                    " has no checkpoint directory (ParameterServerOptions::checkpoint_dir, or "
                    "DISTSTRAT_PS_CHECKPOINT_DIR on the PS ranks) and the request names none");
    // The first save's directory becomes this PS's own (a directory this
    // user or root owns, not writable by others unless sticky: the checkpoint
    // manager's rules); a later request naming another is rejected, so a
    // crafted request cannot move the writes elsewhere once the job saved.
    if (adopted_dir_.empty()) {
      ckpt::check_directory_owner(p.request.dir);
      adopted_dir_ = p.request.dir;
      logger_.warning(who(), ": no checkpoint directory configured; writing shard files into '",
                      adopted_dir_,
                      "', the directory the first save named, and only there (set "
                      "ParameterServerOptions::checkpoint_dir to fix it in advance)");
    }
    DISTSTRAT_CHECK(p.request.dir == adopted_dir_, kInvalidArgument,
                    "the request names directory '", p.request.dir.substr(0, 200),
                    "', this PS writes only into '", adopted_dir_,
                    "', the directory of this job's first save");
    dir = adopted_dir_;
  } else {
    DISTSTRAT_CHECK(p.request.dir.empty() || p.request.dir == dir, kInvalidArgument,
                    "the request names directory '", p.request.dir.substr(0, 200),
                    "', this PS writes only into its own '", dir, "'");
  }
  const uint64_t save_id = p.request.save_id;
  const int32_t ps = options_.ps_index;
  const int32_t num_ps = options_.num_ps;
  const std::string path =
      ckpt::shard_file_path(dir + "/" + p.request.stem + ".safetensors", ps, num_ps, save_id);
  const std::vector<ShardSnapshot> shards = snapshot_locked();
  // Blocks this loop for the write: the workers are quiesced (a save is
  // collective), and the snapshot is the state after every push before it.
  ckpt::write_shard_file(path, save_id, ps, num_ps, shards);
  Writer wr;
  wr.put<int64_t>(static_cast<int64_t>(shards.size()));
  reply.payload = std::move(wr.bytes());
}

Service::Outcome Service::handle_rule(WorkerState& w, Pending& p) {
  const DecodedRequest& q = p.request;
  std::shared_ptr<const UpdateRule> rule = make_update_rule(q.config);  // validates every parameter
  // Validate every shard before changing any.
  std::vector<Shard*> shards;
  for (const Entry& e : q.entries) {
    Shard& s = find_shard(e, "update rule");
    DISTSTRAT_CHECK(s.dtype == DType::kFloat32, kInvalidArgument, "update rule of '", e.name,
                    "': the variable is ", dtype_name(s.dtype), "; optimizers update float32");
    if (q.replace) {
      DISTSTRAT_CHECK(s.rule != nullptr, kFailedPrecondition, "update of the rule of '", e.name,
                      "': none was declared yet");
      DISTSTRAT_CHECK(q.config.name == s.config.name && rule->slot_names() == s.rule->slot_names(),
                      kInvalidArgument, "update of the rule of '", e.name, "': optimizer '",
                      q.config.name, "' with its slots cannot replace '", s.config.name,
                      "' (update_hyperparameters changes hyper-parameters, not the optimizer)");
    } else if (s.rule) {
      const std::string diff = config_difference(s.declared, q.config);
      DISTSTRAT_CHECK(diff.empty(), kInvalidArgument, "the optimizer of worker ", w.index, " for '",
                      e.name, "' differs from the update rule the chief fixed: ", diff);
    } else if (w.index != 0) {
      // The chief fixes the rule; another worker's declaration waits for it.
      if (Clock::now() - p.arrived > options_.timeout) {
        throw DeadlineExceededError(
            "update rule of '" + e.name + "': worker " + std::to_string(w.index) +
            " waited past the deadline for the chief (worker 0) to declare it");
      }
      return Outcome::kDeferred;
    }
    shards.push_back(&s);
  }
  for (Shard* s : shards) {
    if (q.replace) {
      s->rule = rule;
      s->config = q.config;
    } else if (!s->rule) {
      s->rule = rule;
      s->declared = s->config = q.config;
    }
  }
  if (q.replace) {
    logger_.info(who(), ": the chief updated the rule of ", shards.size(), " shard(s): ",
                 config_difference(shards.empty() ? q.config : shards.front()->declared, q.config));
  }
  return Outcome::kServed;
}

void Service::handle_read_slots(Pending& p, Reply& reply) {
  std::vector<std::pair<const Shard*, std::string>> items;
  size_t bytes = 0;
  for (size_t i = 0; i < p.request.entries.size(); ++i) {
    const Entry& e = p.request.entries[i];
    const std::string& slot = p.request.slot_of[i];
    const Shard& s = find_shard(e, "slot read");
    DISTSTRAT_CHECK(s.dtype == DType::kFloat32, kInvalidArgument, "slot read of '", e.name,
                    "': the variable is ", dtype_name(s.dtype),
                    ", only float32 variables have slots");
    items.emplace_back(&s, slot);
    bytes += static_cast<size_t>(s.value.num_elements()) * sizeof(float);
  }
  DISTSTRAT_CHECK(static_cast<int64_t>(bytes) == p.header.reply_bytes, kInvalidArgument,
                  "slot read: the reply is ", bytes, " bytes, the request expects ",
                  p.header.reply_bytes);
  reply.payload.assign(bytes, 0);  // a slot not created yet (no push) is zeros
  char* out = reply.payload.data();
  for (const auto& [s, slot] : items) {
    const size_t b = static_cast<size_t>(s->value.num_elements()) * sizeof(float);
    auto it = s->slots.find(slot);
    if (it != s->slots.end() && b) std::memcpy(out, it->second.data(), b);
    out += b;
  }
}

void Service::handle_restore(Pending& p) {
  struct Item {
    Shard* s;
    bool has_value;
    int64_t step;
    std::vector<std::string> slots;
    size_t offset;
  };
  std::vector<Item> items;
  size_t offset = 0;
  // Validate everything before writing anything.
  for (size_t i = 0; i < p.request.entries.size(); ++i) {
    const Entry& e = p.request.entries[i];
    const RestoreSpec& spec = p.request.restore[i];
    Shard* shard = &find_shard(e, "restore");
    Item it{shard, spec.has_value, spec.step, spec.slots, offset};
    const Shard& s = *it.s;
    DISTSTRAT_CHECK(e.dtype == static_cast<int32_t>(s.dtype) && e.shape == s.value.shape(),
                    kInvalidArgument, "restore of '", e.name, "' shard ", e.shard_index, ": value ",
                    valid_dtype(e.dtype) ? dtype_name(static_cast<DType>(e.dtype)) : "invalid",
                    e.shape.to_string(), " does not match ", s.value.debug_string());
    DISTSTRAT_CHECK(it.slots.empty() || s.dtype == DType::kFloat32, kInvalidArgument,
                    "restore of '", e.name, "': slots for a ", dtype_name(s.dtype), " variable");
    offset += (it.has_value ? s.value.nbytes() : 0) +
              it.slots.size() * static_cast<size_t>(s.value.num_elements()) * sizeof(float);
    items.push_back(std::move(it));
  }
  DISTSTRAT_CHECK(offset == p.payload.size(), kInvalidArgument, "restore: payload has ",
                  p.payload.size(), " bytes, the entries declare ", offset);
  for (Item& it : items) {
    Shard& s = *it.s;
    const char* src = p.payload.data() + it.offset;
    if (it.has_value) {
      if (s.value.nbytes()) std::memcpy(s.value.data(), src, s.value.nbytes());
      src += s.value.nbytes();
      s.initialized = true;
    }
    for (const std::string& slot : it.slots) {
      Tensor t(s.value.shape(), DType::kFloat32);
      if (t.nbytes()) std::memcpy(t.data(), src, t.nbytes());
      src += t.nbytes();
      s.slots[slot] = t;
    }
    if (it.step >= 0) s.step = it.step;
  }
}

void Service::handle_metric(Pending& p, Reply& reply) {
  // Name, count and reply size were checked by decode_request.
  constexpr size_t kMaxMetrics = 1024;
  const std::string& name = p.request.metric_name;
  const double sum = p.request.metric_sum;
  const double count = p.request.metric_count;
  const std::string shown = name.size() > 200 ? name.substr(0, 200) + "..." : name;
  auto it = metrics_.find(name);
  if (it == metrics_.end()) {
    DISTSTRAT_CHECK(metrics_.size() < kMaxMetrics, kInvalidArgument, "metric '", shown,
                    "': already ", kMaxMetrics, " metrics on ", who());
    it = metrics_.emplace(name, std::make_pair(0.0, 0.0)).first;
  }
  it->second.first += sum;
  it->second.second += count;
  if (p.header.reply_bytes == 0) return;
  Writer wr;
  wr.put(it->second.first).put(it->second.second);
  reply.payload = std::move(wr.bytes());
}

void Service::handle_stats(Reply& reply) {
  Writer wr;
  wr.put(stats_.version).put(stats_.pushes_rejected).put(stats_.staleness_sum);
  wr.put(stats_.staleness_max).put(stats_.max_step_gap).put(stats_.pushes_nonfinite);
  wr.put<int64_t>(static_cast<int64_t>(workers_.size()));
  for (const WorkerState& w : workers_) wr.put(w.steps);
  reply.payload = std::move(wr.bytes());
}

ServiceStats Service::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ServiceStats s = stats_;
  for (const WorkerState& w : workers_) s.worker_steps.push_back(w.steps);
  return s;
}

std::vector<int> Service::gone_workers() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> out;
  for (const WorkerState& w : workers_) {
    if (w.gone) out.push_back(w.index);
  }
  return out;
}

std::vector<ShardSnapshot> Service::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return snapshot_locked();
}

std::vector<ShardSnapshot> Service::snapshot_locked() const {
  std::vector<ShardSnapshot> out;
  for (const auto& [key, s] : shards_) {
    ShardSnapshot snap;
    snap.variable = s.name;
    snap.shard_index = key.second;
    snap.num_shards = s.num_shards;
    snap.row_offset = s.row_offset;
    snap.full_shape = s.full_shape;
    snap.value = s.value.clone();
    for (const auto& [name, t] : s.slots) snap.slots.emplace(name, t.clone());
    snap.step = s.step;
    out.push_back(std::move(snap));
  }
  return out;
}

void Service::restore(const std::vector<ShardSnapshot>& shards) {
  std::lock_guard<std::mutex> lock(mu_);
  DISTSTRAT_CHECK(shards_.empty(), kFailedPrecondition, who(),
                  ": restore after workers created variables; restore before training starts");
  for (const ShardSnapshot& s : shards) {
    ShardSnapshot copy = s;
    copy.value = s.value.clone();
    for (auto& [name, t] : copy.slots) t = t.clone();
    restored_[{s.variable, s.shard_index}] = std::move(copy);
  }
}

}  // namespace ps
}  // namespace diststrat
