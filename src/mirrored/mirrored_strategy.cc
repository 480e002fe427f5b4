#include "runtime/variable_impl.h"
#include "diststrat/mirrored.h"

#include "core/device_scope.h"
#include "core/step_capture.h"
#include "core/env.h"
#include "core/user_text.h"
#include "diststrat/optimizer.h"
#include "nn/nn_kernels.h"
#include "runtime/determinism.h"
#include "runtime/local_replicas.h"

namespace diststrat {

struct MirroredStrategy::Impl {
  Impl(MirroredStrategy* s, const MirroredOptions& o)
      : replicas(s, o.devices, o.communication, o.device_manager),
        shard_optimizer_state(o.shard_optimizer_state) {}
  LocalReplicas replicas;
  bool shard_optimizer_state;
};

namespace {
MirroredOptions with_default_devices(MirroredOptions o) {
  resolve_replica_devices(o.devices, o.device_manager, "MirroredStrategy");
  return o;
}
}  // namespace

MirroredStrategy::MirroredStrategy(MirroredOptions options)
    : Strategy(options.log_level, "[mirrored]") {
  if (options.log_device_placement) placement_.set_enabled(true);
  if (auto env = env::flag("DISTSTRAT_LOG_DEVICE_PLACEMENT")) placement_.set_enabled(*env);
  options = with_default_devices(std::move(options));
  check_determinism_options(options.determinism, options.communication, "MirroredStrategy");
  impl_ = std::make_unique<Impl>(this, options);
  enable_determinism(options.determinism, "MirroredStrategy");
  if (options.determinism.enabled()) nn::pin_gemm_blocking();
  logger_.info("MirroredStrategy on ", options.devices.size(), " device(s)");
}

MirroredStrategy::MirroredStrategy(std::vector<Device> devices)
    : MirroredStrategy([&] {
        MirroredOptions o;
        o.devices = std::move(devices);
        return o;
      }()) {}

MirroredStrategy::~MirroredStrategy() = default;

int MirroredStrategy::num_replicas_in_sync() const { return impl_->replicas.size(); }
const std::vector<Device>& MirroredStrategy::devices() const { return impl_->replicas.devices(); }
std::shared_ptr<DeviceManager> MirroredStrategy::device_manager() const {
  return impl_->replicas.gpus();
}

void MirroredStrategy::run_replicas(const std::function<void(ReplicaContext&)>& fn) {
  impl_->replicas.run(fn);
}

void MirroredStrategy::place_variable(Variable::Impl& var, const Initializer& init) {
  // Initialize once on the host and copy, so the copies are identical
  // whatever the initializer.
  Tensor initial(var.shape, var.dtype);
  init(initial);
  impl_->replicas.place_copies(var, initial);
}

void MirroredStrategy::apply_gradients(
    ReplicaContext& ctx, Optimizer& optimizer,
    const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) {
  if (impl_->shard_optimizer_state) {
    refuse_in_capture("apply_gradients with shard_optimizer_state (ZeRO-1's collectives)");
    // ZeRO-1 over the in-process group: reduce-scatter, update the block,
    // all-gather (Optimizer::apply_sharded).
    // (In determinism mode the gradients are summed already: SummedContext.)
    auto* local_ctx = dynamic_cast<LocalReplicaContext*>(&unwrap_summed(ctx));
    DISTSTRAT_CHECK(local_ctx != nullptr, kInternal, "MirroredStrategy: foreign replica context");
    // GPU replicas: the device communicator (NCCL or the shared-device
    // kernel) on the replicas' device buffers.
    Communicator* device_comm = local_ctx->device_comm();
    Communicator& comm = device_comm ? *device_comm : local_ctx->local_comm();
    ShardedCollectives c;
    c.reduce_scatter = [&](const Tensor& in, Tensor& out) {
      comm.reduce_scatter(in.data(), out.data(), static_cast<size_t>(out.num_elements()),
                          DType::kFloat32, ReduceOp::kSum, "sharded gradients");
    };
    c.all_gather = [&](const Tensor& in, Tensor& out) {
      comm.all_gather(in.data(), out.data(), static_cast<size_t>(in.num_elements()),
                      DType::kFloat32, "sharded variables");
    };
    c.sum = [&](double v) {
      if (!device_comm) {
        comm.all_reduce(&v, &v, 1, DType::kFloat64, ReduceOp::kSum, "sharded gradient norm");
        return v;
      }
      // A device communicator reduces device memory only.
      Tensor host(Shape{1}, DType::kFloat64);
      host.data<double>()[0] = v;
      Tensor dev(Shape{1}, DType::kFloat64, ctx.device());
      dev.copy_from(host);
      comm.all_reduce(dev.data(), dev.data(), 1, DType::kFloat64, ReduceOp::kSum,
                      "sharded gradient norm");
      host.copy_from(dev);
      return host.data<double>()[0];
    };
    optimizer.apply_sharded(ctx, grads_and_vars, c);
    return;
  }
  std::vector<Tensor> grads;
  std::vector<std::string> names;
  for (const auto& [g, v] : grads_and_vars) {
    grads.push_back(g);
    names.push_back(v.name() + "/grad");
  }
  ctx.all_reduce(ReduceOp::kSum, grads, names);
  // Every replica applies the same update to its own copies (and slots), so
  // the copies stay bit-identical without further communication.
  Tensor iterations = optimizer.iterations().read(ctx);
  const int64_t step = iterations.data<int64_t>()[0] + 1;
  const std::vector<std::string> slot_names = optimizer.slot_names();
  const size_t local = static_cast<size_t>(ctx.local_replica_id());
  std::vector<Optimizer::TensorUpdate> updates;  // one launch on a GPU replica
  for (size_t k = 0; k < grads.size(); ++k) {
    Variable::Impl& var = grads_and_vars[k].second.impl();
    Optimizer::TensorUpdate u{&var.copies[local], grads[k], {}};
    for (const std::string& s : slot_names) u.slots.push_back(&var.slot(s)[local]);
    updates.push_back(std::move(u));
  }
  optimizer.update_tensors(updates, step, &iterations);
  iterations.data<int64_t>()[0] = step;
  const ExecScope* scope = current_exec_scope();
  if (scope && scope->capture && scope->capture->active()) {
    // A captured step's replays count their steps as this one did.
    scope->capture->on_replay([iterations]() mutable { ++iterations.data<int64_t>()[0]; });
  }
}

void MirroredStrategy::update(Variable& var, const std::function<void(Tensor&)>& fn) {
  impl_->replicas.for_each_copy(var.impl().copies, fn);
}

Tensor MirroredStrategy::variable_value(const Variable::Impl& var) const {
  if (var.copies.empty() || var.copies[0].device().is_cpu() ||
      var.options.synchronization == VariableSynchronization::kOnRead) {
    return Strategy::variable_value(var);  // the reductions stage GPU copies
  }
  return impl_->replicas.to_host(var.copies[0]);
}

void MirroredStrategy::assign_variable(Variable::Impl& var, const Tensor& value) {
  DISTSTRAT_CHECK(value.shape() == var.shape && value.dtype() == var.dtype, kInvalidArgument,
                  "assign to variable '", echo(var.name), "' ", dtype_name(var.dtype),
                  var.shape.to_string(), " from ", value.debug_string());
  impl_->replicas.for_each_copy(var.copies, [&](Tensor& c) { c.copy_from(value); });
}

Tensor MirroredStrategy::reduce_tensors_across(ReduceOp op, const std::vector<Tensor>& local) {
  return Strategy::reduce_tensors_across(op, impl_->replicas.to_host(local));
}

Tensor MirroredStrategy::gather_across(const std::vector<Tensor>& local) {
  return Strategy::gather_across(impl_->replicas.to_host(local));
}

}  // namespace diststrat
