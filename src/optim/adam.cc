// Adam with bias correction (Kingma & Ba, Keras' Adam): the rule on the host,
// as data for device kernels, and without an Adam object for the parameter
// servers. Its hyperparameters() text is in optimizer_agreement.cc.
#include <cmath>
#include <string>
#include <vector>

#include "diststrat/optimizer.h"
#include "optim/optim_kernels.h"

namespace diststrat {

Adam::Adam(Strategy& strategy, AdamOptions options) : Optimizer(strategy), options_(options) {
  DISTSTRAT_CHECK(std::isfinite(options.learning_rate) && options.learning_rate > 0,
                  kInvalidArgument, "Adam learning_rate ", options.learning_rate,
                  " must be finite and positive");
  for (const auto& [field, b] :
       {std::pair<const char*, float>{"beta1", options.beta1}, {"beta2", options.beta2}}) {
    DISTSTRAT_CHECK(b >= 0 && b < 1, kInvalidArgument, "Adam ", field, " ", b,
                    " must be in [0, 1)");
  }
  DISTSTRAT_CHECK(std::isfinite(options.epsilon) && options.epsilon > 0, kInvalidArgument,
                  "Adam epsilon ", options.epsilon, " must be finite and positive");
  options.schedule.validate("Adam");
}

UpdateRule Adam::device_rule() const {
  UpdateRule r;
  r.kind = UpdateRule::Kind::kAdam;
  r.learning_rate = options_.learning_rate;
  r.beta1 = options_.beta1;
  r.beta2 = options_.beta2;
  r.epsilon = options_.epsilon;
  return r;
}

void Adam::update(float* var, const float* grad, float* const* slots, size_t count,
                  int64_t step) const {
  apply(options_, var, grad, slots, count, step);
}

float Adam::learning_rate(int64_t iterations) const {
  return options_.schedule.learning_rate(options_.learning_rate, iterations);
}

void Adam::apply(const AdamOptions& options, float* var, const float* grad, float* const* slots,
                 size_t count, int64_t step) {
  const float b1 = options.beta1, b2 = options.beta2;
  const double t = static_cast<double>(step);
  const float lr = options.schedule.learning_rate(options.learning_rate, step - 1);
  const float alpha =
      static_cast<float>(lr * std::sqrt(1.0 - std::pow(b2, t)) / (1.0 - std::pow(b1, t)));
  optim_detail::optim_kernels().adam(var, grad, slots[0], slots[1], count, b1, b2, alpha,
                                     options.epsilon);
}

}  // namespace diststrat
