#include "parameter_server/client.h"

#include <algorithm>
#include <atomic>
#include <chrono>

namespace diststrat {
namespace ps {

Client::Client(Transport& transport, std::vector<int> ps_ranks, int worker_index,
               std::chrono::milliseconds timeout)
    : t_(transport),
      ps_ranks_(std::move(ps_ranks)),
      worker_index_(worker_index),
      recorder_("ps-client w" + std::to_string(worker_index), 0, 1),
      timeout_(timeout),
      ps_incarnation_(ps_ranks_.size(), 0),
      fifo_(ps_ranks_.size()),
      broken_(ps_ranks_.size()) {
  static std::atomic<uint64_t> last{0};  // two clients of one process in one microsecond differ too
  uint64_t t = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                         std::chrono::system_clock::now().time_since_epoch())
                                         .count());
  uint64_t prev = last.load();
  while (!last.compare_exchange_weak(prev, std::max(t, prev + 1))) {
  }
  incarnation_ = std::max(t, prev + 1);
}

Clock::time_point Client::deadline() const {
  // A little past the PS's own deadline, so that its explanation (a
  // staleness or barrier wait that timed out) arrives before ours fires.
  return Clock::now() + timeout_ + timeout_ / 10 + std::chrono::milliseconds(100);
}

Client::CallPtr Client::post(int ps, Op op, const std::vector<char>& body,
                             std::shared_ptr<const void> payload_owner, const void* payload,
                             size_t payload_bytes, void* reply_dst, size_t reply_bytes,
                             std::string what) {
  auto c = std::make_shared<Call>();
  c->ps = ps;
  c->seq = next_seq_++;
  last_post_ = Clock::now();
  c->what = "worker " + std::to_string(worker_index_) + " (rank " + std::to_string(t_.rank()) +
            "): " + std::move(what) + " (" + op_name(op) + " to PS rank " +
            std::to_string(ps_ranks_[ps]) + ")";
  c->flight_seq = recorder_.begin(op_name(op), c->what, payload_bytes, "", "", ps_ranks_[ps],
                                  payload_bytes + reply_bytes);
  RequestHeader h;
  h.op = static_cast<uint16_t>(op);
  h.worker = worker_index_;
  h.seq = c->seq;
  h.payload_bytes = static_cast<int64_t>(payload_bytes);
  h.reply_bytes = static_cast<int64_t>(reply_bytes);
  h.incarnation = incarnation_;
  h.ps_incarnation = ps_incarnation_[ps];
  if (op == Op::kPush && corrupt_next_push_) {
    h.magic = ~kMagic;
    corrupt_next_push_ = false;
  }
  if (op == Op::kPush && oversize_next_push_) {
    h.payload_bytes += (int64_t{1} << 30) + 8;
    oversize_next_push_ = false;
  }
  c->control.resize(sizeof(h) + body.size());
  std::memcpy(c->control.data(), &h, sizeof(h));
  if (!body.empty()) std::memcpy(c->control.data() + sizeof(h), body.data(), body.size());
  c->payload_owner = std::move(payload_owner);
  c->reply_dst = reply_dst;
  c->reply_bytes = reply_bytes;
  if (!broken_[ps].empty()) {
    // Nothing is sent to a PS the transport already failed with.
    finish(*c, unreachable(*c));
    fifo_[ps].push_back(c);
    return c;
  }
  const int peer = ps_ranks_[ps];
  // The reply's recvs are posted now, so replies match calls in posting
  // order and the payload can arrive while the program computes.
  c->recv_header = t_.recv(peer, &c->reply, sizeof(ReplyHeader), kReplyTag);
  if (reply_bytes) c->recv_payload = t_.recv(peer, reply_dst, reply_bytes, kReplyPayloadTag);
  c->send_control = t_.send(peer, c->control.data(), c->control.size(), kRequestTag);
  if (payload_bytes) c->send_payload = t_.send(peer, payload, payload_bytes, kRequestPayloadTag);
  fifo_[ps].push_back(c);
  return c;
}

std::exception_ptr Client::unreachable(const Call& c) const {
  return std::make_exception_ptr(UnavailableError(c.what + " not completed: PS rank " +
                                                  std::to_string(ps_ranks_[c.ps]) +
                                                  " is unreachable (" + broken_[c.ps] + ")"));
}

