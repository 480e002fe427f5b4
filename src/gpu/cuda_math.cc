// The CUDA backend's math calls: dense layers through cuBLAS GEMMs (with
// the bias + ReLU and dReLU + bias-gradient epilogues as one small kernel
// each), and the activations, loss, optimizer updates, reductions and training features
// (clipping, loss scaling, accumulation) through the kernels of kernels.cu
// and optim_kernels.cu, each on the caller's stream.
#include "gpu/cuda_backend_impl.h"
#include "gpu/kernels.h"
#include "gpu/optim_kernels.h"

namespace diststrat {
namespace gpu {

// Row-major C[m, n] = A[m, k]·B[k, n] is column-major Cᵀ = Bᵀ·Aᵀ, so each
// GEMM below passes the operands in swapped order.
namespace {

// A dense layer's forward GEMM (the plain and the ReLU-fused layer share it).
// yᵀ[out, n] = wᵀ[out, in] · xᵀ[in, n]
void forward_gemm(cublasHandle_t h, const float* x, const float* w, float* y, int64_t n, int64_t in,
                  int64_t out) {
  const float one = 1.0f, zero = 0.0f;
  DISTSTRAT_CUBLAS_CHECK(cublasSgemm(
      h, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(out), static_cast<int>(n), static_cast<int>(in),
      &one, w, static_cast<int>(out), x, static_cast<int>(in), &zero, y, static_cast<int>(out)));
}

// A dense layer's backward GEMMs, given dy (after the dReLU where fused):
// dw and, when dx is wanted, dx.
void backward_gemms(cublasHandle_t h, const float* x, const float* w, const float* dy, float* dx,
                    float* dw, int64_t n, int64_t in, int64_t out) {
  const float one = 1.0f, zero = 0.0f;
  // dw = xᵀ·dy: dwᵀ[out, in] = dyᵀ[out, n] · x[n, in]
  DISTSTRAT_CUBLAS_CHECK(cublasSgemm(
      h, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(out), static_cast<int>(in), static_cast<int>(n),
      &one, dy, static_cast<int>(out), x, static_cast<int>(in), &zero, dw, static_cast<int>(out)));
  if (dx) {
    // dx = dy·wᵀ: dxᵀ[in, n] = w[in, out] (= (wᵀ)ᵀ) · dyᵀ[out, n]
    DISTSTRAT_CUBLAS_CHECK(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(in),
                                       static_cast<int>(n), static_cast<int>(out), &one, w,
                                       static_cast<int>(out), dy, static_cast<int>(out), &zero, dx,
                                       static_cast<int>(in)));
  }
}

}  // namespace

void CudaBackend::dense_forward(int ordinal, void* stream, const float* x, const float* w,
                                const float* b, float* y, int64_t n, int64_t in, int64_t out) {
  if (n == 0) return;
  forward_gemm(blas(ordinal, stream), x, w, y, n, in, out);
  launch_bias_add(y, b, n, out, stream);
}

void CudaBackend::dense_backward(int ordinal, void* stream, const float* x, const float* w,
                                 const float* dy, float* dx, float* dw, float* db, int64_t n,
                                 int64_t in, int64_t out) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  if (n == 0) {
    DISTSTRAT_CUDA_CHECK(cudaMemsetAsync(dw, 0, sizeof(float) * in * out, as_stream(stream)));
    DISTSTRAT_CUDA_CHECK(cudaMemsetAsync(db, 0, sizeof(float) * out, as_stream(stream)));
    return;
  }
  launch_column_sum(dy, db, n, out, stream);
  backward_gemms(blas(ordinal, stream), x, w, dy, dx, dw, n, in, out);
}

// The GEMM of dense_forward, then bias + ReLU in one kernel.
void CudaBackend::dense_relu_forward(int ordinal, void* stream, const float* x, const float* w,
                                     const float* b, float* y, int64_t n, int64_t in, int64_t out) {
  if (n == 0) return;
  forward_gemm(blas(ordinal, stream), x, w, y, n, in, out);
  launch_bias_relu(y, b, n, out, stream);
}

// dReLU and the bias gradient in one kernel, then dense_backward's GEMMs.
void CudaBackend::dense_relu_backward(int ordinal, void* stream, const float* x, const float* w,
                                      const float* y, float* dy, float* dx, float* dw, float* db,
                                      int64_t n, int64_t in, int64_t out) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  if (n == 0) {
    dense_backward(ordinal, stream, x, w, dy, dx, dw, db, n, in, out);
    return;
  }
  launch_drelu_column_sum(y, dy, db, n, out, stream);
  backward_gemms(blas(ordinal, stream), x, w, dy, dx, dw, n, in, out);
}

void CudaBackend::relu_forward(int ordinal, void* stream, const float* x, float* y, int64_t count) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  launch_relu_forward(x, y, count, stream);
}

void CudaBackend::relu_backward(int ordinal, void* stream, const float* y, const float* dy,
                                float* dx, int64_t count) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  launch_relu_backward(y, dy, dx, count, stream);
}

void CudaBackend::softmax_cross_entropy(int ordinal, void* stream, const float* logits,
                                        const int32_t* labels, float* dlogits, float* loss,
                                        int32_t* correct, int32_t* bad, int64_t n, int64_t k,
                                        float scale) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  launch_softmax_xent(logits, labels, dlogits, loss, correct, bad, n, k, scale, stream);
}

void CudaBackend::apply_update(int ordinal, void* stream, const UpdateRule& rule, float* var,
                               const float* grad, float* const* slots, size_t count, int64_t step) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  launch_update(rule, var, grad, slots, count, step, stream);
}

void CudaBackend::apply_update_list(int ordinal, void* stream, const UpdateRule& rule,
                                    float* const* vars, const float* const* grads,
                                    float* const* slots, const size_t* counts, int n,
                                    int64_t step) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  launch_update_list(rule, vars, grads, slots, counts, n, step, stream);
}

void CudaBackend::reduce(int ordinal, void* stream, void* dst, const void* const* srcs, int n,
                         size_t count, DType dtype, ReduceOp op, int mean_divisor) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  launch_reduce(&dst, 1, srcs, n, count, dtype, op, mean_divisor, stream);
}

void CudaBackend::gather_rows(int ordinal, void* stream, void* dst, const void* src,
                              const int64_t* rows, int64_t n, size_t row_bytes) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  launch_gather_rows(dst, src, rows, n, row_bytes, stream);
}

// Training features on device gradients (optim_kernels.cu).
void CudaBackend::sum_of_squares(int ordinal, void* stream, const float* const* in,
                                 const size_t* counts, int n, const float* loss_scale, double* sums,
                                 double* scratch) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  launch_sum_of_squares(in, counts, n, loss_scale, sums, scratch, stream);
}

void CudaBackend::scale_and_clip(int ordinal, void* stream, const float* const* in,
                                 float* const* out, const size_t* counts, int n,
                                 const float* loss_scale, float scale, const double* sums,
                                 float clip_norm, float clip_value) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  launch_scale_and_clip(in, out, counts, n, loss_scale, scale, sums, clip_norm, clip_value, stream);
}

void CudaBackend::accumulate(int ordinal, void* stream, float* const* acc, const float* const* in,
                             const size_t* counts, int n, bool first) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  launch_accumulate(acc, in, counts, n, first, stream);
}

void CudaBackend::fill(int ordinal, void* stream, float* dst, size_t count, float value) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  launch_fill(dst, count, value, stream);
}

}  // namespace gpu
}  // namespace diststrat
