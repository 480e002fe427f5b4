// Internal state of Optimizer shared by its translation units (optimizer.cc,
// gradient_accumulation.cc, clipping_and_loss_scaling.cc,
// device_training.cc, zero_sharding.cc): each replica's accumulated
// gradients, the updates of one apply_gradients call held back until the
// last one arrives (global-norm clipping, loss scaling), the ZeRO-1 layout,
// and the decisions both the host and the device paths apply.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <thread>
#include <vector>

#include "runtime/variable_impl.h"
#include "diststrat/optimizer.h"

namespace diststrat {

// Each local replica's gradient sums of the micro-batches so far.
struct Optimizer::Accumulator {
  struct Sums {
    int count = 0;
    std::vector<std::pair<Tensor, Variable>> grads_and_vars;
  };
  std::mutex mu;  // guards the map; each replica touches only its own Sums
  std::map<int, Sums> replicas;
};

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
    // ZeRO-1 in determinism mode: every replica holds the step's whole
    // gradients (their exact sum), and the norm and the non-finite check
    // read them rather than the block, so that neither depends on how the
    // replica count cut the blocks (set by apply_sharded; sum_across unset).
    std::vector<Tensor> whole;
  };
  std::mutex mu;
  std::map<std::thread::id, Batch> batches;
  // The norm of the latest flush: what a replica reports whose updates ran
  // on another thread (CentralStorage's replicas other than 0).
  double last_norm = std::numeric_limits<double>::quiet_NaN();
  bool last_skipped = false;
};

// ZeRO-1 state: the flat layout of the sharded variables and, per local
// replica, its block's slots and the step's staging buffers.
struct Optimizer::Zero {
  struct Local {
    int64_t begin = 0, end = 0;  // this replica's block [begin, end) of the flat vector
    // The buffers and slot blocks below live where the replica's copies do
    // (host memory, or its GPU), allocated by the replica on its first call.
    bool ready = false;
    Device device;
    std::vector<std::vector<Tensor>> slots;  // [variable][slot]: its piece of the block
    Tensor flat;      // R * B: this replica's gradients laid end to end (zero tail)
    Tensor grads;     // B: the reduced gradients of the block
    Tensor values;    // B: the block of the variables, updated here
    Tensor gathered;  // R * B: every replica's updated block
  };
  mutable std::mutex mu;  // guards planning; afterwards each replica touches only its Local
  bool planned = false;
  int prepared = 0;  // local replicas whose Local is ready (the last frees the full slots)
  std::vector<Variable> vars;    // creation order
  std::vector<int64_t> offsets;  // of each variable in the flat vector
  int64_t total = 0;             // N
  int64_t block = 1;             // B = ceil(N / R), at least 1
  int replicas = 1;              // R
  std::vector<std::string> slot_names;
  std::vector<Local> locals;

  int64_t size(size_t k) const { return vars[k].shape().num_elements(); }
  // Variable k's piece of a block: flat range [lo, hi), possibly empty.
  std::pair<int64_t, int64_t> piece(size_t k, const Local& l) const {
    const int64_t lo = std::min(std::max(offsets[k], l.begin), l.end);
    const int64_t hi = std::max(lo, std::min(offsets[k] + size(k), l.end));
    return {lo, hi};
  }
  int find(const Variable::Impl* v) const {
    for (size_t k = 0; k < vars.size(); ++k) {
      if (&vars[k].impl() == v) return static_cast<int>(k);
    }
    return -1;
  }
  int find_slot(const std::string& s) const {
    for (size_t i = 0; i < slot_names.size(); ++i) {
      if (slot_names[i] == s) return static_cast<int>(i);
    }
    return -1;
  }
};

// The held updates of one step on GPU variables (all on one device) and
// their batch (null for a lone update clipped per tensor or by value).
struct Optimizer::DeviceStep {
  std::vector<Held::Update>& ready;
  Held::Batch* batch;
};

namespace optim_detail {

// A variable passed twice in one call is an error naming it (optimizer.cc).
void check_each_variable_once(const std::string& where,
                              const std::vector<std::pair<Tensor, Variable>>& grads_and_vars);

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
