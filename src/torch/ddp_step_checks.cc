// What DistributedDataParallel::backward checks once the step flags are
// reduced (their layout: Replica::unused_flags, ddp_replica.h). The sums are
// the same on every replica, so is the error: gradients from outside
// ddp.backward, replicas in different steps or with rows that do not add
// up, parameters that got no gradient.
#include <string>

#include "diststrat/torch.h"

#include "ddp_replica.h"

namespace diststrat::libtorch {

// After the reduction of the step flags: no replica may hold gradients that
// were accumulated outside ddp.backward (they were in the sum, unmatched on
// the others, or applied by an optimizer step on that replica alone).
void DistributedDataParallel::check_no_stray(ReplicaContext& ctx, Replica& r) const {
  const float* f = r.unused_flags.data<float>() + names_.size();
  const auto count = static_cast<int64_t>(f[6]);
  if (count == 0) return;
  std::string where = count == 1 ? "replica " + std::to_string(static_cast<int64_t>(f[7]) - 1)
                                 : std::to_string(count) + " replicas";
  if (r.stray_sent) where += " (this one: " + r.stray_report + ")";
  r.stray_sent = false;
  throw_error(ErrorCode::kFailedPrecondition,
              "DistributedDataParallel::backward (replica " + std::to_string(ctx.replica_id()) +
                  " of " + std::to_string(ctx.num_replicas_in_sync()) +
                  "): gradients were accumulated outside ddp.backward on " + where +
                  " since the last synchronization (a plain loss.backward()?); they were never "
                  "synchronized, so the replicas' gradients, and the parameters of any optimizer "
                  "step taken with them, differ; call ddp.backward(ctx, loss, rows, global_rows) "
                  "instead of loss.backward() (torch::autograd::grad is fine; freeze a DDP "
                  "module that another loss passes through with requires_grad_(false))");
}

// After the reduction of the step flags: the replicas must have synchronized
// the same step (as many backward() calls, in as many micro-batches) and
// their rows must add up to the global_rows every one of them passed, or the
// sums just applied pair or scale gradients wrongly. A difference shows in
// the sums on every replica alike (the same error everywhere); a deviation
// that cancels in the sums is still caught by the replicas that deviate.
void DistributedDataParallel::check_same_step(ReplicaContext& ctx, const Replica& r) const {
  const float* f = r.unused_flags.data<float>() + names_.size();
  const int64_t n = ctx.num_replicas_in_sync();
  const auto sum = [&](size_t i) { return static_cast<int64_t>(f[i]); };
  const std::string who = "DistributedDataParallel::backward (replica " +
                          std::to_string(ctx.replica_id()) + " of " + std::to_string(n) + "): ";
  const int64_t index = r.sync_index % ddp_detail::kSyncIndexModulus;
  if (sum(3) != n * r.window_batches || sum(4) != n * index) {
    throw_error(ErrorCode::kInvalidArgument,
                who + "the replicas are not in the same step: this replica synchronizes " +
                    std::to_string(r.window_batches) +
                    " micro-batch(es) as its synchronizing backward() #" +
                    std::to_string(r.sync_index) + " in this run(), but over all " +
                    std::to_string(n) + " replicas the micro-batch counts sum to " +
                    std::to_string(sum(3)) + " and the indices to " + std::to_string(sum(4)) +
                    " (expected " + std::to_string(n * r.window_batches) + " and " +
                    std::to_string(n * index) +
                    "); every replica must call backward() as often in each run(), and "
                    "no_sync() on all replicas or none");
  }
  if (sum(1) != r.window_global_rows || sum(2) != n * r.window_global_rows) {
    // Say who passed what and what everyone should pass: the rows of all
    // replicas add up to sum(1), so that is every replica's global_rows.
    const int64_t want = sum(1);
    const std::string others =
        sum(2) == n * r.window_global_rows
            ? "every replica passed global_rows " + std::to_string(r.window_global_rows)
            : "the replicas passed different global_rows (they add up to " +
                  std::to_string(sum(2)) + ", not " + std::to_string(n) + " x " +
                  std::to_string(r.window_global_rows) + ")";
    throw_error(ErrorCode::kInvalidArgument,
                who + "this replica passed rows " + std::to_string(r.window_rows) +
                    " and global_rows " + std::to_string(r.window_global_rows) + "; " + others +
                    ", but the rows of all " + std::to_string(n) + " replicas add up to " +
                    std::to_string(want) + ": every replica must pass global_rows " +
                    std::to_string(want) +
                    " (the sum of all replicas' rows, DistributedBatch::global_size())");
  }
}

void ddp_detail::check_all_used(ReplicaContext& ctx, const std::vector<std::string>& names,
                                const DistributedDataParallel::Replica& r) {
  const float* f = r.unused_flags.data<float>();
  std::string which;
  int listed = 0;
  for (size_t k = 0; k < names.size(); ++k) {
    if (f[k] == 0.0f) continue;
    if (listed < 8) {
      which += (listed ? ", '" : "'") + names[k] + "' (on " +
               std::to_string(static_cast<int64_t>(f[k])) + " of " +
               std::to_string(ctx.num_replicas_in_sync()) + " replicas" +
               (r.got_grad[k] ? "" : ", this one included") + ")";
    }
    ++listed;
  }
  if (listed > 0) {
    if (listed > 8) which += " and " + std::to_string(listed - 8) + " more";
    throw_error(ErrorCode::kInvalidArgument,
                "DistributedDataParallel::backward (replica " + std::to_string(ctx.replica_id()) +
                    "): parameter(s) " + which +
                    " got no gradient in this step (not part of the loss); set "
                    "DdpOptions::find_unused_parameters = true to count them as zero");
  }
}

}  // namespace diststrat::libtorch
