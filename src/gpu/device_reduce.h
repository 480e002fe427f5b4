// What the device collectives (NCCL, the shared-device reduction) do with
// each dtype and ReduceOp, decided in one place. Header-only and free of
// CUDA/NCCL, so the tests' fake backend makes the same decisions.
//
// Every DType x ReduceOp is supported, with the semantics of collective.h:
//  - f16/bf16: the shared-device kernel accumulates in f32 and rounds once;
//    NCCL reduces in the element type (one rounding per step, and kMean is
//    ncclAvg, which scales by 1/size before summing), so results may differ
//    from the host's by a few units in the last place.
//  - int32/int64 kSum and kProduct wrap modulo 2^bits everywhere.
//  - int32/int64 kMean truncates toward zero the wrapped sum. NCCL's
//    ncclAvg is not used for integers: its integer rounding is not
//    documented and has changed between versions, so the NCCL path sums
//    (ncclSum) and then divides with the library's own kernel, on the same
//    stream, before the collective returns.
// A value outside the enums (a cast from a bad integer) is refused with
// InvalidArgumentError, never reduced as something else.
#pragma once

#include <string>

#include "diststrat/collective.h"
#include "diststrat/dtype.h"
#include "diststrat/error.h"

namespace diststrat {
namespace gpu {

struct DeviceReducePlan {
  // The op the collective library runs (NCCL); kMean stays kMean only where
  // it maps to ncclAvg.
  ReduceOp collective_op = ReduceOp::kSum;
  // Divide the result by the number of ranks afterwards (integer kMean).
  bool divide_after = false;
};

inline bool known_dtype(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kFloat64:
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt32:
    case DType::kInt64:
      return true;
  }
  return false;
}

inline bool known_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
    case ReduceOp::kMin:
    case ReduceOp::kMax:
    case ReduceOp::kProduct:
      return true;
  }
  return false;
}

// Throws InvalidArgumentError naming `what` (rank, collective, tensor) for a
// dtype or op outside the enums. Pure; thread-safe.
inline void check_device_reduce(DType dtype, ReduceOp op, const std::string& what) {
  if (!known_dtype(dtype)) {
    throw InvalidArgumentError(detail::str_cat(what, ": dtype value ", static_cast<int>(dtype),
                                               " is not a DType the GPU collectives support"));
  }
  if (!known_op(op)) {
    throw InvalidArgumentError(detail::str_cat(what, ": reduce op value ", static_cast<int>(op),
                                               " is not a ReduceOp the GPU collectives support"));
  }
}

// The plan of an NCCL reduction (all_reduce, reduce_scatter) of `dtype` with
// `op`; throws as check_device_reduce.
inline DeviceReducePlan plan_nccl_reduce(DType dtype, ReduceOp op, const std::string& what) {
  check_device_reduce(dtype, op, what);
  DeviceReducePlan plan;
  plan.collective_op = op;
  if (op == ReduceOp::kMean && !dtype_is_floating(dtype)) {
    plan.collective_op = ReduceOp::kSum;
    plan.divide_after = true;
  }
  return plan;
}

}  // namespace gpu
}  // namespace diststrat
