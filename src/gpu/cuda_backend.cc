#include "gpu/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "diststrat/config.h"
#include "diststrat/error.h"
#include "gpu/cuda_check.h"
#include "gpu/kernels.h"
#include "gpu/optim_kernels.h"
#include "gpu/shared_device_group.h"
#if DISTSTRAT_HAVE_NCCL
#include "gpu/nccl_communicator.h"
#endif

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

namespace {

cudaStream_t as_stream(void* s) { return stream_or_legacy(s); }

// Device -> pageable host copies go through pinned buffers of this size, two
// at a time (one fills on the GPU while the other is copied out on the host).
constexpr size_t kStageBytes = 8u << 20;

class CudaBackend : public GpuBackend {
 public:
  CudaBackend() {
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
  ~CudaBackend() override {
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

  std::string name() const override { return "cuda"; }
  std::string unavailable_reason() const override { return reason_; }
  int device_count() override { return count_; }

  GpuInfo info(int ordinal) override {
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

  void* raw_malloc(int ordinal, size_t bytes) override {
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

  void raw_free(int ordinal, void* ptr) override {
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

  void* create_stream(int ordinal) override {
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

  void destroy_stream(int ordinal, void* stream) override {
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

  void memcpy_async(int ordinal, void* dst, const void* src, size_t bytes, void* stream) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    DISTSTRAT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(stream)));
  }

  // cudaMemcpyAsync into pageable memory is synchronous (no deadline), so
  // such copies are staged through pinned buffers and every wait is bounded.
  void copy_to_host(int ordinal, void* dst, const void* src, size_t bytes, void* stream,
                    DeadlineClock::time_point deadline, const std::string& what) override {
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
      wait_event(stage[b]->done, deadline, what);
      std::memcpy(out + pending_off[b], stage[b]->buf, pending_len[b]);
      pending_len[b] = 0;
    };
    int b = 0;
    for (size_t off = 0; off < bytes; off += kStageBytes, b ^= 1) {
      drain(b);  // the buffer's previous chunk is copied out before reuse
      const size_t len = std::min(kStageBytes, bytes - off);
      DISTSTRAT_CUDA_CHECK(
          cudaMemcpyAsync(stage[b]->buf, in + off, len, cudaMemcpyDeviceToHost, s));
      DISTSTRAT_CUDA_CHECK(cudaEventRecord(stage[b]->done, s));
      pending_off[b] = off;
      pending_len[b] = len;
    }
    drain(b);  // the older of the (at most two) chunks in flight first
    drain(b ^ 1);
    give_back.done = true;
  }

  void memset_async(int ordinal, void* dst, int value, size_t bytes, void* stream) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    DISTSTRAT_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, as_stream(stream)));
  }

  void synchronize(int ordinal, void* stream, DeadlineClock::time_point deadline,
                   const std::string& what) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    wait_stream(stream, deadline, what);
  }

