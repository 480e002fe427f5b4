// The seam between the library and a GPU runtime. Everything GPU-specific the
// rest of the library needs goes through this interface, so strategies, nn
// layers and optimizers compile without CUDA and the device logic (allocator,
// logical devices, leases) is tested on CPU with a fake backend. The CUDA
// implementation lives in src/gpu/ and is registered in gpu_registry.cc.
//
// Ordinals are CUDA device ordinals of this process; an ordinal that does not
// exist is an error, never undefined behaviour. Streams are opaque
// (cudaStream_t on CUDA); nullptr means the device's legacy default stream,
// which is ordered with every stream create_stream makes (the CUDA backend
// passes cudaStreamLegacy explicitly). Device pointers are never dereferenced
// on the host (the fake backend of the tests poisons them).
// Enqueue-style calls (…_async, kernels) only enqueue on the stream; waits
// take a deadline and never block past it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "diststrat/collective.h"
#include "diststrat/dtype.h"

namespace diststrat {

struct UpdateRule;  // diststrat/update_rule.h: the optimizer rule as data

using DeadlineClock = std::chrono::steady_clock;

struct GpuInfo {
  std::string name;
  std::string uuid;  // "GPU-xxxxxxxx-..." or empty
  size_t total_bytes = 0;
  size_t free_bytes = 0;
  int compute_capability = 0;
};

// Per-rank device buffers for a shared-device reduction (one physical GPU,
// several logical devices): the replicas' streams, in rank order.
struct SharedDeviceGroupSpec {
  int ordinal = 0;
  std::vector<void*> streams;
};

class GpuBackend {
 public:
  virtual ~GpuBackend() = default;
  virtual std::string name() const = 0;
  // Why device_count() is 0 when the runtime could not be used ("" otherwise).
  virtual std::string unavailable_reason() const { return ""; }

  // ---- devices and memory ----
  virtual int device_count() = 0;
  virtual GpuInfo info(int ordinal) = 0;
  // Raw device memory; returns nullptr when the device is out of memory
  // (other failures throw).
  virtual void* raw_malloc(int ordinal, size_t bytes) = 0;
  virtual void raw_free(int ordinal, void* ptr) = 0;

  // ---- streams, copies, waits ----
  virtual void* create_stream(int ordinal) = 0;
  virtual void destroy_stream(int ordinal, void* stream) = 0;
  // Any direction (host/device, device/device); enqueued on `stream`.
  virtual void memcpy_async(int ordinal, void* dst, const void* src, size_t bytes,
                            void* stream) = 0;
  virtual void memset_async(int ordinal, void* dst, int value, size_t bytes, void* stream) = 0;
  // Device -> host memory (any host memory, pageable too); blocks until the
  // bytes are there, never past `deadline` (DeadlineExceededError naming
  // `what`). The CUDA backend stages pageable destinations through pinned
  // buffers: a cudaMemcpyAsync into pageable memory would block without one.
  virtual void copy_to_host(int ordinal, void* dst, const void* src, size_t bytes, void* stream,
                            DeadlineClock::time_point deadline, const std::string& what);
  // Returns when all work on `stream` is done; throws DeadlineExceededError
  // naming `what` past `deadline`, or the error the work raised.
  virtual void synchronize(int ordinal, void* stream, DeadlineClock::time_point deadline,
                           const std::string& what) = 0;
  // Returns when the work enqueued before the call on every stream of device
  // `ordinal` (the default stream and those create_stream made) is done; same
  // errors. Called before raw_free, whose cudaFree waits for the whole device
  // without a deadline.
  virtual void synchronize_device(int ordinal, DeadlineClock::time_point deadline,
                                  const std::string& what) = 0;
  // Events (cudaEvent_t on CUDA) mark a point of a stream: record_event
  // enqueues the mark, event_done says (without blocking) whether the work
  // before it has run (true for an event never recorded). The caching
  // allocator records one when a block is freed, so another stream reuses it
  // only after the freeing stream's work.
  // Whether `stream` (made by create_stream on `ordinal`) still exists; null
  // (the default stream) always does. Tensors may outlive their stream.
  virtual bool stream_alive(int ordinal, void* stream) = 0;
  // The identity of the stream `stream` names now: 0 for null (the default
  // stream); for a live stream create_stream made on `ordinal`, a number
  // > 0 that no other stream of this backend ever gets, even one that later
  // receives the same handle value (CUDA reuses a destroyed stream's
  // handle); kUnknownStream for any other handle (destroyed, foreign, or of
  // another device). Compare identities, never handles, to tell whether two
  // uses are on one stream. Thread-safe; never blocks.
  static constexpr uint64_t kUnknownStream = ~uint64_t{0};
  virtual uint64_t stream_id(int ordinal, void* stream) = 0;
  virtual void* create_event(int ordinal) = 0;
  virtual void record_event(int ordinal, void* event, void* stream) = 0;
  virtual bool event_done(int ordinal, void* event) = 0;
  virtual void destroy_event(int ordinal, void* event) = 0;
  // Work enqueued on `stream` after this call runs only after the work
  // before `event`'s last record_event (on any stream of `ordinal`): orders
  // two streams without the host waiting (cudaStreamWaitEvent). Only
  // enqueues. Default: UnimplementedError.
  virtual void stream_wait_event(int ordinal, void* stream, void* event);
  // Returns when the work before `event`'s last record_event is done (at
  // once for an event never recorded); throws DeadlineExceededError naming
  // `what` past `deadline`, or the error the work raised. Waits for that
  // mark only, not for what was enqueued after it (a bounded number of steps
  // in flight). Default: polls event_done until the deadline.
  virtual void wait_event(int ordinal, void* event, DeadlineClock::time_point deadline,
                          const std::string& what);

