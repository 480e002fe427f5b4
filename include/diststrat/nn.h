// Just enough model code for real training on CPU (Eigen) — dense layers,
// ReLU and softmax cross-entropy with forward and backward — plus an MLP that
// keeps its parameters as strategy variables.
//
// Rules: the layer functions are pure and thread-safe (each replica calls
// them on its own tensors inside run()); none communicates. Mlp's
// create_variables is cross-replica context and collective like
// Strategy::create_variable.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "diststrat/strategy.h"

namespace diststrat {
namespace nn {

// y[n, out] = x[n, in] · w[in, out] + b[out]
void dense_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y);
// dw = xᵀ·dy, db = Σrows dy, and dx = dy·wᵀ when dx is non-null.
void dense_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx, Tensor& dw,
                    Tensor& db);
// y = max(x, 0); in place allowed.
void relu_forward(const Tensor& x, Tensor& y);
// dx = dy where y > 0, else 0; in place allowed (dx == dy).
void relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx);
// Softmax cross-entropy of logits [n, k] against int32 labels [n] in [0, k).
// Returns the SUM of the n per-example losses; writes
// dlogits = (softmax − onehot) · grad_scale. Throws on a label out of range.
double softmax_cross_entropy(const Tensor& logits, const Tensor& labels, Tensor& dlogits,
                             float grad_scale);
// Rows whose arg-max logit equals the label.
int64_t count_correct(const Tensor& logits, const Tensor& labels);

// A multi-layer perceptron: Dense+ReLU ... Dense (logits). Parameters are
// float32 tensors [w0, b0, w1, b1, ...]; the functions below work on any such
// list, so the same code runs under a strategy and in plain single-device
// training (the equivalence tests rely on this).
class Mlp {
 public:
  // sizes = {784, 256, 256, 10}
  explicit Mlp(std::vector<int64_t> sizes);
  const std::vector<int64_t>& sizes() const { return sizes_; }
  size_t num_params() const { return 2 * (sizes_.size() - 1); }
  // "dense0/kernel", "dense0/bias", ...
  std::string param_name(size_t i) const;
  Shape param_shape(size_t i) const;

  // Creates the parameters as variables of `strategy` (Glorot kernels seeded
  // with seed + layer, zero biases).
  std::vector<Variable> create_variables(Strategy& strategy, uint64_t seed) const;
  // Plain tensors with the same initial values as create_variables.
  std::vector<Tensor> init_params(uint64_t seed) const;

  struct Step {
    double loss_sum = 0;        // Σ per-example losses of this slice
    int64_t correct = 0;        // rows classified correctly
    std::vector<Tensor> grads;  // parallel to params, scaled by grad_scale
  };
  // Called during backward as soon as layer `layer`'s gradients (params
  // 2*layer and 2*layer+1) are ready, last layer first: hand them to
  // ReplicaContext::all_reduce_async there to overlap communication with the
  // rest of the backward pass.
  using GradientsReady = std::function<void(size_t layer, const Tensor& dw, const Tensor& db)>;
  // Forward and backward on one slice (x [n, in], labels int32 [n]). n may be
  // 0: the gradients are then zero. grad_scale = 1 / global batch size.
  Step forward_backward(const std::vector<Tensor>& params, const Tensor& x, const Tensor& labels,
                        float grad_scale, const GradientsReady& on_ready = {}) const;
  // Logits of x.
  Tensor predict(const std::vector<Tensor>& params, const Tensor& x) const;

 private:
  std::vector<int64_t> sizes_;
};

}  // namespace nn
}  // namespace diststrat
