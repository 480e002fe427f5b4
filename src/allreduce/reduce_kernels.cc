// Reduction kernels. One template per operation, instantiated per element
// type and operator, and compiled three times for the instruction sets we
// dispatch between at run time (baseline x86-64, AVX2+F16C+FMA, AVX-512):
// the loops are written so that the compiler vectorises them at -O3 for
// whichever target it compiles for, and f16 uses the F16C conversion
// instructions where available. Work proceeds in blocks of kBlock elements
// whose f32/native accumulator stays in L1, so every source is streamed once
// and the destination written once (one pass, no temporaries).

#include "allreduce/reduce_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DISTSTRAT_X86 1
#else
#define DISTSTRAT_X86 0
#endif

#include "core/cast_kernels.h"
#include "diststrat/cpu_isa.h"
#include "diststrat/error.h"

namespace diststrat {
namespace kernels {
namespace {

enum class Isa { kBase, kAvx2, kAvx512 };

// How an element type is accumulated: 16-bit floats in f32, others natively.
template <typename T>
struct Acc {
  using type = T;
};
template <>
struct Acc<Half> {
  using type = float;
};
template <>
struct Acc<BFloat16> {
  using type = float;
};

// Integer sums and products wrap modulo 2^bits (as MPI's and NCCL's do),
// computed in the unsigned type: signed overflow would be undefined.
template <typename A>
A wrap_add(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}
template <typename A>
A wrap_mul(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
  } else {
    return a * b;
  }
}
struct SumOp {
  template <typename A>
  A operator()(A a, A b) const {
    return wrap_add(a, b);
  }
};
struct ProdOp {
  template <typename A>
  A operator()(A a, A b) const {
    return wrap_mul(a, b);
  }
};
struct MinOp {
  template <typename A>
  A operator()(A a, A b) const {
    return b < a ? b : a;
  }
};
struct MaxOp {
  template <typename A>
  A operator()(A a, A b) const {
    return a < b ? b : a;
  }
};

constexpr size_t kBlock = 1024;

#define DS_INLINE inline __attribute__((always_inline))

// ---- loading a block of sources into the accumulator and storing it back.
// Native types: plain copies. bf16: the top half of an f32 (bit operations
// the compiler vectorises). f16: F16C where the ISA has it, else scalar.
template <Isa I, typename T>
struct Convert {
  static DS_INLINE void load(T* __restrict acc, const T* __restrict s, size_t n) {
    for (size_t j = 0; j < n; ++j) acc[j] = s[j];
  }
  static DS_INLINE T get(const T* s, size_t j) { return s[j]; }
  static DS_INLINE void store(T* __restrict d, const T* __restrict acc, size_t n) {
    for (size_t j = 0; j < n; ++j) d[j] = acc[j];
  }
};

template <Isa I>
struct Convert<I, BFloat16> {
  static DS_INLINE float to_f32(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static DS_INLINE uint16_t from_f32(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
  static DS_INLINE void load(float* __restrict acc, const BFloat16* __restrict s, size_t n) {
    const uint16_t* b = reinterpret_cast<const uint16_t*>(s);
    for (size_t j = 0; j < n; ++j) acc[j] = to_f32(b[j]);
  }
  static DS_INLINE float get(const BFloat16* s, size_t j) {
    return to_f32(reinterpret_cast<const uint16_t*>(s)[j]);
  }
  static DS_INLINE void store(BFloat16* __restrict d, const float* __restrict acc, size_t n) {
    uint16_t* b = reinterpret_cast<uint16_t*>(d);
    for (size_t j = 0; j < n; ++j) b[j] = from_f32(acc[j]);
  }
};

template <>
struct Convert<Isa::kBase, Half> {
  static DS_INLINE void load(float* acc, const Half* s, size_t n) {
    for (size_t j = 0; j < n; ++j) acc[j] = Half::to_float(s[j].bits);
  }
  static DS_INLINE void store(Half* d, const float* acc, size_t n) {
    for (size_t j = 0; j < n; ++j) d[j].bits = Half::from_float(acc[j]);
  }
};

#if DISTSTRAT_X86
// F16C: 8 conversions per instruction, round-to-nearest-even like Half.
// Out of line (called once per block) so the callers need no F16C target.
struct F16c {
  __attribute__((target("avx2,f16c"), noinline)) static void load(float* acc, const Half* s,
                                                                  size_t n) {
    size_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + j));
      _mm256_storeu_ps(acc + j, _mm256_cvtph_ps(h));
    }
    for (; j < n; ++j) acc[j] = Half::to_float(s[j].bits);
  }
  __attribute__((target("avx2,f16c"), noinline)) static void store(Half* d, const float* acc,
                                                                   size_t n) {
    size_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(acc + j), _MM_FROUND_TO_NEAREST_INT);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + j), h);
    }
    for (; j < n; ++j) d[j].bits = Half::from_float(acc[j]);
  }
};
template <>
struct Convert<Isa::kAvx2, Half> : F16c {};
template <>
struct Convert<Isa::kAvx512, Half> : F16c {};
#endif

