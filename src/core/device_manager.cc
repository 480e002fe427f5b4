#include "diststrat/device_manager.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <set>

#include "core/device_manager_impl.h"
#include "core/env.h"
#include "core/device_scope.h"

namespace diststrat {

// ---- CUDA_VISIBLE_DEVICES and lease ids --------------------------------------

std::optional<std::vector<std::string>> parse_visible_devices(const char* text) {
  if (text == nullptr) return std::nullopt;
  std::vector<std::string> out;
  std::string s(text);
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string::npos) comma = s.size();
    std::string tok = s.substr(pos, comma - pos);
    tok.erase(0, tok.find_first_not_of(" \t"));
    tok.erase(tok.find_last_not_of(" \t") + 1);
    const bool is_int = !tok.empty() && std::all_of(tok.begin(), tok.end(), ::isdigit);
    const bool is_id = tok.rfind("GPU-", 0) == 0 || tok.rfind("MIG-", 0) == 0;
    if (!is_int && !is_id) break;  // CUDA ignores everything from an invalid entry on
    out.push_back(tok);
    pos = comma + 1;
  }
  return out;
}

std::string gpu_lease_id(int ordinal, const std::string& uuid,
                         const std::optional<std::vector<std::string>>& visible) {
  if (!uuid.empty()) return uuid;
  if (visible && ordinal >= 0 && static_cast<size_t>(ordinal) < visible->size()) {
    const std::string& tok = (*visible)[static_cast<size_t>(ordinal)];
    if (std::all_of(tok.begin(), tok.end(), ::isdigit)) return "gpu" + tok;
    return tok;
  }
  return "gpu" + std::to_string(ordinal);
}

// ---- DeviceManager::Impl -------------------------------------------------------

std::vector<int> DeviceManager::Impl::visible_ordinals() const {
  const int count = backend ? backend->device_count() : 0;
  std::vector<int> out;
  if (!options.visible_devices) {
    for (int i = 0; i < count; ++i) out.push_back(i);
    return out;
  }
  for (int o : *options.visible_devices) {
    DISTSTRAT_CHECK(o >= 0 && o < count, kNotFound, "visible device ", o, " does not exist (",
                    count, " GPU(s) visible to this process)");
    out.push_back(o);
  }
  return out;
}

void DeviceManager::Impl::initialize_locked() {
  if (initialized) return;
  const std::vector<int> ordinals = visible_ordinals();
  for (const auto& [o, cfg] : options.logical_devices) {
    DISTSTRAT_CHECK(std::find(ordinals.begin(), ordinals.end(), o) != ordinals.end(), kNotFound,
                    "logical device configuration for physical GPU ", o,
                    ", which is not a visible GPU");
    DISTSTRAT_CHECK(!cfg.empty(), kInvalidArgument, "physical GPU ", o,
                    ": empty logical device configuration");
    if (cfg.size() > 1) {
      for (const auto& c : cfg) {
        DISTSTRAT_CHECK(c.memory_limit_bytes > 0, kInvalidArgument, "physical GPU ", o,
                        " split into ", cfg.size(),
                        " logical devices: each needs a memory_limit_bytes");
      }
    }
  }
  // Leases first: a GPU held by another job fails before any memory is taken.
  std::vector<GpuLease> taken;
  bool take = options.take_leases;
  if (auto env = env::flag("DISTSTRAT_GPU_LEASE")) take = *env;
  if (take) {
    const auto visible_env = parse_visible_devices(std::getenv("CUDA_VISIBLE_DEVICES"));
    for (int o : ordinals) {
      taken.push_back(
          GpuLease::acquire(gpu_lease_id(o, backend->info(o).uuid, visible_env), options.lease));
    }
  }
  std::vector<Logical> made;
  for (int o : ordinals) {
    auto it = options.logical_devices.find(o);
    std::vector<LogicalDeviceConfiguration> cfg =
        it != options.logical_devices.end()
            ? it->second
            : std::vector<LogicalDeviceConfiguration>{{options.memory_limit_bytes}};
    for (const auto& c : cfg) {
      Logical l;
      l.info.device = Device::gpu(static_cast<int>(made.size()));
      l.info.physical_ordinal = o;
      l.info.memory_limit_bytes = c.memory_limit_bytes;
      l.allocator = std::make_shared<CachingAllocator>(
          backend, o, c.memory_limit_bytes, options.memory_growth,
          l.info.device.to_string() + " (physical GPU " + std::to_string(o) + ")");
      made.push_back(std::move(l));
    }
  }
  logical = std::move(made);
  leases = std::move(taken);
  initialized = true;
}

