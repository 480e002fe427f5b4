// One error style for CUDA and cuBLAS (cuda_check.h): a failing call becomes
// ResourceExhaustedError (out of memory) or InternalError naming the call,
// its error string, file and line.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "diststrat/error.h"
#include "gpu/cuda_check.h"

namespace diststrat {
namespace gpu {

void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  clear_last_error();  // reported here: the next launch check must not see it again
  const std::string msg =
      detail::str_cat("CUDA call ", call, " failed: ", cudaGetErrorString(status), " (",
                      cudaGetErrorName(status), ") at ", file, ":", line);
  if (status == cudaErrorMemoryAllocation) throw ResourceExhaustedError(msg);
  throw InternalError(msg);
}

void check_cublas(int status, const char* call, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  clear_last_error();  // a failed cuBLAS call may leave a runtime error behind
  const cublasStatus_t s = static_cast<cublasStatus_t>(status);
  const std::string msg =
      detail::str_cat("cuBLAS call ", call, " failed: ", cublasGetStatusString(s), " (",
                      cublasGetStatusName(s), ") at ", file, ":", line);
  if (s == CUBLAS_STATUS_ALLOC_FAILED) throw ResourceExhaustedError(msg);
  throw InternalError(msg);
}

}  // namespace gpu
}  // namespace diststrat