  void synchronize_device(int ordinal, DeadlineClock::time_point deadline,
                          const std::string& what) override {
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

  bool stream_alive(int ordinal, void* stream) override {
    if (!stream) return true;
    std::lock_guard<std::mutex> lock(mu_);
    return streams_.count({ordinal, as_stream(stream)}) > 0;
  }
  uint64_t stream_id(int ordinal, void* stream) override {
    if (!stream) return 0;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find({ordinal, as_stream(stream)});
    return it == streams_.end() ? kUnknownStream : it->second;
  }

  void* create_event(int ordinal) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    cudaEvent_t e = nullptr;
    DISTSTRAT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  void record_event(int ordinal, void* event, void* stream) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    DISTSTRAT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), as_stream(stream)));
  }
  bool event_done(int ordinal, void* event) override {
    const cudaError_t st = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (st == cudaSuccess) return true;
    if (st == cudaErrorNotReady) return false;
    throw_cuda_error(st, "cudaEventQuery", __FILE__, __LINE__);
  }
  void destroy_event(int ordinal, void* event) override {
    if (!event) return;
    cudaSetDevice(ordinal);
    cudaEventDestroy(static_cast<cudaEvent_t>(event));
    clear_last_error();
  }

  // Row-major C[m, n] = A[m, k]·B[k, n] is column-major Cᵀ = Bᵀ·Aᵀ, so each
  // GEMM below passes the operands in swapped order.
  void dense_forward(int ordinal, void* stream, const float* x, const float* w, const float* b,
                     float* y, int64_t n, int64_t in, int64_t out) override {
    if (n == 0) return;
    cublasHandle_t h = blas(ordinal, stream);
    const float one = 1.0f, zero = 0.0f;
    // yᵀ[out, n] = wᵀ[out, in] · xᵀ[in, n]
    DISTSTRAT_CUBLAS_CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(out),
                                       static_cast<int>(n), static_cast<int>(in), &one, w,
                                       static_cast<int>(out), x, static_cast<int>(in), &zero, y,
                                       static_cast<int>(out)));
    launch_bias_add(y, b, n, out, stream);
  }

  void dense_backward(int ordinal, void* stream, const float* x, const float* w, const float* dy,
                      float* dx, float* dw, float* db, int64_t n, int64_t in,
                      int64_t out) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    if (n == 0) {
      DISTSTRAT_CUDA_CHECK(cudaMemsetAsync(dw, 0, sizeof(float) * in * out, as_stream(stream)));
      DISTSTRAT_CUDA_CHECK(cudaMemsetAsync(db, 0, sizeof(float) * out, as_stream(stream)));
      return;
    }
    cublasHandle_t h = blas(ordinal, stream);
    const float one = 1.0f, zero = 0.0f;
    // dw = xᵀ·dy: dwᵀ[out, in] = dyᵀ[out, n] · x[n, in]
    DISTSTRAT_CUBLAS_CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(out),
                                       static_cast<int>(in), static_cast<int>(n), &one, dy,
                                       static_cast<int>(out), x, static_cast<int>(in), &zero, dw,
                                       static_cast<int>(out)));
    launch_column_sum(dy, db, n, out, stream);
    if (dx) {
      // dx = dy·wᵀ: dxᵀ[in, n] = w[in, out] (= (wᵀ)ᵀ) · dyᵀ[out, n]
      DISTSTRAT_CUBLAS_CHECK(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(in),
                                         static_cast<int>(n), static_cast<int>(out), &one, w,
                                         static_cast<int>(out), dy, static_cast<int>(out), &zero,
                                         dx, static_cast<int>(in)));
    }
  }

  void relu_forward(int ordinal, void* stream, const float* x, float* y, int64_t count) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    launch_relu_forward(x, y, count, stream);
  }
  void relu_backward(int ordinal, void* stream, const float* y, const float* dy, float* dx,
                     int64_t count) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    launch_relu_backward(y, dy, dx, count, stream);
  }
  void softmax_cross_entropy(int ordinal, void* stream, const float* logits, const int32_t* labels,
                             float* dlogits, float* loss, int32_t* correct, int32_t* bad, int64_t n,
                             int64_t k, float scale) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    launch_softmax_xent(logits, labels, dlogits, loss, correct, bad, n, k, scale, stream);
  }
  void apply_update(int ordinal, void* stream, const UpdateRule& rule, float* var,
                    const float* grad, float* const* slots, size_t count, int64_t step) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    launch_update(rule, var, grad, slots, count, step, stream);
  }
  void reduce(int ordinal, void* stream, void* dst, const void* const* srcs, int n, size_t count,
              DType dtype, ReduceOp op, int mean_divisor) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    launch_reduce(&dst, 1, srcs, n, count, dtype, op, mean_divisor, stream);
  }

  std::vector<std::unique_ptr<Communicator>> shared_device_group(
      const SharedDeviceGroupSpec& spec, const CommunicationOptions& options) override {
    return make_shared_device_group(spec, options);
  }

#if DISTSTRAT_HAVE_NCCL
  std::vector<std::unique_ptr<Communicator>> nccl_local_group(
      const std::vector<int>& ordinals, const std::vector<void*>& streams,
      const CommunicationOptions& options) override {
    return make_nccl_local_group(ordinals, streams, options);
  }
  std::string nccl_version() override { return nccl_version_string(); }
  std::string nccl_unique_id() override { return make_nccl_unique_id(); }
  std::unique_ptr<Communicator> nccl_communicator(const std::string& unique_id, int rank, int size,
                                                  int ordinal, void* stream,
                                                  const CommunicationOptions& options) override {
    return make_nccl_communicator(unique_id, rank, size, ordinal, stream, options);
  }
