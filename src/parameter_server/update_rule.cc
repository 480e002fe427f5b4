#include "parameter_server/update_rule.h"

namespace diststrat {
namespace ps {

OptimizerConfig describe_optimizer(const Optimizer& optimizer) {
  if (const auto* sgd = dynamic_cast<const SGD*>(&optimizer)) {
    const SGDOptions& o = sgd->options();
    return {"sgd", {o.learning_rate, o.momentum, o.nesterov ? 1.0 : 0.0}};
  }
  if (const auto* adam = dynamic_cast<const Adam*>(&optimizer)) {
    const AdamOptions& o = adam->options();
    return {"adam", {o.learning_rate, o.beta1, o.beta2, o.epsilon}};
  }
  throw UnimplementedError("parameter servers apply the sgd and adam optimizers; '" +
                           optimizer.name() + "' cannot be sent to them");
}

void write_config(Writer& w, const OptimizerConfig& c) {
  w.put_string(c.name).put<int64_t>(static_cast<int64_t>(c.params.size()));
  for (double p : c.params) w.put(p);
}

OptimizerConfig read_config(Reader& r) {
  OptimizerConfig c;
  c.name = r.get_string();
  const int64_t n = r.get<int64_t>();
  DISTSTRAT_CHECK(n >= 0 && n <= 64, kInvalidArgument, "optimizer '", c.name, "': ", n,
                  " parameters");
  for (int64_t i = 0; i < n; ++i) c.params.push_back(r.get<double>());
  return c;
}

namespace {
class SgdRule : public UpdateRule {
 public:
  explicit SgdRule(SGDOptions o) : o_(o) {}
  std::vector<std::string> slot_names() const override { return SGD::slot_names_for(o_); }
  void update(float* var, const float* grad, float* const* slots, size_t count,
              int64_t) const override {
    SGD::apply(o_, var, grad, slots, count);
  }

 private:
  SGDOptions o_;
};

class AdamRule : public UpdateRule {
 public:
  explicit AdamRule(AdamOptions o) : o_(o) {}
  std::vector<std::string> slot_names() const override { return {"m", "v"}; }
  void update(float* var, const float* grad, float* const* slots, size_t count,
              int64_t step) const override {
    Adam::apply(o_, var, grad, slots, count, step);
  }

 private:
  AdamOptions o_;
};
}  // namespace

std::unique_ptr<UpdateRule> make_update_rule(const OptimizerConfig& c) {
  if (c.name == "sgd") {
    DISTSTRAT_CHECK_EQ(c.params.size(), 3u, "sgd optimizer parameters");
    SGDOptions o;
    o.learning_rate = static_cast<float>(c.params[0]);
    o.momentum = static_cast<float>(c.params[1]);
    o.nesterov = c.params[2] != 0.0;
    return std::make_unique<SgdRule>(o);
  }
  if (c.name == "adam") {
    DISTSTRAT_CHECK_EQ(c.params.size(), 4u, "adam optimizer parameters");
    AdamOptions o;
    o.learning_rate = static_cast<float>(c.params[0]);
    o.beta1 = static_cast<float>(c.params[1]);
    o.beta2 = static_cast<float>(c.params[2]);
    o.epsilon = static_cast<float>(c.params[3]);
    return std::make_unique<AdamRule>(o);
  }
  throw InvalidArgumentError("unknown optimizer '" + c.name + "'");
}

}  // namespace ps
}  // namespace diststrat
