// Reading and writing elements of any dtype as doubles, for closed-form checks.
#pragma once

#include <cmath>
#include <cstring>

#include "diststrat/dtype.h"

namespace diststrat {
namespace testing {

inline void set_elem(void* p, DType d, size_t i, double v) {
  switch (d) {
    case DType::kFloat32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      break;
    case DType::kFloat64:
      static_cast<double*>(p)[i] = v;
      break;
    case DType::kFloat16:
      static_cast<uint16_t*>(p)[i] = Half::from_float(static_cast<float>(v));
      break;
    case DType::kBFloat16:
      static_cast<uint16_t*>(p)[i] = BFloat16::from_float(static_cast<float>(v));
      break;
    case DType::kInt32:
      static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
      break;
    case DType::kInt64:
      static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v);
      break;
  }
}

inline double get_elem(const void* p, DType d, size_t i) {
  switch (d) {
    case DType::kFloat32:
      return static_cast<const float*>(p)[i];
    case DType::kFloat64:
      return static_cast<const double*>(p)[i];
    case DType::kFloat16:
      return Half::to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16:
      return BFloat16::to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kInt32:
      return static_cast<const int32_t*>(p)[i];
    case DType::kInt64:
      return static_cast<double>(static_cast<const int64_t*>(p)[i]);
  }
  return NAN;
}

// Tolerance for comparing a result of dtype d against an exact double.
inline double tolerance(DType d, double expected) {
  switch (d) {
    case DType::kFloat16:
      return 2e-3 * std::fabs(expected) + 1e-3;
    case DType::kBFloat16:
      return 1e-2 * std::fabs(expected) + 1e-2;
    case DType::kFloat32:
      return 1e-6 * std::fabs(expected) + 1e-6;
    default:
      return 1e-9 * std::fabs(expected);
  }
}

constexpr DType kAllDTypes[] = {DType::kFloat32,  DType::kFloat64, DType::kFloat16,
                                DType::kBFloat16, DType::kInt32,   DType::kInt64};

}  // namespace testing
}  // namespace diststrat
