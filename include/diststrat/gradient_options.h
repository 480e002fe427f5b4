// What an optimizer does to the reduced gradients before it updates the
// variables: gradient clipping (Optimizer::set_clipping) and dynamic loss
// scaling (Optimizer::enable_loss_scaling). Options only: the calls and their
// rules are Optimizer's (diststrat/optimizer.h).
#pragma once

#include <cstdint>

namespace diststrat {

// Gradient clipping, applied to the reduced (global) gradients after the
// strategy's all-reduce and before the update, identically on every replica
// and worker (no extra communication: every replica holds the same reduced
// gradients and computes the same norm, in double, in the same order). At
// most one field may be set (as in Keras); 0 = off.
//  global_norm  clip_by_global_norm: every gradient of one apply_gradients
//               call is scaled by global_norm / max(norm, global_norm), norm =
//               sqrt(sum of all squared elements); a non-finite norm makes
//               every gradient NaN (as tf.clip_by_global_norm).
//  norm         clip_by_norm, per tensor: g * norm / max(|g|, norm).
//  value        clip_by_value: each element into [-value, value].
// The user's gradient tensors are not modified (the clipped values go to a
// copy). GPU variables are clipped on their device: a few list launches per
// step and at most one small device -> host read (the global norm).
// ParameterServerStrategy: UnimplementedError (the parameter servers apply
// each worker's push on its own; there is no global gradient to clip).
struct GradientClipping {
  float global_norm = 0.0f;
  float norm = 0.0f;
  float value = 0.0f;
};

// Dynamic loss scaling (Keras' LossScaleOptimizer): the loop multiplies its
// loss by loss_scale(ctx); after the reduction the optimizer divides the
// gradients by it and, if any reduced gradient is non-finite, skips the whole
// step (no variable, slot or step counter changes) and divides the scale by
// `multiplier` (never below 1); after `growth_interval` finite steps in a
// row it multiplies it. The decision is taken on the reduced gradients: an
// inf or NaN on any replica of any worker reaches every replica through the
// all-reduce (sums propagate them), so every replica skips the same step and
// the scale stays identical everywhere, with no extra communication.
struct LossScaleOptions {
  float initial_scale = 32768.0f;  // 2^15, as Keras
  int64_t growth_interval = 2000;  // finite steps in a row before the scale grows
  float multiplier = 2.0f;         // growth factor; a skipped step divides by it
};

}  // namespace diststrat
