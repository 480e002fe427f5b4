// DistributedDataParallel's reducer: the post-hook on each parameter's
// gradient accumulator marks the parameter ready and, while the next bucket
// in launch order is complete, launches it: its gradients (rescaled after
// accumulation) go to ReplicaContext::all_reduce_async(kSum) as one call,
// the last bucket with the step flags, while backward continues. A gradient
// that arrives with no pass of this DDP on the thread is recorded as stray.
#include <torch/csrc/autograd/variable.h>

#include <mutex>

#include "diststrat/torch.h"

#include "ddp_replica.h"
#include "torch_compat.h"

namespace diststrat::libtorch {

namespace ddp_detail {
thread_local ActivePass active_pass;
}  // namespace ddp_detail

void DistributedDataParallel::on_gradient_ready(int local, size_t k) {
  if (ddp_detail::active_pass.ddp != this) {
    Replica& own = *state_[static_cast<size_t>(local)];
    if (own.cuda && own.in_pass.load()) {
      // Replica `local`'s CUDA pass, on autograd's device thread (its
      // backward() waits for it): mark only. The buckets launch after the
      // pass, on the replica's thread, where its device scope and stream
      // are (no overlap of communication with a CUDA backward).
      if (own.params[k].grad().defined()) own.got_grad[k] = 1;
      if (own.syncing && !own.ready[k]) {
        own.ready[k] = 1;
        --own.pending[bucket_of_[k]];
      }
      return;
    }
    record_stray(local, k);
    return;
  }
  if (ddp_detail::active_pass.local != local) {
    // Replica `active_pass.local` ran replica `local`'s module: leave that
    // replica's step alone (it runs on its own thread), fail this one.
    Replica& caller = *state_[static_cast<size_t>(ddp_detail::active_pass.local)];
    if (caller.foreign_parameter.empty())
      caller.foreign_parameter =
          "local replica " + std::to_string(local) + "'s parameter '" + names_[k] + "'";
    return;
  }
  Replica& r = *state_[static_cast<size_t>(local)];
  // As c10d's reducer: a hook that fires with an undefined gradient (the
  // parameter's outputs got none) leaves the parameter unused. The .grad
  // from before the window is set aside, so defined means "got one now".
  if (r.params[k].grad().defined()) r.got_grad[k] = 1;
  if (!r.syncing || r.ready[k]) return;
  r.ready[k] = 1;
  --r.pending[bucket_of_[k]];
  if (options_.overlap) launch_ready_buckets(r, /*in_hook=*/true);
}

// A gradient accumulated into local replica `local`'s parameter k with no
// backward() of this DDP running on this thread.
void DistributedDataParallel::record_stray(int local, size_t k) {
  Replica& r = *state_[static_cast<size_t>(local)];
  std::lock_guard<std::mutex> lock(r.stray_mu);
  if (r.stray[k]) {
    // The first one was never reported: no synchronizing backward() came
    // in between (a loop that calls loss.backward() instead). Thrown out of
    // that loss.backward() on every replica that runs such a loop; no
    // collective is involved, so nobody waits.
    throw_error(ErrorCode::kFailedPrecondition,
                "DistributedDataParallel: parameter '" + names_[k] + "' of local replica " +
                    std::to_string(local) +
                    " got a gradient outside ddp.backward again, with no synchronizing "
                    "ddp.backward in between: such gradients are never synchronized, the "
                    "replicas drift apart; call ddp.backward(ctx, loss, rows, global_rows) "
                    "instead of loss.backward() (torch::autograd::grad is fine: it accumulates "
                    "into no .grad)");
  }
  r.stray[k] = 1;
  if (r.stray_count++ == 0) r.stray_first = names_[k];
}

void DistributedDataParallel::launch_ready_buckets(Replica& r, bool in_hook) {
  while (r.next_bucket < buckets_.size() && r.pending[r.next_bucket] == 0) {
    launch_bucket(r, r.next_bucket, in_hook);
    ++r.next_bucket;
  }
}

void DistributedDataParallel::launch_bucket(Replica& r, size_t b, bool in_hook) {
  if (r.launch_error) return;
  try {
    std::vector<Tensor> tensors;
    std::vector<std::string> names;
    {
      torch::NoGradGuard no_grad;
      for (size_t k : buckets_[b]) {
        at::Tensor& p = r.params[k];
        at::Tensor g = p.grad();
        DISTSTRAT_CHECK(
            !g.defined() || g.layout() == c10::kStrided, kInvalidArgument,
            "DistributedDataParallel: the gradient of '", names_[k],
            "' is sparse; sparse gradients are not supported (Embedding: sparse=false)");
        if (!g.defined()) {
          p.mutable_grad() = torch::zeros_like(p, at::MemoryFormat::Contiguous);
        } else if (!g.is_contiguous()) {
          p.mutable_grad() = g.contiguous();
        }
        if (r.scale != 1.0f) p.mutable_grad().mul_(r.scale);
        tensors.push_back(to_diststrat(p.grad()));
      }
    }
    names = bucket_names_[b];
    if (b + 1 == buckets_.size()) {
      const size_t P = names_.size();
      r.unused_flags =
          Tensor(Shape{static_cast<int64_t>(P + ddp_detail::kStepFlags)}, DType::kFloat32);
      float* f = r.unused_flags.data<float>();
      const bool ran = r.window_ran_pass && !r.failed;  // else neutral
      for (size_t k = 0; k < P; ++k) f[k] = ran && !r.got_grad[k] ? 1.0f : 0.0f;
      f[P] = r.failed ? 1.0f : 0.0f;
      f[P + 1] = static_cast<float>(r.window_rows);
      f[P + 2] = static_cast<float>(r.window_global_rows);
      f[P + 3] = static_cast<float>(r.window_batches);
      f[P + 4] = static_cast<float>(r.sync_index % ddp_detail::kSyncIndexModulus);
      f[P + 5] = ran ? 1.0f : 0.0f;
      {
        std::lock_guard<std::mutex> lock(r.stray_mu);
        r.stray_sent = r.stray_count > 0;
      }
      f[P + 6] = r.stray_sent ? 1.0f : 0.0f;
      f[P + 7] = r.stray_sent ? static_cast<float>(r.ctx->replica_id() + 1) : 0.0f;
      if (r.cuda) {
        torch::NoGradGuard no_grad;
        r.flags_device =
            to_torch(r.unused_flags).to(r.device, /*non_blocking=*/false, /*copy=*/true);
        tensors.push_back(to_diststrat(r.flags_device));
      } else {
        tensors.push_back(r.unused_flags);
      }
    }
    // The library's stream reads the gradients after torch's wrote them.
    if (r.cuda)
      compat::order_streams(r.device, r.ctx->stream(), compat::StreamOrder::kTorchThenLibrary);
    r.works.push_back(
        r.ctx->all_reduce_async(ReduceOp::kSum, std::move(tensors), std::move(names)));
    ++r.launched;
    if (in_hook) ++r.in_hook;
  } catch (...) {
    r.launch_error = std::current_exception();
  }
}

}  // namespace diststrat::libtorch
