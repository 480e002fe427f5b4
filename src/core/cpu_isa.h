// Internal side of diststrat/cpu_isa.h: DISTSTRAT_CPU and picking the
// per-variant kernel table of a room.
//
// A room's hot kernels live in one source compiled three times (CMake's
// diststrat_isa_sources, cmake/DiststratIsa.cmake) with -DDISTSTRAT_ISA_NS set
// to isa_baseline, isa_avx2 or isa_avx512: each copy defines its table of
// function pointers in its own namespace, and the room's dispatcher (compiled
// once, for the baseline) returns pick(...) of the three.
#pragma once

#include <optional>

#include "diststrat/cpu_isa.h"

namespace diststrat {
namespace cpu {

// DISTSTRAT_CPU, validated (an unknown name or a variant above
// cpu_isa_supported() throws InvalidArgumentError naming the variable);
// nullopt when unset. Reads the environment on every call.
std::optional<CpuIsa> isa_from_env();

// The table of the variant in use.
template <class Table>
const Table& pick(const Table& baseline, const Table& avx2, const Table& avx512) {
  switch (cpu_isa()) {
    case CpuIsa::kAvx512:
      return avx512;
    case CpuIsa::kAvx2:
      return avx2;
    case CpuIsa::kBaseline:
      break;
  }
  return baseline;
}

}  // namespace cpu
}  // namespace diststrat

// A room's table `name` for the variant in use, from inside the room's
// namespace. Builds without the variants (DISTSTRAT_ISA_VARIANTS 0: not
// x86-64) compile the baseline only.
#if DISTSTRAT_ISA_VARIANTS
#define DISTSTRAT_ISA_PICK(name) \
  ::diststrat::cpu::pick(isa_baseline::name, isa_avx2::name, isa_avx512::name)
#else
#define DISTSTRAT_ISA_PICK(name) isa_baseline::name
#endif