// ---- the kernel: dst = op(srcs...) [/ divisor], one pass over every source.
template <Isa I, typename T, typename Op>
DS_INLINE void reduce_body(T* dst, const T* const* srcs, int n, size_t count, Op op, int divisor) {
  using A = typename Acc<T>::type;
  alignas(64) A acc[kBlock];
  alignas(64) A tmp[kBlock];
  using C = Convert<I, T>;
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t len = std::min(kBlock, count - base);
    C::load(acc, srcs[0] + base, len);
    for (int k = 1; k < n; ++k) {
      if constexpr (std::is_same<A, T>::value) {
        const T* __restrict s = srcs[k] + base;
        for (size_t j = 0; j < len; ++j) acc[j] = op(acc[j], s[j]);
      } else {
        C::load(tmp, srcs[k] + base, len);
        for (size_t j = 0; j < len; ++j) acc[j] = op(acc[j], tmp[j]);
      }
    }
    if (divisor > 1) {
      const A d = static_cast<A>(divisor);
      for (size_t j = 0; j < len; ++j) acc[j] = acc[j] / d;
    }
    C::store(dst + base, acc, len);
  }
}

template <typename T, typename Op>
void reduce_base(T* dst, const T* const* srcs, int n, size_t count, Op op, int divisor) {
  reduce_body<Isa::kBase, T, Op>(dst, srcs, n, count, op, divisor);
}
#if DISTSTRAT_X86
template <typename T, typename Op>
__attribute__((target("avx2,fma,f16c"))) void reduce_avx2(T* dst, const T* const* srcs, int n,
                                                          size_t count, Op op, int divisor) {
  reduce_body<Isa::kAvx2, T, Op>(dst, srcs, n, count, op, divisor);
}
template <typename T, typename Op>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))) void reduce_avx512(
    T* dst, const T* const* srcs, int n, size_t count, Op op, int divisor) {
  reduce_body<Isa::kAvx512, T, Op>(dst, srcs, n, count, op, divisor);
}
#endif

// The process's variant (diststrat/cpu_isa.h: the CPU's best, DISTSTRAT_CPU
// or limit_cpu_isa), shared with the model math.
Isa isa() {
#if DISTSTRAT_X86
  switch (cpu_isa()) {
    case CpuIsa::kAvx512:
      return Isa::kAvx512;
    case CpuIsa::kAvx2:
      return Isa::kAvx2;
    case CpuIsa::kBaseline:
      break;
  }
#endif
  return Isa::kBase;
}

template <typename Fn>
void dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32:
      return fn(float{});
    case DType::kFloat64:
      return fn(double{});
    case DType::kFloat16:
      return fn(Half{});
    case DType::kBFloat16:
      return fn(BFloat16{});
    case DType::kInt32:
      return fn(int32_t{});
    case DType::kInt64:
      return fn(int64_t{});
  }
  throw InvalidArgumentError("reduction of unknown dtype");
}

template <typename Fn>
void dispatch_op(ReduceOp op, Fn&& fn) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      return fn(SumOp{});
    case ReduceOp::kProduct:
      return fn(ProdOp{});
    case ReduceOp::kMin:
      return fn(MinOp{});
    case ReduceOp::kMax:
      return fn(MaxOp{});
  }
  throw InvalidArgumentError("unknown reduce op");
}

void run(void* dst, const void* const* srcs, int n, size_t count, DType dtype, ReduceOp op,
         int divisor, Isa which) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_op(op, [&](auto o) {
      T* d = static_cast<T*>(dst);
      const T* const* s = reinterpret_cast<const T* const*>(srcs);
#if DISTSTRAT_X86
      if (which == Isa::kAvx512) return reduce_avx512<T>(d, s, n, count, o, divisor);
      if (which == Isa::kAvx2) return reduce_avx2<T>(d, s, n, count, o, divisor);
#endif
      reduce_base<T>(d, s, n, count, o, divisor);
    });
  });
}

