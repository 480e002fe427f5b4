// PreemptionHandler: a scheduler's signal (SIGTERM by default) becomes a flag
// that every worker agrees on at a step, so all of them save and stop together.
#include <signal.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "diststrat/preemption.h"
#include "io/checkpoint_internal.h"

namespace diststrat {

using ckpt::is_multi_process;

// ---- preemption -----------------------------------------------------------------

namespace {
// Signals are per process, so this flag is too: the one piece of process-wide
// state, written only by the async-signal-safe handler below.
// A lock-free atomic (async-signal-safe): handlers constructed on several
// threads (workers as threads of one process) write it concurrently, which
// a volatile sig_atomic_t made a data race (found by TSan).
std::atomic<int> g_preemption_signalled{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free flag");
extern "C" void on_preemption_signal(int) {
  g_preemption_signalled.store(1, std::memory_order_relaxed);
}
}  // namespace

struct PreemptionHandler::SavedHandlers {
  std::vector<std::pair<int, struct sigaction>> previous;
};

PreemptionHandler::PreemptionHandler(Strategy& strategy, PreemptionOptions options)
    : strategy_(&strategy),
      options_(std::move(options)),
      saved_(std::make_unique<SavedHandlers>()) {
  DISTSTRAT_CHECK(options_.check_every >= 1, kInvalidArgument, "PreemptionHandler: check_every ",
                  options_.check_every, " must be at least 1");
  // Before this, the signal's default action would have ended the process.
  g_preemption_signalled.store(0, std::memory_order_relaxed);
  for (int sig : options_.signals) {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_preemption_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    struct sigaction old;
    DISTSTRAT_CHECK(::sigaction(sig, &sa, &old) == 0, kInvalidArgument,
                    "PreemptionHandler: cannot handle signal ", sig, ": ", std::strerror(errno));
    saved_->previous.emplace_back(sig, old);
  }
}

PreemptionHandler::~PreemptionHandler() {
  for (auto& [sig, old] : saved_->previous) ::sigaction(sig, &old, nullptr);
}

bool PreemptionHandler::signalled() const { return g_preemption_signalled != 0; }

void PreemptionHandler::notify_preemption() { g_preemption_signalled = 1; }

bool ckpt::preemption_signalled() {
  return g_preemption_signalled.load(std::memory_order_relaxed) != 0;
}

bool PreemptionHandler::should_stop(int64_t step) {
  if (step % options_.check_every != 0) return false;
  auto* p = dynamic_cast<CheckpointParticipant*>(strategy_);
  // A parameter server's workers meet through PS 0 even in one process.
  if (!is_multi_process(*strategy_) && !p) return signalled();
  CheckpointParticipant fallback;
  return (p ? *p : fallback).agree_to_stop(*strategy_, step, signalled());
}

}  // namespace diststrat
