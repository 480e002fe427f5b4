// The optimizers' element-wise math on host float32 arrays, compiled once per
// instruction-set variant (optim_kernels.cc; core/cpu_isa.h). Compiled with
// -ffp-contract=off (cmake/DiststratIsa.cmake): no variant fuses a multiply
// and an add, so every variant updates bit-identically.
#pragma once

#include <cstddef>
#include <cstdint>

namespace diststrat {
namespace optim_detail {

struct OptimKernels {
  // var -= lr * grad.
  void (*sgd)(float* var, const float* grad, size_t count, float lr);
  // v = mu * v - lr * grad; var += v (nesterov: var += mu * v - lr * grad).
  void (*sgd_momentum)(float* var, const float* grad, float* v, size_t count, float lr, float mu,
                       bool nesterov);
  // m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; var -= alpha m / (sqrt(v) + eps).
  void (*adam)(float* var, const float* grad, float* m, float* v, size_t count, float b1, float b2,
               float alpha, float epsilon);
  // The sum of p[i]^2 in double, in index order (the same sum on every variant).
  double (*sum_of_squares)(const float* p, size_t count);
  // p *= s; returns whether every result is finite.
  bool (*scale_all_finite)(float* p, size_t count, float s);
  // p *= s.
  void (*scale)(float* p, size_t count, float s);
  // p = min(max(p, lo), hi), NaN kept.
  void (*clip)(float* p, size_t count, float lo, float hi);
  // Determinism mode's exact sum (src/optim/deterministic_sum.cc); integer
  // results, so every variant gives the same bits.
  // dst = src; returns the largest of the elements' |x| bit patterns
  // (x & 0x7fffffff, ordered as |x| is, inf and NaN above every finite one).
  int32_t (*copy_max_abs_bits)(float* dst, const float* src, size_t count);
  // q[i] = the sum over j < shards of round(src[j][i] * 2^shift), each
  // rounding to nearest-even (the products are exact in double; the caller
  // keeps every |result| below 2^62).
  void (*fixed_point_sum)(int64_t* q, const float* const* src, size_t shards, size_t count,
                          int shift);
  // out[i] = float(q[i]) * 2^-shift, the product in double (exact unless the
  // result is a float subnormal).
  void (*from_fixed_point)(float* out, const int64_t* q, size_t count, int shift);
};

// The table of the variant in use (diststrat/cpu_isa.h).
const OptimKernels& optim_kernels();

namespace isa_baseline {
extern const OptimKernels kOptimKernels;
}
namespace isa_avx2 {
extern const OptimKernels kOptimKernels;
}
namespace isa_avx512 {
extern const OptimKernels kOptimKernels;
}

}  // namespace optim_detail
}  // namespace diststrat
