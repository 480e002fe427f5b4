// Defaults of the optional GpuBackend capabilities, and the registration seam.
#include "core/gpu_backend.h"

#include <algorithm>
#include <thread>

#include "diststrat/config.h"

#if DISTSTRAT_HAVE_CUDA
#include "gpu/cuda_backend.h"
#endif

namespace diststrat {

[[noreturn]] void throw_unavailable_in(const GpuBackend& b, const char* what) {
  throw UnimplementedError(std::string(what) + " is not available in the '" + b.name() +
                           "' GPU backend");
}

void GpuBackend::copy_to_host(int ordinal, void* dst, const void* src, size_t bytes, void* stream,
                              DeadlineClock::time_point deadline, const std::string& what) {
  memcpy_async(ordinal, dst, src, bytes, stream);
  synchronize(ordinal, stream, deadline, what);
}

void GpuBackend::stream_wait_event(int, void*, void*) {
  throw_unavailable_in(*this, "stream_wait_event");
}
void GpuBackend::wait_event(int ordinal, void* event, DeadlineClock::time_point deadline,
                            const std::string& what) {
  auto pause = std::chrono::microseconds(20);
  while (!event_done(ordinal, event)) {
    if (DeadlineClock::now() >= deadline) {
      throw DeadlineExceededError(what + ": the work on GPU ordinal " + std::to_string(ordinal) +
                                  " did not finish before the deadline");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(2));
  }
}
void* GpuBackend::host_alloc(size_t) { throw_unavailable_in(*this, "host_alloc"); }
void GpuBackend::host_free(void* ptr) {
  if (ptr) throw_unavailable_in(*this, "host_free");
}

void GpuBackend::dense_forward(int, void*, const float*, const float*, const float*, float*,
                               int64_t, int64_t, int64_t) {
  throw_unavailable_in(*this, "dense_forward");
}
void GpuBackend::dense_backward(int, void*, const float*, const float*, const float*, float*,
                                float*, float*, int64_t, int64_t, int64_t) {
  throw_unavailable_in(*this, "dense_backward");
}
void GpuBackend::relu_forward(int, void*, const float*, float*, int64_t) {
  throw_unavailable_in(*this, "relu_forward");
}
void GpuBackend::relu_backward(int, void*, const float*, const float*, float*, int64_t) {
  throw_unavailable_in(*this, "relu_backward");
}
void GpuBackend::softmax_cross_entropy(int, void*, const float*, const int32_t*, float*, float*,
                                       int32_t*, int32_t*, int64_t, int64_t, float) {
  throw_unavailable_in(*this, "softmax_cross_entropy");
}
void GpuBackend::apply_update(int, void*, const UpdateRule&, float*, const float*, float* const*,
                              size_t, int64_t) {
  throw_unavailable_in(*this, "apply_update");
}
void GpuBackend::dense_relu_forward(int ordinal, void* stream, const float* x, const float* w,
                                    const float* b, float* y, int64_t n, int64_t in, int64_t out) {
  dense_forward(ordinal, stream, x, w, b, y, n, in, out);
  relu_forward(ordinal, stream, y, y, n * out);
}
void GpuBackend::dense_relu_backward(int ordinal, void* stream, const float* x, const float* w,
                                     const float* y, float* dy, float* dx, float* dw, float* db,
                                     int64_t n, int64_t in, int64_t out) {
  relu_backward(ordinal, stream, y, dy, dy, n * out);
  dense_backward(ordinal, stream, x, w, dy, dx, dw, db, n, in, out);
}

void GpuBackend::reduce(int, void*, void*, const void* const*, int, size_t, DType, ReduceOp, int) {
  throw_unavailable_in(*this, "reduce");
}
void GpuBackend::gather_rows(int, void*, void*, const void*, const int64_t*, int64_t, size_t) {
  throw_unavailable_in(*this, "gather_rows");
}
std::vector<std::unique_ptr<Communicator>> GpuBackend::nccl_local_group(
    const std::vector<int>&, const std::vector<void*>&, const CommunicationOptions&) {
  throw_unavailable_in(*this, "NCCL");
}
std::string GpuBackend::nccl_unique_id() { throw_unavailable_in(*this, "NCCL"); }
std::unique_ptr<Communicator> GpuBackend::nccl_communicator(const std::string&, int, int, int,
                                                            void*, const CommunicationOptions&) {
  throw_unavailable_in(*this, "NCCL");
}
std::vector<std::unique_ptr<Communicator>> GpuBackend::shared_device_group(
    const SharedDeviceGroupSpec&, const CommunicationOptions&) {
  throw_unavailable_in(*this, "shared-device reduction");
}

std::unique_ptr<GpuBackend> make_default_gpu_backend() {
#if DISTSTRAT_HAVE_CUDA
  return make_cuda_backend();
#else
  return nullptr;
#endif
}

// ---- graph capture (issue 44 item 2) ----
void GpuBackend::begin_capture(int, void*) { throw_unavailable_in(*this, "begin_capture"); }
void* GpuBackend::end_capture(int, void*) { throw_unavailable_in(*this, "end_capture"); }
void GpuBackend::launch_graph(int, void*, void*) { throw_unavailable_in(*this, "launch_graph"); }
void GpuBackend::destroy_graph(int, void* graph) {
  if (graph) throw_unavailable_in(*this, "destroy_graph");
}
bool GpuBackend::capturing(int, void*) { return false; }
void GpuBackend::apply_update_list_at(int, void*, const UpdateRule&, float* const*,
                                      const float* const*, float* const*, const size_t*, int,
                                      const float*) {
  throw_unavailable_in(*this, "apply_update_list_at");
}

}  // namespace diststrat
