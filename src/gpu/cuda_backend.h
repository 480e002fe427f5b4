// The CUDA implementation of GpuBackend (cuda_backend.cc): CUDA runtime for
// devices, memory, streams and copies, cuBLAS for GEMMs, kernels.cu for the
// rest, NCCL (when built with it) and the shared-device reduction for
// collectives.
#pragma once

#include <memory>

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
// Polls a recorded cudaEvent_t until it completes (same errors).
void wait_event(void* event, DeadlineClock::time_point deadline, const std::string& what);
}  // namespace gpu

}  // namespace diststrat
