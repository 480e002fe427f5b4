// ZeRO-1 (sharded optimizer state) as a strategy implements it: the
// collectives a strategy hands to Optimizer::apply_sharded when its options
// shard the optimizer state (MirroredOptions /
// MultiWorkerOptions::shard_optimizer_state). Users set that option; only
// strategy implementers fill in ShardedCollectives.
//
// Rules for the collectives below:
//  - Blocking: each returns when this replica's part is done (its output
//    holds the result).
//  - Ordering: every replica in sync calls each the same number of times in
//    the same order.
//  - Thread safety: a replica's ShardedCollectives are called only on that
//    replica's thread, during its apply_sharded call.
#pragma once

#include <functional>

#include "diststrat/tensor.h"

namespace diststrat {

// The collectives of Optimizer::apply_sharded, over every replica in sync
// (R of them, global replica ids 0..R-1).
struct ShardedCollectives {
  // `in`: R * B float32 elements; `out`: B. Leaves block replica_id() of the
  // element-wise sum over all replicas in `out`.
  std::function<void(const Tensor& in, Tensor& out)> reduce_scatter;
  // `in`: B float32 elements; `out`: R * B, every replica's `in` in replica
  // order.
  std::function<void(const Tensor& in, Tensor& out)> all_gather;
  // The sum of one double over every replica in sync (global-norm clipping,
  // loss scaling's non-finite decision): one scalar reduction per step.
  std::function<double(double)> sum;
};

}  // namespace diststrat
