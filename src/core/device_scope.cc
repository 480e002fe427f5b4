#include "core/device_scope.h"

#include "core/device_manager_impl.h"

namespace diststrat {

namespace {
thread_local const ExecScope* t_scope = nullptr;
}  // namespace

const ExecScope* current_exec_scope() { return t_scope; }

ScopedExec::ScopedExec(const ExecScope& scope) : scope_(scope), previous_(t_scope) {
  t_scope = &scope_;
}
ScopedExec::~ScopedExec() { t_scope = previous_; }

void record_op_placement(const char* op, const Device& device) {
  const ExecScope* s = t_scope;
  if (s && s->placement && s->placement->enabled()) s->placement->record("op", op, device);
}

namespace {
DeviceManager& scope_manager(const Device& device, const char* op) {
  const ExecScope* s = t_scope;
  DISTSTRAT_CHECK(s && s->devices, kFailedPrecondition, op, " on ", device.to_string(),
                  ": this thread has no GPU scope; GPU tensors are created and used inside "
                  "Strategy::run (or through DeviceManager::allocate)");
  return *s->devices;
}
}  // namespace

GpuExec gpu_exec(const Device& device, const char* op) {
  DeviceManager& dm = scope_manager(device, op);
  const ExecScope* s = t_scope;
  GpuExec e;
  e.backend = &DeviceManagerAccess::impl(dm).require_backend(op);
  e.ordinal = DeviceManagerAccess::impl(dm).ordinal_of(device);
  // The scope's stream belongs to its device; work for another device goes
  // to that device's default stream.
  e.stream = s->device == device ? s->stream : nullptr;
  e.timeout = s->timeout;
  return e;
}

std::shared_ptr<void> allocate_device_memory(const Device& device, size_t bytes, bool zero) {
  DeviceManager& dm = scope_manager(device, "Tensor allocation");
  if (!bytes) return DeviceManagerAccess::impl(dm).allocate_raw(device, bytes);
  // The block belongs to the stream the scope uses for this device.
  const GpuExec e = gpu_exec(device, "Tensor allocation");
  std::shared_ptr<void> mem = DeviceManagerAccess::impl(dm).allocate_raw(device, bytes, e.stream);
  if (zero) e.backend->memset_async(e.ordinal, mem.get(), 0, bytes, e.stream);
  return mem;
}

}  // namespace diststrat
