// Learning-rate schedules: the factories, the checks of their fields, and the
// rate of each update (LearningRateSchedule, diststrat/learning_rate_schedule.h).
// describe(), the text workers compare, is with the other configuration texts
// in optimizer_agreement.cc.
#include "diststrat/learning_rate_schedule.h"

#include <algorithm>
#include <cmath>

#include "diststrat/error.h"

namespace diststrat {

LearningRateSchedule LearningRateSchedule::piecewise_constant(std::vector<int64_t> boundaries,
                                                              std::vector<float> values) {
  LearningRateSchedule s;
  s.kind = Kind::kPiecewiseConstant;
  s.boundaries = std::move(boundaries);
  s.values = std::move(values);
  s.validate("piecewise_constant");
  return s;
}

LearningRateSchedule LearningRateSchedule::cosine_decay(int64_t decay_steps, int64_t warmup_steps,
                                                        float alpha, float warmup_initial) {
  LearningRateSchedule s;
  s.kind = Kind::kCosineDecay;
  s.decay_steps = decay_steps;
  s.warmup_steps = warmup_steps;
  s.alpha = alpha;
  s.warmup_initial = warmup_initial;
  s.validate("cosine_decay");
  return s;
}

LearningRateSchedule LearningRateSchedule::exponential_decay(int64_t decay_steps, float decay_rate,
                                                             bool staircase) {
  LearningRateSchedule s;
  s.kind = Kind::kExponentialDecay;
  s.decay_steps = decay_steps;
  s.decay_rate = decay_rate;
  s.staircase = staircase;
  s.validate("exponential_decay");
  return s;
}

void LearningRateSchedule::validate(const std::string& owner) const {
  switch (kind) {
    case Kind::kConstant:
      return;
    case Kind::kPiecewiseConstant:
      DISTSTRAT_CHECK(values.size() == boundaries.size() + 1, kInvalidArgument, owner,
                      ": piecewise-constant schedule has ", boundaries.size(), " boundaries and ",
                      values.size(), " values; it needs boundaries + 1 values");
      for (size_t i = 0; i < boundaries.size(); ++i) {
        DISTSTRAT_CHECK(boundaries[i] >= 0 && (i == 0 || boundaries[i] > boundaries[i - 1]),
                        kInvalidArgument, owner, ": piecewise-constant boundary ", i, " (",
                        boundaries[i], ") must be >= 0 and above the one before");
      }
      for (size_t i = 0; i < values.size(); ++i) {
        DISTSTRAT_CHECK(std::isfinite(values[i]) && values[i] >= 0, kInvalidArgument, owner,
                        ": piecewise-constant value ", i, " (", values[i],
                        ") must be finite and >= 0");
      }
      return;
    case Kind::kCosineDecay:
      DISTSTRAT_CHECK(decay_steps > 0, kInvalidArgument, owner, ": cosine decay_steps ",
                      decay_steps, " must be positive");
      DISTSTRAT_CHECK(warmup_steps >= 0, kInvalidArgument, owner, ": cosine warmup_steps ",
                      warmup_steps, " must be >= 0");
      DISTSTRAT_CHECK(alpha >= 0 && alpha <= 1, kInvalidArgument, owner, ": cosine alpha ", alpha,
                      " must be in [0, 1]");
      DISTSTRAT_CHECK(std::isfinite(warmup_initial) && warmup_initial >= 0, kInvalidArgument, owner,
                      ": cosine warmup_initial ", warmup_initial, " must be finite and >= 0");
      return;
    case Kind::kExponentialDecay:
      DISTSTRAT_CHECK(decay_steps > 0, kInvalidArgument, owner, ": exponential decay_steps ",
                      decay_steps, " must be positive");
      DISTSTRAT_CHECK(std::isfinite(decay_rate) && decay_rate > 0, kInvalidArgument, owner,
                      ": exponential decay_rate ", decay_rate, " must be finite and positive");
      return;
  }
  throw InvalidArgumentError(owner + ": unknown learning-rate schedule kind " +
                             std::to_string(static_cast<int>(kind)));
}

float LearningRateSchedule::learning_rate(float base, int64_t iterations) const {
  const int64_t t = std::max<int64_t>(0, iterations);
  switch (kind) {
    case Kind::kConstant:
      return base;
    case Kind::kPiecewiseConstant: {
      size_t i = 0;
      while (i < boundaries.size() && t > boundaries[i]) ++i;
      return values[i];
    }
    case Kind::kCosineDecay: {
      if (t < warmup_steps) {
        return static_cast<float>(warmup_initial + (double(base) - warmup_initial) *
                                                       (double(t) / double(warmup_steps)));
      }
      const double d = double(std::min<int64_t>(t - warmup_steps, decay_steps));
      const double pi = 3.14159265358979323846;
      const double cosine = 0.5 * (1.0 + std::cos(pi * d / double(decay_steps)));
      return static_cast<float>(double(base) * ((1.0 - alpha) * cosine + alpha));
    }
    case Kind::kExponentialDecay: {
      double p = double(t) / double(decay_steps);
      if (staircase) p = std::floor(p);
      return static_cast<float>(double(base) * std::pow(double(decay_rate), p));
    }
  }
  return base;
}

}  // namespace diststrat
