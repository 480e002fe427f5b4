// The CPU math of src/nn (nn_kernels.h), compiled once per instruction-set
// variant with DISTSTRAT_ISA_NS naming the variant's namespace (CMake's
// diststrat_isa_sources). Everything defined here lives in that namespace,
// Eigen included (the #define below renames Eigen's namespace for this
// translation unit): otherwise the linker would keep one copy of each of
// Eigen's inline templates for all three variants, and the baseline path
// could run an AVX-512 GEMM. For the same reason this file uses no std::
// template that the compiler might emit out of line.
#ifndef DISTSTRAT_ISA_NS
#error "compiled by diststrat_isa_sources, which defines DISTSTRAT_ISA_NS"
#endif
#define DISTSTRAT_ISA_CAT2(a, b) a##b
#define DISTSTRAT_ISA_CAT(a, b) DISTSTRAT_ISA_CAT2(a, b)
#define Eigen DISTSTRAT_ISA_CAT(diststrat_eigen_, DISTSTRAT_ISA_NS)
#include <Eigen/Dense>
#include <cmath>

#include "nn/nn_kernels.h"

namespace diststrat {
namespace nn {
namespace DISTSTRAT_ISA_NS {
namespace {

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MapM = Eigen::Map<Mat>;
using CMapM = Eigen::Map<const Mat>;
using CMapV = Eigen::Map<const Eigen::RowVectorXf>;
using MapV = Eigen::Map<Eigen::RowVectorXf>;

void dense_forward(const float* x, const float* w, const float* b, float* y, int64_t m, int64_t k,
                   int64_t n) {
  MapM Y(y, m, n);
  Y.noalias() = CMapM(x, m, k) * CMapM(w, k, n);
  Y.rowwise() += CMapV(b, n);
}

void dense_backward(const float* x, const float* w, const float* dy, float* dx, float* dw,
                    float* db, int64_t m, int64_t k, int64_t n) {
  const CMapM DY(dy, m, n);
  MapM(dw, k, n).noalias() = CMapM(x, m, k).transpose() * DY;
  MapV(db, n) = DY.colwise().sum();
  if (dx) MapM(dx, m, k).noalias() = DY * CMapM(w, k, n).transpose();
}

void relu_forward(const float* x, float* y, int64_t count) {
  for (int64_t i = 0; i < count; ++i) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

void relu_backward(const float* y, const float* dy, float* dx, int64_t count) {
  for (int64_t i = 0; i < count; ++i) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

double softmax_cross_entropy(const float* z, const int32_t* labels, float* d, int64_t n, int64_t k,
                             float scale) {
  double loss = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float* zi = z + i * k;
    float* di = d + i * k;
    float m = zi[0];
    for (int64_t j = 1; j < k; ++j) m = zi[j] > m ? zi[j] : m;
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) sum += std::exp(static_cast<double>(zi[j] - m));
    const double log_sum = std::log(sum);
    loss += log_sum - static_cast<double>(zi[labels[i]] - m);
    for (int64_t j = 0; j < k; ++j) {
      const double p = std::exp(static_cast<double>(zi[j] - m) - log_sum);
      di[j] = static_cast<float>((p - (j == labels[i] ? 1.0 : 0.0)) * scale);
    }
  }
  return loss;
}

int64_t count_correct(const float* z, const int32_t* labels, int64_t n, int64_t k) {
  int64_t correct = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t best = 0;
    for (int64_t j = 1; j < k; ++j) {
      if (z[i * k + j] > z[i * k + best]) best = j;
    }
    correct += best == labels[i];
  }
  return correct;
}

void set_cache_sizes(std::ptrdiff_t l1, std::ptrdiff_t l2, std::ptrdiff_t l3) {
  Eigen::setCpuCacheSizes(l1, l2, l3);
}

}  // namespace

extern const NnKernels kNnKernels = {dense_forward,  dense_backward,        relu_forward,
                                     relu_backward,  softmax_cross_entropy, count_correct,
                                     set_cache_sizes};

}  // namespace DISTSTRAT_ISA_NS
}  // namespace nn
}  // namespace diststrat
