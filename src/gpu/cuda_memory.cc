// The CUDA backend's device memory and copies: cudaMalloc / cudaFree, async
// copies and memsets, and device -> pageable host copies staged through a
// pool of pinned buffers so that every wait is bounded.
#include <algorithm>
#include <cstdio>
#include <cstring>

#include "gpu/cuda_backend.h"
#include "gpu/cuda_backend_impl.h"

#include "core/step_capture.h"

namespace diststrat {
namespace gpu {

namespace {
// Device -> pageable host copies go through pinned buffers of this size, two
// at a time (one fills on the GPU while the other is copied out on the host).
constexpr size_t kStageBytes = 8u << 20;
}  // namespace

void* CudaBackend::raw_malloc(int ordinal, size_t bytes) {
  check_ordinal(ordinal);
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  void* p = nullptr;
  const cudaError_t st = cudaMalloc(&p, bytes);
  if (st == cudaErrorMemoryAllocation) {
    clear_last_error();  // not sticky: clear it
    return nullptr;
  }
  DISTSTRAT_CUDA_CHECK(st);
  return p;
}

void CudaBackend::raw_free(int ordinal, void* ptr) {
  // Called from destructors: report, never throw. The caller waited for the
  // device first (synchronize_device), so cudaFree's implicit device-wide
  // synchronization has nothing left to wait for.
  if (cudaSetDevice(ordinal) != cudaSuccess || cudaFree(ptr) != cudaSuccess) {
    const cudaError_t st = cudaGetLastError();
    if (st != cudaErrorCudartUnloading) {
      std::fprintf(stderr, "diststrat: cudaFree on GPU %d failed: %s\n", ordinal,
                   cudaGetErrorString(st));
    }
  }
}

void* CudaBackend::host_alloc(size_t bytes) {
  void* p = nullptr;
  const cudaError_t st = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable);
  if (st == cudaErrorMemoryAllocation) {
    clear_last_error();
    return nullptr;
  }
  DISTSTRAT_CUDA_CHECK(st);
  return p;
}

void CudaBackend::host_free(void* ptr) {
  if (ptr && cudaFreeHost(ptr) != cudaSuccess) {
    const cudaError_t st = cudaGetLastError();
    if (st != cudaErrorCudartUnloading) {
      std::fprintf(stderr, "diststrat: cudaFreeHost failed: %s\n", cudaGetErrorString(st));
    }
  }
}

void CudaBackend::memcpy_async(int ordinal, void* dst, const void* src, size_t bytes,
                               void* stream) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  DISTSTRAT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(stream)));
}

// cudaMemcpyAsync into pageable memory is synchronous (no deadline), so
// such copies are staged through pinned buffers and every wait is bounded.
void CudaBackend::copy_to_host(int ordinal, void* dst, const void* src, size_t bytes, void* stream,
                               DeadlineClock::time_point deadline, const std::string& what) {
  // A capturing stream would record the copy and never run it: refused.
  refuse_in_capture("a device -> host read (" + what + ")");
  if (bytes == 0) return;
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  const cudaStream_t s = as_stream(stream);
  cudaPointerAttributes attr{};
  const cudaError_t at = cudaPointerGetAttributes(&attr, dst);
  if (at != cudaSuccess) clear_last_error();
  if (at == cudaSuccess && attr.type == cudaMemoryTypeHost) {  // pinned: direct
    DISTSTRAT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
    wait_stream(stream, deadline, what);
    return;
  }
  std::vector<Stage*> stage = take_stages(ordinal);
  // Back to the pool only after a complete copy: after a failure or a
  // deadline a queued copy may still write into them (they stay owned by
  // the backend and are freed with it).
  struct Return {
    CudaBackend* self;
    std::vector<Stage*>& st;
    bool done = false;
    ~Return() {
      if (done) self->return_stages(st);
    }
  } give_back{this, stage};
  char* out = static_cast<char*>(dst);
  const char* in = static_cast<const char*>(src);
  size_t pending_off[2] = {0, 0}, pending_len[2] = {0, 0};
  auto drain = [&](int b) {
    if (!pending_len[b]) return;
    gpu::wait_event(stage[b]->done, deadline, what);
    std::memcpy(out + pending_off[b], stage[b]->buf, pending_len[b]);
    pending_len[b] = 0;
  };
  int b = 0;
  for (size_t off = 0; off < bytes; off += kStageBytes, b ^= 1) {
    drain(b);  // the buffer's previous chunk is copied out before reuse
    const size_t len = std::min(kStageBytes, bytes - off);
    DISTSTRAT_CUDA_CHECK(cudaMemcpyAsync(stage[b]->buf, in + off, len, cudaMemcpyDeviceToHost, s));
    DISTSTRAT_CUDA_CHECK(cudaEventRecord(stage[b]->done, s));
    pending_off[b] = off;
    pending_len[b] = len;
  }
  drain(b);  // the older of the (at most two) chunks in flight first
  drain(b ^ 1);
  give_back.done = true;
}

void CudaBackend::memset_async(int ordinal, void* dst, int value, size_t bytes, void* stream) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  DISTSTRAT_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, as_stream(stream)));
}

std::vector<CudaBackend::Stage*> CudaBackend::take_stages(int ordinal) {
  std::vector<Stage*> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_stages_.begin(); it != free_stages_.end() && out.size() < 2;) {
      if ((*it)->ordinal == ordinal) {
        out.push_back(*it);
        it = free_stages_.erase(it);
      } else {
        ++it;
      }
    }
  }
  while (out.size() < 2) {
    Stage st;
    st.ordinal = ordinal;
    const cudaError_t m = cudaMallocHost(&st.buf, kStageBytes);
    if (m != cudaSuccess) {
      if (!out.empty()) return_stages(out);
      DISTSTRAT_CUDA_CHECK(m);
    }
    const cudaError_t e = cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      // Not cudaFreeHost here (a device-wide wait without a deadline): the
      // buffer stays with the backend, unused, and goes with it after the
      // destructor's deadlined wait.
      st.done = nullptr;
      {
        std::lock_guard<std::mutex> lock(mu_);
        stages_.push_back(st);
      }
      if (!out.empty()) return_stages(out);
      DISTSTRAT_CUDA_CHECK(e);
    }
    std::lock_guard<std::mutex> lock(mu_);
    stages_.push_back(st);
    out.push_back(&stages_.back());
  }
  return out;
}

void CudaBackend::return_stages(const std::vector<Stage*>& st) {
  std::lock_guard<std::mutex> lock(mu_);
  free_stages_.insert(free_stages_.end(), st.begin(), st.end());
}

}  // namespace gpu
}  // namespace diststrat
