// GPU device configuration: which physical GPUs a program uses, how each is
// split into logical GPUs, how their memory is allocated, and the exclusive
// per-host lease on each. TensorFlow's tf.config in one object, without the
// process-global state: a DeviceManager is a value a program creates and hands
// to its strategies (MirroredOptions::device_manager); strategies that share
// GPUs share one manager.
//
//   ```cpp fragment=unqualified gpu
//   auto dm = std::make_shared<DeviceManager>();
//   dm->set_logical_device_configuration(0, {{2ull << 30}, {2ull << 30}});  // 2 logical GPUs
//   MirroredOptions o;
//   o.devices = {Device::gpu(0), Device::gpu(1)};   // logical indices
//   o.device_manager = dm;
//   MirroredStrategy strategy(o);
//   ```
//
// Lifecycle: configuration calls (set_*) are allowed until the manager is
// initialized, which happens on the first list_logical_devices(), allocate()
// or strategy construction; after that they throw FailedPreconditionError
// (TensorFlow: "cannot be modified after being initialized"). Initialization
// takes the lease on every physical GPU the manager uses (see gpu_lease.h).
//
// Thread safety: every member function is thread-safe.
// No CUDA header is needed to use this file; in a build without CUDA the
// manager sees no GPUs.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "diststrat/device.h"
#include "diststrat/gpu_lease.h"
#include "diststrat/tensor.h"

namespace diststrat {

class GpuBackend;  // internal (src/core/gpu_backend.h)

// One logical GPU carved out of a physical one (tf.config.LogicalDeviceConfiguration).
struct LogicalDeviceConfiguration {
  // Most bytes this logical device may hold. Required (> 0) when a physical
  // GPU is split into more than one logical device.
  size_t memory_limit_bytes = 0;
};

struct GpuOptions {
  // Physical GPUs to use, as CUDA ordinals of this process (CUDA_VISIBLE_DEVICES
  // is applied first, by CUDA itself). Unset = all; empty = none.
  std::optional<std::vector<int>> visible_devices;
  // true: take device memory from CUDA on demand, in chunks, up to the limit.
  // false: reserve the limit (or, without one, 90% of the free memory) up front.
  bool memory_growth = true;
  // Memory limit of every physical GPU that is not split; 0 = no limit.
  size_t memory_limit_bytes = 0;
  // Physical ordinal -> its logical devices. A GPU not listed is one logical device.
  std::map<int, std::vector<LogicalDeviceConfiguration>> logical_devices;
  // Take the per-host lease on each used physical GPU at initialization
  // (DISTSTRAT_GPU_LEASE=0 turns it off).
  bool take_leases = true;
  LeaseOptions lease;
};

struct PhysicalDeviceInfo {
  int ordinal = 0;       // CUDA ordinal in this process
  std::string name;      // "NVIDIA H200"
  std::string uuid;      // "GPU-8f3a..." (empty when unknown)
  std::string lease_id;  // id of the host-wide lease of this GPU
  size_t total_memory_bytes = 0;
  size_t free_memory_bytes = 0;  // at the time of the call
  int compute_capability = 0;    // 90 for sm_90
};

struct LogicalDeviceInfo {
  Device device;  // Device::gpu(logical index)
  int physical_ordinal = 0;
  size_t memory_limit_bytes = 0;  // 0 = none
};

// One logical device's allocator figures.
struct MemoryStats {
  size_t in_use_bytes = 0;  // held by live tensors (rounded sizes)
  size_t peak_in_use_bytes = 0;
  size_t reserved_bytes = 0;      // taken from CUDA (in use + cached)
  size_t limit_bytes = 0;         // 0 = none
  size_t num_allocs = 0;          // allocate calls served
  size_t num_backend_allocs = 0;  // cudaMalloc calls made
};

class DeviceManager {
 public:
  // Uses the CUDA backend when this build has one (none otherwise).
  explicit DeviceManager(GpuOptions options = {});
  ~DeviceManager();
  DeviceManager(const DeviceManager&) = delete;
  DeviceManager& operator=(const DeviceManager&) = delete;

  // Configuration; throws FailedPreconditionError once initialized.
  void set_visible_devices(std::vector<int> ordinals);
  void set_memory_growth(bool grow);
  void set_memory_limit(size_t bytes);
  void set_logical_device_configuration(int physical_ordinal,
                                        std::vector<LogicalDeviceConfiguration> config);

  // Visible physical GPUs (does not initialize).
  std::vector<PhysicalDeviceInfo> list_physical_devices() const;
  // Logical GPUs, numbered 0.. over the visible physical ones in order
  // (initializes; may throw ResourceExhaustedError for a held lease).
  std::vector<LogicalDeviceInfo> list_logical_devices();
  bool initialized() const;

  // A zero-filled tensor on logical GPU `device` (initializes). Blocks until
  // the memory is zeroed. Throws ResourceExhaustedError past the device's
  // memory limit, NotFoundError for a device that does not exist.
  Tensor allocate(const Shape& shape, DType dtype, const Device& device);
  MemoryStats memory_stats(const Device& device);
  // Returns the device's cached, unused memory to CUDA.
  void empty_cache(const Device& device);

  struct Impl;  // defined inside the library (src/core/device_manager_impl.h)

 private:
  friend struct DeviceManagerAccess;  // the library's (and its tests') way in
  // Uses `backend` (tests use a fake one): through DeviceManagerAccess.
  DeviceManager(GpuOptions options, std::unique_ptr<GpuBackend> backend);
  std::unique_ptr<Impl> impl_;
};

// GpuOptions for one of several processes that share a host's GPUs (one
// MultiWorker or parameter-server worker per process): process `local_rank`
// sees, and leases, only physical GPUs local_rank * per_process ..
// local_rank * per_process + per_process - 1, which become its logical GPUs
// 0 .. per_process - 1. local_rank < 0 takes it from the launcher
// (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID; else 0;
// a value that is not an integer in 0..4096 is an InvalidArgumentError
// naming it). per_process 1..1024. A process whose GPUs do not exist gets
// NotFoundError when the manager initializes.
GpuOptions gpu_options_for_local_process(int per_process, int local_rank = -1);

}  // namespace diststrat
