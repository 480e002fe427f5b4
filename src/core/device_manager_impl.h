// DeviceManager internals shared by the strategies and the GPU paths of the
// tensor, nn and optimizer code.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/caching_allocator.h"
#include "core/gpu_backend.h"
#include "diststrat/device_manager.h"

namespace diststrat {

// CUDA_VISIBLE_DEVICES as CUDA reads it: comma-separated entries (integers or
// "GPU-<uuid>" / "MIG-..." ids), read up to the first invalid entry; unset
// (nullptr) = no restriction, returned as nullopt.
std::optional<std::vector<std::string>> parse_visible_devices(const char* text);

// The host-wide id of the GPU a process sees as CUDA ordinal `ordinal`:
// "GPU-<uuid>" when the backend knows it, else "gpu<host index>" with the
// host index taken from CUDA_VISIBLE_DEVICES (`visible`) when it is an integer.
std::string gpu_lease_id(int ordinal, const std::string& uuid,
                         const std::optional<std::vector<std::string>>& visible);

struct DeviceManager::Impl {
  GpuOptions options;
  std::shared_ptr<GpuBackend> backend;  // null: no GPU support in this build
  mutable std::mutex mu;
  bool initialized = false;

  struct Logical {
    LogicalDeviceInfo info;
    std::shared_ptr<CachingAllocator> allocator;
  };
  std::vector<Logical> logical;
  std::vector<GpuLease> leases;

  // Visible CUDA ordinals (options.visible_devices ∩ what the backend has).
  std::vector<int> visible_ordinals() const;
  void initialize_locked();
  const Logical& logical_locked(const Device& device);

  // ---- for strategies and GPU code paths (thread-safe; initialize) ----
  GpuBackend& require_backend(const std::string& what) const;
  int ordinal_of(const Device& device);
  // Raw memory whose deleter hands it back to the device's allocator (which
  // the deleter keeps alive).
  std::shared_ptr<void> allocate_raw(const Device& device, size_t bytes, void* stream = nullptr);
  std::vector<LogicalDeviceInfo> logical_devices();

  // Host -> device copies without a host wait (Tensor::copy_from): `src` is
  // copied into a pinned host buffer, and the device copy enqueued on
  // `stream` from it; the buffer is reused only after an event recorded
  // behind that copy has passed (so it outlives the copy). Returns false,
  // having done nothing, when the backend has no pinned memory left (or
  // none at all): the caller copies from `src` itself.
  bool copy_to_device_staged(int ordinal, void* dst, const void* src, size_t bytes, void* stream);
  // The same for several destinations from one pinned buffer: `fill` writes
  // the bytes of every piece, back to back in order, into the buffer (it
  // runs without the staging lock, so it may gather rows at leisure), then
  // one copy per piece is enqueued on `stream` and the buffer is reused only
  // after all of them have run. Returns false, having done nothing, as above.
  struct StagedPiece {
    void* dst = nullptr;
    size_t bytes = 0;
  };
  bool stage_to_device(int ordinal, const std::vector<StagedPiece>& pieces,
                       const std::function<void(char* host)>& fill, void* stream);
  // Device memory of `device` handed out by its allocator (any address in a
  // block) is also used by work on `stream` (CachingAllocator::record_stream).
  void record_stream(const Device& device, const void* ptr, void* stream);
  ~Impl();  // frees the staging buffers once their copies are done (bounded wait)

 private:
  struct Staging {
    void* host = nullptr;
    size_t bytes = 0;
    int ordinal = 0;
    void* done = nullptr;  // event behind the buffer's latest copy
    bool busy = false;     // being filled (outside the lock)
  };
  std::mutex staging_mu_;
  std::deque<Staging> staging_;  // a deque: a buffer's address stays put while it is filled
  bool no_pinned_memory_ = false;
};

// The library's access to a DeviceManager's internals, and the constructor
// over a given backend (the tests' fake GPUs), neither of them public.
struct DeviceManagerAccess {
  static DeviceManager::Impl& impl(const DeviceManager& manager) { return *manager.impl_; }
  static std::unique_ptr<DeviceManager> with_backend(GpuOptions options,
                                                     std::unique_ptr<GpuBackend> backend) {
    return std::unique_ptr<DeviceManager>(
        new DeviceManager(std::move(options), std::move(backend)));
  }
  static std::shared_ptr<DeviceManager> shared_with_backend(GpuOptions options,
                                                            std::unique_ptr<GpuBackend> backend) {
    return with_backend(std::move(options), std::move(backend));
  }
};

}  // namespace diststrat
