// Learning-rate schedules (Keras' LearningRateSchedule): the rate an
// optimizer (SGDOptions / AdamOptions::schedule) uses for each update, as a
// function of its step counter.
//
// Rules for the calls below:
//  - Blocking: none communicates or waits; learning_rate() is pure.
//  - Ordering: none. A schedule is plain data, so every worker (and the
//    parameter servers) evaluates the same one to the same float.
//  - Thread safety: the const calls may run concurrently on one schedule.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace diststrat {

// A learning rate as a function of the optimizer's step counter: the number
// of updates completed before this one (Optimizer::iterations(), which
// checkpoints save, so a restored run continues the schedule exactly; the
// first update sees 0), as Keras' LearningRateSchedule(optimizer.iterations).
// Plain data, so parameter servers rebuild it (their counter is the shard's
// own update count, equal to iterations for a dense variable). `base` below
// is the optimizer's learning_rate.
//  kConstant          base.
//  kPiecewiseConstant values[0] while t <= boundaries[0], values[i] while
//                     boundaries[i-1] < t <= boundaries[i], values.back()
//                     after (Keras' PiecewiseConstantDecay; base unused).
//  kCosineDecay       linear warm-up from warmup_initial to base over
//                     warmup_steps, then base * ((1 - alpha) * 0.5 *
//                     (1 + cos(pi * min(t - warmup_steps, decay_steps) /
//                     decay_steps)) + alpha) (Keras' CosineDecay).
//  kExponentialDecay  base * decay_rate ^ (t / decay_steps), the exponent
//                     floored when staircase (Keras' ExponentialDecay).
// Evaluated in double, rounded to float once.
struct LearningRateSchedule {
  enum class Kind { kConstant, kPiecewiseConstant, kCosineDecay, kExponentialDecay };
  Kind kind = Kind::kConstant;
  std::vector<int64_t> boundaries;  // piecewise: strictly increasing, >= 0
  std::vector<float> values;        // piecewise: boundaries.size() + 1 rates
  int64_t warmup_steps = 0;         // cosine
  float warmup_initial = 0.0f;      // cosine: the rate at t = 0 when warming up
  int64_t decay_steps = 1;          // cosine, exponential: > 0
  float alpha = 0.0f;               // cosine: final rate as a fraction of base, [0, 1]
  float decay_rate = 1.0f;          // exponential: > 0
  bool staircase = false;           // exponential

  static LearningRateSchedule piecewise_constant(std::vector<int64_t> boundaries,
                                                 std::vector<float> values);
  static LearningRateSchedule cosine_decay(int64_t decay_steps, int64_t warmup_steps = 0,
                                           float alpha = 0.0f, float warmup_initial = 0.0f);
  static LearningRateSchedule exponential_decay(int64_t decay_steps, float decay_rate,
                                                bool staircase = false);
  // Throws InvalidArgumentError naming the bad field. Optimizers call it.
  void validate(const std::string& owner) const;
  // The rate for the update that follows `iterations` completed ones. Pure,
  // thread-safe; iterations < 0 counts as 0.
  float learning_rate(float base, int64_t iterations) const;
  // "constant", "cosine_decay(decay_steps=..., ...)": every field, floats
  // exactly (9 significant digits).
  std::string describe() const;
};

}  // namespace diststrat
