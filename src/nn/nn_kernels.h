// The CPU math of src/nn, compiled once per instruction-set variant
// (nn_kernels.cc; core/cpu_isa.h): row-major float32 matrices given as
// pointers and sizes, operands already validated by the caller.
#pragma once

#include <cstddef>
#include <cstdint>

namespace diststrat {
namespace nn {

struct NnKernels {
  // y[m,n] = x[m,k] * w[k,n] + b[n] (b broadcast over the rows).
  void (*dense_forward)(const float* x, const float* w, const float* b, float* y, int64_t m,
                        int64_t k, int64_t n);
  // dw[k,n] = x^T * dy, db[n] = the column sums of dy[m,n], and, when dx is
  // not null, dx[m,k] = dy * w^T.
  void (*dense_backward)(const float* x, const float* w, const float* dy, float* dx, float* dw,
                         float* db, int64_t m, int64_t k, int64_t n);
  // y = max(x, 0); dx = y > 0 ? dy : 0. In place allowed.
  void (*relu_forward)(const float* x, float* y, int64_t count);
  void (*relu_backward)(const float* y, const float* dy, float* dx, int64_t count);
  // Softmax cross-entropy of logits z[n,k] against labels (each in [0, k)):
  // returns the summed loss; d = (softmax - onehot) * scale.
  double (*softmax_cross_entropy)(const float* z, const int32_t* labels, float* d, int64_t n,
                                  int64_t k, float scale);
  // Rows whose largest logit (the first, on ties) is the label.
  int64_t (*count_correct)(const float* z, const int32_t* labels, int64_t n, int64_t k);
  // Sets this variant's Eigen cache sizes (bytes), which decide its GEMM
  // blocking and so the order of each dot product's partial sums.
  void (*set_cache_sizes)(std::ptrdiff_t l1, std::ptrdiff_t l2, std::ptrdiff_t l3);
};

// The table of the variant in use (diststrat/cpu_isa.h).
const NnKernels& nn_kernels();

// Determinism mode (diststrat/determinism.h): fixes the GEMM blocking of
// every compiled variant to the same cache sizes, whatever this CPU's, so
// that machines with different caches multiply alike. Per process (Eigen's
// sizes are); call it before replica threads multiply, not concurrently.
void pin_gemm_blocking();

namespace isa_baseline {
extern const NnKernels kNnKernels;
}
namespace isa_avx2 {
extern const NnKernels kNnKernels;
}
namespace isa_avx512 {
extern const NnKernels kNnKernels;
}

}  // namespace nn
}  // namespace diststrat