  // ---- pinned host memory ----
  // Page-locked host memory (cudaHostAlloc): a copy from it to the device is
  // truly asynchronous, so the copy reads it when it runs, not at the call;
  // the caller keeps it alive and unchanged until the copy is done (an event
  // recorded after the copy says when). Returns nullptr when none is left.
  // host_free of a pointer host_alloc returned (nullptr: nothing) waits for
  // nothing: free only after the copies that read it are done. Defaults:
  // UnimplementedError (callers then use pageable memory).
  virtual void* host_alloc(size_t bytes);
  virtual void host_free(void* ptr);

  // ---- compute (float32, row-major) on `stream`; default: Unimplemented ----
  // y[n, out] = x[n, in] · w[in, out] + b
  virtual void dense_forward(int ordinal, void* stream, const float* x, const float* w,
                             const float* b, float* y, int64_t n, int64_t in, int64_t out);
  // dw = xᵀ·dy, db = Σrows dy, dx = dy·wᵀ (dx may be null)
  virtual void dense_backward(int ordinal, void* stream, const float* x, const float* w,
                              const float* dy, float* dx, float* dw, float* db, int64_t n,
                              int64_t in, int64_t out);
  // y = max(x, 0) / dx = dy where y > 0
  virtual void relu_forward(int ordinal, void* stream, const float* x, float* y, int64_t count);
  virtual void relu_backward(int ordinal, void* stream, const float* y, const float* dy, float* dx,
                             int64_t count);
  // Fused dense layer + ReLU (issue 44: fewer launches). Forward: dense_forward,
  // then y = max(y, 0), as one call (CUDA: the GEMM and one bias + ReLU
  // kernel). The output y is the ReLU mask the backward needs (y > 0 exactly
  // where the pre-activation was), so no aux buffer is written.
  // Default: dense_forward, then relu_forward(y, y).
  virtual void dense_relu_forward(int ordinal, void* stream, const float* x, const float* w,
                                  const float* b, float* y, int64_t n, int64_t in, int64_t out);
  // Backward of that layer: dy, the gradient of its ReLU output y, becomes
  // dy where y > 0, else 0 (dReLU, in place), then dense_backward on it
  // (CUDA: one kernel for the dReLU and the bias gradient db, then the two
  // GEMMs). Default: relu_backward(y, dy, dy), then dense_backward.
  virtual void dense_relu_backward(int ordinal, void* stream, const float* x, const float* w,
                                   const float* y, float* dy, float* dx, float* dw, float* db,
                                   int64_t n, int64_t in, int64_t out);
  // Per row: loss[i], dlogits = (softmax − onehot)·scale, correct[i] = argmax == label,
  // bad[0] = 1 + first row index whose label is out of range (0 if none).
  virtual void softmax_cross_entropy(int ordinal, void* stream, const float* logits,
                                     const int32_t* labels, float* dlogits, float* loss,
                                     int32_t* correct, int32_t* bad, int64_t n, int64_t k,
                                     float scale);
  // The optimizer rule over `count` elements (slots as in Optimizer::update).
  virtual void apply_update(int ordinal, void* stream, const UpdateRule& rule, float* var,
                            const float* grad, float* const* slots, size_t count, int64_t step);
  // The rule over a list of `n` float32 tensors of one device in one launch
  // (CUDA: one kernel per up to 48 tensors): tensor i is vars[i], grads[i]
  // (counts[i] elements each) with its slots at slots[s * n + i], s <
  // update_slot_count(rule). Every element gets exactly what apply_update
  // would give it with the same rule and step. The lists are host arrays
  // read during the call only. Default: apply_update per tensor, in order.
  virtual void apply_update_list(int ordinal, void* stream, const UpdateRule& rule,
                                 float* const* vars, const float* const* grads, float* const* slots,
                                 const size_t* counts, int n, int64_t step);
  // dst[i] = op(srcs[0][i] .. srcs[n-1][i]) (f32/f64/f16/bf16/i32/i64; f16/bf16 in f32),
  // divided by mean_divisor for kMean. dst may alias a src.
  virtual void reduce(int ordinal, void* stream, void* dst, const void* const* srcs, int n,
                      size_t count, DType dtype, ReduceOp op, int mean_divisor);
  // Input on the device (DistributeOptions::on_device): dst row i = src row
  // rows[i] for i < n, each row `row_bytes` bytes; `rows` are n int64 values
  // in device memory, each a row of src (the caller checked them on the
  // host). Default: UnimplementedError.
  virtual void gather_rows(int ordinal, void* stream, void* dst, const void* src,
                           const int64_t* rows, int64_t n, size_t row_bytes);

