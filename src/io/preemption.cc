// PreemptionHandler: a scheduler's signal (SIGTERM by default) becomes a flag
// that every worker agrees on at a step, so all of them save and stop together.
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "diststrat/checkpoint_manager.h"
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
// When the first signal arrived (CLOCK_MONOTONIC, ns; 0: none yet): the
// grace period counts from it. clock_gettime is async-signal-safe.
std::atomic<int64_t> g_preemption_time_ns{0};
static_assert(std::atomic<int64_t>::is_always_lock_free,
              "the signal handler needs a lock-free time");
int64_t monotonic_ns() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}
void mark_preempted() {
  int64_t none = 0;
  g_preemption_time_ns.compare_exchange_strong(none, monotonic_ns(), std::memory_order_relaxed);
  g_preemption_signalled.store(1, std::memory_order_relaxed);
}
extern "C" void on_preemption_signal(int) {
  const int saved_errno = errno;
  mark_preempted();
  errno = saved_errno;
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
  g_preemption_time_ns.store(0, std::memory_order_relaxed);
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

void PreemptionHandler::notify_preemption() { mark_preempted(); }

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

// ---- run(step_fn) ----------------------------------------------------------------

PreemptionHandler::PreemptionHandler(CheckpointManager& manager, PreemptionOptions options)
    : PreemptionHandler(manager.checkpoint().strategy(), std::move(options)) {
  DISTSTRAT_CHECK(std::isfinite(options_.grace_period_s) && options_.grace_period_s >= 0,
                  kInvalidArgument, "PreemptionHandler: grace_period_s ", options_.grace_period_s,
                  " must be a finite number >= 0");
  DISTSTRAT_CHECK(options_.exit_code >= 0 && options_.exit_code <= 255, kInvalidArgument,
                  "PreemptionHandler: exit_code ", options_.exit_code, " is not in [0, 255]");
  manager_ = &manager;
  // TensorFlow's handler restores at creation; the run count goes on from
  // the restored checkpoint's step.
  if (manager.restore_or_initialize()) run_calls_ = manager.restored_step().value_or(0);
}

double PreemptionHandler::now() const {
  if (options_.clock) return options_.clock();
  return static_cast<double>(monotonic_ns()) * 1e-9;
}

void PreemptionHandler::before_step() {
  DISTSTRAT_CHECK(manager_ != nullptr, kFailedPrecondition,
                  "PreemptionHandler::run needs a handler made on a CheckpointManager "
                  "(PreemptionHandler(manager, options))");
  DISTSTRAT_CHECK(!preempted_, kFailedPrecondition, "PreemptionHandler::run after step ",
                  run_calls_,
                  ": this process was preempted and its checkpoint saved; stop training");
  step_start_ = now();
}

void PreemptionHandler::save_preempted() {
  const double t0 = now();
  manager_->save(run_calls_, {}, /*check_interval=*/false);
  save_seconds_ = std::max(save_seconds_, now() - t0);
}

void PreemptionHandler::after_step() {
  ++run_calls_;
  const double end = now();
  longest_step_ = std::max(longest_step_, end - step_start_);
  if (!in_grace_) {
    if (!should_stop(run_calls_)) return;
    if (signalled() && !signal_time_) {
      const int64_t ns = g_preemption_time_ns.load(std::memory_order_relaxed);
      signal_time_ = options_.clock || ns == 0 ? end : static_cast<double>(ns) * 1e-9;
    }
    save_preempted();
    if (options_.grace_period_s <= 0) {
      preempted_ = true;
    } else {
      // TensorFlow's grace period: a checkpoint now, more training, and the
      // last checkpoint just before the period runs out.
      in_grace_ = true;
      strategy_->logger().info("PreemptionHandler: preempted; saved step ", run_calls_,
                               ", training on for the grace period of ", options_.grace_period_s,
                               " s");
      return;
    }
  } else {
    if (signalled() && !signal_time_) signal_time_ = end;
    // Out of time here when one more step and a save would overrun the
    // grace period; every process stops at the step any process says so.
    const bool out_of_time = signal_time_ && end + longest_step_ + save_seconds_ >=
                                                 *signal_time_ + options_.grace_period_s;
    auto* p = dynamic_cast<CheckpointParticipant*>(strategy_);
    CheckpointParticipant fallback;
    const bool stop = !is_multi_process(*strategy_) && !p
                          ? out_of_time
                          : (p ? *p : fallback).agree_to_stop(*strategy_, run_calls_, out_of_time);
    if (!stop) return;
    save_preempted();
    preempted_ = true;
  }
  strategy_->logger().info("PreemptionHandler: preempted; saved step ", run_calls_,
                           " and exiting with status ", options_.exit_code);
  std::fflush(nullptr);
  if (options_.exit_fn) {
    options_.exit_fn(options_.exit_code);
    return;
  }
  std::exit(options_.exit_code);
}

}  // namespace diststrat
