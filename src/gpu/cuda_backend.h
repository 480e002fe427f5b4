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
// Polls `stream` until its work is done: throws DeadlineExceededError naming
// `what` past `deadline`, or the CUDA error the work raised. Never a blind
// cudaStreamSynchronize.
void wait_stream(void* stream, DeadlineClock::time_point deadline, const std::string& what);
}  // namespace gpu

}  // namespace diststrat
