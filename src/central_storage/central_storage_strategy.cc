// CentralStorageStrategy. Variables have one copy (Variable::Impl::copies has
// exactly one tensor), which every replica reads. apply_gradients is a
// reduce-to-one: each replica publishes its gradient tensors, then inside
// merge_call local replica 0 sums them into one buffer per variable and
// applies the optimizer once to the single copy (and its single set of slots),
// bumping the single step counter once. Sync-on-read variables (metrics,
// which are not trainable) are the exception: one copy per replica, as under
// MirroredStrategy, aggregated when read. With GPU compute replicas the
// variables stay on the host: reads copy them to the replica's device,
// gradients come back to the host before the reduce-to-one.

#include "runtime/variable_impl.h"
#include "diststrat/central_storage.h"

#include <mutex>

#include "allreduce/reduce_kernels.h"
#include "core/user_text.h"
#include "diststrat/optimizer.h"
#include "nn/nn_kernels.h"
#include "runtime/determinism.h"
#include "runtime/local_replicas.h"

namespace diststrat {

struct CentralStorageStrategy::Impl {
  Impl(CentralStorageStrategy* s, const CentralStorageOptions& o)
      : parameter_device(o.parameter_device),
        replicas(s, o.devices, o.communication, o.device_manager),
        pending(o.devices.size()) {}
  Device parameter_device;
  LocalReplicas replicas;
  // Gradients each local replica hands to the merge step, indexed by local
  // replica. Written by replica i before merge_call's entry barrier, read by
  // replica 0 inside it: the barrier orders the two.
  std::vector<std::vector<std::pair<Tensor, Variable>>> pending;
};

namespace {
CentralStorageOptions checked(CentralStorageOptions o) {
  resolve_replica_devices(o.devices, o.device_manager, "CentralStorageStrategy");
  DISTSTRAT_CHECK(o.parameter_device.is_cpu(), kUnimplemented,
                  "CentralStorageStrategy: parameter device ", o.parameter_device.to_string(),
                  ": variables on a GPU are not implemented; keep them in host memory "
                  "(the default) and compute on GPUs");
  return o;
}
}  // namespace

CentralStorageStrategy::CentralStorageStrategy(CentralStorageOptions options)
    : Strategy(options.log_level, "[central_storage]") {
  options = checked(std::move(options));
  check_determinism_options(options.determinism, options.communication, "CentralStorageStrategy");
  impl_ = std::make_unique<Impl>(this, options);
  enable_determinism(options.determinism, "CentralStorageStrategy");
  if (options.determinism.enabled()) nn::pin_gemm_blocking();
  logger_.info("CentralStorageStrategy: ", options.devices.size(),
               " compute replica(s), variables on ", options.parameter_device.to_string());
}

CentralStorageStrategy::CentralStorageStrategy(std::vector<Device> devices)
    : CentralStorageStrategy([&] {
        CentralStorageOptions o;
        o.devices = std::move(devices);
        return o;
      }()) {}

CentralStorageStrategy::~CentralStorageStrategy() = default;

int CentralStorageStrategy::num_replicas_in_sync() const { return impl_->replicas.size(); }
const std::vector<Device>& CentralStorageStrategy::devices() const {
  return impl_->replicas.devices();
}
const Device& CentralStorageStrategy::parameter_device() const { return impl_->parameter_device; }

void CentralStorageStrategy::run_replicas(const std::function<void(ReplicaContext&)>& fn) {
  impl_->replicas.run(fn);
}

std::shared_ptr<DeviceManager> CentralStorageStrategy::device_manager() const {
  return impl_->replicas.gpus();
}

Tensor CentralStorageStrategy::read_variable(const Variable::Impl& var,
                                             const ReplicaContext& ctx) const {
  if (var.options.synchronization == VariableSynchronization::kOnRead) {
    return var.copies.at(static_cast<size_t>(ctx.local_replica_id()));
  }
  return read_on_replica_device(var.copies.at(0), ctx.device());
}

void CentralStorageStrategy::update(Variable& var, const std::function<void(Tensor&)>& fn) {
  impl_->replicas.for_each_copy(var.impl().copies, fn);
}

void CentralStorageStrategy::assign_variable(Variable::Impl& var, const Tensor& value) {
  DISTSTRAT_CHECK(value.shape() == var.shape && value.dtype() == var.dtype, kInvalidArgument,
                  "assign to variable '", echo(var.name), "' ", dtype_name(var.dtype),
                  var.shape.to_string(), " from ", value.debug_string());
  impl_->replicas.for_each_copy(var.copies, [&](Tensor& c) { c.copy_from(value); });
}

Tensor CentralStorageStrategy::reduce_tensors_across(ReduceOp op,
                                                     const std::vector<Tensor>& local) {
  return Strategy::reduce_tensors_across(op, impl_->replicas.to_host(local));
}

Tensor CentralStorageStrategy::gather_across(const std::vector<Tensor>& local) {
  return Strategy::gather_across(impl_->replicas.to_host(local));
}

void CentralStorageStrategy::place_variable(Variable::Impl& var, const Initializer& init) {
  if (var.options.synchronization == VariableSynchronization::kOnRead) {
    // Per-replica state (metrics, statistics): each replica writes its own
    // copy, on its own device, and value() aggregates them.
    Tensor initial(var.shape, var.dtype);
    init(initial);
    impl_->replicas.place_copies(var, initial);
    return;
  }
  var.copies.emplace_back(var.shape, var.dtype, impl_->parameter_device);
  init(var.copies[0]);
}

void CentralStorageStrategy::apply_gradients(
    ReplicaContext& ctx, Optimizer& optimizer,
    const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) {
  const int local = ctx.local_replica_id();
  // GPU gradients come to host memory (on this replica's stream) for the
  // reduce-to-one; the update runs on the host copy.
  std::vector<std::pair<Tensor, Variable>> mine = grads_and_vars;
  for (auto& gv : mine) stage_to_host(gv.first);
  impl_->pending[local] = std::move(mine);
  ctx.merge_call([&](Strategy&) {
    auto& pending = impl_->pending;
    const size_t n = grads_and_vars.size();
    for (size_t r = 0; r < pending.size(); ++r) {
      DISTSTRAT_CHECK(pending[r].size() == n, kInvalidArgument,
                      "CentralStorageStrategy::apply_gradients: replica ", r, " passed ",
                      pending[r].size(), " gradients but replica 0 passed ", n);
      for (size_t k = 0; k < n; ++k) {
        DISTSTRAT_CHECK(pending[r][k].second.impl_ptr() == grads_and_vars[k].second.impl_ptr(),
                        kInvalidArgument, "CentralStorageStrategy::apply_gradients: replica ", r,
                        " passed variable '", echo(pending[r][k].second.name()), "' at position ",
                        k, " where replica 0 passed '", echo(grads_and_vars[k].second.name()), "'");
      }
    }
    Tensor iterations = optimizer.iterations().impl().copies[0];
    const int64_t step = iterations.data<int64_t>()[0] + 1;
    const std::vector<std::string> slot_names = optimizer.slot_names();
    std::vector<const void*> srcs(pending.size());
    for (size_t k = 0; k < n; ++k) {
      Variable::Impl& var = grads_and_vars[k].second.impl();
      // Reduce to one: the sum of every replica's gradient, into one buffer.
      Tensor sum(var.shape, var.dtype, impl_->parameter_device);
      for (size_t r = 0; r < pending.size(); ++r) srcs[r] = pending[r][k].first.data();
      kernels::reduce(sum.data(), srcs.data(), static_cast<int>(srcs.size()),
                      static_cast<size_t>(sum.num_elements()), sum.dtype(), ReduceOp::kSum, 1);
      std::vector<Tensor*> slots;
      for (const std::string& s : slot_names) slots.push_back(&var.slot(s)[0]);
      optimizer.update_tensor(var.copies[0], sum, slots, step);
    }
    iterations.data<int64_t>()[0] = step;
    for (auto& p : pending) p.clear();
  });
}

}  // namespace diststrat
