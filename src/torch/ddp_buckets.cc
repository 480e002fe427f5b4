// DistributedDataParallel's buckets: which parameters' gradients travel
// together in one all-reduce call, in launch order (no torch header: the
// plan is made of names and sizes).
#include "ddp_buckets.h"

#include <utility>

namespace diststrat::libtorch::ddp_detail {

BucketPlan plan_buckets(const std::vector<std::string>& names, const std::vector<size_t>& sizes,
                        size_t bytes_per_bucket) {
  BucketPlan plan;
  std::vector<size_t> bucket;
  size_t bytes = 0;
  for (size_t k = names.size(); k-- > 0;) {
    if (!bucket.empty() && bytes_per_bucket > 0 && bytes + sizes[k] > bytes_per_bucket) {
      plan.buckets.push_back(bucket);
      bucket.clear();
      bytes = 0;
    }
    bucket.push_back(k);
    bytes += sizes[k];
  }
  if (!bucket.empty()) plan.buckets.push_back(bucket);
  plan.bucket_of.resize(names.size());
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    for (size_t k : plan.buckets[b]) plan.bucket_of[k] = b;
  }
  // The names the fusion engine checks across ranks (and quotes in errors).
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    std::vector<std::string> n;
    for (size_t k : plan.buckets[b]) n.push_back("ddp/" + names[k]);
    if (b + 1 == plan.buckets.size()) n.push_back("ddp/step_flags");
    plan.names.push_back(std::move(n));
  }
  return plan;
}

}  // namespace diststrat::libtorch::ddp_detail
