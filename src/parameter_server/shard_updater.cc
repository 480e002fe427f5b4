// ps::ShardUpdater (shard_updater.h): describing an optimizer as an
// OptimizerConfig, checking one that arrives, and the SGD and Adam updaters.
#include "parameter_server/shard_updater.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "core/user_text.h"

namespace diststrat {
namespace ps {

namespace {
// The learning-rate schedule after the optimizer's own parameters: kind,
// warmup_steps, warmup_initial, decay_steps, alpha, decay_rate, staircase,
// boundary count, boundaries, then the values to the end. Doubles hold
// every field exactly (steps below 2^53). Without the block: constant.
constexpr size_t kScheduleFixed = 8;
constexpr int64_t kMaxBoundaries = 1000;

void put_schedule(const LearningRateSchedule& s, std::vector<double>& p) {
  p.insert(p.end(), {double(static_cast<int>(s.kind)), double(s.warmup_steps), s.warmup_initial,
                     double(s.decay_steps), s.alpha, s.decay_rate, s.staircase ? 1.0 : 0.0,
                     double(s.boundaries.size())});
  for (int64_t b : s.boundaries) p.push_back(double(b));
  for (float v : s.values) p.push_back(v);
}

LearningRateSchedule get_schedule(const OptimizerConfig& c, size_t at) {
  if (c.params.size() == at) return {};  // no schedule block: the constant rate
  DISTSTRAT_CHECK(c.params.size() >= at + kScheduleFixed, kInvalidArgument, "optimizer '", c.name,
                  "': ", c.params.size(), " parameters, too few for its learning-rate schedule");
  const double* q = c.params.data() + at;
  const auto as_int = [&](double d, const char* what) {
    DISTSTRAT_CHECK(d == std::floor(d) && std::fabs(d) < 9.0e15, kInvalidArgument, "optimizer '",
                    c.name, "': schedule ", what, " ", d, " is not an integer");
    return static_cast<int64_t>(d);
  };
  LearningRateSchedule s;
  const int64_t kind = as_int(q[0], "kind");
  DISTSTRAT_CHECK(
      kind >= 0 && kind <= static_cast<int64_t>(LearningRateSchedule::Kind::kExponentialDecay),
      kInvalidArgument, "optimizer '", echo(c.name), "': unknown schedule kind ", kind);
  s.kind = static_cast<LearningRateSchedule::Kind>(kind);
  s.warmup_steps = as_int(q[1], "warmup_steps");
  s.warmup_initial = static_cast<float>(q[2]);
  s.decay_steps = as_int(q[3], "decay_steps");
  s.alpha = static_cast<float>(q[4]);
  s.decay_rate = static_cast<float>(q[5]);
  s.staircase = q[6] != 0.0;
  const int64_t nb = as_int(q[7], "boundary count");
  const size_t rest = c.params.size() - at - kScheduleFixed;  // boundaries, then values
  DISTSTRAT_CHECK(nb >= 0 && nb <= kMaxBoundaries && rest >= size_t(nb) &&
                      rest - size_t(nb) <= size_t(kMaxBoundaries) + 1,
                  kInvalidArgument, "optimizer '", echo(c.name), "': schedule with ", nb,
                  " boundaries does not fit its ", c.params.size(), " parameters");
  for (int64_t i = 0; i < nb; ++i)
    s.boundaries.push_back(as_int(q[kScheduleFixed + i], "boundary"));
  for (size_t i = size_t(nb); i < rest; ++i)
    s.values.push_back(static_cast<float>(q[kScheduleFixed + i]));
  s.validate("optimizer '" + echo(c.name) + "' from a worker");
  return s;
}
}  // namespace

OptimizerConfig describe_optimizer(const Optimizer& optimizer) {
  if (const auto* sgd = dynamic_cast<const SGD*>(&optimizer)) {
    const SGDOptions& o = sgd->options();
    OptimizerConfig c{"sgd", {o.learning_rate, o.momentum, o.nesterov ? 1.0 : 0.0}};
    put_schedule(o.schedule, c.params);
    return c;
  }
  if (const auto* adam = dynamic_cast<const Adam*>(&optimizer)) {
    const AdamOptions& o = adam->options();
    OptimizerConfig c{"adam", {o.learning_rate, o.beta1, o.beta2, o.epsilon}};
    put_schedule(o.schedule, c.params);
    return c;
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
  DISTSTRAT_CHECK(n >= 0 && n <= 64 + 2 * kMaxBoundaries, kInvalidArgument, "optimizer '", c.name,
                  "': ", n, " parameters");
  for (int64_t i = 0; i < n; ++i) c.params.push_back(r.get<double>());
  return c;
}

namespace {
class SgdRule : public ShardUpdater {
 public:
  explicit SgdRule(SGDOptions o) : o_(o) {}
  std::vector<std::string> slot_names() const override { return SGD::slot_names_for(o_); }
  void update(float* var, const float* grad, float* const* slots, size_t count,
              int64_t step) const override {
    SGD::apply(o_, var, grad, slots, count, step);
  }

 private:
  SGDOptions o_;
};

class AdamRule : public ShardUpdater {
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

namespace {
// Names of the parameters of `c`, in order (the optimizer's, then the schedule's).
std::string param_name(const OptimizerConfig& c, size_t i) {
  static const char* const kSgd[] = {"learning_rate", "momentum", "nesterov"};
  static const char* const kAdam[] = {"learning_rate", "beta1", "beta2", "epsilon"};
  static const char* const kSchedule[] = {"schedule.kind",           "schedule.warmup_steps",
                                          "schedule.warmup_initial", "schedule.decay_steps",
                                          "schedule.alpha",          "schedule.decay_rate",
                                          "schedule.staircase",      "schedule.boundary_count"};
  const size_t own = c.name == "sgd" ? 3 : c.name == "adam" ? 4 : 0;
  if (i < own) return c.name == "sgd" ? kSgd[i] : kAdam[i];
  if (i - own < kScheduleFixed) return kSchedule[i - own];
  return "schedule.boundaries/values[" + std::to_string(i - own - kScheduleFixed) + "]";
}
}  // namespace

std::string config_difference(const OptimizerConfig& fixed, const OptimizerConfig& other) {
  if (fixed.name != other.name)
    return "optimizer '" + echo(other.name) + "', fixed '" + echo(fixed.name) + "'";
  const size_t n = std::min(fixed.params.size(), other.params.size());
  for (size_t i = 0; i < n; ++i) {
    // Bitwise: a NaN never equals the fixed value.
    if (std::memcmp(&fixed.params[i], &other.params[i], sizeof(double)) != 0) {
      std::ostringstream o;
      o << param_name(other, i) << " " << other.params[i] << ", fixed " << fixed.params[i];
      return o.str();
    }
  }
  if (fixed.params.size() != other.params.size()) {
    return std::to_string(other.params.size()) + " parameters, fixed " +
           std::to_string(fixed.params.size()) + " (" + param_name(other, n) + ")";
  }
  return "";
}

bool same_config(const OptimizerConfig& a, const OptimizerConfig& b) {
  return a.name == b.name && a.params.size() == b.params.size() &&
         (a.params.empty() ||
          std::memcmp(a.params.data(), b.params.data(), a.params.size() * sizeof(double)) == 0);
}

std::unique_ptr<ShardUpdater> make_shard_updater(const OptimizerConfig& c) {
  for (size_t i = 0; i < c.params.size(); ++i) {
    DISTSTRAT_CHECK(std::isfinite(c.params[i]), kInvalidArgument, "optimizer '", c.name,
                    "': ", param_name(c, i), " is ", c.params[i]);
  }
  const size_t own = c.name == "sgd" ? 3 : c.name == "adam" ? 4 : 0;
  DISTSTRAT_CHECK(own == 0 || c.params.size() >= own, kInvalidArgument, "optimizer '", c.name,
                  "': ", c.params.size(), " parameters, it has ", own);
  if (own) {
    // Float ranges: a rate that does not fit a float would be inf on the shards.
    const double lr = c.params[0];
    DISTSTRAT_CHECK(lr > 0 && lr <= 1e6, kInvalidArgument, "optimizer '", c.name,
                    "': learning_rate ", lr, " is not in (0, 1e6]");
  }
  if (c.name == "sgd") {
    DISTSTRAT_CHECK(c.params[1] >= 0 && c.params[1] < 1 && (c.params[2] == 0 || c.params[2] == 1),
                    kInvalidArgument, "optimizer 'sgd': momentum ", c.params[1],
                    " (in [0, 1)), nesterov ", c.params[2]);
  }
  if (c.name == "adam") {
    DISTSTRAT_CHECK(c.params[1] >= 0 && c.params[1] < 1 && c.params[2] >= 0 && c.params[2] < 1 &&
                        c.params[3] > 0 && c.params[3] <= 1,
                    kInvalidArgument, "optimizer 'adam': beta1 ", c.params[1], ", beta2 ",
                    c.params[2], " (in [0, 1)), epsilon ", c.params[3], " (in (0, 1])");
  }
  if (c.name == "sgd") {
    SGDOptions o;
    o.schedule = get_schedule(c, 3);
    o.learning_rate = static_cast<float>(c.params[0]);
    o.momentum = static_cast<float>(c.params[1]);
    o.nesterov = c.params[2] != 0.0;
    return std::make_unique<SgdRule>(o);
  }
  if (c.name == "adam") {
    AdamOptions o;
    o.schedule = get_schedule(c, 4);
    o.learning_rate = static_cast<float>(c.params[0]);
    o.beta1 = static_cast<float>(c.params[1]);
    o.beta2 = static_cast<float>(c.params[2]);
    o.epsilon = static_cast<float>(c.params[3]);
    return std::make_unique<AdamRule>(o);
  }
  throw InvalidArgumentError("unknown optimizer '" + echo(c.name) + "'");
}

}  // namespace ps
}  // namespace diststrat
