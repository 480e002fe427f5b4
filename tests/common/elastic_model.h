// The model the elastic tests train (tests/unit/elastic_training_test.cc,
// workers as threads; tests/elastic/elastic_check.cc, workers as processes):
// a linear model on sin() features with a known target, a sequential
// reference over the same global batches, and one replica's gradients --
// those of the weights and a per-row use counter (-1 per use, so that an
// SGD step without momentum adds exactly lr per use and the counter proves
// every row was used exactly once per epoch).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "diststrat/diststrat.h"

namespace diststrat_test {
namespace elastic_model {

constexpr int kFeatures = 8;
constexpr float kLr = 0.05f, kMomentum = 0.9f;

inline float target(const float* x) {
  float y = 0;
  for (int f = 0; f < kFeatures; ++f) y += (0.25f * static_cast<float>(f) - 0.8f) * x[f];
  return y;
}

// Row r's features, and its id as the label.
inline diststrat::Dataset make_data(int rows) {
  diststrat::Tensor x(diststrat::Shape{rows, kFeatures}, diststrat::DType::kFloat32);
  diststrat::Tensor id(diststrat::Shape{rows}, diststrat::DType::kFloat32);
  for (int r = 0; r < rows; ++r) {
    for (int f = 0; f < kFeatures; ++f) {
      x.data<float>()[r * kFeatures + f] = std::sin(0.37f * static_cast<float>(r) + 1.3f * f);
    }
    id.data<float>()[r] = static_cast<float>(r);
  }
  return diststrat::Dataset(x, id);
}

// The gradient of the mean squared error over rows [begin, end) at `w` (in
// double: the references' sums).
inline std::vector<double> batch_gradient(const diststrat::Dataset& d, const std::vector<float>& w,
                                          int begin, int end) {
  std::vector<double> g(kFeatures, 0.0);
  for (int r = begin; r < end; ++r) {
    const float* x = d.features().data<float>() + r * kFeatures;
    double pred = 0;
    for (int f = 0; f < kFeatures; ++f) pred += w[f] * x[f];
    for (int f = 0; f < kFeatures; ++f) g[f] += (pred - target(x)) * x[f] / (end - begin);
  }
  return g;
}

// The same training, sequentially (SGD with momentum, mean loss per global
// batch, the last batch possibly short), over the same global batches.
inline std::vector<float> reference(int rows, int batch, int epochs) {
  const diststrat::Dataset d = make_data(rows);
  std::vector<float> w(kFeatures, 0.0f), v(kFeatures, 0.0f);  // v: SGD's momentum slot
  for (int e = 0; e < epochs; ++e) {
    for (int b = 0; b * batch < rows; ++b) {
      const std::vector<double> g =
          batch_gradient(d, w, b * batch, std::min(rows, (b + 1) * batch));
      for (int f = 0; f < kFeatures; ++f) {
        v[f] = kMomentum * v[f] - kLr * static_cast<float>(g[f]);
        w[f] += v[f];
      }
    }
  }
  return w;
}

// The same training with Adam (the library's formula: Keras' bias
// correction folded into the rate, epsilon outside the root).
constexpr float kAdamLr = 0.02f, kBeta1 = 0.9f, kBeta2 = 0.999f, kEpsilon = 1e-7f;
inline std::vector<float> reference_adam(int rows, int batch, int epochs) {
  const diststrat::Dataset d = make_data(rows);
  std::vector<float> w(kFeatures, 0.0f), m(kFeatures, 0.0f), v(kFeatures, 0.0f);
  int64_t step = 0;
  for (int e = 0; e < epochs; ++e) {
    for (int b = 0; b * batch < rows; ++b) {
      const std::vector<double> g =
          batch_gradient(d, w, b * batch, std::min(rows, (b + 1) * batch));
      const double t = static_cast<double>(++step);
      const float alpha = static_cast<float>(kAdamLr * std::sqrt(1.0 - std::pow(kBeta2, t)) /
                                             (1.0 - std::pow(kBeta1, t)));
      for (int f = 0; f < kFeatures; ++f) {
        const float gf = static_cast<float>(g[f]);
        m[f] = kBeta1 * m[f] + (1 - kBeta1) * gf;
        v[f] = kBeta2 * v[f] + (1 - kBeta2) * gf * gf;
        w[f] -= alpha * m[f] / (std::sqrt(v[f]) + kEpsilon);
      }
    }
  }
  return w;
}

// One replica's share of a global batch of `global_size` rows: the weights'
// gradient (gw, kFeatures) and the use counter's (gc, rows).
inline void gradients(const diststrat::Tensor& x, const diststrat::Tensor& ids,
                      const diststrat::Tensor& w, int64_t global_size, int rows,
                      diststrat::Tensor* gw, diststrat::Tensor* gc) {
  const float scale = 1.0f / static_cast<float>(global_size);
  std::fill(gw->data<float>(), gw->data<float>() + kFeatures, 0.0f);
  std::fill(gc->data<float>(), gc->data<float>() + rows, 0.0f);
  for (int64_t i = 0; i < x.shape()[0]; ++i) {
    const float* xi = x.data<float>() + i * kFeatures;
    float pred = 0;
    for (int f = 0; f < kFeatures; ++f) pred += w.data<float>()[f] * xi[f];
    for (int f = 0; f < kFeatures; ++f) gw->data<float>()[f] += (pred - target(xi)) * xi[f] * scale;
    gc->data<float>()[static_cast<int>(ids.data<float>()[i])] -= 1.0f;
  }
}

}  // namespace elastic_model
}  // namespace diststrat_test
