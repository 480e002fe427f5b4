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
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "diststrat/strategy.h"

namespace diststrat {
namespace nn {

// A number a step computes, read when it is used: on a GPU the value is
// brought from the device the first time it is converted to T (then kept),
// so a loop that reads its loss only when logging never waits for the
// device in between; elsewhere it is the value itself. Copies share the
// read. The read blocks (bounded by the strategy's timeout) and rethrows
// the device errors of the work it waits for; thread-safe.
template <typename T>
class StepValue {
 public:
  StepValue(T value = T()) : value_(value) {}  // NOLINT: a plain value converts
  // A value that `read` brings (called at most once successfully; a throw
  // is rethrown by every later read).
  static StepValue deferred(std::function<T()> read) {
    StepValue v;
    v.deferred_ = std::make_shared<Deferred>();
    v.deferred_->read = std::move(read);
    return v;
  }
  T get() const {
    if (!deferred_) return value_;
    std::lock_guard<std::mutex> lock(deferred_->mu);
    if (deferred_->read) {
      deferred_->value = deferred_->read();
      deferred_->read = nullptr;
    }
    return deferred_->value;
  }
  operator T() const { return get(); }  // NOLINT: reads as the number it is
  // Whether get() may still have to read the device.
  bool pending() const {
    if (!deferred_) return false;
    std::lock_guard<std::mutex> lock(deferred_->mu);
    return static_cast<bool>(deferred_->read);
  }

 private:
  struct Deferred {
    std::mutex mu;
    std::function<T()> read;
    T value = T();
  };
  T value_ = T();
  std::shared_ptr<Deferred> deferred_;
};

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

  // On a GPU the loss and the count stay on the device: forward_backward
  // only enqueues (it does not wait between forward and backward), and
  // loss_sum and correct are read from the device when first converted to
  // a number, a read that waits for the step's work up to the loss (within
  // the strategy's timeout) and throws the step's device errors (a label out
  // of range: InvalidArgumentError naming the row and the step). Read them
  // when logging, not every step, and while their strategy (its
  // DeviceManager) lives. On a CPU they are plain values.
  struct Step {
    StepValue<double> loss_sum = 0.0;  // Σ per-example losses of this slice
    StepValue<int64_t> correct = 0;    // rows classified correctly
    std::vector<Tensor> grads;         // parallel to params, scaled by grad_scale
    // GPU: the per-row losses (float32 [n]) and hits (int32 [n], 1 where the
    // arg-max is the label) on the device, for device-side metrics; a
    // label check failed when the values are read. Undefined on a CPU.
    Tensor row_losses, row_hits;
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
