// One call of the shared-memory communicator as the ranks meet in it: the
// comparison of what each rank calls, the barrier, abort and reset.
//
// Every call first publishes what it is (kind, count, dtype, reduce op,
// root) in its header, and every rank compares all ranks' calls right after
// the call's first barrier, before it reads or writes anything of a peer's:
// a rank whose call differs is named on every rank (InvalidArgumentError,
// then an abort, so a rank that looks later fails too) instead of the ranks
// exchanging bytes of different calls. Calls of nothing (count 0) meet at one
// barrier for it. The record is double-buffered by the parity of the first
// barrier's number: a peer can write the next call's record while this rank
// still compares, but not the one after (that needs this rank's next barrier).
//
// Barrier: each rank bumps its own counter (release) and waits until every
// counter has reached its value (acquire), spinning, then yielding, then
// sleeping, until the deadline; then it throws DeadlineExceededError naming
// the ranks whose counters lag. abort() raises this rank's abort word, which
// every waiting peer checks, and its reason, which they quote.

#include <algorithm>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

#include "allreduce/mpi_util.h"
#include "allreduce/shm_internal.h"
#include "core/flight_recorder.h"
#include "core/fnv1a.h"
#include "core/user_text.h"

namespace diststrat {
namespace shm {

CallRecord record(CallKind kind, size_t count, DType dtype, const ReduceOp* op, int root,
                  const std::string& name) {
  CallRecord r;
  r.name_hash = fnv1a(name);
  head_and_tail_to(name, sizeof r.name - 1, r.name);
  r.kind = static_cast<uint32_t>(kind);
  r.count = count;
  r.dtype = kind == CallKind::kBarrier ? 0 : static_cast<int32_t>(dtype);
  r.op = op ? static_cast<int32_t>(*op) : -1;
  r.root = root;
  return r;
}

namespace {

// "5 x float32 in all_gather", "4 x float32 from root 1 in broadcast", "a barrier".
std::string describe_record(const CallRecord& r) {
  static const char* const kNames[] = {"?",          "all_reduce",     "broadcast",
                                       "all_gather", "reduce_scatter", "barrier"};
  const char* kind = r.kind < 6 ? kNames[r.kind] : "?";
  const std::string name(r.name, strnlen(r.name, sizeof r.name));
  const std::string named =
      name.empty() ? std::string(" (unnamed)")
                   : " '" + echo(name) + (name.size() == sizeof r.name - 1 ? "...'" : "'");
  if (r.kind == static_cast<uint32_t>(CallKind::kBarrier)) return "a barrier" + named;
  const bool known = r.dtype >= 0 && r.dtype <= static_cast<int32_t>(DType::kInt64);
  std::string s =
      std::to_string(r.count) + " x " + (known ? dtype_name(static_cast<DType>(r.dtype)) : "?");
  if (r.op >= 0 && r.op <= static_cast<int32_t>(ReduceOp::kProduct)) {
    s += std::string(" ") + reduce_op_name(static_cast<ReduceOp>(r.op));
  }
  if (r.kind == static_cast<uint32_t>(CallKind::kBroadcast))
    s += " from root " + std::to_string(r.root);
  return s + " in " + kind + named;
}

}  // namespace
}  // namespace shm

ShmCommunicator::Call::Call(ShmCommunicator* c, const CallText& what, const shm::CallRecord& rec)
    : c_(c), what_(what) {
  deadline_ = Clock::now() + c_->options_.timeout;
  check_abort();
  slot_ = static_cast<int>((c_->barriers_ + 1) % 2);
  c_->headers_[c_->rank_]->calls[slot_] = rec;
}

void ShmCommunicator::Call::empty() {
  ++c_->chunks_;
  barrier();
}

void ShmCommunicator::Call::barrier() {
  const uint64_t target = ++c_->barriers_;
  c_->headers_[c_->rank_]->arrived.store(target, std::memory_order_release);
  for (int q = 0; q < c_->size_; ++q) {
    if (q == c_->rank_) continue;
    auto& counter = c_->headers_[q]->arrived;
    if (counter.load(std::memory_order_acquire) < target) flight::note_waiting(q);
    for (unsigned spin = 0; counter.load(std::memory_order_acquire) < target; ++spin) {
      if ((spin & 63) == 0) {
        check_abort();
        if (Clock::now() >= deadline_) timeout(target);
        if (spin >= 1024) c_->progress();
      }
      if (spin < 1024) continue;
      // Yields, then sleeps; only a few yields when the ranks outnumber the
      // CPUs they may run on together: a waiting rank that stays runnable
      // (yielding) then competes for a core with the rank it waits for (3 ranks and a busy process
      // on 2 cores: a test of small segments took 115 s with 16384 yields,
      // 1 s with 64, 15 s with none). With a core each, yielding keeps the
      // wake-up prompt (2 workers of train_bench on 2 cores: 64 yields
      // before sleeping cost a fifth of their throughput), also when each
      // rank is bound to its own core.
      if (spin < (c_->oversubscribed_ ? 1024 + 64 : 16384)) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }
  // A peer that gave this barrier up at its deadline had arrived before it
  // did: its counter says "here", its gave_up_at says it left. (Not any
  // abort word: a peer that completed the barrier may abort afterwards, e.g.
  // leave the group on an error of its own, and this call is still whole.)
  for (int q = 0; q < c_->size_; ++q) {
    const uint64_t g = c_->headers_[q]->gave_up_at.load(std::memory_order_acquire);
    if (q != c_->rank_ && g != 0 && g <= target) check_abort();
  }
  if (!compared_) {
    compared_ = true;
    compare_calls();
  }
}

// Every rank sees the same records, so every rank throws alike.
void ShmCommunicator::Call::compare_calls() {
  const shm::CallRecord& first = c_->headers_[0]->calls[slot_];
  for (int q = 1; q < c_->size_; ++q) {
    const shm::CallRecord& other = c_->headers_[q]->calls[slot_];
    if (other == first) continue;
    // Long names are shown by their start and end only.
    const bool hidden = std::memcmp(first.name, other.name, sizeof first.name) == 0 &&
                        first.name_hash != other.name_hash;
    const std::string msg = "rank " + std::to_string(c_->rank_) + ": " + what_.str() +
                            ": ranks disagree on the call: rank 0 has " +
                            shm::describe_record(first) + ", rank " + std::to_string(q) + " has " +
                            shm::describe_record(other) +
                            (hidden ? " (the names differ where they are not shown)" : "");
    c_->abort(msg);
    throw InvalidArgumentError(msg);
  }
}

void ShmCommunicator::Call::check_abort() {
  for (int q = 0; q < c_->size_; ++q) {
    if (c_->headers_[q]->aborted.load(std::memory_order_acquire)) {
      c_->failed_ = true;
      const shm::Header* h = c_->headers_[q];
      if (q == c_->rank_) {
        throw AbortedError("rank " + std::to_string(c_->rank_) + ": " + what_.str() +
                           " aborted by rank " + std::to_string(q) + ": " + c_->own_abort_reason());
      }
      // The rank whose failure it is (q itself, or the one q passes on).
      const int origin = h->abort_origin >= 0 && h->abort_origin < c_->size_ ? h->abort_origin : q;
      const std::string reason(h->abort_reason, strnlen(h->abort_reason, sizeof(h->abort_reason)));
      c_->observe_abort(origin, reason);
      throw AbortedError("rank " + std::to_string(c_->rank_) + ": " + what_.str() +
                         " aborted by rank " + std::to_string(origin) +
                         (reason.empty() ? std::string() : ": " + reason));
    }
  }
}

void ShmCommunicator::Call::timeout(uint64_t target) {
  std::ostringstream missing;
  int n = 0;
  for (int q = 0; q < c_->size_; ++q) {
    if (c_->headers_[q]->arrived.load(std::memory_order_acquire) < target) {
      missing << (n++ ? ", " : "") << q;
    }
  }
  const std::string msg = "rank " + std::to_string(c_->rank_) + ": " + what_.str() + ": rank" +
                          (n > 1 ? "s " : " ") + missing.str() + " did not arrive within " +
                          std::to_string(c_->options_.timeout.count()) +
                          " ms (stopped: SIGSTOP or a debugger; or busy elsewhere: a slower "
                          "step, another collective)";
  // This rank gives the call up: a late peer must not complete it (it would
  // find this rank's arrival and go on, while this rank's caller sees an
  // error), nor may the next calls pair up as if nothing happened. The abort
  // fails them on every rank until reset().
  c_->abort(msg);
  c_->headers_[c_->rank_]->gave_up_at.store(target, std::memory_order_release);
  throw DeadlineExceededError(msg);
}

void ShmCommunicator::abort(const std::string& reason) {
  failed_ = true;
  mpi::mark_failed();
  std::lock_guard<std::mutex> lock(abort_mu_);
  abort_reason_ = reason;
  shm::Header* h = headers_[rank_];
  if (h->aborted.load(std::memory_order_relaxed)) return;  // the first reason stays
  const bool passed_on = observed_origin_ >= 0 && observed_origin_ != rank_;
  const std::string& text = passed_on ? observed_reason_ : reason;
  const size_t n = std::min(text.size(), sizeof(h->abort_reason) - 1);
  std::memcpy(h->abort_reason, text.data(), n);
  h->abort_reason[n] = '\0';
  h->abort_origin = passed_on ? observed_origin_ : rank_;
  h->aborted.store(1, std::memory_order_release);
}

void ShmCommunicator::reset() {
  shm::Header* mine = headers_[rank_];
  {
    std::lock_guard<std::mutex> lock(abort_mu_);
    abort_reason_.clear();
    observed_origin_ = -1;
    observed_reason_.clear();
    mine->abort_reason[0] = '\0';
    mine->abort_origin = -1;
    mine->aborted.store(0, std::memory_order_release);
    mine->gave_up_at.store(0, std::memory_order_release);
  }
  const uint64_t epoch = ++resets_;
  mine->reset_barriers = barriers_;
  mine->reset_epoch.store(epoch, std::memory_order_release);
  const auto deadline = Clock::now() + options_.timeout;
  uint64_t top = barriers_;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    for (unsigned spin = 0; headers_[q]->reset_epoch.load(std::memory_order_acquire) < epoch;
         ++spin) {
      if (Clock::now() >= deadline) {
        std::string missing;
        for (int p = 0; p < size_; ++p) {
          if (p != rank_ && headers_[p]->reset_epoch.load(std::memory_order_acquire) < epoch)
            missing += (missing.empty() ? "" : ", ") + std::to_string(p);
        }
        failed_ = true;
        throw DeadlineExceededError("rank " + std::to_string(rank_) + ": reset: rank(s) " +
                                    missing + " did not call reset() within " +
                                    std::to_string(options_.timeout.count()) +
                                    " ms (every rank of the group must reset it)");
      }
      if (spin >= 1024) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    top = std::max(top, headers_[q]->reset_barriers);
  }
  // Every rank computes the same `top` (the values were written before the
  // epochs it waited for). A rank behind it moves its counter up; a rank
  // that already left its reset has not passed `top` yet, since its next
  // barrier waits for everybody else's.
  barriers_ = top;
  mine->arrived.store(top, std::memory_order_release);
  chunks_ = 0;
  failed_ = false;
}

}  // namespace diststrat
