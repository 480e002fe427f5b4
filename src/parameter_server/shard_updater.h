// The update rule a parameter server applies to its shards (ShardUpdater),
// built from the optimizer's rule as data (OptimizerConfig, wire.h): the
// worker describes its optimizer, the PS builds the updater once per
// variable (when the chief's kRule declares or replaces the rule) and runs
// the same code as the optimizer (SGD::apply, Adam::apply) over the float
// ranges of its shards. Not diststrat::UpdateRule (optimizer.h), the rule as
// data for the device kernels.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "diststrat/optimizer.h"
#include "parameter_server/wire.h"

namespace diststrat {
namespace ps {

// OptimizerConfig (the rule as data) is declared in wire.h: it travels in kRule requests.
// Throws UnimplementedError for optimizers a PS cannot rebuild.
OptimizerConfig describe_optimizer(const Optimizer& optimizer);
void write_config(Writer& w, const OptimizerConfig& c);
OptimizerConfig read_config(Reader& r);

// One optimizer's step over float ranges of a shard; immutable, so shards
// with the same config share one.
class ShardUpdater {
 public:
  virtual ~ShardUpdater() = default;
  virtual std::vector<std::string> slot_names() const = 0;
  virtual void update(float* var, const float* grad, float* const* slots, size_t count,
                      int64_t step) const = 0;
};
// Throws InvalidArgumentError for an unknown name, a wrong parameter count
// or a parameter out of its range (every one finite; learning rate > 0;
// momentum and betas in [0, 1); epsilon > 0): a rule arrives from a worker.
std::unique_ptr<ShardUpdater> make_shard_updater(const OptimizerConfig& config);

// The first difference of `other` from `fixed`, naming the field
// ("learning_rate 0.1, fixed 0.05"), or "" when they are the same rule.
std::string config_difference(const OptimizerConfig& fixed, const OptimizerConfig& other);
// Whether `a` and `b` are the same rule, bitwise as config_difference
// compares (a NaN never equals anything): a config equal to one that
// make_shard_updater accepted is valid, and its updater can be reused.
bool same_config(const OptimizerConfig& a, const OptimizerConfig& b);

}  // namespace ps
}  // namespace diststrat