bool Client::advance(Call& c, bool block, Clock::time_point deadline) {
  const int peer = ps_ranks_[c.ps];
  if (c.stage != Call::Stage::kDone && !broken_[c.ps].empty()) {
    finish(c, unreachable(c));
    return true;
  }
  while (c.stage != Call::Stage::kDone) {
    Request& r = c.stage == Call::Stage::kHeader  ? c.recv_header
                 : c.stage == Call::Stage::kError ? c.recv_error
                                                  : c.recv_payload;
    try {
      if (block) {
        r.wait(deadline);
      } else if (!r.test()) {
        return false;
      }
    } catch (const Error& e) {
      // The transport failed (deadline, abort): this call and the stream
      // behind it cannot be completed.
      broken_[c.ps] = e.message();
      finish(c, std::current_exception());
      return true;
    }
    switch (c.stage) {
      case Call::Stage::kHeader: {
        // Nothing of the reply is used before it is checked: the error
        // text's size (it sizes an allocation), the status, the payload.
        std::string bad = check_reply(c.reply, static_cast<int64_t>(c.reply_bytes));
        if (bad.empty() && c.reply.seq != c.seq && c.reply.seq != -1) {
          bad = "reply for request " + std::to_string(c.reply.seq) + " while expecting " +
                std::to_string(c.seq);
        }
        if (!bad.empty()) {
          finish(c, std::make_exception_ptr(InternalError(c.what + ": protocol error: " + bad)));
          return true;
        }
        if (c.reply.incarnation != 0) ps_incarnation_[c.ps] = c.reply.incarnation;
        if (c.reply.error_bytes > 0) {
          c.error_text.resize(static_cast<size_t>(c.reply.error_bytes));
          c.recv_error = t_.recv(peer, &c.error_text[0], c.error_text.size(), kReplyErrorTag);
          c.stage = Call::Stage::kError;
        } else if (c.reply_bytes > 0) {
          c.stage = Call::Stage::kPayload;
        } else {
          finish(c, nullptr);
        }
        break;
      }
      case Call::Stage::kError: {
        try {
          const ErrorCode code = static_cast<ErrorCode>(c.reply.status);  // checked: a known code
          throw_error(code, c.what + " failed: " + c.error_text);
        } catch (...) {
          c.pending_error = std::current_exception();
        }
        if (c.reply_bytes > 0) {
          c.stage = Call::Stage::kPayload;  // the PS pads the payload after an error
        } else {
          finish(c, c.pending_error);
        }
        break;
      }
      case Call::Stage::kPayload: {
        finish(c, c.pending_error);
        break;
      }
      case Call::Stage::kDone:
        break;
    }
  }
  return true;
}

namespace {
// Whether a send has completed (a failed send counts: it reads no more).
bool send_done(Request& r) {
  try {
    return r.test();
  } catch (const Error&) {
    return true;
  }
}
}  // namespace

void Client::finish(Call& c, std::exception_ptr error) {
  if (!error) {
    // The PS answered, so it has received our messages: the sends are done.
    try {
      const auto d = deadline();
      c.send_control.wait(d);
      c.send_payload.wait(d);
    } catch (const Error&) {
      error = std::current_exception();
    }
  }
  c.error = error;
  c.stage = Call::Stage::kDone;
  if (!error) {
    recorder_.end(c.flight_seq, flight::State::kCompleted);
  } else {
    std::string why = "failed";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      why = e.what();
    } catch (...) {
    }
    recorder_.end(c.flight_seq, flight::State::kFailed, why);
  }
  if (!send_done(c.send_control) || !send_done(c.send_payload)) {
    // An error before the PS took our messages (e.g. it rejected a damaged
    // header): the transport may still read them, so they outlive the call.
    orphans_.push_back(
        {c.send_control, c.send_payload, std::move(c.control), std::move(c.payload_owner)});
  }
  c.payload_owner.reset();
  if (error && c.detached) deferred_.push_back(error);
}

void Client::release_sent_orphans() {
  orphans_.erase(std::remove_if(orphans_.begin(), orphans_.end(),
                                [](Orphan& o) {
                                  return send_done(o.send_control) && send_done(o.send_payload);
                                }),
                 orphans_.end());
}

Client::~Client() {
  // A live PS consumes what it was sent, rejected or not; give it a moment
  // (bounded: a PS that is gone never will, and then nothing reads it).
  const auto until =
      Clock::now() + std::min<std::chrono::milliseconds>(timeout_, std::chrono::seconds(1));
  for (Orphan& o : orphans_) {
    try {
      o.send_control.wait(until);
      o.send_payload.wait(until);
    } catch (const Error&) {
    }
  }
}

void Client::wait(const CallPtr& call) { wait(call, deadline()); }

void Client::wait(const CallPtr& call, Clock::time_point d) {
  auto& q = fifo_[call->ps];
  while (!q.empty()) {
    CallPtr front = q.front();
    advance(*front, true, d);
    q.pop_front();
    if (front == call) break;
  }
  if (call->error) {
    call->detached = false;
    std::rethrow_exception(call->error);
  }
}

void Client::poll() {
  if (!orphans_.empty()) release_sent_orphans();
  for (auto& q : fifo_) {
    while (!q.empty() && advance(*q.front(), false, Clock::now())) q.pop_front();
  }
}

void Client::drain() {
  const auto d = deadline();
  for (auto& q : fifo_) {
    while (!q.empty()) {
      advance(*q.front(), true, d);
      q.pop_front();
    }
  }
}

void Client::throw_deferred() {
  if (std::exception_ptr e = take_deferred()) std::rethrow_exception(e);
}

std::exception_ptr Client::take_deferred() {
  if (deferred_.empty()) return nullptr;
  std::exception_ptr e = deferred_.front();
  deferred_.clear();
  return e;
}

bool Client::has_outstanding() const {
  for (const auto& q : fifo_) {
    if (!q.empty()) return true;
  }
  return false;
}

}  // namespace ps
}  // namespace diststrat
