// Stopping at a preemption signal at a step boundary every process agrees on
// (TensorFlow's PreemptionCheckpointHandler), and run(step_fn), which also
// saves and exits for you.
//
// Rules: should_stop and run are collective (every process calls them after
// / for every step, with the same step) and block, bounded by the strategy's
// timeout; signalled and notify_preemption are local, thread-safe and never
// block.
#pragma once

#include <csignal>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "diststrat/strategy.h"

namespace diststrat {

class CheckpointManager;

// The exit status of run(step_fn) after its preemption save, by default:
// 128 + SIGTERM, what the launcher would have seen had the signal ended the
// process, so that whatever restarts a SIGTERMed job (a Kubernetes Job, the
// MPI Operator, a shell loop) restarts this one to resume; TensorFlow's
// PreemptionCheckpointHandler exits with it on Google Cloud (elsewhere with
// the arbitrary 42). Set PreemptionOptions::exit_code = 0 to report success.
constexpr int kPreemptedExitCode = 143;

struct PreemptionOptions {
  // Signals that mean "save and exit" (the cluster's grace-period signal).
  std::vector<int> signals = {SIGTERM};
  // Steps between cross-process agreements; every process must use the same
  // value. 1 = check at every step boundary.
  int check_every = 1;

  // ---- run(step_fn) only (TensorFlow's TerminationConfig) ----
  // Seconds between the signal and the preemption itself (TensorFlow's
  // grace_period). 0: save at the step every process agrees on and exit.
  // > 0: save there, train on, and save again and exit at the last step
  // boundary that leaves time for one more step (the longest seen) and a
  // save (as long as the first) before the grace period ends, counted from
  // the signal. Every process must use the same value.
  double grace_period_s = 0;
  // The process's exit status after the preemption save (see kPreemptedExitCode).
  int exit_code = kPreemptedExitCode;
  // TensorFlow's exit_fn: called with exit_code after the save instead of
  // std::exit(exit_code) (stdout and stderr are flushed first either way).
  // If it returns, run() returns and preempted() is true: stop training.
  std::function<void(int exit_code)> exit_fn;
  // The grace period's clock, in seconds (tests inject one; the signal's
  // time is then when run() first sees it). Empty: the monotonic clock, and
  // the signal's time is when it arrived.
  std::function<double()> clock;
};

// TensorFlow's PreemptionCheckpointHandler: catches the preemption signal and
// lets the training loop stop at a step boundary that every process agrees on.
//
//   ```cpp fragment=preemption
//   ds::PreemptionHandler preemption(strategy);
//   for (int64_t step = 0; step < kSteps; ++step) {
//     train_one_step(step);
//     if (preemption.should_stop(step)) { manager.save(step, md); return 0; }
//   }
//   ```
//
// The signal handler only sets a flag (async-signal-safe); the flag is per
// process (signals are), shared by every PreemptionHandler alive. The
// previous handlers are restored on destruction.
//
// run(step_fn), TensorFlow's PreemptionCheckpointHandler.run: the handler
// made on a CheckpointManager restores its latest checkpoint (restore_or_
// initialize) and counts the calls of run() from that checkpoint's step
// (total_run_calls(), saved as the checkpoint's step). After each step it
// agrees with the other processes as should_stop does; on a preemption it
// saves through the manager (step total_run_calls(), ignoring
// checkpoint_interval) at that step boundary and exits with
// PreemptionOptions::exit_code (143 by default). The state to resume --
// model, optimizer, data position -- is what the manager's Checkpoint holds
// (a Checkpoint of named objects can hold a DataPosition):
//
//   ```cpp fragment=preemption
//   ds::PreemptionHandler handler(manager);           // restores the latest checkpoint
//   while (handler.total_run_calls() < kSteps)
//     handler.run([&] { train_one_step(handler.total_run_calls()); });
//   ```
class PreemptionHandler {
 public:
  explicit PreemptionHandler(Strategy& strategy, PreemptionOptions options = {});
  // For run(step_fn): `manager` (which must outlive the handler) is
  // restored at once (restore_or_initialize: collective, blocking).
  explicit PreemptionHandler(CheckpointManager& manager, PreemptionOptions options = {});
  ~PreemptionHandler();
  PreemptionHandler(const PreemptionHandler&) = delete;
  PreemptionHandler& operator=(const PreemptionHandler&) = delete;

  // Whether this process received a preemption signal.
  bool signalled() const;
  // Collective at step boundaries: every process calls it after every step
  // with the same `step`; on steps that are multiples of check_every the
  // processes agree (CheckpointParticipant::agree_to_stop: a max-reduction
  // over every replica in sync; the parameter server's workers ask PS 0,
  // which fixes one stop step for all without holding anyone back), and it
  // returns true on every process at that same step. Cross-replica context.
  // Blocking (bounded by the strategy's timeout).
  bool should_stop(int64_t step);
  // Marks this process preempted, exactly as the signal would: for a
  // scheduler that announces preemption another way (a cloud's maintenance
  // notice polled over HTTP, a Kubernetes hook) and for tests. The next
  // should_stop that agrees stops every process at one step.
  // Async-signal-safe, thread-safe, never blocks.
  static void notify_preemption();
  [[deprecated("renamed to notify_preemption()")]] static void raise_for_testing() {
    notify_preemption();
  }

  // Runs one training step `step_fn()` (which calls Strategy::run) and
  // returns its result; then, at the step boundary, the preemption check
  // above: on a preemption, saves and exits (or calls exit_fn). Collective,
  // cross-replica context, blocking. Needs the CheckpointManager
  // constructor (else FailedPreconditionError); after preempted(),
  // FailedPreconditionError. step_fn's exceptions pass through, uncounted.
  template <typename StepFn>
  auto run(StepFn&& step_fn) -> decltype(step_fn()) {
    before_step();
    if constexpr (std::is_void_v<decltype(step_fn())>) {
      step_fn();
      after_step();
    } else {
      auto result = step_fn();
      after_step();
      return result;
    }
  }
  // run() calls over the job's life: the restored checkpoint's step plus the
  // calls of this process since (TensorFlow's total_run_calls).
  int64_t total_run_calls() const { return run_calls_; }
  // Whether run() saved on a preemption and exit_fn returned.
  bool preempted() const { return preempted_; }

 private:
  void before_step();
  void after_step();
  void save_preempted();
  double now() const;

  Strategy* strategy_;
  PreemptionOptions options_;
  struct SavedHandlers;
  std::unique_ptr<SavedHandlers> saved_;
  CheckpointManager* manager_ = nullptr;
  int64_t run_calls_ = 0;
  bool preempted_ = false;
  // The grace period (run only): after the first save, until the deadline.
  bool in_grace_ = false;
  std::optional<double> signal_time_;
  double step_start_ = 0, longest_step_ = 0, save_seconds_ = 0;
};

}  // namespace diststrat
