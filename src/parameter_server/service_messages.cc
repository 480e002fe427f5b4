// The PS service's messages: receiving a worker's requests (the control
// message, decoded and checked, then its payload in parts), taking their
// sequence numbers and incarnations, and sending replies (padded to what the
// request expects) and reaping them.
#include "parameter_server/service.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>

#include <sys/mman.h>

namespace diststrat {
namespace ps {

namespace {

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
      if (p.request.op == Op::kBroadcast) w.broadcast_arrived = p.request.broadcast.count;
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

}  // namespace ps
}  // namespace diststrat
