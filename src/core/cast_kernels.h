// Array conversions between float32 and the 16-bit floats, compiled once per
// instruction-set variant (cast_kernels.cc; core/cpu_isa.h). float16 rounds
// to nearest even on every variant (AVX2 and AVX-512 use F16C); bfloat16 is
// the top half of a float32, rounded to nearest even, NaN kept a NaN.
#pragma once

#include <cstddef>
#include <cstdint>

namespace diststrat {
namespace cpu {

struct CastKernels {
  void (*f16_to_f32)(const uint16_t* src, float* dst, size_t count);
  void (*f32_to_f16)(const float* src, uint16_t* dst, size_t count);
  void (*bf16_to_f32)(const uint16_t* src, float* dst, size_t count);
  void (*f32_to_bf16)(const float* src, uint16_t* dst, size_t count);
};

// The table of the variant in use (diststrat/cpu_isa.h).
const CastKernels& cast_kernels();

namespace isa_baseline {
extern const CastKernels kCastKernels;
}
namespace isa_avx2 {
extern const CastKernels kCastKernels;
}
namespace isa_avx512 {
extern const CastKernels kCastKernels;
}

}  // namespace cpu
}  // namespace diststrat