  // ---- collectives ----
  // One NCCL communicator per listed device of this process (MirroredStrategy);
  // rank r uses ordinals[r] and streams[r].
  virtual std::vector<std::unique_ptr<Communicator>> nccl_local_group(
      const std::vector<int>& ordinals, const std::vector<void*>& streams,
      const CommunicationOptions& options);
  // The NCCL library loaded at run time ("2.27.7"), "" without NCCL.
  virtual std::string nccl_version() { return ""; }
  // A new NCCL unique id (opaque bytes) for a multi-process communicator.
  virtual std::string nccl_unique_id();
  // This process's rank of a multi-process NCCL communicator; every rank
  // passes the same `unique_id` (broadcast by rank 0, e.g. over MPI).
  virtual std::unique_ptr<Communicator> nccl_communicator(const std::string& unique_id, int rank,
                                                          int size, int ordinal, void* stream,
                                                          const CommunicationOptions& options);
  // Logical devices that share one physical GPU cannot share an NCCL
  // communicator: this group reduces with a device kernel over the replicas'
  // buffers instead (same address space).
  virtual std::vector<std::unique_ptr<Communicator>> shared_device_group(
      const SharedDeviceGroupSpec& spec, const CommunicationOptions& options);

  // ==== Training features on device gradients ================================
  // Gradient clipping, loss scaling and gradient accumulation of the
  // optimizer (src/optim/device_training.cc) on GPU variables; CUDA:
  // src/gpu/optim_kernels.cu. Each call only enqueues on `stream` (a launch
  // per up to 48 tensors, no host round trip); the lists are host arrays of
  // `n` float32 device tensors (pointer, element count) that are read during
  // the call only. `loss_scale` (device, nullable): the tensors are first
  // multiplied by 1.0f / *loss_scale in float, as the host path unscales.
  // Defaults: UnimplementedError.
  // Device doubles of scratch that sum_of_squares needs per tensor.
  static constexpr size_t kSumOfSquaresScratch = 64;
  // sums[i] = sum over j of double(x) * x, x = in[i][j] (unscaled), summed in
  // an order fixed by counts[i] alone, so devices holding equal values get
  // equal sums; non-finite iff an element is (a float squared cannot
  // overflow a double). sums: n device doubles; scratch: n *
  // kSumOfSquaresScratch device doubles.
  virtual void sum_of_squares(int ordinal, void* stream, const float* const* in,
                              const size_t* counts, int n, const float* loss_scale, double* sums,
                              double* scratch);
  // out[i][j] = clip(x * f), x = in[i][j] (unscaled), f = clip_norm > 0 ?
  // float(clip_norm / max(sqrt(sums[i]), clip_norm)) (NaN when sums[i] is not
  // finite; sums: device, from sum_of_squares with the same loss_scale) :
  // scale; the product only when f != 1; clip into [-clip_value, clip_value]
  // when clip_value > 0. out may alias in.
  virtual void scale_and_clip(int ordinal, void* stream, const float* const* in, float* const* out,
                              const size_t* counts, int n, const float* loss_scale, float scale,
                              const double* sums, float clip_norm, float clip_value);
  // acc[i][j] = in[i][j] when `first`, else acc[i][j] + in[i][j] (float).
  virtual void accumulate(int ordinal, void* stream, float* const* acc, const float* const* in,
                          const size_t* counts, int n, bool first);
  // dst[0 .. count) = value (the value travels in the launch: no host memory
  // stays referenced).
  virtual void fill(int ordinal, void* stream, float* dst, size_t count, float value);
  // ==== end of the training-feature block ====================================

