// In-process transport: a mailbox per (receiver) rank, guarded by one mutex.
// A send posts (source, tag, pointer, bytes) to the receiver's mailbox; a recv
// looks for the first matching posted send (or parks itself until one
// arrives), copies straight from the sender's buffer and marks both done.
// So each message is copied exactly once, sender's buffer -> receiver's.

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>

#include "allreduce/transport.h"

namespace diststrat {

void wait_all(std::vector<Request>& requests, Clock::time_point deadline) {
  for (Request& r : requests) r.wait(deadline);
}

struct InProcessTransportGroup::State {
  explicit State(int n) : size(n), inbox(n), parked(n) {}
  struct Done {
    bool complete = false;
    std::string error;
  };
  struct Message {
    int source;
    int tag;
    const void* data;
    size_t bytes;
    std::shared_ptr<Done> done;
  };
  struct Parked {  // a recv posted before its send arrived
    int source;
    int tag;
    void* data;
    size_t bytes;
    std::shared_ptr<Done> done;
  };
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::deque<Message>> inbox;  // per receiver: sends not yet received
  std::vector<std::deque<Parked>> parked;  // per receiver: recvs not yet matched
  bool aborted = false;
  std::string abort_reason;

  // Copies a message into a recv, checking the byte count. Caller holds mu.
  static void deliver(const Message& m, void* data, size_t bytes, Done& recv_done) {
    if (m.bytes != bytes) {
      const std::string err = "message from rank " + std::to_string(m.source) + " (tag " +
                              std::to_string(m.tag) + ") has " + std::to_string(m.bytes) +
                              " bytes but the recv expects " + std::to_string(bytes);
      recv_done.error = err;
      m.done->error = err;
    } else if (bytes) {
      std::memcpy(data, m.data, bytes);
    }
    recv_done.complete = true;
    m.done->complete = true;
  }
};

namespace {

using GroupState = InProcessTransportGroup::State;

class InProcRequest : public Request::State {
 public:
  // `mailbox`: where the operation waits while unmatched (the receiver's
  // parked recvs for a recv, the receiver's inbox for a send).
  InProcRequest(std::shared_ptr<GroupState> s, std::shared_ptr<GroupState::Done> done,
                std::string what, int rank, bool is_recv, int mailbox, int peer)
      : s_(std::move(s)),
        done_(std::move(done)),
        what_(std::move(what)),
        rank_(rank),
        is_recv_(is_recv),
        mailbox_(mailbox),
        peer_(peer) {}
  int peer() const override { return peer_; }

  // Dropped before it completed: cancelled, as an MPI request is. Nothing
  // touches its buffer afterwards (a cancelled recv leaves the message for a
  // later recv; a cancelled send is never delivered).
  ~InProcRequest() override {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (done_->complete) return;
    auto same = [&](const auto& e) { return e.done == done_; };
    if (is_recv_) {
      auto& q = s_->parked[mailbox_];
      q.erase(std::remove_if(q.begin(), q.end(), same), q.end());
    } else {
      auto& q = s_->inbox[mailbox_];
      q.erase(std::remove_if(q.begin(), q.end(), same), q.end());
    }
  }

  bool test() override {
    std::lock_guard<std::mutex> lock(s_->mu);
    check();
    return done_->complete;
  }

  void wait(Clock::time_point deadline) override {
    std::unique_lock<std::mutex> lock(s_->mu);
    while (!done_->complete) {
      if (s_->aborted) {
        throw AbortedError("rank " + std::to_string(rank_) + ": " + what_ +
                           " aborted: " + s_->abort_reason);
      }
      if (s_->cv.wait_until(lock, deadline) == std::cv_status::timeout && !done_->complete) {
        throw DeadlineExceededError("rank " + std::to_string(rank_) + ": " + what_ +
                                    " did not complete before the deadline (the peer never "
                                    "posted the matching operation)");
      }
    }
    check();
  }

  std::string describe() const override { return what_; }

