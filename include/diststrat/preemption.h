// Stopping at a preemption signal at a step boundary every process agrees on
// (TensorFlow's PreemptionCheckpointHandler).
//
// Rules: should_stop is collective (every process calls it after every step,
// with the same step) and blocks, bounded by the strategy's timeout;
// signalled and notify_preemption are local, thread-safe and never block.
#pragma once

#include <csignal>
#include <cstdint>
#include <memory>
#include <vector>

#include "diststrat/strategy.h"

namespace diststrat {

struct PreemptionOptions {
  // Signals that mean "save and exit" (the cluster's grace-period signal).
  std::vector<int> signals = {SIGTERM};
  // Steps between cross-process agreements; every process must use the same
  // value. 1 = check at every step boundary.
  int check_every = 1;
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
class PreemptionHandler {
 public:
  explicit PreemptionHandler(Strategy& strategy, PreemptionOptions options = {});
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

 private:
  Strategy* strategy_;
  PreemptionOptions options_;
  struct SavedHandlers;
  std::unique_ptr<SavedHandlers> saved_;
};

}  // namespace diststrat
