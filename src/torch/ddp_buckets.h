// DistributedDataParallel's buckets: the parameters cut, once at
// construction, into the all-reduce calls that carry their gradients, and
// the order those calls launch in. Internal (src/torch).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace diststrat::libtorch::ddp_detail {

struct BucketPlan {
  std::vector<std::vector<size_t>> buckets;     // parameter indices, launch order
  std::vector<size_t> bucket_of;                // parameter index -> bucket
  std::vector<std::vector<std::string>> names;  // per bucket, as all-reduced
};

// Parameters `names` (requires_grad, named_parameters() order) of `sizes`
// bytes each, in buckets: reverse registration order (the order backprop
// produces gradients, as c10d's reducer assumes before it has seen a step),
// consecutive parameters up to `bytes_per_bucket` bytes (0 = one bucket; a
// larger parameter gets one of its own). Every replica of the job computes
// the same plan, so every launch order below matches. The last bucket also
// carries the step flags (ddp_replica.h), named "ddp/step_flags".
BucketPlan plan_buckets(const std::vector<std::string>& names, const std::vector<size_t>& sizes,
                        size_t bytes_per_bucket);

}  // namespace diststrat::libtorch::ddp_detail
