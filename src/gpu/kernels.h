// Launchers of the CUDA kernels in kernels.cu. Host functions: they enqueue
// on `stream` (a cudaStream_t) and check the launch; nothing here blocks.
// Row-major float32 unless said otherwise.
#pragma once

#include <cstddef>
#include <cstdint>

#include "diststrat/collective.h"
#include "diststrat/dtype.h"
#include "diststrat/update_rule.h"

namespace diststrat {
namespace gpu {

// Most buffers one reduce launch reads or writes (logical GPUs per physical GPU).
constexpr int kMaxReduceBuffers = 16;

// For every i < count and every output o: outs[o][i] = op over k of ins[k][i]
// (divided by mean_divisor for kMean). f16/bf16 accumulate in f32. An output
// may alias an input exactly. n_in, n_out in [1, kMaxReduceBuffers].
// Integer kSum/kProduct wrap modulo 2^bits and integer kMean truncates the
// wrapped sum toward zero, as the host kernels do; a dtype or op outside the
// enums is InvalidArgumentError (device_reduce.h).
void launch_reduce(void* const* outs, int n_out, const void* const* ins, int n_in, size_t count,
                   DType dtype, ReduceOp op, int mean_divisor, void* stream);

// dst row i = src row rows[i] (i < n; rows of row_bytes bytes, rows[]
// int64 in device memory): GpuBackend::gather_rows.
void launch_gather_rows(void* dst, const void* src, const int64_t* rows, int64_t n,
                        size_t row_bytes, void* stream);

// y[r, c] += b[c]
void launch_bias_add(float* y, const float* b, int64_t rows, int64_t cols, void* stream);
// db[c] = Σr dy[r, c]  (0 when rows == 0)
void launch_column_sum(const float* dy, float* db, int64_t rows, int64_t cols, void* stream);
void launch_relu_forward(const float* x, float* y, int64_t count, void* stream);
void launch_relu_backward(const float* y, const float* dy, float* dx, int64_t count, void* stream);
// y[r, c] = max(y[r, c] + b[c], 0): dense_relu_forward's epilogue.
void launch_bias_relu(float* y, const float* b, int64_t rows, int64_t cols, void* stream);
// dy[r, c] = y[r, c] > 0 ? dy[r, c] : 0 and db[c] = Σr dy[r, c] (the masked
// values, summed as launch_column_sum sums): dense_relu_backward's dReLU and
// bias gradient in one kernel.
void launch_drelu_column_sum(const float* y, float* dy, float* db, int64_t rows, int64_t cols,
                             void* stream);
// See GpuBackend::softmax_cross_entropy.
void launch_softmax_xent(const float* logits, const int32_t* labels, float* dlogits, float* loss,
                         int32_t* correct, int32_t* bad, int64_t n, int64_t k, float scale,
                         void* stream);
// The optimizer rule (SGD with momentum / Nesterov, Adam with bias correction).
void launch_update(const UpdateRule& rule, float* var, const float* grad, float* const* slots,
                   size_t count, int64_t step, void* stream);
// The rule over a list (GpuBackend::apply_update_list: slots[s * n + i]),
// one launch per kUpdateChunk tensors, each element as launch_update does it.
constexpr int kUpdateChunk = 48;
void launch_update_list(const UpdateRule& rule, float* const* vars, const float* const* grads,
                        float* const* slots, const size_t* counts, int n, int64_t step,
                        void* stream);
// The same with the step's rate (update_step_rate) read from device memory
// when the kernel runs (GpuBackend::apply_update_list_at: a captured step).
void launch_update_list_at(const UpdateRule& rule, float* const* vars, const float* const* grads,
                           float* const* slots, const size_t* counts, int n, const float* rate,
                           void* stream);

}  // namespace gpu
}  // namespace diststrat
