// The CUDA GpuBackend, declared for the files that implement it: the backend
// object, its devices and where its collectives come from (cuda_backend.cc),
// memory and copies (cuda_memory.cc), streams, events and cuBLAS handles
// (cuda_streams.cc), the math calls (cuda_math.cc). The rest of the library
// sees only make_cuda_backend (cuda_backend.h).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "core/gpu_backend.h"
#include "diststrat/config.h"
#include "diststrat/error.h"
#include "gpu/cuda_check.h"

namespace diststrat {
namespace gpu {

class CudaBackend : public GpuBackend {
 public:
  CudaBackend();
  ~CudaBackend() override;

  std::string name() const override { return "cuda"; }
  std::string unavailable_reason() const override { return reason_; }
  int device_count() override { return count_; }
  GpuInfo info(int ordinal) override;

  // Memory and copies (cuda_memory.cc).
  void* raw_malloc(int ordinal, size_t bytes) override;
  void raw_free(int ordinal, void* ptr) override;
  void memcpy_async(int ordinal, void* dst, const void* src, size_t bytes, void* stream) override;
  void copy_to_host(int ordinal, void* dst, const void* src, size_t bytes, void* stream,
                    DeadlineClock::time_point deadline, const std::string& what) override;
  void memset_async(int ordinal, void* dst, int value, size_t bytes, void* stream) override;

  // Streams and events (cuda_streams.cc).
  void* create_stream(int ordinal) override;
  void destroy_stream(int ordinal, void* stream) override;
  void synchronize(int ordinal, void* stream, DeadlineClock::time_point deadline,
                   const std::string& what) override;
  void synchronize_device(int ordinal, DeadlineClock::time_point deadline,
                          const std::string& what) override;
  bool stream_alive(int ordinal, void* stream) override;
  uint64_t stream_id(int ordinal, void* stream) override;
  void* create_event(int ordinal) override;
  void record_event(int ordinal, void* event, void* stream) override;
  bool event_done(int ordinal, void* event) override;
  void destroy_event(int ordinal, void* event) override;
  void stream_wait_event(int ordinal, void* stream, void* event) override;
  void wait_event(int ordinal, void* event, DeadlineClock::time_point deadline,
                  const std::string& what) override;
  void* host_alloc(size_t bytes) override;
  void host_free(void* ptr) override;

  // Layers, updates and reductions: cuBLAS and kernels.cu (cuda_math.cc).
  void dense_forward(int ordinal, void* stream, const float* x, const float* w, const float* b,
                     float* y, int64_t n, int64_t in, int64_t out) override;
  void dense_backward(int ordinal, void* stream, const float* x, const float* w, const float* dy,
                      float* dx, float* dw, float* db, int64_t n, int64_t in, int64_t out) override;
  void relu_forward(int ordinal, void* stream, const float* x, float* y, int64_t count) override;
  void relu_backward(int ordinal, void* stream, const float* y, const float* dy, float* dx,
                     int64_t count) override;
  void softmax_cross_entropy(int ordinal, void* stream, const float* logits, const int32_t* labels,
                             float* dlogits, float* loss, int32_t* correct, int32_t* bad, int64_t n,
                             int64_t k, float scale) override;
  void apply_update(int ordinal, void* stream, const UpdateRule& rule, float* var,
                    const float* grad, float* const* slots, size_t count, int64_t step) override;
  void reduce(int ordinal, void* stream, void* dst, const void* const* srcs, int n, size_t count,
              DType dtype, ReduceOp op, int mean_divisor) override;
  void gather_rows(int ordinal, void* stream, void* dst, const void* src, const int64_t* rows,
                   int64_t n, size_t row_bytes) override;
  // Fewer launches (issue 44): the fused layer epilogues and the list update.
  void dense_relu_forward(int ordinal, void* stream, const float* x, const float* w, const float* b,
                          float* y, int64_t n, int64_t in, int64_t out) override;
  void dense_relu_backward(int ordinal, void* stream, const float* x, const float* w,
                           const float* y, float* dy, float* dx, float* dw, float* db, int64_t n,
                           int64_t in, int64_t out) override;
  void apply_update_list(int ordinal, void* stream, const UpdateRule& rule, float* const* vars,
                         const float* const* grads, float* const* slots, const size_t* counts,
                         int n, int64_t step) override;

