// The execution scope of the calling thread: which device it computes on,
// where GPU memory comes from, which stream its work goes to, and where
// placement is logged. Strategies set it on each replica thread for the
// duration of a replica function (like CUDA's current device), so user code
// written once (Tensor(shape, dtype, ctx.device()), nn ops, optimizers) runs
// on CPU or GPU. It is thread-local, not process-global: two strategies'
// threads never see each other's scope.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "core/gpu_backend.h"
#include "diststrat/device.h"
#include "diststrat/logging.h"

namespace diststrat {

class DeviceManager;

struct ExecScope {
  Device device;
  DeviceManager* devices = nullptr;  // owner of GPU memory; null on CPU-only scopes
  void* stream = nullptr;            // the replica's stream (GPU)
  const PlacementLog* placement = nullptr;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};  // bound of every wait
};

// The innermost scope of this thread, or null.
const ExecScope* current_exec_scope();

// Installs a scope on this thread until destruction (nests).
class ScopedExec {
 public:
  explicit ScopedExec(const ExecScope& scope);
  ~ScopedExec();
  ScopedExec(const ScopedExec&) = delete;
  ScopedExec& operator=(const ScopedExec&) = delete;

 private:
  ExecScope scope_;
  const ExecScope* previous_;
};

// Logs "op <op> on <device>" through the scope's placement log, if any.
void record_op_placement(const char* op, const Device& device);

// What a GPU op needs: the backend, the CUDA ordinal of the tensor's device,
// the stream to enqueue on and the deadline of any wait.
struct GpuExec {
  GpuBackend* backend = nullptr;
  int ordinal = 0;
  void* stream = nullptr;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  DeadlineClock::time_point deadline() const { return DeadlineClock::now() + timeout; }
  void synchronize(const std::string& what) const {
    backend->synchronize(ordinal, stream, deadline(), what);
  }
};
// Resolves `device` (a logical GPU) in the calling thread's scope; throws
// FailedPreconditionError naming `op` when the thread has no GPU scope.
GpuExec gpu_exec(const Device& device, const char* op);

// Device memory for a new GPU tensor from the scope's DeviceManager,
// zero-filled on the scope's stream unless `zero` is false (Tensor's
// constructor and Tensor::uninitialized use it).
std::shared_ptr<void> allocate_device_memory(const Device& device, size_t bytes, bool zero = true);

}  // namespace diststrat