const DeviceManager::Impl::Logical& DeviceManager::Impl::logical_locked(const Device& device) {
  initialize_locked();
  DISTSTRAT_CHECK(
      device.is_gpu() && device.index >= 0 && static_cast<size_t>(device.index) < logical.size(),
      kNotFound, "device ", device.to_string(), " does not exist: ", logical.size(),
      " logical GPU(s) configured", backend ? "" : " (this build has no GPU support)");
  return logical[static_cast<size_t>(device.index)];
}

GpuBackend& DeviceManager::Impl::require_backend(const std::string& what) const {
  DISTSTRAT_CHECK(backend != nullptr, kUnimplemented, what,
                  ": this build of diststrat has no GPU backend (configure with CUDA)");
  return *backend;
}

int DeviceManager::Impl::ordinal_of(const Device& device) {
  std::lock_guard<std::mutex> lock(mu);
  return logical_locked(device).info.physical_ordinal;
}

std::shared_ptr<void> DeviceManager::Impl::allocate_raw(const Device& device, size_t bytes,
                                                        void* stream) {
  std::shared_ptr<CachingAllocator> alloc;
  {
    std::lock_guard<std::mutex> lock(mu);
    alloc = logical_locked(device).allocator;
  }
  void* p = alloc->allocate(bytes, stream);
  return std::shared_ptr<void>(p, [alloc](void* q) { alloc->deallocate(q); });
}

std::vector<LogicalDeviceInfo> DeviceManager::Impl::logical_devices() {
  std::lock_guard<std::mutex> lock(mu);
  initialize_locked();
  std::vector<LogicalDeviceInfo> out;
  for (const Logical& l : logical) out.push_back(l.info);
  return out;
}

bool DeviceManager::Impl::copy_to_device_staged(int ordinal, void* dst, const void* src,
                                                size_t bytes, void* stream) {
  return stage_to_device(
      ordinal, {{dst, bytes}}, [&](char* host) { std::memcpy(host, src, bytes); }, stream);
}

bool DeviceManager::Impl::stage_to_device(int ordinal, const std::vector<StagedPiece>& pieces,
                                          const std::function<void(char* host)>& fill,
                                          void* stream) {
  size_t bytes = 0;
  for (const StagedPiece& p : pieces) bytes += p.bytes;
  Staging* use = nullptr;
  {
    std::lock_guard<std::mutex> lock(staging_mu_);
    if (no_pinned_memory_) return false;
    for (Staging& b : staging_) {
      if (!b.busy && b.ordinal == ordinal && b.bytes >= bytes &&
          backend->event_done(ordinal, b.done)) {
        use = &b;
        break;
      }
    }
    if (!use) {
      // Sizes in powers of two from 64 KiB, so buffers fit later batches.
      size_t size = size_t{64} << 10;
      while (size < bytes) size *= 2;
      void* host = nullptr;
      try {
        host = backend->host_alloc(size);
      } catch (const UnimplementedError&) {
        no_pinned_memory_ = true;
        return false;
      }
      if (!host) return false;
      Staging b;
      b.host = host;
      b.bytes = size;
      b.ordinal = ordinal;
      try {
        b.done = backend->create_event(ordinal);
      } catch (...) {
        backend->host_free(host);
        throw;
      }
      staging_.push_back(b);
      use = &staging_.back();
    }
    use->busy = true;
  }
  // The buffer is ours until busy is cleared: its last copy has run, and no
  // other caller takes a busy buffer. A failed copy leaves it busy (a copy
  // enqueued before it may still read the buffer): leaked, not reused early.
  char* host = static_cast<char*>(use->host);
  try {
    fill(host);
  } catch (...) {
    std::lock_guard<std::mutex> lock(staging_mu_);
    use->busy = false;  // nothing read it yet
    throw;
  }
  size_t at = 0;
  for (const StagedPiece& p : pieces) {
    if (p.bytes) backend->memcpy_async(ordinal, p.dst, host + at, p.bytes, stream);
    at += p.bytes;
  }
  backend->record_event(ordinal, use->done, stream);
  std::lock_guard<std::mutex> lock(staging_mu_);
  use->busy = false;
  return true;
}

void DeviceManager::Impl::record_stream(const Device& device, const void* ptr, void* stream) {
  std::shared_ptr<CachingAllocator> alloc;
  {
    std::lock_guard<std::mutex> lock(mu);
    alloc = logical_locked(device).allocator;
  }
  alloc->record_stream(ptr, stream);
}

DeviceManager::Impl::~Impl() {
  for (Staging& b : staging_) {
    if (b.busy) continue;  // a failed copy's: leaked (see stage_to_device)
    try {
      backend->wait_event(b.ordinal, b.done, DeadlineClock::now() + std::chrono::seconds(30),
                          "a staged host -> device copy at DeviceManager destruction");
    } catch (...) {
      continue;  // a copy that may still read the buffer: leak it rather than free it
    }
    backend->destroy_event(b.ordinal, b.done);
    backend->host_free(b.host);
  }
}

