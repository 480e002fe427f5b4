// Optimizers. An optimizer holds hyper-parameters and an update rule; the
// strategy decides where the rule runs (on every mirrored copy, once on the
// host copy, or on the parameter servers). Slots (momentum, Adam moments) live
// beside each variable's copies and are created zero-filled on first use.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "diststrat/strategy.h"

namespace diststrat {

// An update rule in data form, so a GPU backend can run it as a kernel
// (Optimizer::update is host code). kNone: the optimizer runs on the host only.
struct UpdateRule {
  enum class Kind { kNone, kSgd, kAdam };
  Kind kind = Kind::kNone;
  float learning_rate = 0.0f;
  float momentum = 0.0f;  // SGD
  bool nesterov = false;  // SGD
  float beta1 = 0.0f, beta2 = 0.0f, epsilon = 0.0f;  // Adam
};

class Optimizer {
 public:
  explicit Optimizer(Strategy& strategy);
  virtual ~Optimizer() = default;

  virtual std::string name() const = 0;
  // Names of the per-variable slots the rule needs, e.g. {"momentum"}.
  virtual std::vector<std::string> slot_names() const = 0;
  // The update rule over `count` float32 elements: var, grad and each slot
  // (parallel to slot_names()) point at the same range. `step` is the 1-based
  // number of this update. Pure: same inputs, same outputs.
  virtual void update(float* var, const float* grad, float* const* slots, size_t count,
                      int64_t step) const = 0;

  // In replica context: reduces the gradients across replicas (the strategy's
  // way) and updates the variables. Every local replica must call it with the
  // same variables in the same order. Gradients are summed: scale the loss by
  // 1 / global batch size (DistributedBatch::global_size()) so the sum is the
  // mean over the global batch.
  void apply_gradients(ReplicaContext& ctx,
                       const std::vector<std::pair<Tensor, Variable>>& grads_and_vars);

  // Number of completed apply_gradients steps (an int64 scalar variable that
  // checkpoints save with the model).
  Variable iterations() const { return iterations_; }
  Strategy& strategy() const { return *strategy_; }

  // The rule as data for device kernels; kNone (the default) means the
  // optimizer cannot update variables that live on a GPU.
  virtual UpdateRule device_rule() const { return {}; }

  // Applies the rule to one tensor with its slot tensors (helper for
  // strategies); GPU tensors are updated on the calling replica's stream.
  void update_tensor(Tensor& var, const Tensor& grad, std::vector<Tensor*> slots, int64_t step) const;

 private:
  Strategy* strategy_;
  Variable iterations_;
};

struct SGDOptions {
  float learning_rate = 0.01f;
  float momentum = 0.0f;  // 0 = plain SGD
  bool nesterov = false;
};

// v = momentum * v - lr * g; w += v  (Keras' SGD; nesterov: w += momentum * v - lr * g)
class SGD : public Optimizer {
 public:
  SGD(Strategy& strategy, SGDOptions options = {});
  std::string name() const override { return "sgd"; }
  std::vector<std::string> slot_names() const override;
  void update(float* var, const float* grad, float* const* slots, size_t count,
              int64_t step) const override;
  UpdateRule device_rule() const override;
  const SGDOptions& options() const { return options_; }
  // The rule and its slots without an SGD object (parameter servers apply it).
  static void apply(const SGDOptions& options, float* var, const float* grad, float* const* slots,
                    size_t count);
  static std::vector<std::string> slot_names_for(const SGDOptions& options);

 private:
  SGDOptions options_;
};

struct AdamOptions {
  float learning_rate = 0.001f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float epsilon = 1e-7f;
};

// Kingma & Ba with bias correction (Keras' Adam).
class Adam : public Optimizer {
 public:
  Adam(Strategy& strategy, AdamOptions options = {});
  std::string name() const override { return "adam"; }
  std::vector<std::string> slot_names() const override { return {"m", "v"}; }
  void update(float* var, const float* grad, float* const* slots, size_t count,
              int64_t step) const override;
  UpdateRule device_rule() const override;
  const AdamOptions& options() const { return options_; }
  // The rule without an Adam object (parameter servers apply it).
  static void apply(const AdamOptions& options, float* var, const float* grad, float* const* slots,
                    size_t count, int64_t step);

 private:
  AdamOptions options_;
};

}  // namespace diststrat
