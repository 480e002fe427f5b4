// CPU layers on Eigen (row-major maps over tensor memory; no copies). Eigen
// runs single-threaded here: one replica = one worker thread.
#include <Eigen/Dense>
#include <cmath>

#include "diststrat/nn.h"

namespace diststrat {
namespace nn {

namespace {
using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MapM = Eigen::Map<Mat>;
using CMapM = Eigen::Map<const Mat>;
using CMapV = Eigen::Map<const Eigen::RowVectorXf>;
using MapV = Eigen::Map<Eigen::RowVectorXf>;

void check_matrix(const Tensor& t, const char* what, const char* op) {
  DISTSTRAT_CHECK(t.defined() && t.dtype() == DType::kFloat32 && t.shape().rank() == 2 &&
                      t.device().is_cpu(),
                  kInvalidArgument, op, ": ", what, " must be a float32 CPU matrix, got ",
                  t.debug_string());
}
CMapM cmat(const Tensor& t) { return CMapM(t.data<float>(), t.shape()[0], t.shape()[1]); }
MapM mat(Tensor& t) { return MapM(t.data<float>(), t.shape()[0], t.shape()[1]); }
}  // namespace

void dense_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) {
  check_matrix(x, "x", "dense_forward");
  check_matrix(w, "w", "dense_forward");
  check_matrix(y, "y", "dense_forward");
  DISTSTRAT_CHECK_EQ(x.shape()[1], w.shape()[0], "dense_forward: x cols vs w rows");
  DISTSTRAT_CHECK(y.shape() == Shape({x.shape()[0], w.shape()[1]}), kInvalidArgument,
                  "dense_forward: y is ", y.shape().to_string(), ", expected [", x.shape()[0],
                  ", ", w.shape()[1], "]");
  DISTSTRAT_CHECK_EQ(b.num_elements(), w.shape()[1], "dense_forward: bias size vs w cols");
  if (x.shape()[0] == 0) return;
  auto Y = mat(y);
  Y.noalias() = cmat(x) * cmat(w);
  Y.rowwise() += CMapV(b.data<float>(), b.num_elements());
}

void dense_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx, Tensor& dw,
                    Tensor& db) {
  check_matrix(x, "x", "dense_backward");
  check_matrix(dy, "dy", "dense_backward");
  check_matrix(dw, "dw", "dense_backward");
  DISTSTRAT_CHECK(dw.shape() == w.shape(), kInvalidArgument, "dense_backward: dw ",
                  dw.shape().to_string(), " vs w ", w.shape().to_string());
  DISTSTRAT_CHECK_EQ(db.num_elements(), w.shape()[1], "dense_backward: db size");
  if (x.shape()[0] == 0) {
    dw.zero();
    db.zero();
    return;
  }
  mat(dw).noalias() = cmat(x).transpose() * cmat(dy);
  MapV(db.data<float>(), db.num_elements()) = cmat(dy).colwise().sum();
  if (dx) {
    check_matrix(*dx, "dx", "dense_backward");
    mat(*dx).noalias() = cmat(dy) * cmat(w).transpose();
  }
}

void relu_forward(const Tensor& x, Tensor& y) {
  DISTSTRAT_CHECK_EQ(x.num_elements(), y.num_elements(), "relu_forward sizes");
  const float* a = x.data<float>();
  float* o = y.data<float>();
  const int64_t n = x.num_elements();
  for (int64_t i = 0; i < n; ++i) o[i] = a[i] > 0.0f ? a[i] : 0.0f;
}

void relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  DISTSTRAT_CHECK_EQ(y.num_elements(), dy.num_elements(), "relu_backward sizes");
  const float* a = y.data<float>();
  const float* g = dy.data<float>();
  float* o = dx.data<float>();
  const int64_t n = y.num_elements();
  for (int64_t i = 0; i < n; ++i) o[i] = a[i] > 0.0f ? g[i] : 0.0f;
}

double softmax_cross_entropy(const Tensor& logits, const Tensor& labels, Tensor& dlogits,
                             float grad_scale) {
  check_matrix(logits, "logits", "softmax_cross_entropy");
  DISTSTRAT_CHECK(labels.dtype() == DType::kInt32 && labels.num_elements() == logits.shape()[0],
                  kInvalidArgument, "softmax_cross_entropy: labels ", labels.debug_string(),
                  " must be int32 with one label per row of ", logits.debug_string());
  DISTSTRAT_CHECK(dlogits.shape() == logits.shape(), kInvalidArgument,
                  "softmax_cross_entropy: dlogits ", dlogits.shape().to_string());
  const int64_t n = logits.shape()[0], k = logits.shape()[1];
  const float* z = logits.data<float>();
  const int32_t* y = labels.data<int32_t>();
  float* d = dlogits.data<float>();
  double loss = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    DISTSTRAT_CHECK(y[i] >= 0 && y[i] < k, kInvalidArgument, "softmax_cross_entropy: label ",
                    y[i], " of row ", i, " is outside [0, ", k, ")");
    const float* zi = z + i * k;
    float* di = d + i * k;
    float m = zi[0];
    for (int64_t j = 1; j < k; ++j) m = std::max(m, zi[j]);
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) sum += std::exp(static_cast<double>(zi[j] - m));
    const double log_sum = std::log(sum);
    loss += log_sum - static_cast<double>(zi[y[i]] - m);
    for (int64_t j = 0; j < k; ++j) {
      const double p = std::exp(static_cast<double>(zi[j] - m) - log_sum);
      di[j] = static_cast<float>((p - (j == y[i] ? 1.0 : 0.0)) * grad_scale);
    }
  }
  return loss;
}

int64_t count_correct(const Tensor& logits, const Tensor& labels) {
  check_matrix(logits, "logits", "count_correct");
  const int64_t n = logits.shape()[0], k = logits.shape()[1];
  DISTSTRAT_CHECK_EQ(labels.num_elements(), n, "count_correct: labels vs rows");
  const float* z = logits.data<float>();
  const int32_t* y = labels.data<int32_t>();
  int64_t correct = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t best = 0;
    for (int64_t j = 1; j < k; ++j) {
      if (z[i * k + j] > z[i * k + best]) best = j;
    }
    correct += best == y[i];
  }
  return correct;
}

}  // namespace nn
}  // namespace diststrat
