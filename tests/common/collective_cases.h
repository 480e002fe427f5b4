// Closed-form inputs and expected results for collective tests, shared by the
// in-process sweep (tests/unit) and the MPI tests (tests/mpi).
//
// Rank r contributes, at element i:
//   sum/mean/min/max: (r + 1) * (i % 7 + 1)   (small integers: exact in every
//                     dtype including f16/bf16 for up to 7 ranks)
//   product:          2 if (r + i) % 3 == 0 else 1 (so products stay <= 2^7)
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "diststrat/collective.h"
#include "diststrat/dtype.h"
#include "../unit/dtype_util.h"

namespace diststrat {
namespace testing_cases {

inline double contribution(int rank, size_t i, ReduceOp op) {
  if (op == ReduceOp::kProduct) return (rank + i) % 3 == 0 ? 2.0 : 1.0;
  return static_cast<double>((rank + 1) * static_cast<int>(i % 7 + 1));
}

inline double expected(int n, size_t i, ReduceOp op, DType dtype) {
  double acc = contribution(0, i, op);
  for (int r = 1; r < n; ++r) {
    const double v = contribution(r, i, op);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kMean:
        acc += v;
        break;
      case ReduceOp::kProduct:
        acc *= v;
        break;
      case ReduceOp::kMin:
        acc = std::min(acc, v);
        break;
      case ReduceOp::kMax:
        acc = std::max(acc, v);
        break;
    }
  }
  if (op == ReduceOp::kMean) {
    if (dtype == DType::kInt32 || dtype == DType::kInt64) {
      acc = static_cast<double>(static_cast<int64_t>(acc) / n);
    } else {
      acc /= n;
    }
  }
  return acc;
}

// Rank r's input buffer of `count` elements.
inline std::vector<char> make_input(int rank, size_t count, DType dtype, ReduceOp op) {
  std::vector<char> buf(count * dtype_size(dtype) + 1);
  for (size_t i = 0; i < count; ++i)
    testing::set_elem(buf.data(), dtype, i, contribution(rank, i, op));
  return buf;
}

// Checks elements [0, count) of an all-reduce result (element i of `buf` is
// element first + i of the reduced vector).
inline ::testing::AssertionResult check_reduced(const void* buf, size_t count, DType dtype,
                                                ReduceOp op, int n, size_t first = 0) {
  for (size_t i = 0; i < count; ++i) {
    const double want = expected(n, first + i, op, dtype), got = testing::get_elem(buf, dtype, i);
    if (!(std::abs(got - want) <= testing::tolerance(dtype, want))) {
      return ::testing::AssertionFailure()
             << "element " << first + i << " of " << dtype_name(dtype) << " " << reduce_op_name(op)
             << " over " << n << " ranks: got " << got << ", want " << want;
    }
  }
  return ::testing::AssertionSuccess();
}

inline std::vector<DType> all_dtypes() {
  return std::vector<DType>(std::begin(testing::kAllDTypes), std::end(testing::kAllDTypes));
}
inline const std::vector<ReduceOp>& all_ops() {
  static const std::vector<ReduceOp> o = {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMin,
                                          ReduceOp::kMax, ReduceOp::kProduct};
  return o;
}

}  // namespace testing_cases
}  // namespace diststrat