 private:
  void check() {
    if (!done_->error.empty()) {
      throw InvalidArgumentError("rank " + std::to_string(rank_) + ": " + what_ + ": " +
                                 done_->error);
    }
  }
  std::shared_ptr<GroupState> s_;  // a request may outlive its transport group
  std::shared_ptr<GroupState::Done> done_;
  std::string what_;
  int rank_;
  bool is_recv_;
  int mailbox_;
  int peer_;
};

class InProcessTransport : public Transport {
 public:
  InProcessTransport(std::shared_ptr<GroupState> s, int rank) : s_(std::move(s)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return s_->size; }
  bool shared_address_space() const override { return true; }

  Request send(int peer, const void* data, size_t bytes, int tag) override {
    check_peer(peer, "send");
    auto done = std::make_shared<GroupState::Done>();
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      GroupState::Message m{rank_, tag, data, bytes, done};
      auto& parked = s_->parked[peer];
      auto it = std::find_if(parked.begin(), parked.end(), [&](const GroupState::Parked& p) {
        return p.source == rank_ && p.tag == tag;
      });
      if (it != parked.end()) {
        GroupState::deliver(m, it->data, it->bytes, *it->done);
        parked.erase(it);
      } else {
        s_->inbox[peer].push_back(m);
      }
    }
    s_->cv.notify_all();
    return Request(std::make_shared<InProcRequest>(s_, done,
                                                   "send of " + std::to_string(bytes) +
                                                       " bytes to rank " + std::to_string(peer) +
                                                       " (tag " + std::to_string(tag) + ")",
                                                   rank_, /*is_recv=*/false, peer, peer));
  }

  Request recv(int peer, void* data, size_t bytes, int tag) override {
    check_peer(peer, "recv");
    auto done = std::make_shared<GroupState::Done>();
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      auto& inbox = s_->inbox[rank_];
      auto it = std::find_if(inbox.begin(), inbox.end(), [&](const GroupState::Message& m) {
        return m.source == peer && m.tag == tag;
      });
      if (it != inbox.end()) {
        GroupState::deliver(*it, data, bytes, *done);
        inbox.erase(it);
      } else {
        s_->parked[rank_].push_back(GroupState::Parked{peer, tag, data, bytes, done});
      }
    }
    s_->cv.notify_all();
    return Request(std::make_shared<InProcRequest>(s_, done,
                                                   "recv of " + std::to_string(bytes) +
                                                       " bytes from rank " + std::to_string(peer) +
                                                       " (tag " + std::to_string(tag) + ")",
                                                   rank_, /*is_recv=*/true, rank_, peer));
  }

  bool probe_any(Envelope* env) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->aborted)
      throw AbortedError("rank " + std::to_string(rank_) + ": probe aborted: " + s_->abort_reason);
    const auto& inbox = s_->inbox[rank_];
    if (inbox.empty()) return false;
    env->source = inbox.front().source;
    env->tag = inbox.front().tag;
    env->bytes = inbox.front().bytes;
    return true;
  }

  void abort(const std::string& reason) override {
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      if (!s_->aborted) {
        s_->aborted = true;
        s_->abort_reason = reason;
      }
    }
    s_->cv.notify_all();
  }

 private:
  void check_peer(int peer, const char* what) const {
    DISTSTRAT_CHECK(0 <= peer && peer < s_->size && peer != rank_, kInvalidArgument, "rank ", rank_,
                    ": ", what, " to/from rank ", peer, " in a group of ", s_->size);
  }
  std::shared_ptr<GroupState> s_;
  int rank_;
};

}  // namespace

InProcessTransportGroup::InProcessTransportGroup(int size) : state_(std::make_shared<State>(size)) {
  DISTSTRAT_CHECK_GE(size, 1, "InProcessTransportGroup size");
  for (int r = 0; r < size; ++r)
    transports_.push_back(std::make_unique<InProcessTransport>(state_, r));
}
InProcessTransportGroup::~InProcessTransportGroup() = default;
int InProcessTransportGroup::size() const { return state_->size; }
Transport& InProcessTransportGroup::at(int rank) {
  DISTSTRAT_CHECK(0 <= rank && rank < size(), kInvalidArgument, "InProcessTransportGroup::at(",
                  rank, ")");
  return *transports_[rank];
}

}  // namespace diststrat
