#include "diststrat/mirrored.h"

#include "diststrat/optimizer.h"
#include "mirrored/local_replicas.h"

namespace diststrat {

struct MirroredStrategy::Impl {
  Impl(MirroredStrategy* s, const MirroredOptions& o) : replicas(s, o.devices, o.communication) {}
  LocalReplicas replicas;
};

namespace {
MirroredOptions with_default_devices(MirroredOptions o) {
  // Without a GPU backend, "all visible GPUs" is none: one CPU device.
  if (o.devices.empty()) o.devices = {Device::cpu(0)};
  validate_devices(o.devices, "MirroredStrategy");
  for (const Device& d : o.devices) {
    DISTSTRAT_CHECK(d.is_cpu(), kUnimplemented, "MirroredStrategy: device ", d.to_string(),
                    " needs the GPU backend, which this build does not have");
  }
  return o;
}
}  // namespace

MirroredStrategy::MirroredStrategy(MirroredOptions options)
    : Strategy(options.log_level, "[mirrored]") {
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

void MirroredStrategy::run_replicas(const std::function<void(ReplicaContext&)>& fn) {
  impl_->replicas.run(fn);
}

void MirroredStrategy::place_variable(Variable::Impl& var, const Initializer& init) {
  // Initialize once and copy, so the copies are identical whatever the initializer.
  for (size_t i = 0; i < devices().size(); ++i) var.copies.emplace_back(var.shape, var.dtype, devices()[i]);
  init(var.copies[0]);
  for (size_t i = 1; i < var.copies.size(); ++i) var.copies[i].copy_from(var.copies[0]);
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

}  // namespace diststrat
