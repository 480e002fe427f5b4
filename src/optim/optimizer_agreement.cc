// Ranks agree on the optimizer's configuration (issue: a worker started
// with another --lr trained on without a word, as under PyTorch DDP).
//
// At the first apply_gradients, and at the first one after any change of
// the configuration (set_clipping, set_accumulation_steps,
// enable_loss_scaling), every replica all-gathers one 64-bit hash per field
// of Optimizer::configuration() (the optimizer's name, its
// hyper-parameters() -- learning rate, schedule, momentum, betas ... -- and
// clipping, loss scaling and accumulation). Every replica then holds
// every replica's hashes and throws the same InvalidArgumentError naming the
// first field that differs and which replicas hold which value, before any
// gradient is reduced. One small collective per change; nothing per step.
// Only where several processes train (in one process every replica shares
// the one optimizer object); not under ParameterServerStrategy, whose
// servers fix each variable's rule when it is created. ZeRO-1 on some
// workers only is caught by the fusion engine's call signature, which names
// shard_optimizer_state.
#include <cinttypes>
#include <cstdio>
#include <mutex>
#include <vector>

#include "core/fnv1a.h"
#include "core/user_text.h"
#include "diststrat/optimizer.h"

namespace diststrat {

namespace {

// Hash slots gathered per replica: the same on every rank, whatever the
// optimizer (fields past the last slot fold into it).
constexpr int64_t kSlots = 16;

// Exact text of a hyper-parameter (9 significant digits round-trip a float).
std::string float_text(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.9g", v);
  return b;
}

}  // namespace

std::string LearningRateSchedule::describe() const {
  std::string s;
  switch (kind) {
    case Kind::kConstant:
      return "constant";
    case Kind::kPiecewiseConstant:
      s = "piecewise_constant(boundaries=[";
      for (size_t i = 0; i < boundaries.size(); ++i)
        s += (i ? "," : "") + std::to_string(boundaries[i]);
      s += "], values=[";
      for (size_t i = 0; i < values.size(); ++i) s += (i ? "," : "") + float_text(values[i]);
      return s + "])";
    case Kind::kCosineDecay:
      return "cosine_decay(decay_steps=" + std::to_string(decay_steps) +
             ", warmup_steps=" + std::to_string(warmup_steps) + ", alpha=" + float_text(alpha) +
             ", warmup_initial=" + float_text(warmup_initial) + ")";
    case Kind::kExponentialDecay:
      return "exponential_decay(decay_steps=" + std::to_string(decay_steps) +
             ", decay_rate=" + float_text(decay_rate) +
             ", staircase=" + (staircase ? "true" : "false") + ")";
  }
  return "unknown";
}

std::vector<std::pair<std::string, std::string>> SGD::hyperparameters() const {
  return {{"learning_rate", float_text(options_.learning_rate)},
          {"schedule", options_.schedule.describe()},
          {"momentum", float_text(options_.momentum)},
          {"nesterov", options_.nesterov ? "true" : "false"}};
}

std::vector<std::pair<std::string, std::string>> Adam::hyperparameters() const {
  return {{"learning_rate", float_text(options_.learning_rate)},
          {"schedule", options_.schedule.describe()},
          {"beta1", float_text(options_.beta1)},
          {"beta2", float_text(options_.beta2)},
          {"epsilon", float_text(options_.epsilon)}};
}

std::vector<std::pair<std::string, std::string>> Optimizer::configuration() const {
  std::vector<std::pair<std::string, std::string>> f;
  f.emplace_back("optimizer", name());
  for (auto& p : hyperparameters()) f.push_back(std::move(p));
  f.emplace_back("clipping", "global_norm=" + float_text(clipping_.global_norm) +
                                 " norm=" + float_text(clipping_.norm) +
                                 " value=" + float_text(clipping_.value));
  f.emplace_back("loss_scaling",
                 loss_scaling() ? "initial_scale=" + float_text(loss_scale_options_.initial_scale) +
                                      " growth_interval=" +
                                      std::to_string(loss_scale_options_.growth_interval) +
                                      " multiplier=" + float_text(loss_scale_options_.multiplier)
                                : "off");
  f.emplace_back("accumulation_steps", std::to_string(accumulation_steps_));
  return f;
}

struct Optimizer::Agreement {
  std::mutex mu;
  int64_t version = 0;  // bumped by every configuration change
  // Per local replica: the version last agreed on, and in which group of
  // workers (an elastic group's new members have agreed on nothing yet).
  std::vector<std::pair<int64_t, int64_t>> checked;
};

std::shared_ptr<Optimizer::Agreement> Optimizer::new_agreement() {
  return std::make_shared<Agreement>();
}

void Optimizer::configuration_changed() {
  std::lock_guard<std::mutex> lock(agreement_->mu);
  ++agreement_->version;
}

void Optimizer::agree_on_configuration(ReplicaContext& ctx) {
  const ClusterInfo cluster = strategy_->cluster();
  if (cluster.num_workers <= 1 || strategy_->name() == "parameter_server") return;
  const size_t local = static_cast<size_t>(ctx.local_replica_id());
  int64_t version;
  const int64_t group = strategy_->membership_group();
  {
    std::lock_guard<std::mutex> lock(agreement_->mu);
    if (agreement_->checked.size() <= local) agreement_->checked.resize(local + 1, {-1, -1});
    version = agreement_->version;
    if (agreement_->checked[local] == std::make_pair(version, group)) return;
  }
  const std::vector<std::pair<std::string, std::string>> fields = configuration();
  Tensor mine(Shape{1, kSlots}, DType::kInt64);
  std::vector<Fnv1a> h(kSlots);
  for (size_t i = 0; i < fields.size(); ++i) {
    Fnv1a& slot = h[std::min<size_t>(i, kSlots - 1)];
    slot.text(fields[i].first);
    slot.text(fields[i].second);
  }
  for (int64_t i = 0; i < kSlots; ++i)
    mine.data<int64_t>()[i] =
        i < static_cast<int64_t>(fields.size()) ? static_cast<int64_t>(h[i].get()) : 0;
  const Tensor all = ctx.all_gather(mine, "optimizer/configuration");
  const int64_t replicas = all.shape()[0];
  const int64_t* v = all.data<int64_t>();
  for (int64_t i = 0; i < kSlots; ++i) {
    std::vector<int64_t> same, other;
    for (int64_t r = 0; r < replicas; ++r) (v[r * kSlots + i] == v[i] ? same : other).push_back(r);
    if (other.empty()) continue;
    auto list = [](const std::vector<int64_t>& rs) {
      std::string s;
      for (size_t k = 0; k < rs.size() && k < 16; ++k) s += (k ? ", " : "") + std::to_string(rs[k]);
      if (rs.size() > 16) s += " and " + std::to_string(rs.size() - 16) + " more";
      return s;
    };
    const bool named = i < static_cast<int64_t>(fields.size());
    const std::string field = !named ? "field " + std::to_string(i)
                              : i == kSlots - 1
                                  ? "one of the fields from '" + fields[i].first + "' on"
                                  : "'" + fields[i].first + "'";
    throw_error(ErrorCode::kInvalidArgument,
                "apply_gradients on replica " + std::to_string(ctx.replica_id()) +
                    ": the optimizer's configuration differs across workers: " + field +
                    " of replica(s) " + list(other) + " differs from replica(s) " + list(same) +
                    " (this replica's " + (named ? fields[i].first : std::string("value")) + ": " +
                    (named ? echo(fields[i].second) : std::string("none")) +
                    "); every worker must configure the optimizer alike (the same learning rate, "
                    "schedule, clipping, loss scaling and accumulation)");
  }
  std::lock_guard<std::mutex> lock(agreement_->mu);
  agreement_->checked[local] = {version, group};
}

}  // namespace diststrat
