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
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

int32_t copy_max_abs_bits(float* dst, const float* src, size_t count) {
  int32_t m = 0;
  for (size_t i = 0; i < count; ++i) {
    const float x = src[i];
    dst[i] = x;
    int32_t b;
    __builtin_memcpy(&b, &x, sizeof b);
    b &= 0x7fffffff;
    m = b > m ? b : m;
  }
  return m;
}

// 2^e as a double (|e| < 1023).
double power_of_two(int e) {
  const uint64_t bits = static_cast<uint64_t>(1023 + e) << 52;
  double d;
  __builtin_memcpy(&d, &bits, sizeof d);
  return d;
}

// round(v) to nearest-even as int64 (|v| < 2^63): the CPU's conversion under
// the default rounding mode.
inline int64_t round_to_int64(double v) {
#if defined(__x86_64__)
  return _mm_cvtsd_si64(_mm_set_sd(v));
#else
  return __builtin_llrint(v);
#endif
}

void fixed_point_sum(int64_t* q, const float* const* src, size_t shards, size_t count, int shift) {
  const double scale = power_of_two(shift);
  // In blocks that stay in L1: the int64 sums are written once per block.
  constexpr size_t kBlock = 512;
  for (size_t b = 0; b < count; b += kBlock) {
    const size_t n = count - b < kBlock ? count - b : kBlock;
    int64_t* out = q + b;
    for (size_t j = 0; j < shards; ++j) {
      const float* x = src[j] + b;
      size_t i = 0;
#if defined(__AVX512DQ__)
      const __m512d s8 = _mm512_set1_pd(scale);
      for (; i + 8 <= n; i += 8) {
        const __m512i r =
            _mm512_cvtpd_epi64(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + i)), s8));
        __m512i* o = reinterpret_cast<__m512i*>(out + i);
        _mm512_storeu_si512(o, j == 0 ? r : _mm512_add_epi64(_mm512_loadu_si512(o), r));
      }
#endif
      for (; i < n; ++i) {
        const int64_t r = round_to_int64(static_cast<double>(x[i]) * scale);
        out[i] = j == 0 ? r : out[i] + r;
      }
    }
  }
  if (shards == 0)
    for (size_t i = 0; i < count; ++i) q[i] = 0;
}

void from_fixed_point(float* out, const int64_t* q, size_t count, int shift) {
  const double unscale = power_of_two(-shift);
  for (size_t i = 0; i < count; ++i)
    out[i] = static_cast<float>(static_cast<double>(static_cast<float>(q[i])) * unscale);
}

}  // namespace

extern const OptimKernels kOptimKernels = {sgd,
                                           sgd_momentum,
                                           adam,
                                           sum_of_squares,
                                           scale_all_finite,
                                           scale,
                                           clip,
                                           copy_max_abs_bits,
                                           fixed_point_sum,
                                           from_fixed_point};

}  // namespace DISTSTRAT_ISA_NS
}  // namespace optim_detail
}  // namespace diststrat