  // Training features on device gradients: optim_kernels.cu (cuda_math.cc).
  void sum_of_squares(int ordinal, void* stream, const float* const* in, const size_t* counts,
                      int n, const float* loss_scale, double* sums, double* scratch) override;
  void scale_and_clip(int ordinal, void* stream, const float* const* in, float* const* out,
                      const size_t* counts, int n, const float* loss_scale, float scale,
                      const double* sums, float clip_norm, float clip_value) override;
  void accumulate(int ordinal, void* stream, float* const* acc, const float* const* in,
                  const size_t* counts, int n, bool first) override;
  void fill(int ordinal, void* stream, float* dst, size_t count, float value) override;

  // Graph capture (cuda_graph.cc).
  void begin_capture(int ordinal, void* stream) override;
  void* end_capture(int ordinal, void* stream) override;
  void launch_graph(int ordinal, void* graph, void* stream) override;
  void destroy_graph(int ordinal, void* graph) override;
  bool capturing(int ordinal, void* stream) override;
  void apply_update_list_at(int ordinal, void* stream, const UpdateRule& rule, float* const* vars,
                            const float* const* grads, float* const* slots, const size_t* counts,
                            int n, const float* rate) override;

  // Collectives (cuda_backend.cc).
  std::vector<std::unique_ptr<Communicator>> shared_device_group(
      const SharedDeviceGroupSpec& spec, const CommunicationOptions& options) override;
#if DISTSTRAT_HAVE_NCCL
  std::vector<std::unique_ptr<Communicator>> nccl_local_group(
      const std::vector<int>& ordinals, const std::vector<void*>& streams,
      const CommunicationOptions& options) override;
  std::string nccl_version() override;
  std::string nccl_unique_id() override;
  std::unique_ptr<Communicator> nccl_communicator(const std::string& unique_id, int rank, int size,
                                                  int ordinal, void* stream,
                                                  const CommunicationOptions& options) override;
#endif

 private:
  static cudaStream_t as_stream(void* s) { return stream_or_legacy(s); }

  // Returns when the work enqueued so far on every stream of the device (the
  // legacy default stream and those create_stream made) is done; the caller
  // made `ordinal` current.
  void wait_device(int ordinal, DeadlineClock::time_point deadline, const std::string& what);

  // Destroys the retired cuBLAS handles of `ordinal` (made current by the
  // caller): after a completed device wait, or, with `only_if_idle`, when
  // every stream of the device reports idle right now (cudaStreamQuery never
  // blocks). Work another thread enqueues after that look only delays
  // cublasDestroy by that work's own duration.
  void destroy_retired_blas(int ordinal, bool only_if_idle);

  void check_ordinal(int ordinal) const {
    DISTSTRAT_CHECK(ordinal >= 0 && ordinal < count_, kNotFound, "GPU ordinal ", ordinal,
                    " does not exist (", count_, " visible)");
  }
  // One cuBLAS handle per (device, stream): handles are not safe to share
  // between threads. Work on the default stream (outside a replica) can come
  // from any thread, so its handles are per thread as well.
  cublasHandle_t blas(int ordinal, void* stream);

  // Pinned staging buffers for copy_to_host, two per copy in flight.
  struct Stage {
    int ordinal = 0;
    void* buf = nullptr;
    cudaEvent_t done = nullptr;
  };
  std::vector<Stage*> take_stages(int ordinal);
  void return_stages(const std::vector<Stage*>& st);

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
};

}  // namespace gpu
}  // namespace diststrat
