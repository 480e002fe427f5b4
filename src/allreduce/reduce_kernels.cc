#include "allreduce/reduce_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "diststrat/error.h"

namespace diststrat {
namespace kernels {
namespace {

// How an element type is accumulated: 16-bit floats in f32, others natively.
template <typename T> struct Acc {
  using type = T;
  static type load(T v) { return v; }
  static T store(type a) { return a; }
};
template <> struct Acc<Half> {
  using type = float;
  static float load(Half v) { return Half::to_float(v.bits); }
  static Half store(float a) {
    Half h;
    h.bits = Half::from_float(a);
    return h;
  }
};
template <> struct Acc<BFloat16> {
  using type = float;
  static float load(BFloat16 v) { return BFloat16::to_float(v.bits); }
  static BFloat16 store(float a) {
    BFloat16 b;
    b.bits = BFloat16::from_float(a);
    return b;
  }
};

struct SumOp {
  template <typename A> A operator()(A a, A b) const { return a + b; }
};
struct ProdOp {
  template <typename A> A operator()(A a, A b) const { return a * b; }
};
struct MinOp {
  template <typename A> A operator()(A a, A b) const { return b < a ? b : a; }
};
struct MaxOp {
  template <typename A> A operator()(A a, A b) const { return a < b ? b : a; }
};

// Block size: the accumulator block stays in L1 while the sources stream.
constexpr size_t kBlock = 512;

template <typename T, typename Op>
void reduce_n(T* dst, const T* const* srcs, int n, size_t count, Op op, int mean_divisor) {
  using A = typename Acc<T>::type;
  A acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t len = std::min(kBlock, count - base);
    const T* s0 = srcs[0] + base;
    for (size_t j = 0; j < len; ++j) acc[j] = Acc<T>::load(s0[j]);
    for (int k = 1; k < n; ++k) {
      const T* s = srcs[k] + base;
      for (size_t j = 0; j < len; ++j) acc[j] = op(acc[j], Acc<T>::load(s[j]));
    }
    if (mean_divisor > 1) {
      const A d = static_cast<A>(mean_divisor);
      for (size_t j = 0; j < len; ++j) acc[j] = acc[j] / d;
    }
    T* out = dst + base;
    for (size_t j = 0; j < len; ++j) out[j] = Acc<T>::store(acc[j]);
  }
}

// Two-source fast path (the common case: accumulate, 2 ranks): a straight
// loop the compiler vectorizes for the native types.
template <typename T, typename Op>
void accumulate_2(T* __restrict dst, const T* __restrict src, size_t count, Op op) {
  for (size_t i = 0; i < count; ++i) {
    dst[i] = Acc<T>::store(op(Acc<T>::load(dst[i]), Acc<T>::load(src[i])));
  }
}

template <typename Fn> void dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(float{});
    case DType::kFloat64: return fn(double{});
    case DType::kFloat16: return fn(Half{});
    case DType::kBFloat16: return fn(BFloat16{});
    case DType::kInt32: return fn(int32_t{});
    case DType::kInt64: return fn(int64_t{});
  }
  throw InvalidArgumentError("reduction of unknown dtype");
}

template <typename Fn> void dispatch_op(ReduceOp op, Fn&& fn) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean: return fn(SumOp{});
    case ReduceOp::kProduct: return fn(ProdOp{});
    case ReduceOp::kMin: return fn(MinOp{});
    case ReduceOp::kMax: return fn(MaxOp{});
  }
  throw InvalidArgumentError("unknown reduce op");
}

}  // namespace

void reduce(void* dst, const void* const* srcs, int n, size_t count, DType dtype, ReduceOp op,
            int mean_divisor) {
  if (count == 0 || n == 0) return;
  const int divisor = op == ReduceOp::kMean ? mean_divisor : 1;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_op(op, [&](auto o) {
      reduce_n<T>(static_cast<T*>(dst), reinterpret_cast<const T* const*>(srcs), n, count, o,
                  divisor);
    });
  });
}

void accumulate(void* dst, const void* src, size_t count, DType dtype, ReduceOp op) {
  if (count == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_op(op, [&](auto o) {
      accumulate_2<T>(static_cast<T*>(dst), static_cast<const T*>(src), count, o);
    });
  });
}

void scale_mean(void* dst, size_t count, DType dtype, int divisor) {
  if (count == 0 || divisor <= 1) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename Acc<T>::type;
    T* p = static_cast<T*>(dst);
    const A d = static_cast<A>(divisor);
    for (size_t i = 0; i < count; ++i) p[i] = Acc<T>::store(Acc<T>::load(p[i]) / d);
  });
}

void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t count) {
  if (src_dtype == dst_dtype) {
    std::memmove(dst, src, count * dtype_size(src_dtype));
    return;
  }
  dispatch_dtype(src_dtype, [&](auto stag) {
    using S = decltype(stag);
    dispatch_dtype(dst_dtype, [&](auto dtag) {
      using D = decltype(dtag);
      const S* s = static_cast<const S*>(src);
      D* d = static_cast<D*>(dst);
      for (size_t i = 0; i < count; ++i) {
        const double v = static_cast<double>(Acc<S>::load(s[i]));
        d[i] = Acc<D>::store(static_cast<typename Acc<D>::type>(v));
      }
    });
  });
}

}  // namespace kernels
}  // namespace diststrat
