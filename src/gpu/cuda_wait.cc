// Bounded waits for CUDA work (cuda_backend.h): a host function behind the
// work signals a condition variable, and the waiter wakes every few ms to
// look for a failed stream or event and for its deadline.
#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>

#include "diststrat/error.h"
#include "gpu/cuda_backend.h"
#include "gpu/cuda_check.h"

namespace diststrat {
namespace gpu {

struct HostSignalWait::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
};

namespace {
// Runs on a driver thread once everything before it on the stream is done.
void CUDART_CB signal_host(void* arg) {
  auto* owner = static_cast<std::shared_ptr<HostSignalWait::State>*>(arg);
  {
    std::lock_guard<std::mutex> lock((*owner)->mu);
    (*owner)->done = true;
  }
  (*owner)->cv.notify_all();
  delete owner;
}
}  // namespace

HostSignalWait::HostSignalWait(void* stream, const std::string& what)
    : state_(std::make_shared<State>()) {
  auto* arg = new std::shared_ptr<State>(state_);
  const cudaError_t st = cudaLaunchHostFunc(stream_or_legacy(stream), signal_host, arg);
  if (st != cudaSuccess) {
    delete arg;
    throw_cuda_error(st, ("cudaLaunchHostFunc while waiting for " + what).c_str(), __FILE__,
                     __LINE__);
  }
}

bool HostSignalWait::wait_until(DeadlineClock::time_point until) {
  std::unique_lock<std::mutex> lock(state_->mu);
  return state_->cv.wait_until(lock, until, [&] { return state_->done; });
}

void wait_stream(void* stream, DeadlineClock::time_point deadline, const std::string& what) {
  const cudaStream_t s = stream_or_legacy(stream);
  const auto fail = [&](cudaError_t st) {
    throw_cuda_error(st, ("cudaStreamQuery while waiting for " + what).c_str(), __FILE__, __LINE__);
  };
  cudaError_t st = cudaStreamQuery(s);
  if (st == cudaSuccess) return;
  if (st != cudaErrorNotReady) fail(st);
  // Sleep until the host function behind the work fires; wake every few ms
  // to look for a failed stream (whose host function may never run) and for
  // the deadline.
  HostSignalWait signal(stream, what);
  for (;;) {
    if (signal.wait_until(std::min(deadline, DeadlineClock::now() + kSignalPoll))) break;
    st = cudaStreamQuery(s);
    if (st == cudaSuccess) return;  // the host function is about to run, or already ran
    if (st != cudaErrorNotReady) fail(st);
    if (DeadlineClock::now() >= deadline) {
      throw DeadlineExceededError(what + ": the GPU work did not finish before the deadline");
    }
  }
  // Everything before the host function ran; it may still have failed.
  st = cudaStreamQuery(s);
  if (st != cudaSuccess && st != cudaErrorNotReady) fail(st);
}

namespace {
// One non-blocking stream per device that only waits for events: a host
// function behind cudaStreamWaitEvent on it signals an event's completion
// without holding up the stream the event was recorded on (a copy pipeline
// keeps enqueueing there). Never destroyed: it lives as long as the process's
// CUDA context, as the runtime's own streams do.
cudaStream_t event_waiter_stream(int device) {
  static std::mutex mu;
  static std::map<int, cudaStream_t>* streams = new std::map<int, cudaStream_t>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams->find(device);
  if (it != streams->end()) return it->second;
  cudaStream_t s = nullptr;
  DISTSTRAT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  (*streams)[device] = s;
  return s;
}
}  // namespace

void wait_event(void* event, DeadlineClock::time_point deadline, const std::string& what) {
  const cudaEvent_t e = static_cast<cudaEvent_t>(event);
  const auto fail = [&](cudaError_t st) {
    throw_cuda_error(st, ("cudaEventQuery while waiting for " + what).c_str(), __FILE__, __LINE__);
  };
  cudaError_t st = cudaEventQuery(e);
  if (st == cudaSuccess) return;
  if (st != cudaErrorNotReady) fail(st);
  int device = 0;
  DISTSTRAT_CUDA_CHECK(cudaGetDevice(&device));
  const cudaStream_t waiter = event_waiter_stream(device);
  DISTSTRAT_CUDA_CHECK(cudaStreamWaitEvent(waiter, e, 0));
  HostSignalWait signal(waiter, what);
  for (;;) {
    // The event itself is looked at every few ms too: a host function queued
    // behind an earlier wait that never completes would never run.
    if (signal.wait_until(std::min(deadline, DeadlineClock::now() + kSignalPoll))) break;
    st = cudaEventQuery(e);
    if (st == cudaSuccess) return;
    if (st != cudaErrorNotReady) fail(st);
    if (DeadlineClock::now() >= deadline) {
      throw DeadlineExceededError(what + ": the GPU work did not finish before the deadline");
    }
  }
  st = cudaEventQuery(e);
  if (st != cudaSuccess && st != cudaErrorNotReady) fail(st);
}

}  // namespace gpu
}  // namespace diststrat
