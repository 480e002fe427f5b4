#include "diststrat/mirrored.h"

#include "core/device_scope.h"
#include "diststrat/optimizer.h"
#include "mirrored/local_replicas.h"

namespace diststrat {

struct MirroredStrategy::Impl {
  Impl(MirroredStrategy* s, const MirroredOptions& o)
      : replicas(s, o.devices, o.communication, o.device_manager) {}
  LocalReplicas replicas;

  int replica_of(const Device& d) const {
    const auto& devs = replicas.devices();
    for (size_t i = 0; i < devs.size(); ++i) {
      if (devs[i] == d) return static_cast<int>(i);
    }
    throw InvalidArgumentError("device " + d.to_string() + " is not a replica device");
  }
  // A host copy of a (possibly GPU) tensor, from the main thread.
  Tensor to_host(const Tensor& t) const {
    if (t.device().is_cpu()) return t.clone();
    ScopedExec scoped(replicas.scope(replica_of(t.device()), /*with_stream=*/false));
    Tensor host(t.shape(), t.dtype());
    host.copy_from(t);
    return host;
  }
};

namespace {
bool uses_gpu(const MirroredOptions& o) {
  for (const Device& d : o.devices) {
    if (d.is_gpu()) return true;
  }
  return false;
}

MirroredOptions with_default_devices(MirroredOptions o) {
  if (o.devices.empty()) {
    // Every visible GPU, else one CPU device.
    if (!o.device_manager) o.device_manager = std::make_shared<DeviceManager>();
    if (!o.device_manager->list_physical_devices().empty()) {
      for (const LogicalDeviceInfo& l : o.device_manager->list_logical_devices()) {
        o.devices.push_back(l.device);
      }
    }
    if (o.devices.empty()) o.devices = {Device::cpu(0)};
  }
  validate_devices(o.devices, "MirroredStrategy");
  if (uses_gpu(o)) {
    if (!o.device_manager) o.device_manager = std::make_shared<DeviceManager>();
  } else {
    o.device_manager = nullptr;  // CPU replicas take no GPU (and no lease)
  }
  return o;
}
}  // namespace

MirroredStrategy::MirroredStrategy(MirroredOptions options)
    : Strategy(options.log_level, "[mirrored]") {
  if (options.log_device_placement) placement_.set_enabled(true);
  if (const char* env = std::getenv("DISTSTRAT_LOG_DEVICE_PLACEMENT"); env && *env) {
    placement_.set_enabled(std::string(env) != "0");
  }
  options = with_default_devices(std::move(options));
  impl_ = std::make_unique<Impl>(this, options);
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
  // whatever the initializer. Integer variables (step counters) stay in host
  // memory on GPU replicas, as TensorFlow keeps int32 on the host.
  Tensor initial(var.shape, var.dtype);
  init(initial);
  const bool host_only = !dtype_is_floating(var.dtype);
  for (size_t i = 0; i < devices().size(); ++i) {
    const Device d = host_only ? Device::cpu(static_cast<int>(i)) : devices()[i];
    ScopedExec scoped(impl_->replicas.scope(static_cast<int>(i), /*with_stream=*/false));
    Tensor t(var.shape, var.dtype, d);
    t.copy_from(initial);
    var.copies.push_back(t);
  }
}

void MirroredStrategy::apply_gradients(ReplicaContext& ctx, Optimizer& optimizer,
                                       const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) {
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
  for (size_t k = 0; k < grads.size(); ++k) {
    Variable::Impl& var = grads_and_vars[k].second.impl();
    std::vector<Tensor*> slots;
    for (const std::string& s : slot_names) slots.push_back(&var.slot(s)[local]);
    optimizer.update_tensor(var.copies[local], grads[k], slots, step);
  }
  iterations.data<int64_t>()[0] = step;
}

void MirroredStrategy::update(Variable& var, const std::function<void(Tensor&)>& fn) {
  std::vector<Tensor>& copies = var.impl().copies;
  for (size_t i = 0; i < copies.size(); ++i) {
    ScopedExec scoped(impl_->replicas.scope(static_cast<int>(i), /*with_stream=*/false));
    fn(copies[i]);
  }
}

Tensor MirroredStrategy::variable_value(const Variable::Impl& var) const {
  if (var.copies.empty() || var.copies[0].device().is_cpu()) return Strategy::variable_value(var);
  if (var.options.synchronization == VariableSynchronization::kOnRead &&
      var.options.aggregation != VariableAggregation::kNone &&
      var.options.aggregation != VariableAggregation::kOnlyFirstReplica) {
    return const_cast<MirroredStrategy*>(this)->reduce_tensors_across(
        var.options.aggregation == VariableAggregation::kSum ? ReduceOp::kSum : ReduceOp::kMean,
        var.copies);
  }
  return impl_->to_host(var.copies[0]);
}

void MirroredStrategy::assign_variable(Variable::Impl& var, const Tensor& value) {
  DISTSTRAT_CHECK(value.shape() == var.shape && value.dtype() == var.dtype, kInvalidArgument,
                  "assign to variable '", var.name, "' ", dtype_name(var.dtype),
                  var.shape.to_string(), " from ", value.debug_string());
  for (size_t i = 0; i < var.copies.size(); ++i) {
    ScopedExec scoped(impl_->replicas.scope(static_cast<int>(i), /*with_stream=*/false));
    var.copies[i].copy_from(value);
  }
}

Tensor MirroredStrategy::reduce_tensors_across(ReduceOp op, const std::vector<Tensor>& local) {
  std::vector<Tensor> host;
  for (const Tensor& t : local) host.push_back(t.device().is_gpu() ? impl_->to_host(t) : t);
  return Strategy::reduce_tensors_across(op, host);
}

Tensor MirroredStrategy::gather_across(const std::vector<Tensor>& local) {
  std::vector<Tensor> host;
  for (const Tensor& t : local) host.push_back(t.device().is_gpu() ? impl_->to_host(t) : t);
  return Strategy::gather_across(host);
}

}  // namespace diststrat
