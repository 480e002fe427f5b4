// float32 <-> float16 / bfloat16 arrays (cast_kernels.h), compiled once per
// instruction-set variant with DISTSTRAT_ISA_NS naming the variant's
// namespace (CMake's diststrat_isa_sources): everything defined here lives in
// that namespace, and the conversions are written out here rather than taken
// from dtype.h's inline members, so that no AVX-compiled copy of a shared
// inline function can replace the baseline's at link time.
#ifndef DISTSTRAT_ISA_NS
#error "compiled by diststrat_isa_sources, which defines DISTSTRAT_ISA_NS"
#endif
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "core/cast_kernels.h"
#include "diststrat/dtype.h"

namespace diststrat {
namespace cpu {
namespace DISTSTRAT_ISA_NS {
namespace {

void f16_to_f32(const uint16_t* src, float* dst, size_t count) {
  size_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < count; ++i) dst[i] = Half::to_float(src[i]);
}

void f32_to_f16(const float* src, uint16_t* dst, size_t count) {
  size_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < count; ++i) dst[i] = Half::from_float(src[i]);
}

void bf16_to_f32(const uint16_t* src, float* dst, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &u, 4);
  }
}

void f32_to_bf16(const float* src, uint16_t* dst, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    dst[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
}

}  // namespace

extern const CastKernels kCastKernels = {f16_to_f32, f32_to_f16, bf16_to_f32, f32_to_bf16};

}  // namespace DISTSTRAT_ISA_NS
}  // namespace cpu
}  // namespace diststrat
