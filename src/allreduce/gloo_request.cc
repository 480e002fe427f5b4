// GlooRequest (gloo_transport_impl.h): one send or recv over a Gloo
// transport. Posting (a send deferred until the next wait or test), the
// bounded waits the watcher ends, the completion check of a wait that must
// stop, and the error that says why a transfer cannot complete.

#include <exception>
#include <thread>

#include "allreduce/gloo_transport_impl.h"

namespace diststrat {
namespace gloo_impl {

GlooRequest::~GlooRequest() {
  // A send still deferred counts too: its peer would wait for it in vain.
  if ((buf_ || deferred_) && !done_ && !failed_ && !control_)
    core_->request_dropped(peer_, describe());
  gloo_destroy(buf_, is_recv_);
  if (live_) core_->request_finished();
}

void GlooRequest::post_deferred() {
  if (!deferred_) return;
  deferred_ = false;
  if (!core_->should_stop(peer_)) post(deferred_data_, deferred_slot_);
}

void GlooRequest::post(void* data, uint64_t slot) {
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

bool GlooRequest::test() {
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

void GlooRequest::wait(Clock::time_point deadline) {
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

void GlooRequest::flush_deferred_sends(GlooCore& core) {
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

std::string GlooRequest::describe() const {
  return std::string(is_recv_ ? "recv of " : "send of ") + std::to_string(bytes_) +
         (is_recv_ ? " bytes from rank " : " bytes to rank ") + std::to_string(peer_) + " (tag " +
         std::to_string(tag_) + ")";
}

GlooRequest::Outcome GlooRequest::gloo_wait(bool probe, Clock::time_point until) {
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

bool GlooRequest::probe() {
  bool final_state = false;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (core_->destroyed) return false;
    final_state = core_->peers[peer_].state != GlooPeerState::kAlive;
  }
  const auto grace = final_state ? kGlooFinalProbeGrace : kGlooProbeGrace;
  return gloo_wait(true, Clock::now() + grace) == Outcome::kComplete;
}

void GlooRequest::complete() {
  done_ = true;
  release();
}

void GlooRequest::failed(const std::string& what) {
  failed_ = true;
  failure_ = gloo_text(what);
  core_->transfer_failed(peer_, what);
  release();
}

void GlooRequest::release() {
  gloo_destroy(buf_, is_recv_);  // also lets go of Gloo's context
  if (live_) {
    live_ = false;
    core_->request_finished();
  }
}

void GlooRequest::throw_failure(bool deadline_passed) {
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

}  // namespace gloo_impl
}  // namespace diststrat
