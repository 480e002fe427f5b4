// The optimizer's update rule as plain data, for code that runs the rule
// without an Optimizer object: a GPU backend's update kernel
// (GpuBackend::apply_update), and what Optimizer::device_rule() returns.
// Data only: no calls.
#pragma once

namespace diststrat {

// An update rule in data form, so a GPU backend can run it as a kernel
// (Optimizer::update is host code). kNone: the optimizer runs on the host only.
struct UpdateRule {
  enum class Kind { kNone, kSgd, kAdam };
  Kind kind = Kind::kNone;
  float learning_rate = 0.0f;  // update_tensor puts this step's scheduled rate here
  float momentum = 0.0f;       // SGD
  bool nesterov = false;       // SGD
  float beta1 = 0.0f, beta2 = 0.0f, epsilon = 0.0f;  // Adam
};

}  // namespace diststrat