#if DISTSTRAT_X86
__attribute__((target("avx512f"))) void stream_avx512(char* d, const char* s, size_t bytes) {
  for (size_t i = 0; i < bytes; i += 64) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), _mm512_loadu_si512(s + i));
  }
}
__attribute__((target("avx2"))) void stream_avx2(char* d, const char* s, size_t bytes) {
  for (size_t i = 0; i < bytes; i += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
  }
}
#endif

}  // namespace

void copy_streaming(void* dst, const void* src, size_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#if DISTSTRAT_X86
  // Head up to a 64-byte boundary of dst and the tail with memcpy; the
  // aligned middle with streaming stores.
  const size_t head = std::min(bytes, (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  const size_t body = bytes / 64 * 64;
  if (body > 0 && isa() != Isa::kBase) {
    if (isa() == Isa::kAvx512) {
      stream_avx512(d, s, body);
    } else {
      stream_avx2(d, s, body);
    }
    _mm_sfence();  // streaming stores are weakly ordered: publish them before any flag
    d += body;
    s += body;
    bytes -= body;
  }
#endif
  std::memcpy(d, s, bytes);
}

const char* isa_name() {
  switch (isa()) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kBase:
      return "baseline";
  }
  return "?";
}

void reduce(void* dst, const void* const* srcs, int n, size_t count, DType dtype, ReduceOp op,
            int mean_divisor) {
  if (count == 0 || n == 0) return;
  run(dst, srcs, n, count, dtype, op, op == ReduceOp::kMean ? mean_divisor : 1, isa());
}

void reduce_baseline(void* dst, const void* const* srcs, int n, size_t count, DType dtype,
                     ReduceOp op, int mean_divisor) {
  if (count == 0 || n == 0) return;
  run(dst, srcs, n, count, dtype, op, op == ReduceOp::kMean ? mean_divisor : 1, Isa::kBase);
}

void accumulate(void* dst, const void* src, size_t count, DType dtype, ReduceOp op) {
  if (count == 0) return;
  const void* srcs[2] = {dst, src};
  run(dst, srcs, 2, count, dtype, op, 1, isa());
}

void scale_mean(void* dst, size_t count, DType dtype, int divisor) {
  if (count == 0 || divisor <= 1) return;
  const void* srcs[1] = {dst};
  run(dst, srcs, 1, count, dtype, ReduceOp::kSum, divisor, isa());
}

void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t count) {
  if (src_dtype == dst_dtype) {
    std::memmove(dst, src, count * dtype_size(src_dtype));
    return;
  }
  // The wire compression's casts: the variant's array kernels.
  const cpu::CastKernels& k = cpu::cast_kernels();
  const bool half = src_dtype == DType::kFloat16 || dst_dtype == DType::kFloat16;
  if (src_dtype == DType::kFloat32 && (half || dst_dtype == DType::kBFloat16)) {
    (half ? k.f32_to_f16 : k.f32_to_bf16)(static_cast<const float*>(src),
                                          static_cast<uint16_t*>(dst), count);
    return;
  }
  if (dst_dtype == DType::kFloat32 && (half || src_dtype == DType::kBFloat16)) {
    (half ? k.f16_to_f32 : k.bf16_to_f32)(static_cast<const uint16_t*>(src),
                                          static_cast<float*>(dst), count);
    return;
  }
  dispatch_dtype(src_dtype, [&](auto stag) {
    using S = decltype(stag);
    dispatch_dtype(dst_dtype, [&](auto dtag) {
      using D = decltype(dtag);
      const S* s = static_cast<const S*>(src);
      D* d = static_cast<D*>(dst);
      for (size_t i = 0; i < count; ++i) {
        double v;
        if constexpr (std::is_same<S, Half>::value || std::is_same<S, BFloat16>::value) {
          v = static_cast<float>(s[i]);
        } else {
          v = static_cast<double>(s[i]);
        }
        if constexpr (std::is_same<D, Half>::value || std::is_same<D, BFloat16>::value) {
          d[i] = D(static_cast<float>(v));
        } else {
          d[i] = static_cast<D>(v);
        }
      }
    });
  });
}

}  // namespace kernels
}  // namespace diststrat
