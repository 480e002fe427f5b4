// One training step whose gradients are all ones, so the variables' values
// after N steps are known exactly (the soak's and the mpirun fault driver's
// accounting: a lost or doubled update changes them). Shared by
// tests/soak/soak.cc and tests/mpi/fault/mpi_fault.cc.
#pragma once

#include <utility>
#include <vector>

#include "diststrat/diststrat.h"

namespace diststrat {
namespace testing {

// In replica context: applies a gradient of ones to every variable of `vars`
// with `optimizer`.
inline void apply_gradient_of_ones(ReplicaContext& ctx, Optimizer& optimizer,
                                   const std::vector<Variable>& vars) {
  std::vector<std::pair<Tensor, Variable>> gv;
  for (const Variable& v : vars) {
    Tensor g(v.shape(), DType::kFloat32);
    init::Constant{1.0}(g);
    gv.emplace_back(g, v);
  }
  optimizer.apply_gradients(ctx, gv);
}

}  // namespace testing
}  // namespace diststrat