  // ==== Graph capture (issue 44 item 2) ======================================
  // A replica's step recorded once and replayed with one launch (CUDA
  // graphs). begin_capture puts `stream` in capture mode
  // (cudaStreamBeginCapture, relaxed mode: the caching allocator may still
  // grow and query events of blocks freed before the capture): work enqueued on it
  // is recorded, not run, until end_capture, which returns the instantiated
  // graph (cudaStreamEndCapture + cudaGraphInstantiate; an opaque handle)
  // and throws when the capture was invalidated. While a stream captures, a
  // device -> host read, a synchronize of it or of its device, a copy from
  // pageable host memory and a query of an event recorded in the capture
  // are errors (cudaErrorStreamCaptureUnsupported / ...Invalidated): they
  // throw, and the capture is invalidated. launch_graph enqueues the whole
  // graph on `stream` (cudaGraphLaunch): the recorded work runs in its
  // recorded order, reading and writing the same addresses each time.
  // destroy_graph frees the graph (not the memory its work uses).
  // Defaults: UnimplementedError (capturing() is false).
  virtual void begin_capture(int ordinal, void* stream);
  virtual void* end_capture(int ordinal, void* stream);
  virtual void launch_graph(int ordinal, void* graph, void* stream);
  virtual void destroy_graph(int ordinal, void* graph);
  virtual bool capturing(int ordinal, void* stream);
  // apply_update_list with the step's rate in device memory, read when the
  // kernel runs, so a captured update follows the schedule and Adam's bias
  // correction on every replay: *rate is update_step_rate(rule, step) of the
  // step (the rule's learning_rate and the step in the call are not used).
  // Every element gets the bits apply_update_list gives it at that step.
  // Default: UnimplementedError.
  virtual void apply_update_list_at(int ordinal, void* stream, const UpdateRule& rule,
                                    float* const* vars, const float* const* grads,
                                    float* const* slots, const size_t* counts, int n,
                                    const float* rate);
  // ==== end of the graph-capture block =======================================
};

// Slots per tensor of `rule` (Optimizer::slot_names' count): SGD 0 or 1
// (momentum), Adam 2 (m, v).
int update_slot_count(const UpdateRule& rule);

// The rate an update kernel applies at `step` (1-based): SGD's
// rule.learning_rate; Adam's bias-corrected step size lr * sqrt(1 - b2^t) /
// (1 - b1^t), computed as the host rule and the kernels compute it.
float update_step_rate(const UpdateRule& rule, int64_t step);

// Throws UnimplementedError "<what> is not available in the '<name>' GPU
// backend": the default of an operation a backend does not provide.
[[noreturn]] void throw_unavailable_in(const GpuBackend& b, const char* what);

// The backend this build registers: CUDA when compiled with it, else none.
std::unique_ptr<GpuBackend> make_default_gpu_backend();

}  // namespace diststrat
