// The TCP transport's streams (tcp_transport_impl.h): a connection's
// messages read and matched with posted recvs (or kept until one comes),
// queued sends written, and the waits, tests and errors of one request.

#include "allreduce/tcp_transport_impl.h"

namespace diststrat {
namespace tcp_impl {

void Core::peer_gone_locked(int p, const std::string& what) {
  Peer& peer = peers[p];
  if (peer.state != PeerState::kAlive) return;
  peer.state = peer.goodbye ? PeerState::kLeft : PeerState::kFailed;
  peer.detail = what;
  peer.order = ++dead;
  if (peer.state == PeerState::kFailed && failure_breaks_group) break_locked();
}

// A complete message at the head of `peer.unexpected` meets the oldest
// posted recv of its tag (in order: an older incomplete one blocks it).
void Core::deliver_locked(Peer& peer, int p) {
  bool moved = true;
  while (moved) {
    moved = false;
    for (auto it = peer.unexpected.begin(); it != peer.unexpected.end(); ++it) {
      Unexpected& u = **it;
      // Only the oldest message of a tag may be taken.
      bool oldest = true;
      for (auto jt = peer.unexpected.begin(); jt != it; ++jt) {
        if ((*jt)->tag == u.tag) oldest = false;
      }
      if (!oldest || !u.complete) continue;
      auto rt = std::find_if(peer.posted.begin(), peer.posted.end(),
                             [&](TcpRequest* r) { return r->tag_ == u.tag; });
      if (rt == peer.posted.end()) continue;
      TcpRequest* r = *rt;
      peer.posted.erase(rt);
      if (r->bytes_ != u.data.size()) {
        r->fail_locked(ErrorCode::kInvalidArgument,
                       rank_text() + ": " + r->describe() + ": the message from " + peer_text(p) +
                           " has " + std::to_string(u.data.size()) +
                           " bytes (sender and receiver disagree on its size)");
      } else {
        if (!u.data.empty()) std::memcpy(r->data_, u.data.data(), u.data.size());
        r->finish_locked();
      }
      peer.unexpected.erase(it);
      moved = true;
      break;
    }
  }
}

// Reads what the connection to p has; false when nothing moved.
bool Core::read_peer_locked(int p) {
  Peer& peer = peers[p];
  if (peer.fd < 0 || peer.state != PeerState::kAlive) return false;
  bool moved = false;
  char sink[65536];
  for (;;) {
    char* dst;
    size_t want;
    if (!peer.in_payload) {
      dst = reinterpret_cast<char*>(&peer.hdr) + peer.hdr_got;
      want = sizeof(Header) - peer.hdr_got;
    } else {
      const size_t left = peer.hdr.bytes - peer.payload_got;
      if (peer.in_req) {
        dst = peer.in_req->data_ + peer.payload_got;
        want = left;
      } else if (peer.in_unexp) {
        dst = peer.in_unexp->data.data() + peer.payload_got;
        want = left;
      } else {
        dst = sink;
        want = std::min(left, sizeof sink);
      }
    }
    ssize_t n = want == 0 ? 0 : recv(peer.fd, dst, want, 0);
    if (want > 0) {
      if (n == 0) {
        peer_gone_locked(p, "the connection was closed");
        return true;
      }
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return moved;
        peer_gone_locked(p, errno_text(errno));
        return true;
      }
      moved = true;
    }
    if (!peer.in_payload) {
      peer.hdr_got += static_cast<size_t>(n);
      if (peer.hdr_got < sizeof(Header)) continue;
      peer.hdr_got = 0;
      if (peer.hdr.kind == kKindGoodbye) {
        peer.goodbye = true;
        continue;
      }
      if (peer.hdr.kind != kKindData) {
        peer_gone_locked(p, "it sent a message of unknown kind " + std::to_string(peer.hdr.kind) +
                                " (not this transport's stream)");
        return true;
      }
      peer.in_payload = true;
      peer.payload_got = 0;
      peer.in_req = nullptr;
      peer.in_unexp = nullptr;
      const int tag = peer.hdr.tag;
      const bool older = std::any_of(peer.unexpected.begin(), peer.unexpected.end(),
                                     [&](const auto& u) { return u->tag == tag; });
      auto rt = older ? peer.posted.end()
                      : std::find_if(peer.posted.begin(), peer.posted.end(),
                                     [&](TcpRequest* r) { return r->tag_ == tag; });
      if (rt != peer.posted.end()) {
        TcpRequest* r = *rt;
        peer.posted.erase(rt);
        if (r->bytes_ == peer.hdr.bytes) {
          peer.in_req = r;
        } else {
          r->fail_locked(ErrorCode::kInvalidArgument,
                         rank_text() + ": " + r->describe() + ": the message from " + peer_text(p) +
                             " has " + std::to_string(peer.hdr.bytes) +
                             " bytes (sender and receiver disagree on its size)");
        }
      } else {
        auto u = std::make_unique<Unexpected>();
        u->tag = tag;
        u->seq = next_seq++;
        try {
          u->data.resize(peer.hdr.bytes);
        } catch (const std::exception&) {
          peer_gone_locked(
              p, "no memory for its message of " + std::to_string(peer.hdr.bytes) + " bytes");
          return true;
        }
        peer.in_unexp = u.get();
        peer.unexpected.push_back(std::move(u));
      }
    } else {
      peer.payload_got += static_cast<size_t>(n);
    }
    if (peer.in_payload && peer.payload_got == peer.hdr.bytes) {
      peer.in_payload = false;
      if (peer.in_req) peer.in_req->finish_locked();
      if (peer.in_unexp) {
        peer.in_unexp->complete = true;
        deliver_locked(peer, p);
      }
      peer.in_req = nullptr;
      peer.in_unexp = nullptr;
      moved = true;
    }
  }
}

// Writes what the connection to p takes; false when nothing moved.
bool Core::write_peer_locked(int p) {
  Peer& peer = peers[p];
  bool moved = false;
  while (!peer.out.empty() && peer.fd >= 0 && peer.state == PeerState::kAlive) {
    OutMsg& m = peer.out.front();
    const size_t total = sizeof(Header) + m.hdr.bytes;
    iovec iov[2];
    int n_iov = 0;
    if (m.written < sizeof(Header)) {
      iov[n_iov].iov_base = reinterpret_cast<char*>(&m.hdr) + m.written;
      iov[n_iov].iov_len = sizeof(Header) - m.written;
      ++n_iov;
      if (m.hdr.bytes > 0) {
        iov[n_iov].iov_base = const_cast<char*>(m.data);
        iov[n_iov].iov_len = m.hdr.bytes;
        ++n_iov;
      }
    } else {
      const size_t off = m.written - sizeof(Header);
      iov[n_iov].iov_base = const_cast<char*>(m.data + off);
      iov[n_iov].iov_len = m.hdr.bytes - off;
      ++n_iov;
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n_iov;
    const ssize_t n = sendmsg(peer.fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return moved;
      peer_gone_locked(p, errno_text(errno));
      return true;
    }
    moved = true;
    m.written += static_cast<size_t>(n);
    if (m.written < total) continue;
    if (m.req) m.req->finish_locked();
    peer.out.pop_front();
  }
  return moved;
}

bool Core::progress_locked() {
  if (stop == Stop::kDestroyed) return false;
  bool moved = false;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    moved = write_peer_locked(p) || moved;
    moved = read_peer_locked(p) || moved;
  }
  return moved;
}

TcpRequest::~TcpRequest() {
  std::lock_guard<std::mutex> lock(core_->mu);
  if (finished()) return;
  --core_->pending;
  Peer& peer = core_->peers[peer_];
  if (!is_recv_) {
    for (auto it = peer.out.begin(); it != peer.out.end(); ++it) {
      if (it->req != this) continue;
      if (it->written == 0) {
        peer.out.erase(it);
      } else {
        // Partly written: the rest must follow, or the stream is torn.
        const size_t off = it->written > sizeof(Header) ? it->written - sizeof(Header) : 0;
        auto rest = std::make_shared<std::vector<char>>(bytes_);
        if (bytes_ > off) std::memcpy(rest->data() + off, data_ + off, bytes_ - off);
        it->owned = rest;
        it->data = rest->data();
        it->req = nullptr;
      }
      return;
    }
    return;
  }
  peer.posted.remove(this);
  if (peer.in_req == this) {
    peer.in_req = nullptr;  // the rest of its message is discarded
    if (core_->stop == Stop::kNone) {
      core_->stop = Stop::kAborted;
      core_->stop_reason = "a recv was dropped mid-message (" + describe() +
                           "); its message is lost, so this group's transport is unusable";
      core_->shutdown_all_locked();
      core_->wake();
    }
  }
}

bool TcpRequest::settled_locked(bool deadline_passed) {
  if (done_) return true;
  if (failed_) throw_error(code_, error_);
  const Peer& peer = core_->peers[peer_];
  if (core_->stop != Stop::kNone || peer.state != PeerState::kAlive || deadline_passed)
    throw_locked(deadline_passed);
  return false;
}

void TcpRequest::throw_locked(bool deadline_passed) {
  const std::string head = core_->rank_text() + ": " + describe();
  Peer& peer = core_->peers[peer_];
  const std::string who = core_->peer_text(peer_);
  switch (core_->stop) {
    case Stop::kAborted:
      throw AbortedError(head + " aborted: " + core_->stop_reason);
    case Stop::kDestroyed:
      throw AbortedError(head + " aborted: the TCP transport was destroyed before it completed");
    case Stop::kBroken:
      // Every connection found gone by now, not only the first.
      throw UnavailableError(head + " failed: the group is broken: " + core_->dead_peers_locked());
    case Stop::kNone:
      break;
  }
  if (peer.state == PeerState::kLeft) {
    // The group's work needed a rank that is gone: it cannot finish.
    const std::string why = head + " failed: " + who +
                            " left the group (its transport was destroyed) before it completed";
    if (!core_->failure_breaks_group) throw UnavailableError(why);
    core_->stop = Stop::kBroken;
    core_->stop_reason = core_->dead_peers_locked();
    throw UnavailableError(why);
  }
  if (peer.state == PeerState::kFailed) {
    if (!core_->failure_breaks_group)
      throw UnavailableError(head + " failed: the connection to " + who +
                             " failed: " + peer.detail);
    throw UnavailableError(head + " failed: the group is broken: " + core_->dead_peers_locked());
  }
  (void)deadline_passed;
  throw DeadlineExceededError(
      head + " did not complete before the deadline: rank " + std::to_string(peer_) +
      (is_recv_ ? " did not send the matching message of " : " did not take the message of ") +
      std::to_string(bytes_) + " bytes with tag " + std::to_string(tag_) + " in time" +
      kLatePeerCauses);
}

bool TcpRequest::test() {
  std::lock_guard<std::mutex> lock(core_->mu);
  if (finished()) return settled_locked(false);
  core_->progress_locked();
  return settled_locked(false);
}

void TcpRequest::wait(Clock::time_point deadline) {
  std::vector<pollfd> fds;
  int idle = 0;
  Clock::time_point moved_at = Clock::now();
  for (;;) {
    bool long_idle = false;
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      if (finished()) {
        settled_locked(false);
        return;
      }
      const bool moved = core_->progress_locked();
      if (settled_locked(false)) return;
      const auto now = Clock::now();
      if (now >= deadline) settled_locked(true);
      if (moved) {
        idle = 0;
        moved_at = now;
        continue;
      }
      if (++idle < kSpinPolls) continue;
      long_idle = now - moved_at > kLongIdle;
      if (long_idle) {
        fds.clear();
        for (int p = 0; p < core_->size; ++p) {
          const Peer& peer = core_->peers[p];
          if (p == core_->rank || peer.fd < 0 || peer.state != PeerState::kAlive) continue;
          fds.push_back(
              {peer.fd, static_cast<short>(POLLIN | (peer.out.empty() ? 0 : POLLOUT)), 0});
        }
        fds.push_back({core_->event_fd, POLLIN, 0});
      }
    }
    // (See kSpinPolls: a timer's wake-up, not the socket's.)
    if (long_idle) {
      poll(fds.data(), fds.size(), std::min(1, ms_until(deadline)));
    } else {
      std::this_thread::sleep_for(kPollSleep);
    }
  }
}

}  // namespace tcp_impl
}  // namespace diststrat
