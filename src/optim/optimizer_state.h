// Internal state of Optimizer shared by its translation units (optimizer.cc,
// device_training.cc): the updates of one apply_gradients call held back
// until the last one arrives (global-norm clipping, loss scaling), and the
// loss-scale bookkeeping both the host and the device paths apply.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "diststrat/optimizer.h"

namespace diststrat {

// Updates of one apply_gradients call held back, per calling thread (a
// replica's thread, or local replica 0's during a merge_call), until the last
// one arrives and the global norm is known.
struct Optimizer::Held {
  struct Update {
    Tensor var, grad;
    std::vector<Tensor> slots;
    int64_t step;
  };
  struct Batch {
    size_t expected = 0;
    std::vector<Update> updates;
    bool flushed = false;
    double norm = std::numeric_limits<double>::quiet_NaN();
    // Loss scaling: this replica's copies of the state, and the decision.
    // `scale` may be in device memory (a GPU replica's copy): scale_value is
    // then read with the step's sums, at the flush.
    Tensor scale, good, skipped_count;
    float scale_value = 1.0f;
    bool skipped = false;
    // ZeRO-1: this replica holds a block of the gradients; sums one double
    // over every replica (set by apply_sharded).
    std::function<double(double)> sum_across;
  };
  std::mutex mu;
  std::map<std::thread::id, Batch> batches;
  // The norm of the latest flush: what a replica reports whose updates ran
  // on another thread (CentralStorage's replicas other than 0).
  double last_norm = std::numeric_limits<double>::quiet_NaN();
  bool last_skipped = false;
};

// The held updates of one step on GPU variables (all on one device) and
// their batch (null for a lone update clipped per tensor or by value).
struct Optimizer::DeviceStep {
  std::vector<Held::Update>& ready;
  Held::Batch* batch;
};

namespace optim_detail {

// Dynamic loss scaling after a step's decision: the next scale (a skipped
// step divides by the multiplier, never below 1; growth_interval finite steps
// in a row multiply by it, unless that overflows), with the good-step and
// skipped-step counters updated.
inline float next_loss_scale(const LossScaleOptions& o, float scale, bool skip, int64_t& good,
                             int64_t& skipped) {
  if (skip) {
    good = 0;
    ++skipped;
    return std::max(1.0f, scale / o.multiplier);
  }
  if (++good >= o.growth_interval) {
    good = 0;
    const float grown = scale * o.multiplier;
    if (std::isfinite(grown)) return grown;
  }
  return scale;
}

// The skip decision and the global norm of a step from the per-tensor sums
// of squares of its (unscaled) gradients, in call order, as every path
// computes them. `nonfinite`: loss scaling found a non-finite element here.
// `sum_across` (ZeRO-1, may be empty) sums one double over every replica.
struct StepDecision {
  bool skip = false;
  double norm = std::numeric_limits<double>::quiet_NaN();
};
inline StepDecision decide_step(bool loss_scaling, bool by_norm, bool nonfinite,
                                const std::function<double()>& local_sum_of_squares,
                                const std::function<double(double)>& sum_across) {
  StepDecision d;
  d.skip = loss_scaling && nonfinite;
  if (!by_norm && !loss_scaling) return d;  // clipping by value or per-tensor norm only
  if (sum_across) {
    // ZeRO-1: each replica holds a block of every gradient, so the norm and
    // the non-finite decision are sums over the replicas: one scalar (the
    // squared norm of this block, infinite when loss scaling found a
    // non-finite element here; without clipping, a 0/1 flag).
    double local = d.skip ? 1.0 : 0.0;
    if (by_norm) {
      local = local_sum_of_squares();
      if (d.skip) local = std::numeric_limits<double>::infinity();
    }
    const double total = sum_across(local);
    if (by_norm) {
      if (loss_scaling) d.skip = !std::isfinite(total);
      if (!d.skip) d.norm = std::sqrt(total);
    } else {
      d.skip = total > 0;
    }
  } else if (by_norm && !d.skip) {
    // In call order, so every replica sums in the same order: the same norm.
    d.norm = std::sqrt(local_sum_of_squares());
  }
  return d;
}

}  // namespace optim_detail
}  // namespace diststrat