// ---- DeviceManager -----------------------------------------------------------

DeviceManager::DeviceManager(GpuOptions options)
    : DeviceManager(std::move(options), make_default_gpu_backend()) {}

DeviceManager::DeviceManager(GpuOptions options, std::unique_ptr<GpuBackend> backend)
    : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->backend = std::move(backend);
}

DeviceManager::~DeviceManager() = default;

namespace {
void check_not_initialized(const DeviceManager::Impl& impl, const char* what) {
  DISTSTRAT_CHECK(!impl.initialized, kFailedPrecondition, what,
                  ": the GPUs are already initialized; configure the DeviceManager before "
                  "creating strategies or tensors on it");
}
}  // namespace

void DeviceManager::set_visible_devices(std::vector<int> ordinals) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  check_not_initialized(*impl_, "set_visible_devices");
  std::set<int> seen;
  for (int o : ordinals) {
    DISTSTRAT_CHECK(seen.insert(o).second, kInvalidArgument, "set_visible_devices: ordinal ", o,
                    " listed twice");
  }
  impl_->options.visible_devices = std::move(ordinals);
}

void DeviceManager::set_memory_growth(bool grow) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  check_not_initialized(*impl_, "set_memory_growth");
  impl_->options.memory_growth = grow;
}

void DeviceManager::set_memory_limit(size_t bytes) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  check_not_initialized(*impl_, "set_memory_limit");
  impl_->options.memory_limit_bytes = bytes;
}

void DeviceManager::set_logical_device_configuration(
    int physical_ordinal, std::vector<LogicalDeviceConfiguration> config) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  check_not_initialized(*impl_, "set_logical_device_configuration");
  impl_->options.logical_devices[physical_ordinal] = std::move(config);
}

std::vector<PhysicalDeviceInfo> DeviceManager::list_physical_devices() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<PhysicalDeviceInfo> out;
  if (!impl_->backend) return out;
  const auto visible_env = parse_visible_devices(std::getenv("CUDA_VISIBLE_DEVICES"));
  for (int o : impl_->visible_ordinals()) {
    const GpuInfo g = impl_->backend->info(o);
    PhysicalDeviceInfo p;
    p.ordinal = o;
    p.name = g.name;
    p.uuid = g.uuid;
    p.lease_id = gpu_lease_id(o, g.uuid, visible_env);
    p.total_memory_bytes = g.total_bytes;
    p.free_memory_bytes = g.free_bytes;
    p.compute_capability = g.compute_capability;
    out.push_back(p);
  }
  return out;
}

std::vector<LogicalDeviceInfo> DeviceManager::list_logical_devices() {
  return impl_->logical_devices();
}

bool DeviceManager::initialized() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->initialized;
}

Tensor DeviceManager::allocate(const Shape& shape, DType dtype, const Device& device) {
  const size_t bytes = static_cast<size_t>(shape.num_elements()) * dtype_size(dtype);
  std::shared_ptr<void> mem = impl_->allocate_raw(device, bytes);
  if (bytes) {
    GpuBackend& b = impl_->require_backend("DeviceManager::allocate");
    const int o = impl_->ordinal_of(device);
    b.memset_async(o, mem.get(), 0, bytes, nullptr);
    b.synchronize(o, nullptr, DeadlineClock::now() + std::chrono::seconds(300),
                  "zero-fill of a new tensor on " + device.to_string());
  }
  return Tensor::adopt(std::move(mem), shape, dtype, device);
}

MemoryStats DeviceManager::memory_stats(const Device& device) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->logical_locked(device).allocator->stats();
}

void DeviceManager::empty_cache(const Device& device) {
  std::shared_ptr<CachingAllocator> alloc;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    alloc = impl_->logical_locked(device).allocator;
  }
  alloc->empty_cache();
}

GpuOptions gpu_options_for_local_process(int per_process, int local_rank) {
  // Bounded so that local_rank * per_process cannot overflow.
  DISTSTRAT_CHECK(per_process >= 1 && per_process <= 1024, kInvalidArgument,
                  "gpu_options_for_local_process: ", per_process, " GPUs per process (1..1024)");
  DISTSTRAT_CHECK(local_rank <= 4096, kInvalidArgument,
                  "gpu_options_for_local_process: local rank ", local_rank, " (at most 4096)");
  if (local_rank < 0) {
    local_rank = 0;
    for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
      // Checked like every variable read (a junk value is an error naming it,
      // not GPU 0).
      if (auto v = env::integer(name, 0, 4096)) {
        local_rank = static_cast<int>(*v);
        break;
      }
    }
  }
  GpuOptions o;
  o.visible_devices.emplace();
  for (int i = 0; i < per_process; ++i) o.visible_devices->push_back(local_rank * per_process + i);
  return o;
}

}  // namespace diststrat