#endif

 private:
  // Returns when the work enqueued so far on every stream of the device (the
  // legacy default stream and those create_stream made) is done; the caller
  // made `ordinal` current.
  void wait_device(int ordinal, DeadlineClock::time_point deadline, const std::string& what) {
    std::vector<cudaStream_t> streams{cudaStreamLegacy};
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [key, id] : streams_) {
        if (key.first == ordinal) streams.push_back(key.second);
      }
    }
    for (cudaStream_t s : streams) wait_stream(s, deadline, what);
  }

  // Destroys the retired cuBLAS handles of `ordinal` (made current by the
  // caller): after a completed device wait, or, with `only_if_idle`, when
  // every stream of the device reports idle right now (cudaStreamQuery never
  // blocks). Work another thread enqueues after that look only delays
  // cublasDestroy by that work's own duration.
  void destroy_retired_blas(int ordinal, bool only_if_idle) {
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

  void check_ordinal(int ordinal) const {
    DISTSTRAT_CHECK(ordinal >= 0 && ordinal < count_, kNotFound, "GPU ordinal ", ordinal,
                    " does not exist (", count_, " visible)");
  }
  // One cuBLAS handle per (device, stream): handles are not safe to share
  // between threads. Work on the default stream (outside a replica) can come
  // from any thread, so its handles are per thread as well.
  cublasHandle_t blas(int ordinal, void* stream) {
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

  // Pinned staging buffers for copy_to_host, two per copy in flight.
  struct Stage {
    int ordinal = 0;
    void* buf = nullptr;
    cudaEvent_t done = nullptr;
  };
  std::vector<Stage*> take_stages(int ordinal) {
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
  void return_stages(const std::vector<Stage*>& st) {
    std::lock_guard<std::mutex> lock(mu_);
    free_stages_.insert(free_stages_.end(), st.begin(), st.end());
  }

  using BlasKey = std::tuple<int, void*, std::thread::id>;
  int count_ = 0;
  std::string reason_;
  std::chrono::milliseconds teardown_timeout_{std::chrono::seconds(300)};
  std::mutex mu_;
  std::map<BlasKey, cublasHandle_t> blas_;
  // Of destroyed streams: destroyed once the device is seen idle (`mark`,
  // recorded as the stream went, done; null: unknown) or after a completed
  // device wait.
  struct RetiredBlas {
    int ordinal = 0;
    cublasHandle_t handle = nullptr;
    cudaEvent_t mark = nullptr;
  };
  std::vector<RetiredBlas> retired_blas_;
  // Streams create_stream made -> their identity (stream_id), never reused
  // although CUDA reuses the handles.
  std::map<std::pair<int, cudaStream_t>, uint64_t> streams_;
  uint64_t last_stream_id_ = 0;
  std::deque<Stage> stages_;  // stable addresses
  std::vector<Stage*> free_stages_;

 public:
  // ==== Training features on device gradients (optim_kernels.cu) ====
  void sum_of_squares(int ordinal, void* stream, const float* const* in, const size_t* counts,
                      int n, const float* loss_scale, double* sums, double* scratch) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    launch_sum_of_squares(in, counts, n, loss_scale, sums, scratch, stream);
  }
  void scale_and_clip(int ordinal, void* stream, const float* const* in, float* const* out,
                      const size_t* counts, int n, const float* loss_scale, float scale,
                      const double* sums, float clip_norm, float clip_value) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    launch_scale_and_clip(in, out, counts, n, loss_scale, scale, sums, clip_norm, clip_value,
                          stream);
  }
  void accumulate(int ordinal, void* stream, float* const* acc, const float* const* in,
                  const size_t* counts, int n, bool first) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    launch_accumulate(acc, in, counts, n, first, stream);
  }
  void fill(int ordinal, void* stream, float* dst, size_t count, float value) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    launch_fill(dst, count, value, stream);
  }
  // ==== end of the training-feature block ====
};

}  // namespace
}  // namespace gpu

std::unique_ptr<GpuBackend> make_cuda_backend() { return std::make_unique<gpu::CudaBackend>(); }

}  // namespace diststrat
