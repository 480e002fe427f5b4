#include "gpu/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <map>
#include <mutex>
#include <thread>

#include "diststrat/config.h"
#include "diststrat/error.h"
#include "gpu/cuda_check.h"
#include "gpu/kernels.h"
#include "gpu/shared_device_group.h"
#if DISTSTRAT_HAVE_NCCL
#include "gpu/nccl_communicator.h"
#endif

namespace diststrat {
namespace gpu {

void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  const std::string msg = detail::str_cat("CUDA call ", call, " failed: ", cudaGetErrorString(status),
                                          " (", cudaGetErrorName(status), ") at ", file, ":", line);
  if (status == cudaErrorMemoryAllocation) throw ResourceExhaustedError(msg);
  throw InternalError(msg);
}

void check_cublas(int status, const char* call, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  const cublasStatus_t s = static_cast<cublasStatus_t>(status);
  const std::string msg = detail::str_cat("cuBLAS call ", call, " failed: ",
                                          cublasGetStatusString(s), " (", cublasGetStatusName(s),
                                          ") at ", file, ":", line);
  if (s == CUBLAS_STATUS_ALLOC_FAILED) throw ResourceExhaustedError(msg);
  throw InternalError(msg);
}

void wait_stream(void* stream, DeadlineClock::time_point deadline, const std::string& what) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  int spins = 0;
  for (;;) {
    const cudaError_t st = cudaStreamQuery(s);
    if (st == cudaSuccess) return;
    if (st != cudaErrorNotReady) throw_cuda_error(st, ("cudaStreamQuery while waiting for " + what).c_str(), __FILE__, __LINE__);
    if (DeadlineClock::now() >= deadline) {
      throw DeadlineExceededError(what + ": the GPU work did not finish before the deadline");
    }
    // Spin briefly (short kernels), then back off so a waiting replica does
    // not burn a core.
    if (++spins < 200) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

namespace {

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

class CudaBackend : public GpuBackend {
 public:
  CudaBackend() {
    const cudaError_t st = cudaGetDeviceCount(&count_);
    if (st != cudaSuccess) {
      count_ = 0;
      reason_ = std::string(cudaGetErrorName(st)) + ": " + cudaGetErrorString(st);
      (void)cudaGetLastError();
    }
  }
  ~CudaBackend() override {
    for (auto& [key, handle] : blas_) {
      cudaSetDevice(key.first);
      cublasDestroy(handle);
    }
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
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    void* p = nullptr;
    const cudaError_t st = cudaMalloc(&p, bytes);
    if (st == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky: clear it
      return nullptr;
    }
    DISTSTRAT_CUDA_CHECK(st);
    return p;
  }

  void raw_free(int ordinal, void* ptr) override {
    // Called from destructors: report, never throw.
    if (cudaSetDevice(ordinal) != cudaSuccess || cudaFree(ptr) != cudaSuccess) {
      const cudaError_t st = cudaGetLastError();
      if (st != cudaErrorCudartUnloading) {
        std::fprintf(stderr, "diststrat: cudaFree on GPU %d failed: %s\n", ordinal,
                     cudaGetErrorString(st));
      }
    }
  }

  void* create_stream(int ordinal) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    cudaStream_t s = nullptr;
    // A blocking stream: work on the device's default stream (copies made
    // outside a replica) stays ordered with it.
    DISTSTRAT_CUDA_CHECK(cudaStreamCreate(&s));
    return s;
  }

  void destroy_stream(int ordinal, void* stream) override {
    if (!stream) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = blas_.find({ordinal, stream});
      if (it != blas_.end()) {
        cudaSetDevice(ordinal);
        cublasDestroy(it->second);
        blas_.erase(it);
      }
    }
    cudaSetDevice(ordinal);
    cudaStreamDestroy(as_stream(stream));
  }

  void memcpy_async(int ordinal, void* dst, const void* src, size_t bytes, void* stream) override {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    DISTSTRAT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(stream)));
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
  void softmax_cross_entropy(int ordinal, void* stream, const float* logits,
                             const int32_t* labels, float* dlogits, float* loss, int32_t* correct,
                             int32_t* bad, int64_t n, int64_t k, float scale) override {
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
  std::string nccl_unique_id() override { return make_nccl_unique_id(); }
  std::unique_ptr<Communicator> nccl_communicator(const std::string& unique_id, int rank, int size,
                                                  int ordinal, void* stream,
                                                  const CommunicationOptions& options) override {
    return make_nccl_communicator(unique_id, rank, size, ordinal, stream, options);
  }
#endif

 private:
  void check_ordinal(int ordinal) const {
    DISTSTRAT_CHECK(ordinal >= 0 && ordinal < count_, kNotFound, "GPU ordinal ", ordinal,
                    " does not exist (", count_, " visible)");
  }
  // One cuBLAS handle per (device, stream): handles are not safe to share
  // between replica threads.
  cublasHandle_t blas(int ordinal, void* stream) {
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blas_.find({ordinal, stream});
    if (it != blas_.end()) return it->second;
    cublasHandle_t h = nullptr;
    DISTSTRAT_CUBLAS_CHECK(cublasCreate(&h));
    DISTSTRAT_CUBLAS_CHECK(cublasSetStream(h, as_stream(stream)));
    blas_[{ordinal, stream}] = h;
    return h;
  }

  int count_ = 0;
  std::string reason_;
  std::mutex mu_;
  std::map<std::pair<int, void*>, cublasHandle_t> blas_;
};

}  // namespace
}  // namespace gpu

std::unique_ptr<GpuBackend> make_cuda_backend() { return std::make_unique<gpu::CudaBackend>(); }

}  // namespace diststrat
