// CPU detection and the process's kernel variant (diststrat/cpu_isa.h).
#include "core/cpu_isa.h"

#include <atomic>
#include <mutex>
#include <string>

#if DISTSTRAT_ISA_VARIANTS
#include <cpuid.h>
#endif

#include "core/cast_kernels.h"
#include "core/env.h"
#include "diststrat/error.h"

namespace diststrat {

namespace {

#if DISTSTRAT_ISA_VARIANTS
// F16C from CPUID leaf 1 (clang 14's __builtin_cpu_supports does not know
// "f16c").
bool cpu_has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
}
#endif

CpuIsa detect_cpu_isa() {
#if DISTSTRAT_ISA_VARIANTS
  __builtin_cpu_init();
  const bool f16c = cpu_has_f16c();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) {
    return CpuIsa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) {
    return CpuIsa::kAvx2;
  }
#endif
  return CpuIsa::kBaseline;
}

// The variant in use, -1 until decided. A property of the process (of its
// CPU and environment), like the CPU itself: the kernels are free functions
// that every strategy and user program of the process calls.
std::atomic<int> g_active{-1};
std::mutex g_decide;

CpuIsa decide_cpu_isa() {
  std::lock_guard<std::mutex> lock(g_decide);
  const int now = g_active.load();
  if (now >= 0) return static_cast<CpuIsa>(now);
  const CpuIsa chosen = cpu::isa_from_env().value_or(cpu_isa_supported());
  g_active.store(static_cast<int>(chosen));
  return chosen;
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBaseline:
      return "baseline";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
  }
  return "?";
}

CpuIsa cpu_isa_supported() {
  static const CpuIsa detected = detect_cpu_isa();
  return detected;
}

CpuIsa cpu_isa() {
  const int now = g_active.load(std::memory_order_relaxed);
  return now >= 0 ? static_cast<CpuIsa>(now) : decide_cpu_isa();
}

CpuIsa limit_cpu_isa(CpuIsa most) {
  const int m = static_cast<int>(most);
  DISTSTRAT_CHECK(
      m >= static_cast<int>(CpuIsa::kBaseline) && m <= static_cast<int>(CpuIsa::kAvx512),
      kInvalidArgument, "limit_cpu_isa: ", m, " is not a CpuIsa (kBaseline 0, kAvx2 1, kAvx512 2)");
  cpu_isa();
  int now = g_active.load();
  while (static_cast<int>(most) < now &&
         !g_active.compare_exchange_weak(now, static_cast<int>(most))) {
  }
  return static_cast<CpuIsa>(g_active.load());
}

namespace cpu {

std::optional<CpuIsa> isa_from_env() {
  return env::parsed<CpuIsa>("DISTSTRAT_CPU", [](const std::string& v) {
    for (CpuIsa isa : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
      if (v != cpu_isa_name(isa)) continue;
      DISTSTRAT_CHECK(static_cast<int>(isa) <= static_cast<int>(cpu_isa_supported()),
                      kInvalidArgument, "this CPU runs at most '",
                      cpu_isa_name(cpu_isa_supported()), "'",
                      DISTSTRAT_ISA_VARIANTS ? "" : " (this build has the baseline only)");
      return isa;
    }
    throw InvalidArgumentError("expected baseline, avx2 or avx512");
  });
}

const CastKernels& cast_kernels() { return DISTSTRAT_ISA_PICK(kCastKernels); }

}  // namespace cpu
}  // namespace diststrat
