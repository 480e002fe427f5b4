// SGD with momentum and Nesterov momentum (Keras' SGD): the rule on the host,
// as data for device kernels, and without an SGD object for the parameter
// servers. Its hyperparameters() text is in optimizer_agreement.cc.
#include <cmath>
#include <string>
#include <vector>

#include "diststrat/optimizer.h"
#include "optim/optim_kernels.h"

namespace diststrat {

SGD::SGD(Strategy& strategy, SGDOptions options) : Optimizer(strategy), options_(options) {
  DISTSTRAT_CHECK(std::isfinite(options.learning_rate) && options.learning_rate > 0,
                  kInvalidArgument, "SGD learning_rate ", options.learning_rate,
                  " must be finite and positive");
  options.schedule.validate("SGD");
  DISTSTRAT_CHECK(options.momentum >= 0 && options.momentum < 1, kInvalidArgument, "SGD momentum ",
                  options.momentum, " must be in [0, 1)");
}

std::vector<std::string> SGD::slot_names() const { return slot_names_for(options_); }

std::vector<std::string> SGD::slot_names_for(const SGDOptions& options) {
  if (options.momentum == 0.0f) return {};
  return {"momentum"};
}

void SGD::update(float* var, const float* grad, float* const* slots, size_t count,
                 int64_t step) const {
  apply(options_, var, grad, slots, count, step);
}

float SGD::learning_rate(int64_t iterations) const {
  return options_.schedule.learning_rate(options_.learning_rate, iterations);
}

void SGD::apply(const SGDOptions& options, float* var, const float* grad, float* const* slots,
                size_t count, int64_t step) {
  const float lr = options.schedule.learning_rate(options.learning_rate, step - 1);
  const float mu = options.momentum;
  const optim_detail::OptimKernels& k = optim_detail::optim_kernels();
  if (mu == 0.0f) {
    k.sgd(var, grad, count, lr);
  } else {
    k.sgd_momentum(var, grad, slots[0], count, lr, mu, options.nesterov);
  }
}

UpdateRule SGD::device_rule() const {
  UpdateRule r;
  r.kind = UpdateRule::Kind::kSgd;
  r.learning_rate = options_.learning_rate;
  r.momentum = options_.momentum;
  r.nesterov = options_.nesterov;
  return r;
}

}  // namespace diststrat
