// One error style for CUDA, cuBLAS and NCCL: a failing call becomes a
// diststrat::Error carrying the call, its error string, file and line.
// Out-of-memory becomes ResourceExhaustedError, everything else InternalError.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace diststrat {
namespace gpu {

// Clears the calling thread's last CUDA error before throwing, so the next
// kernel launch check (cudaGetLastError) does not report this failure again.
[[noreturn]] void throw_cuda_error(cudaError_t status, const char* call, const char* file,
                                   int line);
inline void check_cuda(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess) throw_cuda_error(status, call, file, line);
}
// After a failure that is deliberately ignored (cleanup in destructors,
// aborts): forget it, so it cannot poison the next launch check. Sticky
// errors (a faulted context) cannot be cleared; every later call reports them.
inline void clear_last_error() { (void)cudaGetLastError(); }

// A null stream handle is the legacy default stream, said explicitly: a
// translation unit built with per-thread default streams must not turn it
// into a stream that no longer orders with the replicas' (blocking) streams.
inline cudaStream_t stream_or_legacy(void* s) {
  return s ? static_cast<cudaStream_t>(s) : cudaStreamLegacy;
}

// cublasStatus_t / ncclResult_t are passed as int so this header needs neither.
void check_cublas(int status, const char* call, const char* file, int line);
void check_nccl(int status, const char* call, const char* file, int line);

}  // namespace gpu
}  // namespace diststrat

#define DISTSTRAT_CUDA_CHECK(call) ::diststrat::gpu::check_cuda((call), #call, __FILE__, __LINE__)
#define DISTSTRAT_CUBLAS_CHECK(call) \
  ::diststrat::gpu::check_cublas(static_cast<int>(call), #call, __FILE__, __LINE__)
#define DISTSTRAT_NCCL_CHECK(call) \
  ::diststrat::gpu::check_nccl(static_cast<int>(call), #call, __FILE__, __LINE__)
