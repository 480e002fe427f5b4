// NCCL's rule for a communicator: ncclCommAbort must not run while another
// thread is inside an NCCL call on it. A CallGate enforces it: calls enter
// under a shared lock (replicas still call concurrently), abort and reset
// hold it exclusively, so an abort waits for the calls in flight (each only
// enqueues or polls: never a wait) and later calls see the abort.
// Header-only and free of CUDA/NCCL, so the tests' fake NCCL uses the same
// gate as NcclCommunicator. Thread-safe.
#pragma once

#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>

#include "diststrat/error.h"

namespace diststrat {
namespace gpu {

class CallGate {
 public:
  // Runs `call` (one NCCL call) unless the gate was aborted; then throws
  // AbortedError naming `what` and the abort's reason.
  template <typename Call>
  auto enter(const std::string& what, Call&& call) {
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (aborted_) throw AbortedError(what + ": " + reason_);
    return call();
  }
  // Runs `do_abort` once no call is inside; false (and nothing run) when the
  // gate was already aborted.
  template <typename Abort>
  bool abort(const std::string& why, Abort&& do_abort) {
    std::unique_lock<std::shared_mutex> lock(mu_);
    if (aborted_) return false;
    aborted_ = true;
    reason_ = why;
    do_abort();
    return true;
  }
  // After an abort: runs `recreate` with no call inside and opens the gate
  // again (a throwing `recreate` leaves it aborted). No-op when not aborted.
  template <typename Recreate>
  void reset(Recreate&& recreate) {
    std::unique_lock<std::shared_mutex> lock(mu_);
    if (!aborted_) return;
    recreate();
    aborted_ = false;
    reason_.clear();
  }
  bool aborted() const {
    std::shared_lock<std::shared_mutex> lock(mu_);
    return aborted_;
  }

 private:
  mutable std::shared_mutex mu_;
  bool aborted_ = false;
  std::string reason_;
};

}  // namespace gpu
}  // namespace diststrat
