// The CUDA implementation of GpuBackend (cuda_backend_impl.h, cuda_*.cc): CUDA
// runtime for devices, memory, streams and copies, cuBLAS for GEMMs,
// kernels.cu for the rest, NCCL (when built with it) and the shared-device
// reduction for collectives. The bounded waits below are in cuda_wait.cc.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "core/gpu_backend.h"

namespace diststrat {

std::unique_ptr<GpuBackend> make_cuda_backend();

namespace gpu {
// Returns when the work enqueued on `stream` (null: the legacy default
// stream) before the call is done: sleeps on a condition variable that a
// host function behind the work (cudaLaunchHostFunc) signals, looking at the
// stream every few ms for a failure. Throws DeadlineExceededError naming
// `what` past `deadline`, or the CUDA error the work raised. Never a blind
// cudaStreamSynchronize.
void wait_stream(void* stream, DeadlineClock::time_point deadline, const std::string& what);
// Returns when a recorded cudaEvent_t (of the current device) completed:
// sleeps on a condition variable that a host function signals, enqueued on a
// private non-blocking stream of the device behind a wait for the event (so
// the stream the event was recorded on is not held up), looking at the event
// every few ms for a failure. Same errors as wait_stream.
void wait_event(void* event, DeadlineClock::time_point deadline, const std::string& what);

// A host function enqueued on `stream` (null: the legacy default stream)
// behind the work enqueued so far (cudaLaunchHostFunc); wait_until sleeps on
// a condition variable until it ran. Its state is shared with the callback,
// so a waiter that gives up leaves the callback something valid to write.
// The constructor throws InternalError naming `what` when the host function
// cannot be enqueued. Not a wait by itself: callers loop over wait_until with
// their deadline and look for failures (a failed stream never runs it).
class HostSignalWait {
 public:
  HostSignalWait(void* stream, const std::string& what);
  // True once the host function ran; false when `until` came first.
  bool wait_until(DeadlineClock::time_point until);
  struct State;  // shared with the host function (cuda_wait.cc)

 private:
  std::shared_ptr<State> state_;
};
// How often a signal wait wakes to look for failures and the deadline.
constexpr std::chrono::milliseconds kSignalPoll{5};
}  // namespace gpu

}  // namespace diststrat
