// The CUDA GpuBackend object: the visible devices and their properties, the
// teardown that releases cuBLAS handles and pinned buffers only after a
// bounded wait, and the collectives it makes (NCCL, shared-device groups).
#include "gpu/cuda_backend.h"

#include <cstdio>
#include <set>

#include "gpu/cuda_backend_impl.h"
#include "gpu/shared_device_group.h"
#if DISTSTRAT_HAVE_NCCL
#include "gpu/nccl_communicator.h"
#endif

namespace diststrat {
namespace gpu {

CudaBackend::CudaBackend() {
  const cudaError_t st = cudaGetDeviceCount(&count_);
  if (st != cudaSuccess) {
    count_ = 0;
    reason_ = std::string(cudaGetErrorName(st)) + ": " + cudaGetErrorString(st);
    clear_last_error();
  }
  try {
    teardown_timeout_ = timeout_from_env().value_or(teardown_timeout_);
  } catch (const Error&) {
    // A bad DISTSTRAT_TIMEOUT is reported where a strategy reads it; the
    // backend keeps the default.
  }
}

// cublasDestroy and cudaFreeHost synchronize the whole device, without a
// deadline: each device's handles and pinned buffers are released only
// after a completed wait for its streams (synchronize_device, bounded by
// DISTSTRAT_TIMEOUT or 300 s). Past it they are leaked with a message
// rather than blocking in a destructor. At process exit (the runtime
// unloading) nothing runs any more and nothing is released.
CudaBackend::~CudaBackend() {
  std::set<int> ordinals;
  for (const auto& [key, handle] : blas_) ordinals.insert(std::get<0>(key));
  for (const RetiredBlas& r : retired_blas_) ordinals.insert(r.ordinal);
  for (const Stage& st : stages_) ordinals.insert(st.ordinal);
  for (int o : ordinals) {
    const cudaError_t set = cudaSetDevice(o);
    if (set == cudaErrorCudartUnloading) break;
    try {
      wait_device(o, DeadlineClock::now() + teardown_timeout_,
                  detail::str_cat("GPU ", o,
                                  ": draining the device before releasing its cuBLAS "
                                  "handles and pinned staging buffers"));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "diststrat: %s; leaking them rather than block\n", e.what());
      continue;
    }
    for (auto& [key, handle] : blas_) {
      if (std::get<0>(key) == o) cublasDestroy(handle);
    }
    for (const RetiredBlas& r : retired_blas_) {
      if (r.ordinal != o) continue;
      cublasDestroy(r.handle);
      if (r.mark) cudaEventDestroy(r.mark);
    }
    for (Stage& st : stages_) {
      if (st.ordinal != o) continue;
      if (st.buf) cudaFreeHost(st.buf);
      if (st.done) cudaEventDestroy(st.done);
    }
  }
  clear_last_error();
}

GpuInfo CudaBackend::info(int ordinal) {
  check_ordinal(ordinal);
  cudaDeviceProp p{};
  DISTSTRAT_CUDA_CHECK(cudaGetDeviceProperties(&p, ordinal));
  GpuInfo g;
  g.name = p.name;
  g.total_bytes = p.totalGlobalMem;
  g.compute_capability = p.major * 10 + p.minor;
  char uuid[64];
  const unsigned char* u = reinterpret_cast<const unsigned char*>(p.uuid.bytes);
  std::snprintf(uuid, sizeof(uuid),
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
                u[14], u[15]);
  g.uuid = uuid;
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  size_t free_b = 0, total_b = 0;
  DISTSTRAT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  g.free_bytes = free_b;
  return g;
}

std::vector<std::unique_ptr<Communicator>> CudaBackend::shared_device_group(
    const SharedDeviceGroupSpec& spec, const CommunicationOptions& options) {
  return make_shared_device_group(spec, options);
}

#if DISTSTRAT_HAVE_NCCL
std::vector<std::unique_ptr<Communicator>> CudaBackend::nccl_local_group(
    const std::vector<int>& ordinals, const std::vector<void*>& streams,
    const CommunicationOptions& options) {
  return make_nccl_local_group(ordinals, streams, options);
}
std::string CudaBackend::nccl_version() { return nccl_version_string(); }
std::string CudaBackend::nccl_unique_id() { return make_nccl_unique_id(); }
std::unique_ptr<Communicator> CudaBackend::nccl_communicator(const std::string& unique_id, int rank,
                                                             int size, int ordinal, void* stream,
                                                             const CommunicationOptions& options) {
  return make_nccl_communicator(unique_id, rank, size, ordinal, stream, options);
}
#endif

}  // namespace gpu

std::unique_ptr<GpuBackend> make_cuda_backend() { return std::make_unique<gpu::CudaBackend>(); }

}  // namespace diststrat
