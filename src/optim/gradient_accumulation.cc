// Gradient accumulation (Optimizer::set_accumulation_steps): the first k - 1
// micro-batches of an update add their gradients to this replica's sums (host
// gradients here, GPU ones by one launch in device_training.cc); the k-th
// hands the sums to the reduction and update. Nothing is communicated before
// the k-th.
#include <mutex>

#include "runtime/variable_impl.h"
#include "core/user_text.h"
#include "optim/device_training.h"
#include "optim/optimizer_state.h"

namespace diststrat {

ApplyResult Optimizer::accumulate_micro_batch(
    ReplicaContext& ctx, const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) {
  Accumulator::Sums* sums;
  {
    std::lock_guard<std::mutex> lock(accumulator_->mu);
    sums = &accumulator_->replicas[ctx.local_replica_id()];
  }
  auto& acc = sums->grads_and_vars;
  if (sums->count == 0) {
    acc.clear();
    for (const auto& [g, v] : grads_and_vars)
      acc.emplace_back(g.device().is_cpu() ? g.clone() : Tensor(), v);
    accumulate_on_device(acc, grads_and_vars, /*first=*/true);
  } else {
    DISTSTRAT_CHECK(acc.size() == grads_and_vars.size(), kInvalidArgument,
                    "apply_gradients: replica ", ctx.replica_id(), " passed ",
                    grads_and_vars.size(), " gradients in micro-batch ", sums->count + 1, " of ",
                    accumulation_steps_, ", the first had ", acc.size());
    for (size_t k = 0; k < acc.size(); ++k) {
      const auto& [g, v] = grads_and_vars[k];
      DISTSTRAT_CHECK(v.impl_ptr() == acc[k].second.impl_ptr(), kInvalidArgument,
                      "apply_gradients: replica ", ctx.replica_id(), " passed variable '",
                      echo(v.name()), "' at position ", k, " of micro-batch ", sums->count + 1,
                      " where the first had '", echo(acc[k].second.name()), "'");
      const Device& first_device = acc[k].first.device();
      DISTSTRAT_CHECK(g.device().is_cpu() ? first_device.is_cpu() : g.device() == first_device,
                      kInvalidArgument, "apply_gradients: replica ", ctx.replica_id(),
                      " passed gradient ", g.debug_string(), " of '", echo(v.name()),
                      "' in micro-batch ", sums->count + 1, " where the first was on ",
                      acc[k].first.device().to_string());
      if (g.device().is_gpu()) continue;  // below, one launch for all
      float* dst = acc[k].first.data<float>();
      const float* src = g.data<float>();
      for (int64_t i = 0, n = g.num_elements(); i < n; ++i) dst[i] += src[i];
    }
    accumulate_on_device(acc, grads_and_vars, /*first=*/false);
  }
  ApplyResult result;
  if (++sums->count < accumulation_steps_) {
    result.applied = false;
    return result;
  }
  std::vector<std::pair<Tensor, Variable>> total = std::move(acc);
  acc.clear();
  sums->count = 0;
  return reduce_and_update(ctx, total);
}

void Optimizer::set_accumulation_steps(int k) {
  DISTSTRAT_CHECK(k >= 1, kInvalidArgument, name(), ": accumulation_steps ", k, " must be >= 1");
  std::lock_guard<std::mutex> lock(accumulator_->mu);
  for (const auto& [replica, sums] : accumulator_->replicas) {
    DISTSTRAT_CHECK(sums.count == 0, kFailedPrecondition, name(), ": set_accumulation_steps(", k,
                    ") while local replica ", replica, " has ", sums.count,
                    " micro-batches pending");
  }
  accumulation_steps_ = k;
  configuration_changed();
}

}  // namespace diststrat
