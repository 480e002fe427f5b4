// The CUDA backend's streams and events: creating and destroying streams
// (their cuBLAS handles retired until the device is seen idle), bounded waits
// for a stream or a whole device, stream identities, events, and the cuBLAS
// handle per (device, stream).
#include "gpu/cuda_backend.h"
#include "gpu/cuda_backend_impl.h"

#include "core/step_capture.h"

namespace diststrat {
namespace gpu {

void* CudaBackend::create_stream(int ordinal) {
  check_ordinal(ordinal);
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  cudaStream_t s = nullptr;
  // A blocking stream: work on the legacy default stream (copies made
  // outside a replica) stays ordered with it.
  DISTSTRAT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamDefault));
  std::lock_guard<std::mutex> lock(mu_);
  streams_[{ordinal, s}] = ++last_stream_id_;
  return s;
}

void CudaBackend::destroy_stream(int ordinal, void* stream) {
  if (!stream) return;
  cudaSetDevice(ordinal);
  {
    std::lock_guard<std::mutex> lock(mu_);
    // cublasDestroy synchronizes the device without a deadline: the
    // stream's handles are retired, with an event marking the stream's
    // last work, and destroyed once the device is seen idle or after its
    // next completed synchronize_device (or with the backend).
    for (auto it = blas_.begin(); it != blas_.end();) {
      if (std::get<0>(it->first) == ordinal && std::get<1>(it->first) == stream) {
        cudaEvent_t mark = nullptr;
        if (cudaEventCreateWithFlags(&mark, cudaEventDisableTiming) != cudaSuccess ||
            cudaEventRecord(mark, as_stream(stream)) != cudaSuccess) {
          if (mark) cudaEventDestroy(mark);
          mark = nullptr;  // then only a completed device wait releases the handle
        }
        // The handle outlives its stream: point it at the legacy default
        // stream before the stream goes, so that cublasDestroy (later)
        // never touches a destroyed stream, whose handle value CUDA may
        // already have given to a new stream. No work is enqueued on it
        // any more; the mark above covers the work it enqueued.
        cublasSetStream(it->second, cudaStreamLegacy);
        retired_blas_.push_back({ordinal, it->second, mark});
        it = blas_.erase(it);
      } else {
        ++it;
      }
    }
    streams_.erase({ordinal, as_stream(stream)});
  }
  cudaStreamDestroy(as_stream(stream));  // returns at once; queued work still completes
  clear_last_error();                    // cleanup: failures are deliberately ignored
  // Usually the replicas drained before their streams go: then the handles
  // go at once instead of piling up until the next device wait.
  destroy_retired_blas(ordinal, /*only_if_idle=*/true);
}

void CudaBackend::synchronize(int ordinal, void* stream, DeadlineClock::time_point deadline,
                              const std::string& what) {
  refuse_in_capture("a wait for the stream (" + what + ")");
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  wait_stream(stream, deadline, what);
}

void CudaBackend::synchronize_device(int ordinal, DeadlineClock::time_point deadline,
                                     const std::string& what) {
  const cudaError_t st = cudaSetDevice(ordinal);
  if (st == cudaErrorCudartUnloading) {  // process exit: the runtime is gone, nothing runs
    clear_last_error();
    return;
  }
  DISTSTRAT_CUDA_CHECK(st);
  wait_device(ordinal, deadline, what);
  // The device just drained: cublasDestroy's implicit device
  // synchronization has (next to) nothing left to wait for.
  destroy_retired_blas(ordinal, /*only_if_idle=*/false);
}

bool CudaBackend::stream_alive(int ordinal, void* stream) {
  if (!stream) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return streams_.count({ordinal, as_stream(stream)}) > 0;
}

uint64_t CudaBackend::stream_id(int ordinal, void* stream) {
  if (!stream) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find({ordinal, as_stream(stream)});
  return it == streams_.end() ? kUnknownStream : it->second;
}

void* CudaBackend::create_event(int ordinal) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  cudaEvent_t e = nullptr;
  DISTSTRAT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void CudaBackend::record_event(int ordinal, void* event, void* stream) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  DISTSTRAT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), as_stream(stream)));
}

bool CudaBackend::event_done(int ordinal, void* event) {
  const cudaError_t st = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (st == cudaSuccess) return true;
  if (st == cudaErrorNotReady) return false;
  throw_cuda_error(st, "cudaEventQuery", __FILE__, __LINE__);
}

void CudaBackend::stream_wait_event(int ordinal, void* stream, void* event) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  DISTSTRAT_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), static_cast<cudaEvent_t>(event), 0));
}

void CudaBackend::wait_event(int ordinal, void* event, DeadlineClock::time_point deadline,
                             const std::string& what) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  gpu::wait_event(event, deadline, what + " on GPU ordinal " + std::to_string(ordinal));
}

void CudaBackend::destroy_event(int ordinal, void* event) {
  if (!event) return;
  cudaSetDevice(ordinal);
  cudaEventDestroy(static_cast<cudaEvent_t>(event));
  clear_last_error();
}

void CudaBackend::wait_device(int ordinal, DeadlineClock::time_point deadline,
                              const std::string& what) {
  std::vector<cudaStream_t> streams{cudaStreamLegacy};
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, id] : streams_) {
      if (key.first == ordinal) streams.push_back(key.second);
    }
  }
  for (cudaStream_t s : streams) wait_stream(s, deadline, what);
}

void CudaBackend::destroy_retired_blas(int ordinal, bool only_if_idle) {
  std::vector<RetiredBlas> retired;
  std::vector<cudaStream_t> streams{cudaStreamLegacy};
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, id] : streams_) {
      if (key.first == ordinal) streams.push_back(key.second);
    }
    for (auto it = retired_blas_.begin(); it != retired_blas_.end();) {
      if (it->ordinal == ordinal) {
        retired.push_back(*it);
        it = retired_blas_.erase(it);
      } else {
        ++it;
      }
    }
  }
  if (retired.empty()) return;
  bool idle = true;
  if (only_if_idle) {
    // The live streams, and the destroyed ones through their marks.
    for (cudaStream_t s : streams) idle = idle && cudaStreamQuery(s) == cudaSuccess;
    for (const RetiredBlas& r : retired)
      idle = idle && r.mark && cudaEventQuery(r.mark) == cudaSuccess;
  }
  if (idle) {
    for (const RetiredBlas& r : retired) {
      cublasDestroy(r.handle);
      if (r.mark) cudaEventDestroy(r.mark);
    }
  } else {
    std::lock_guard<std::mutex> lock(mu_);
    retired_blas_.insert(retired_blas_.end(), retired.begin(), retired.end());
  }
  clear_last_error();  // cleanup (and the queries): failures are deliberately ignored
}

cublasHandle_t CudaBackend::blas(int ordinal, void* stream) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  const BlasKey key{ordinal, stream, stream ? std::thread::id() : std::this_thread::get_id()};
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blas_.find(key);
  if (it != blas_.end()) return it->second;
  cublasHandle_t h = nullptr;
  DISTSTRAT_CUBLAS_CHECK(cublasCreate(&h));
  DISTSTRAT_CUBLAS_CHECK(cublasSetStream(h, as_stream(stream)));
  blas_[key] = h;
  return h;
}

}  // namespace gpu
}  // namespace diststrat
