#include <gtest/gtest.h>

#include <cmath>

#include "diststrat/diststrat.h"

namespace ds = diststrat;

namespace {

// Loss of the MLP on (x, y) as a double, for finite differences.
double loss_of(const ds::nn::Mlp& mlp, const std::vector<ds::Tensor>& p, const ds::Tensor& x,
               const ds::Tensor& y) {
  return mlp.forward_backward(p, x, y, 1.0f).loss_sum;
}

TEST(NN, GradientsMatchFiniteDifferences) {
  ds::nn::Mlp mlp({5, 4, 3});
  std::vector<ds::Tensor> p = mlp.init_params(3);
  for (size_t i = 1; i < p.size(); i += 2) ds::init::Constant{0.1}(p[i]);
  ds::Tensor x(ds::Shape{6, 5}, ds::DType::kFloat32), y(ds::Shape{6}, ds::DType::kInt32);
  ds::init::RandomNormal{0, 1, 1}(x);
  for (int i = 0; i < 6; ++i) y.data<int32_t>()[i] = i % 3;
  // Finite differences are only valid away from ReLU's kink: keep every
  // hidden pre-activation clear of zero by more than a step can move it.
  ds::Tensor pre(ds::Shape{6, 4}, ds::DType::kFloat32);
  ds::nn::dense_forward(x, p[0], p[1], pre);
  for (int64_t i = 0; i < pre.num_elements(); ++i) {
    ASSERT_GT(std::fabs(pre.data<float>()[i]), 0.02f) << "pick another seed";
  }
  auto step = mlp.forward_backward(p, x, y, 1.0f);
  for (size_t k = 0; k < p.size(); ++k) {
    for (int64_t i = 0; i < p[k].num_elements(); ++i) {
      float& w = p[k].data<float>()[i];
      const float orig = w;
      const float h = 1e-3f;
      w = orig + h;
      const double up = loss_of(mlp, p, x, y);
      w = orig - h;
      const double down = loss_of(mlp, p, x, y);
      w = orig;
      const double numeric = (up - down) / (2 * h);
      EXPECT_NEAR(step.grads[k].data<float>()[i], numeric, 2e-2 * std::max(1.0, std::fabs(numeric)))
          << mlp.param_name(k) << "[" << i << "]";
    }
  }
}

TEST(NN, SoftmaxCrossEntropyValuesAndErrors) {
  ds::Tensor z(ds::Shape{1, 3}, ds::DType::kFloat32), y(ds::Shape{1}, ds::DType::kInt32);
  ds::Tensor d(ds::Shape{1, 3}, ds::DType::kFloat32);
  // Uniform logits: loss = log(3), gradient = 1/3 - onehot.
  const double loss = ds::nn::softmax_cross_entropy(z, y, d, 1.0f);
  EXPECT_NEAR(loss, std::log(3.0), 1e-6);
  EXPECT_NEAR(d.data<float>()[0], 1.0 / 3 - 1, 1e-6);
  y.data<int32_t>()[0] = 3;
  EXPECT_THROW(ds::nn::softmax_cross_entropy(z, y, d, 1.0f), ds::InvalidArgumentError);
}

TEST(NN, ZeroRowsGiveZeroGradients) {
  ds::nn::Mlp mlp({4, 3, 2});
  auto p = mlp.init_params(1);
  ds::Tensor x(ds::Shape{0, 4}, ds::DType::kFloat32), y(ds::Shape{0}, ds::DType::kInt32);
  auto step = mlp.forward_backward(p, x, y, 0.5f);
  EXPECT_EQ(step.loss_sum, 0.0);
  for (auto& g : step.grads) {
    for (int64_t i = 0; i < g.num_elements(); ++i) ASSERT_EQ(g.data<float>()[i], 0.0f);
  }
}

TEST(NN, ShapeErrorsAreClear) {
  ds::Tensor x(ds::Shape{2, 3}, ds::DType::kFloat32), w(ds::Shape{4, 5}, ds::DType::kFloat32);
  ds::Tensor b(ds::Shape{5}, ds::DType::kFloat32), y(ds::Shape{2, 5}, ds::DType::kFloat32);
  EXPECT_THROW(ds::nn::dense_forward(x, w, b, y), ds::InvalidArgumentError);
}

}  // namespace
