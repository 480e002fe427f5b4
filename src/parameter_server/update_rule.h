// The optimizer's update rule as data, so a parameter server (which holds no
// Optimizer object) can apply it: the worker describes its optimizer, the PS
// rebuilds the rule and runs the same code (SGD::apply, Adam::apply) over the
// float ranges of its shards.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "diststrat/optimizer.h"
#include "parameter_server/wire.h"

namespace diststrat {
namespace ps {

// OptimizerConfig (the rule as data) is declared in wire.h: it travels in pushes.
// Throws UnimplementedError for optimizers a PS cannot rebuild.
OptimizerConfig describe_optimizer(const Optimizer& optimizer);
void write_config(Writer& w, const OptimizerConfig& c);
OptimizerConfig read_config(Reader& r);

class UpdateRule {
 public:
  virtual ~UpdateRule() = default;
  virtual std::vector<std::string> slot_names() const = 0;
  virtual void update(float* var, const float* grad, float* const* slots, size_t count,
                      int64_t step) const = 0;
};
// Throws InvalidArgumentError for an unknown name, a wrong parameter count
// or a parameter out of its range (every one finite; learning rate > 0;
// momentum and betas in [0, 1); epsilon > 0): a rule arrives from a worker.
std::unique_ptr<UpdateRule> make_update_rule(const OptimizerConfig& config);

// The first difference of `other` from `fixed`, naming the field
// ("learning_rate 0.1, fixed 0.05"), or "" when they are the same rule.
std::string config_difference(const OptimizerConfig& fixed, const OptimizerConfig& other);

}  // namespace ps
}  // namespace diststrat
