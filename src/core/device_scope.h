// The execution scope of the calling thread: which device it computes on,
// where GPU memory comes from, which stream its work goes to, and where
// placement is logged. Strategies set it on each replica thread for the
// duration of a replica function (like CUDA's current device), so user code
// written once (Tensor(shape, dtype, ctx.device()), nn ops, optimizers) runs
// on CPU or GPU. It is thread-local, not process-global: two strategies'
// threads never see each other's scope.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>
#include <memory>
#include <string>

#include "core/gpu_backend.h"
#include "diststrat/device.h"
#include "diststrat/logging.h"
#include "diststrat/tensor.h"

namespace diststrat {

class DeviceManager;
class DeviceChecks;
class StepCapture;

struct ExecScope {
  Device device;
  DeviceManager* devices = nullptr;  // owner of GPU memory; null on CPU-only scopes
  void* stream = nullptr;            // the replica's stream (GPU)
  const PlacementLog* placement = nullptr;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};  // bound of every wait
  // A GPU replica's checks of enqueued work (below), and the step it runs
  // (-1: not a numbered step); null / -1 elsewhere.
  std::shared_ptr<DeviceChecks> checks;
  int64_t step = -1;
  // The capture of this replica's step while one is recorded (core/step_capture.h).
  std::shared_ptr<StepCapture> capture;
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

namespace diststrat {

// Checks that only the device can make of work it runs later (a label out of
// range in the loss kernel): each is a device int32 flag, 0 when fine, else
// 1 + the offending row, that the host reads at the next synchronization
// instead of waiting for the step. One per GPU replica (its ExecScope's),
// shared with the values its steps leave to be read later. Thread-safe.
class DeviceChecks {
 public:
  struct Check {
    Tensor flag;     // int32 [1] on the replica's device
    Tensor scratch;  // int32 [1] beside it: where the checks' max goes
    GpuExec exec;
    int64_t step = -1;
    // The error for a flag v != 0 (v - 1 is the row).
    std::function<std::string(int32_t v)> message;
  };
  // Pending checks past which the replica reads them at the end of its
  // step (one device max of them all, one read).
  static constexpr size_t kMaxPending = 16;

  void add(Check check);
  size_t pending() const;
  // Forgets the check of `flag` (its owner read it itself).
  void drop(const Tensor& flag);
  // Reads every pending check (one launch and one device -> host read; more
  // only when one failed) within the checks' deadline, forgets them, and
  // throws InvalidArgumentError with the message of the earliest that
  // failed ("... in step S: ...").
  void run();

 private:
  mutable std::mutex mu_;
  std::vector<Check> pending_;
};

// The stream `e` names when it still exists, else the device's default
// stream (a value read after its strategy, and so its streams, are gone).
void* live_stream(const GpuExec& e);

}  // namespace diststrat
