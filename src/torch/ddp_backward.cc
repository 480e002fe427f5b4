// DistributedDataParallel::backward: one (micro-)batch's autograd pass,
// seeded with this replica's share of the mean; outside no_sync() also the
// synchronization of the accumulation window: the buckets the hooks did not
// launch, the wait for every one, the .grads from before the window put
// back, and the checks of the reduced step flags (steps 2.-4. in ddp.cc).
#include <algorithm>
#include <exception>
#include <mutex>

#include "diststrat/torch.h"

#include "ddp_module_sync.h"
#include "ddp_replica.h"
#include "intra_op_threads.h"
#include "torch_compat.h"

namespace diststrat::libtorch {

void DistributedDataParallel::backward(ReplicaContext& ctx, const at::Tensor& loss, int64_t rows,
                                       int64_t global_rows) {
  const int local = ctx.local_replica_id();
  DISTSTRAT_CHECK(&ctx.strategy() == strategy_ && local >= 0 && local < num_local_replicas(),
                  kInvalidArgument,
                  "DistributedDataParallel::backward: the replica context is not "
                  "one of this model's strategy");
  // Every replica of every worker reaches this check alike: no peer waits.
  DISTSTRAT_CHECK(!elastic_ || elastic_tracked_, kFailedPrecondition,
                  "DistributedDataParallel::backward (replica ", ctx.replica_id(),
                  "): the strategy is elastic, but no TrainingState of this model is tracked by "
                  "the ElasticState (TrainingState::track(state)): the module and its optimizer "
                  "would be neither committed nor sent to joining workers, and the replicas would "
                  "diverge without a word (docs/torch.md, \"Elastic training\")");
  // Bad rows fail this replica's pass like a bad loss: its buckets still go
  // (zeros, failure flag), so no peer waits for them.
  std::exception_ptr argument_error;
  if (rows < 0 || global_rows < rows) {
    try {
      throw_error(ErrorCode::kInvalidArgument,
                  "DistributedDataParallel::backward (replica " + std::to_string(ctx.replica_id()) +
                      "): rows " + std::to_string(rows) + " and global_rows " +
                      std::to_string(global_rows) + " (0 <= rows <= global_rows expected)");
    } catch (...) {
      argument_error = std::current_exception();
    }
    rows = 0;
    global_rows = std::max<int64_t>(global_rows, 0);
  }
  if (num_local_replicas() > 1) single_intra_op_thread();
  Replica& r = *state_[static_cast<size_t>(local)];
  // A module changed since construction fails this replica's pass like a
  // bad loss (its buckets still go).
  if (!argument_error) {
    const std::string changed = module_change(r);
    if (!changed.empty()) {
      try {
        throw_error(ErrorCode::kFailedPrecondition,
                    "DistributedDataParallel::backward (replica " +
                        std::to_string(ctx.replica_id()) + "): the module of local replica " +
                        std::to_string(local) +
                        " changed after DistributedDataParallel was constructed: " + changed +
                        "; DDP's hooks are on the parameters it had, so these gradients would "
                        "never be synchronized; construct DistributedDataParallel after the "
                        "module's last change");
      } catch (...) {
        argument_error = std::current_exception();
      }
    }
  }
  if (r.window_batches == 0) {
    // The window begins: the .grads already there (kept by the user, or
    // zeroed by LibTorch's zero_grad()) step aside, so that the buckets
    // carry this window's gradients only and a hook sees whether this
    // window produced one.
    for (size_t k = 0; k < r.params.size(); ++k) {
      r.stash[k] = r.params[k].grad();
      if (r.stash[k].defined()) r.params[k].mutable_grad() = at::Tensor();
    }
    r.window_ran_pass = false;
  }
  // A window of one micro-batch (no no_sync before it) seeds backward with
  // rows / global_rows directly, so the hooks need not rescale; otherwise the
  // micro-batches seed `rows` and the synchronizing pass divides the sums by
  // the window's global rows.
  const bool single = !r.in_no_sync && r.window_global_rows == 0;
  r.window_global_rows += global_rows;
  r.window_rows += rows;
  ++r.window_batches;
  const double seed =
      single
          ? (global_rows > 0 ? static_cast<double>(rows) / static_cast<double>(global_rows) : 0.0)
          : static_cast<double>(rows);
  const bool sync = !r.in_no_sync;
  if (sync) {
    r.syncing = true;
    r.ctx = &ctx;
    r.scale = single ? 1.0f
              : r.window_global_rows > 0
                  ? static_cast<float>(1.0 / static_cast<double>(r.window_global_rows))
                  : 0.0f;
    std::fill(r.ready.begin(), r.ready.end(), 0);
    r.pending.assign(buckets_.size(), 0);
    for (size_t b = 0; b < buckets_.size(); ++b)
      r.pending[b] = static_cast<int>(buckets_[b].size());
    r.next_bucket = 0;
    r.works.clear();
    r.launch_error = nullptr;
    r.failed = false;
    const int64_t run = strategy_->steps_run();
    if (run != r.run_seen) {
      r.run_seen = run;
      r.sync_index = 0;
    }
    ++r.sync_index;
  }
  // Leaves the replica's step state clean whatever happens.
  struct Reset {
    Replica& r;
    bool sync;
    ~Reset() {
      if (!sync) return;
      r.syncing = false;
      r.ctx = nullptr;
      r.works.clear();
      r.window_global_rows = 0;
      r.window_rows = 0;
      r.window_batches = 0;
      r.window_ran_pass = false;
      std::fill(r.got_grad.begin(), r.got_grad.end(), 0);
    }
  } reset{r, sync};

  std::exception_ptr backward_error = argument_error;
  if (argument_error) {
    // Nothing to differentiate; the failure flag goes with the buckets.
  } else if (rows > 0) {
    // A bad loss or a failing autograd pass still launches every bucket
    // below (so no peer waits for them), then throws.
    try {
      DISTSTRAT_CHECK(
          loss.defined() && loss.numel() == 1, kInvalidArgument,
          "DistributedDataParallel::backward (replica ", ctx.replica_id(),
          "): the loss must be a scalar, got ",
          loss.defined() ? ddp_detail::shape_text(loss) : std::string("an undefined tensor"));
      // The loss is a mean over this replica's rows (see `seed` above).
      struct Active {
        Replica& r;
        ddp_detail::ActivePass saved = ddp_detail::active_pass;
        ~Active() {
          ddp_detail::active_pass = saved;
          r.in_pass = false;
        }
      } active{r};
      ddp_detail::active_pass = {this, local};
      r.in_pass = true;
      r.foreign_parameter.clear();
      r.window_ran_pass = true;
      torch::autograd::backward({loss}, {torch::full_like(loss, seed)});
      DISTSTRAT_CHECK(r.foreign_parameter.empty(), kInvalidArgument,
                      "DistributedDataParallel::backward (replica ", ctx.replica_id(),
                      "): the autograd pass reached ", r.foreign_parameter,
                      ": each replica must run its own module, ddp.module(ctx), not another "
                      "replica's");
    } catch (...) {
      backward_error = std::current_exception();
    }
  }
  // No rows: nothing to differentiate; the replica contributes zeros and is
  // neutral on which parameters were used (window_ran_pass stays false).
  if (!sync) {
    if (backward_error) std::rethrow_exception(backward_error);
    return;
  }
  // The buckets the hooks did not launch, in order. Even after a failed
  // backward: the other replicas wait for these calls (they get zeros and
  // the failure flag; this replica then throws its own error).
  if (backward_error) r.failed = true;  // neutral on "unused" too
  for (size_t b = r.next_bucket; b < buckets_.size(); ++b) {
    for (size_t k : buckets_[b]) r.ready[k] = 1;
    r.pending[b] = 0;
  }
  launch_ready_buckets(r, /*in_hook=*/false);
  std::exception_ptr wait_error;
  // works[b] is bucket b's (launched in order; the first launch error
  // stops the rest). The old .grads of parameters this replica used (so not
  // unused by all) are added back as each bucket completes, while the
  // fusion engine may still be reducing later ones.
  for (size_t b = 0; b < r.works.size(); ++b) {
    try {
      r.works[b].wait();
      // torch's stream reads the reduced gradients after the library wrote them.
      if (r.cuda)
        compat::order_streams(r.device, ctx.stream(), compat::StreamOrder::kLibraryThenTorch);
    } catch (...) {
      if (!wait_error) wait_error = std::current_exception();
    }
    if (!wait_error && !r.launch_error && !r.failed) add_back_used(r, b);
  }
  if (r.cuda && !r.launch_error && !wait_error && r.flags_device.defined() &&
      r.works.size() == buckets_.size()) {
    torch::NoGradGuard no_grad;
    r.unused_flags = to_diststrat(r.flags_device.to(torch::kCPU));  // waits for torch's stream
  }
  if (local == 0) ++r.sync_steps;
  const bool reduced = !r.launch_error && !wait_error;
  finish_window(r, reduced ? r.unused_flags.data<float>() : nullptr);
  if (reduced && r.stray_sent) {
    // Reported below, on every replica: start afresh.
    std::lock_guard<std::mutex> lock(r.stray_mu);
    r.stray_report =
        "parameter '" + r.stray_first + "'" +
        (r.stray_count > 1 ? " and " + std::to_string(r.stray_count - 1) + " more" : std::string());
    std::fill(r.stray.begin(), r.stray.end(), 0);
    r.stray_count = 0;
  }
  if (backward_error) std::rethrow_exception(backward_error);
  if (r.launch_error) std::rethrow_exception(r.launch_error);
  if (wait_error) std::rethrow_exception(wait_error);
  // Before the failure check: replicas that drifted apart matter more than
  // one aborted step.
  check_no_stray(ctx, r);
  const float failed = r.unused_flags.data<float>()[names_.size()];
  if (failed > 0) {
    throw_error(ErrorCode::kAborted,
                "DistributedDataParallel::backward (replica " + std::to_string(ctx.replica_id()) +
                    "): the autograd pass failed on " +
                    std::to_string(static_cast<int64_t>(failed)) + " of " +
                    std::to_string(ctx.num_replicas_in_sync()) +
                    " replicas (see that replica's error); this step's gradients are incomplete");
  }
  check_same_step(ctx, r);
  if (!options_.find_unused_parameters) ddp_detail::check_all_used(ctx, names_, r);
}

// Bucket b has been reduced: a parameter this replica used gets its old
// .grad (from before the window) plus the reduced one, in the old tensor
// (the one the user holds, as autograd's accumulation would).
void DistributedDataParallel::add_back_used(Replica& r, size_t b) {
  torch::NoGradGuard no_grad;
  for (size_t k : buckets_[b]) {
    if (!r.got_grad[k] || !r.stash[k].defined()) continue;
    at::Tensor old = std::move(r.stash[k]);
    r.stash[k] = at::Tensor();
    old.add_(r.params[k].grad());
    r.params[k].mutable_grad() = old;
  }
}

// After the window's reduction: a parameter that no replica used gets back
// the .grad it had before the window (undefined unless the user kept one);
// the others get that old .grad plus the reduced one. `flags` is null when
// the reduction did not complete (then nothing counts as unused).
void DistributedDataParallel::finish_window(Replica& r, const float* flags) {
  torch::NoGradGuard no_grad;
  const size_t P = names_.size();
  for (size_t k = 0; k < P; ++k) {
    at::Tensor& p = r.params[k];
    at::Tensor old = std::move(r.stash[k]);
    r.stash[k] = at::Tensor();
    if (flags != nullptr && flags[k] == flags[P + 5]) {
      p.mutable_grad() = old;
    } else if (old.defined()) {
      // old + reduced, into the tensor the user holds (as autograd would).
      if (p.grad().defined()) old.add_(p.grad());
      p.mutable_grad() = old;
    }
  }
}

}  // namespace diststrat::libtorch
