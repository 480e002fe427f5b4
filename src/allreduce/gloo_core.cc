// GlooCore (gloo_transport_impl.h): the state a Gloo transport, its
// requests and its watcher share. Peers found gone (the control receives),
// the stops (abort, a drop, a broken group), the waits the watcher ends at
// their deadlines, and the closing of the connections.

#include <algorithm>
#include <exception>

#include "allreduce/gloo_transport_impl.h"

namespace diststrat {
namespace gloo_impl {

void GlooCore::mark_dead_locked(int p, PeerState state, const std::string& what) {
  peers[p].state = state;
  peers[p].detail = gloo_text(what);
  peers[p].order = ++dead_peers;
}

std::string GlooCore::dead_peers_locked() const {
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

void GlooCore::break_locked() {
  stop = Stop::kBroken;
  stop_reason = dead_peers_locked();
  broken_at = Clock::now();
  close_requested = true;
}

bool GlooCore::control_failed(GlooBuffer* buf, std::string* what) {
  try {
    buf->abortWaitRecv();
    buf->waitRecv(nullptr, kGlooBackstop);  // the abort flag ends it at once
    return false;
  } catch (const std::exception& e) {
    *what = e.what();
    return true;
  }
}

void GlooCore::scan_locked() {
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

Clock::time_point GlooCore::interrupt_due_locked(Clock::time_point now,
                                                 std::vector<int>* to_close) {
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

void GlooCore::changed_locked() {
  interrupt_due_locked(Clock::now(), nullptr);
  cv.notify_all();
}

bool GlooCore::add_waiter(GlooWaiter* w) {
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
void GlooCore::remove_waiter(GlooWaiter* w) {
  std::lock_guard<std::mutex> lock(mu);
  waiters.erase(std::remove(waiters.begin(), waiters.end(), w), waiters.end());
}

void GlooCore::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu);
  if (destroyed) return;
  if (stop != Stop::kAborted) {
    stop = Stop::kAborted;
    stop_reason = reason;
  }
  close_requested = true;
  changed_locked();
}

void GlooCore::transfer_failed(int peer, const std::string& what) {
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

void GlooCore::request_dropped(int peer, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu);
  if (stop != Stop::kNone || destroyed || peers[peer].state != PeerState::kAlive) return;
  stop = Stop::kDropped;
  stop_reason = "a request was dropped before completion (" + what +
                "); Gloo cannot cancel a posted transfer, so this group's transport is unusable";
  close_requested = true;
  changed_locked();
}

void GlooCore::request_finished() {
  std::lock_guard<std::mutex> lock(mu);
  --live_requests;
}

bool GlooCore::completion_counts() {
  std::lock_guard<std::mutex> lock(mu);
  return stop != Stop::kAborted && stop != Stop::kDropped && !destroyed;
}

template <typename Fn>
void GlooCore::for_each_pair(Fn fn) {
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

void GlooCore::close_all_pairs() {
  for_each_pair([&](int p) {
    auto& pair = ctx->getPair(p);
    if (pair) pair->close();
  });
}

void GlooCore::destroy_pairs() {
  for_each_pair([&](int p) { ctx->getPair(p).reset(); });
}

void GlooCore::watch() {
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

}  // namespace gloo_impl
}  // namespace diststrat
