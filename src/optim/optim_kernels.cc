// The optimizers' element-wise math (optim_kernels.h), compiled once per
// instruction-set variant with DISTSTRAT_ISA_NS naming the variant's
// namespace (CMake's diststrat_isa_sources). Everything defined here lives in
// that namespace and nothing here calls a std:: template the compiler could
// emit out of line, so no function compiled for AVX can stand in for a
// baseline one at link time. The loops are plain so that each variant's
// compiler vectorises them for its instruction set.
#ifndef DISTSTRAT_ISA_NS
#error "compiled by diststrat_isa_sources, which defines DISTSTRAT_ISA_NS"
#endif
#include <cmath>

#include "optim/optim_kernels.h"

namespace diststrat {
namespace optim_detail {
namespace DISTSTRAT_ISA_NS {
namespace {

void sgd(float* var, const float* grad, size_t count, float lr) {
  for (size_t i = 0; i < count; ++i) var[i] -= lr * grad[i];
}

void sgd_momentum(float* var, const float* grad, float* v, size_t count, float lr, float mu,
                  bool nesterov) {
  if (nesterov) {
    for (size_t i = 0; i < count; ++i) {
      v[i] = mu * v[i] - lr * grad[i];
      var[i] += mu * v[i] - lr * grad[i];
    }
  } else {
    for (size_t i = 0; i < count; ++i) {
      v[i] = mu * v[i] - lr * grad[i];
      var[i] += v[i];
    }
  }
}

void adam(float* var, const float* grad, float* m, float* v, size_t count, float b1, float b2,
          float alpha, float epsilon) {
  for (size_t i = 0; i < count; ++i) {
    m[i] = b1 * m[i] + (1 - b1) * grad[i];
    v[i] = b2 * v[i] + (1 - b2) * grad[i] * grad[i];
    var[i] -= alpha * m[i] / (__builtin_sqrtf(v[i]) + epsilon);
  }
}

double sum_of_squares(const float* p, size_t count) {
  double s = 0;
  for (size_t i = 0; i < count; ++i) s += double(p[i]) * p[i];
  return s;
}

bool scale_all_finite(float* p, size_t count, float s) {
  // |x| <= FLT_MAX is false for inf and NaN: a branch-free test that
  // vectorises (std::isfinite is a call at some optimisation levels).
  bool finite = true;
  for (size_t i = 0; i < count; ++i) {
    p[i] *= s;
    finite &= __builtin_fabsf(p[i]) <= 3.40282347e+38f;
  }
  return finite;
}

void scale(float* p, size_t count, float s) {
  for (size_t i = 0; i < count; ++i) p[i] *= s;
}

void clip(float* p, size_t count, float lo, float hi) {
  for (size_t i = 0; i < count; ++i) p[i] = p[i] < lo ? lo : (p[i] > hi ? hi : p[i]);
}

}  // namespace

extern const OptimKernels kOptimKernels = {
    sgd, sgd_momentum, adam, sum_of_squares, scale_all_finite, scale, clip};

}  // namespace DISTSTRAT_ISA_NS
}  // namespace optim_detail
}  // namespace diststrat
