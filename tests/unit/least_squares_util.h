// Shared by the parameter-server lockstep tests (unit and MPI): least squares
// on a fixed stream of global batches, and synchronous SGD over them.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace diststrat {
namespace testing {

// Step t's global batch is X_t [kRows, kDim] with targets y_t; the loss is
// 0.5 * sum (X w - y)^2 / kRows, so the gradient of a slice of rows is
// X_s^T (X_s w - y_s) / kRows and the slices' gradients sum to the batch's.
struct LeastSquares {
  static constexpr int kRows = 12, kDim = 6;
  static constexpr float kInit = 0.5f;  // every weight starts here
  std::vector<std::vector<float>> x, y;

  LeastSquares(int steps, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (int t = 0; t < steps; ++t) {
      x.emplace_back(kRows * kDim);
      y.emplace_back(kRows);
      for (float& v : x.back()) v = n(rng);
      for (float& v : y.back()) v = n(rng);
    }
  }
  // Gradient of rows [lo, hi) of step t's batch at w.
  std::vector<float> grad(int t, int lo, int hi, const float* w) const {
    std::vector<float> g(kDim, 0.0f);
    for (int i = lo; i < hi; ++i) {
      const float* xi = x[t].data() + i * kDim;
      float r = -y[t][i];
      for (int j = 0; j < kDim; ++j) r += xi[j] * w[j];
      for (int j = 0; j < kDim; ++j) g[j] += xi[j] * r / kRows;
    }
    return g;
  }
  // Rows [lo, hi) of worker `w` of `workers`.
  static int first_row(int w, int workers) { return w * kRows / workers; }
  // Synchronous SGD over the whole global batches of steps 0..steps-1.
  std::vector<float> synchronous_sgd(int steps, float lr) const {
    std::vector<float> w(kDim, kInit);
    for (int t = 0; t < steps; ++t) {
      const std::vector<float> g = grad(t, 0, kRows, w.data());
      for (int j = 0; j < kDim; ++j) w[j] -= lr * g[j];
    }
    return w;
  }
};

}  // namespace testing
}  // namespace diststrat
