// diststrat-smi: the host's GPUs (through CUDA) and who holds each one's
// diststrat lease.
//
//   diststrat-smi [--lease-dir DIR]
//
// Lists the GPUs this process can see (name, memory used/total, lease id and
// holder), then every lease held in the lock directory, including leases on
// GPUs hidden from this process by CUDA_VISIBLE_DEVICES. Never takes a lease.
// Exit status: 0, or 2 for a usage error.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include <diststrat/diststrat.h>

namespace ds = diststrat;

namespace {
double gib(size_t bytes) { return static_cast<double>(bytes) / (1ull << 30); }

int usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--lease-dir DIR]\n", argv0);
  return 2;
}
}  // namespace

int main(int argc, char** argv) {
  ds::LeaseOptions lease;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--lease-dir") == 0 && i + 1 < argc) {
      lease.lock_dir = argv[++i];
    } else if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      usage(argv[0]);
      return 0;
    } else {
      return usage(argv[0]);
    }
  }
  try {
    const std::string dir = ds::resolve_lease_dir(lease);
    std::map<std::string, ds::LeaseHolder> held;
    for (auto& [id, holder] : ds::list_leases(lease)) held[id] = holder;

    std::printf("diststrat-smi %s (lease directory %s)\n", DISTSTRAT_VERSION, dir.c_str());
    ds::GpuOptions options;
    options.take_leases = false;
    ds::DeviceManager devices(options);
    const auto gpus = devices.list_physical_devices();
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    if (gpus.empty()) {
      std::printf("GPUs: none%s\n", DISTSTRAT_HAVE_CUDA
                                        ? " (the CUDA runtime sees no device)"
                                        : " (this build of diststrat has no CUDA backend)");
    } else {
      std::printf("GPUs visible to this process%s%s:\n", visible ? ", CUDA_VISIBLE_DEVICES=" : "",
                  visible ? visible : "");
      std::printf("  %-3s %-24s %-22s %-42s %s\n", "#", "name", "memory used/total", "lease id",
                  "lease");
      for (const auto& g : gpus) {
        char mem[64];
        std::snprintf(mem, sizeof(mem), "%.1f / %.1f GiB",
                      gib(g.total_memory_bytes - g.free_memory_bytes), gib(g.total_memory_bytes));
        auto it = held.find(g.lease_id);
        std::printf("  %-3d %-24s %-22s %-42s %s\n", g.ordinal, g.name.c_str(), mem,
                    g.lease_id.c_str(), it == held.end() ? "free" : it->second.to_string().c_str());
      }
    }
    if (held.empty()) {
      std::printf("Leases held: none\n");
    } else {
      std::printf("Leases held:\n");
      for (const auto& [id, h] : held)
        std::printf("  %-42s %s\n", id.c_str(), h.to_string().c_str());
    }
    return 0;
  } catch (const ds::Error& e) {
    std::fprintf(stderr, "diststrat-smi: %s\n", e.what());
    return 1;
  }
}
