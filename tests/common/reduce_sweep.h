// The device collectives' dtype x ReduceOp sweep, shared by the fake-backend
// test (tests/unit/device_collectives_test.cc) and the GPU test
// (tests/gpu/gpu_test.cc): every rank's values, the exact results computed on
// the host (collective.h semantics: integer kSum/kProduct wrap, integer kMean
// truncates toward zero) and a run of all_reduce and reduce_scatter over
// every op through any GpuBackend. Small counts: the sweep is fast.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "core/gpu_backend.h"
#include "diststrat/collective.h"
#include "diststrat/dtype.h"

namespace diststrat_test {
namespace reduce_sweep {

namespace ds = diststrat;

inline const std::vector<ds::DType> kDtypes{ds::DType::kFloat32, ds::DType::kFloat64,
                                            ds::DType::kFloat16, ds::DType::kBFloat16,
                                            ds::DType::kInt32,   ds::DType::kInt64};
inline const std::vector<ds::ReduceOp> kOps{ds::ReduceOp::kSum, ds::ReduceOp::kMean,
                                            ds::ReduceOp::kMin, ds::ReduceOp::kMax,
                                            ds::ReduceOp::kProduct};
constexpr size_t kCount = 13;  // per rank (reduce_scatter: per block)

// Rank r's element i as a double (floats: multiples of 1/4, exact in every
// float dtype) or an int64 (ints: negatives, so kMean's truncation shows;
// element 0 overflows kSum and element 1 kProduct, so the wrap shows).
inline double float_value(int r, size_t i) {
  return (static_cast<double>(i % 11) - 5) * 0.25 * (r + 1) + 0.5;
}
template <typename I>
inline I int_value(int r, size_t i) {
  if (i == 0) return static_cast<I>((I{1} << (sizeof(I) * 8 - 2)) + r);        // sum wraps
  if (i == 1) return static_cast<I>((sizeof(I) == 4 ? 100000 : 3000000) + r);  // product wraps
  return static_cast<I>((static_cast<int64_t>(i % 7) - 3) * (r + 1) - r);
}

// Exact result over `n` ranks of element i (collective.h semantics).
template <typename I>
inline I int_expected(ds::ReduceOp op, int n, size_t i) {
  using U = std::make_unsigned_t<I>;
  U acc = static_cast<U>(int_value<I>(0, i));
  I best = int_value<I>(0, i);
  for (int r = 1; r < n; ++r) {
    const I v = int_value<I>(r, i);
    if (op == ds::ReduceOp::kProduct) {
      acc = static_cast<U>(acc * static_cast<U>(v));
    } else {
      acc = static_cast<U>(acc + static_cast<U>(v));
    }
    if (op == ds::ReduceOp::kMin) best = std::min(best, v);
    if (op == ds::ReduceOp::kMax) best = std::max(best, v);
  }
  if (op == ds::ReduceOp::kMin || op == ds::ReduceOp::kMax) return best;
  if (op == ds::ReduceOp::kMean) return static_cast<I>(static_cast<I>(acc) / n);  // toward zero
  return static_cast<I>(acc);
}
inline double float_expected(ds::ReduceOp op, int n, size_t i) {
  double acc = float_value(0, i);
  for (int r = 1; r < n; ++r) {
    const double v = float_value(r, i);
    switch (op) {
      case ds::ReduceOp::kSum:
      case ds::ReduceOp::kMean:
        acc += v;
        break;
      case ds::ReduceOp::kProduct:
        acc *= v;
        break;
      case ds::ReduceOp::kMin:
        acc = std::min(acc, v);
        break;
      case ds::ReduceOp::kMax:
        acc = std::max(acc, v);
        break;
    }
  }
  return op == ds::ReduceOp::kMean ? acc / n : acc;
}

// Host bytes of `count` elements: rank r's values at element offset `first`.
inline std::vector<char> host_values(ds::DType d, int r, size_t first, size_t count) {
  std::vector<char> out(count * ds::dtype_size(d));
  for (size_t k = 0; k < count; ++k) {
    const size_t i = first + k;
    void* p = out.data() + k * ds::dtype_size(d);
    switch (d) {
      case ds::DType::kFloat32:
        *static_cast<float*>(p) = static_cast<float>(float_value(r, i));
        break;
      case ds::DType::kFloat64:
        *static_cast<double*>(p) = float_value(r, i);
        break;
      case ds::DType::kFloat16:
        *static_cast<ds::Half*>(p) = ds::Half(static_cast<float>(float_value(r, i)));
        break;
      case ds::DType::kBFloat16:
        *static_cast<ds::BFloat16*>(p) = ds::BFloat16(static_cast<float>(float_value(r, i)));
        break;
      case ds::DType::kInt32:
        *static_cast<int32_t*>(p) = int_value<int32_t>(r, i);
        break;
      case ds::DType::kInt64:
        *static_cast<int64_t*>(p) = int_value<int64_t>(r, i);
        break;
    }
  }
  return out;
}

// "" when `got` (count elements from element offset `first`) is the exact
// result (f16/bf16/f32/f64 within a few units in the last place).
inline std::string check(ds::DType d, ds::ReduceOp op, int n, size_t first,
                         const std::vector<char>& got, size_t count) {
  for (size_t k = 0; k < count; ++k) {
    const size_t i = first + k;
    const void* p = got.data() + k * ds::dtype_size(d);
    bool ok = true;
    std::string g, w;
    if (d == ds::DType::kInt32 || d == ds::DType::kInt64) {
      const int64_t gv = d == ds::DType::kInt32 ? *static_cast<const int32_t*>(p)
                                                : *static_cast<const int64_t*>(p);
      const int64_t wv = d == ds::DType::kInt32 ? int_expected<int32_t>(op, n, i)
                                                : int_expected<int64_t>(op, n, i);
      ok = gv == wv;
      g = std::to_string(gv);
      w = std::to_string(wv);
    } else {
      double gv = 0, tol = 0;
      switch (d) {
        case ds::DType::kFloat32:
          gv = *static_cast<const float*>(p);
          tol = 1e-6;
          break;
        case ds::DType::kFloat64:
          gv = *static_cast<const double*>(p);
          tol = 1e-12;
          break;
        case ds::DType::kFloat16:
          gv = static_cast<float>(*static_cast<const ds::Half*>(p));
          tol = 2e-3;
          break;
        case ds::DType::kBFloat16:
          gv = static_cast<float>(*static_cast<const ds::BFloat16*>(p));
          tol = 1.6e-2;
          break;
        default:
          break;
      }
      const double wv = float_expected(op, n, i);
      ok = std::fabs(gv - wv) <= tol * (1 + std::fabs(wv));
      g = std::to_string(gv);
      w = std::to_string(wv);
    }
    if (!ok) {
      return std::string(ds::dtype_name(d)) + " " + ds::reduce_op_name(op) + " [" +
             std::to_string(i) + "]: got " + g + ", want " + w;
    }
  }
  return "";
}

// Runs the whole sweep (all_reduce and reduce_scatter, every dtype and op)
// on `comms`, one thread per rank as replicas do; returns the mismatches.
inline std::vector<std::string> sweep(ds::GpuBackend& b,
                                      std::vector<std::unique_ptr<ds::Communicator>>& comms,
                                      const std::vector<int>& ordinals,
                                      const std::vector<void*>& streams,
                                      const std::vector<ds::DType>& dtypes) {
  const int n = static_cast<int>(comms.size());
  std::vector<std::vector<std::string>> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      const int o = ordinals[static_cast<size_t>(r)];
      void* s = streams[static_cast<size_t>(r)];
      auto& err = errors[static_cast<size_t>(r)];
      try {
        for (ds::DType d : dtypes) {
          const size_t es = ds::dtype_size(d);
          void* in = b.raw_malloc(o, n * kCount * es);
          void* out = b.raw_malloc(o, n * kCount * es);
          const std::vector<char> mine = host_values(d, r, 0, n * kCount);
          for (ds::ReduceOp op : kOps) {
            const std::string name = std::string(ds::dtype_name(d)) + "_" + ds::reduce_op_name(op);
            b.memcpy_async(o, in, mine.data(), kCount * es, s);
            comms[static_cast<size_t>(r)]->all_reduce(in, out, kCount, d, op, "ar_" + name);
            std::vector<char> got(kCount * es);
            b.copy_to_host(o, got.data(), out, got.size(), s,
                           ds::DeadlineClock::now() + std::chrono::seconds(10), "read");
            std::string e = check(d, op, n, 0, got, kCount);
            if (!e.empty()) err.push_back("all_reduce " + e);
            b.memcpy_async(o, in, mine.data(), mine.size(), s);
            comms[static_cast<size_t>(r)]->reduce_scatter(in, out, kCount, d, op, "rs_" + name);
            b.copy_to_host(o, got.data(), out, got.size(), s,
                           ds::DeadlineClock::now() + std::chrono::seconds(10), "read");
            e = check(d, op, n, r * kCount, got, kCount);
            if (!e.empty()) err.push_back("reduce_scatter " + e);
          }
          b.synchronize(o, s, ds::DeadlineClock::now() + std::chrono::seconds(10), "end");
          b.raw_free(o, in);
          b.raw_free(o, out);
        }
      } catch (const std::exception& e) {
        err.push_back(std::string("rank ") + std::to_string(r) + " threw: " + e.what());
        comms[static_cast<size_t>(r)]->abort(e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  std::vector<std::string> all;
  for (const auto& e : errors) all.insert(all.end(), e.begin(), e.end());
  return all;
}

// A dtype or op outside the enums is refused on every rank before anything
// runs, naming the rank, the collective and the tensor.
inline void expect_refusals(ds::GpuBackend& b,
                            std::vector<std::unique_ptr<ds::Communicator>>& comms, int ordinal) {
  void* buf = b.raw_malloc(ordinal, 64 * sizeof(double));
  for (size_t r = 0; r < comms.size(); ++r) {
    ds::Communicator& c = *comms[r];
    const std::string rank = "rank " + std::to_string(r);
    try {
      c.all_reduce(buf, buf, 4, ds::DType::kFloat32, static_cast<ds::ReduceOp>(42), "w");
      ADD_FAILURE() << "op 42 was reduced";
    } catch (const ds::InvalidArgumentError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(rank), std::string::npos) << m;
      EXPECT_NE(m.find("all_reduce 'w'"), std::string::npos) << m;
      EXPECT_NE(m.find("reduce op value 42"), std::string::npos) << m;
    }
    try {
      c.reduce_scatter(buf, buf, 4, static_cast<ds::DType>(17), ds::ReduceOp::kSum, "g");
      ADD_FAILURE() << "dtype 17 was reduced";
    } catch (const ds::InvalidArgumentError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(rank + " "), std::string::npos) << m;
      EXPECT_NE(m.find("reduce_scatter 'g'"), std::string::npos) << m;
      EXPECT_NE(m.find("dtype value 17"), std::string::npos) << m;
    }
  }
  b.raw_free(ordinal, buf);
}

}  // namespace reduce_sweep
}  // namespace diststrat_test
