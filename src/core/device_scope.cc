#include "core/device_scope.h"

#include "core/device_manager_impl.h"
#include "core/step_capture.h"

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
  // A captured step's memory stays with its graphs (its private pool): the
  // block is neither freed nor reused while a replay may write it.
  const ExecScope* s = t_scope;
  if (s->capture && s->capture->active() && s->device == device) s->capture->keep(mem);
  return mem;
}

void* live_stream(const GpuExec& e) {
  return e.stream && !e.backend->stream_alive(e.ordinal, e.stream) ? nullptr : e.stream;
}

void DeviceChecks::add(Check check) {
  const ExecScope* s = t_scope;
  if (s && s->capture && s->capture->active() && s->checks.get() == this) {
    // A captured step's flag is rewritten by every replay: after each launch
    // a copy of it is checked, under the step that launch ran.
    std::shared_ptr<DeviceChecks> self = s->checks;
    s->capture->after_launch([self, check] {
      Check c = check;
      c.flag = Tensor::uninitialized(check.flag.shape(), check.flag.dtype(), check.flag.device());
      c.flag.copy_from(check.flag);
      const ExecScope* now = t_scope;
      c.step = now ? now->step : check.step;
      const std::string from = "step " + std::to_string(check.step);
      const std::string to = "step " + std::to_string(c.step);
      c.message = [message = check.message, from, to](int32_t v) {
        std::string m = message(v);  // names the captured step: name this one
        const size_t at = m.find(from);
        return at == std::string::npos ? m : m.replace(at, from.size(), to);
      };
      self->add(std::move(c));
    });
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  pending_.push_back(std::move(check));
}

size_t DeviceChecks::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.size();
}

void DeviceChecks::drop(const Tensor& flag) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (it->flag.same_storage(flag)) {
      pending_.erase(it);
      return;
    }
  }
}

void DeviceChecks::run() {
  std::lock_guard<std::mutex> lock(mu_);
  if (pending_.empty()) return;
  std::vector<Check> checks;
  checks.swap(pending_);
  const Check& last = checks.back();
  const GpuExec& e = last.exec;
  void* stream = live_stream(e);
  const auto read = [&](const Check& c, const Tensor& t) {
    int32_t v = 0;
    c.exec.backend->copy_to_host(c.exec.ordinal, &v, t.data(), sizeof v, live_stream(c.exec),
                                 c.exec.deadline(),
                                 "the device checks of step " + std::to_string(c.step));
    return v;
  };
  Tensor any_flag = last.flag;
  if (checks.size() > 1) {
    // The max of every flag into the newest one's scratch: one launch and
    // one read when all are fine. The checks of one replica share its
    // device (and at most kMaxPending + 1 fit one reduce launch).
    std::vector<const void*> srcs;
    for (const Check& c : checks) srcs.push_back(c.flag.data());
    any_flag = last.scratch;
    e.backend->reduce(e.ordinal, stream, any_flag.data(), srcs.data(),
                      static_cast<int>(srcs.size()), 1, DType::kInt32, ReduceOp::kMax, 0);
  }
  if (read(last, any_flag) == 0) return;
  for (const Check& c : checks) {
    const int32_t v = read(c, c.flag);
    if (v != 0) throw InvalidArgumentError(c.message(v));
  }
}

}  // namespace diststrat
