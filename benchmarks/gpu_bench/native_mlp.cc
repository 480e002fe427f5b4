// Compiled with -march=native (benchmarks/gpu_bench/CMakeLists.txt): see native_mlp.h.
#define EIGEN_DONT_PARALLELIZE
#include "native_mlp.h"

#include <Eigen/Dense>

#include <chrono>
#include <cmath>
#include <random>
#include <vector>

namespace {

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Row = Eigen::Matrix<float, 1, Eigen::Dynamic>;

struct Layer {
  Mat w, vw;
  Row b, vb;
  Layer(int in, int out, std::mt19937& rng)
      : w(in, out), vw(Mat::Zero(in, out)), b(Row::Zero(out)), vb(Row::Zero(out)) {
    std::normal_distribution<float> d(0.0f, std::sqrt(2.0f / in));
    for (Eigen::Index i = 0; i < w.size(); ++i) w.data()[i] = d(rng);
  }
  void update(const Mat& dw, const Row& db, float lr, float momentum) {
    vw = momentum * vw + dw;
    vb = momentum * vb + db;
    w -= lr * vw;
    b -= lr * vb;
  }
};

}  // namespace

double native_mlp_step_seconds(int64_t batch, int warmup, int steps, double* checksum) {
  std::mt19937 rng(2);
  Layer l1(784, 256, rng), l2(256, 256, rng), l3(256, 10, rng);
  Mat x(batch, 784);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = d(rng);
  std::vector<int> y(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i) y[static_cast<size_t>(i)] = static_cast<int>(i % 10);
  const float scale = 1.0f / static_cast<float>(batch);
  Mat h1, h2, logits, dl, dh2, dh1;
  auto step = [&] {
    h1.noalias() = x * l1.w;
    h1.rowwise() += l1.b;
    h1 = h1.cwiseMax(0.0f);
    h2.noalias() = h1 * l2.w;
    h2.rowwise() += l2.b;
    h2 = h2.cwiseMax(0.0f);
    logits.noalias() = h2 * l3.w;
    logits.rowwise() += l3.b;
    // softmax cross-entropy: dlogits = (softmax - onehot) / batch
    dl.resize(logits.rows(), logits.cols());
    for (Eigen::Index r = 0; r < logits.rows(); ++r) {
      const float m = logits.row(r).maxCoeff();
      dl.row(r) = (logits.row(r).array() - m).exp().matrix();
      dl.row(r) /= dl.row(r).sum();
      dl(r, y[static_cast<size_t>(r)]) -= 1.0f;
    }
    dl *= scale;
    const Mat dw3 = h2.transpose() * dl;
    const Row db3 = dl.colwise().sum();
    dh2.noalias() = dl * l3.w.transpose();
    dh2 = (h2.array() > 0.0f).select(dh2, 0.0f);
    const Mat dw2 = h1.transpose() * dh2;
    const Row db2 = dh2.colwise().sum();
    dh1.noalias() = dh2 * l2.w.transpose();
    dh1 = (h1.array() > 0.0f).select(dh1, 0.0f);
    const Mat dw1 = x.transpose() * dh1;
    const Row db1 = dh1.colwise().sum();
    l1.update(dw1, db1, 0.01f, 0.9f);
    l2.update(dw2, db2, 0.01f, 0.9f);
    l3.update(dw3, db3, 0.01f, 0.9f);
  };
  for (int i = 0; i < warmup; ++i) step();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (checksum) *checksum = static_cast<double>(l1.w.sum() + l2.w.sum() + l3.w.sum());
  return s / steps;
}
