// Exclusive per-host GPU leases, so that two jobs never silently share a GPU.
//
// A lease is an advisory flock(2) on <lock_dir>/gpu-<id>.lock. The holder's
// pid, user, command line and start time are written into the file, so a
// second job that asks for the same GPU gets an error that names the holder
// (or, with LeaseOptions::wait, waits up to a deadline). The kernel drops the
// lock when the holding process dies, however it dies, so a crashed job never
// leaves a GPU locked. The lease logic needs no GPU: ids are plain strings
// ("GPU-<uuid>" for real devices, anything for tests).
//
// Thread safety: GpuLease objects are independent; distinct objects may be
// used from different threads. Leases are exclusive even between two objects
// of one process (flock locks belong to open file descriptions).
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace diststrat {

struct LeaseOptions {
  // Directory of the lock files; created (mode 1777) if missing. Empty = the
  // DISTSTRAT_GPU_LEASE_DIR environment variable, else /tmp/diststrat-gpu-leases.
  std::string lock_dir;
  // false: a held GPU fails at once (ResourceExhaustedError naming the holder).
  // true: wait until it is free, at most wait_timeout (then DeadlineExceededError).
  bool wait = false;
  std::chrono::milliseconds wait_timeout{std::chrono::minutes(10)};
  // How often a waiting acquire retries.
  std::chrono::milliseconds poll_interval{std::chrono::milliseconds(100)};
};

// Who holds a lease.
struct LeaseHolder {
  int pid = 0;
  std::string user;
  std::string command;  // the holder's command line, arguments space-separated
  std::string since;    // UTC, ISO 8601 ("2026-11-30T01:02:03Z")
  std::string host;
  // "pid 1234 (user alice, command 'train --gpus 2', since 2026-11-30T01:02:03Z, host h1)"
  std::string to_string() const;
};

// The lock directory the options resolve to (see LeaseOptions::lock_dir).
std::string resolve_lease_dir(const LeaseOptions& options);

class GpuLease {
 public:
  // Takes the lease on `gpu_id` for this process. Throws ResourceExhaustedError
  // naming the holder when it is held (wait = false), DeadlineExceededError when
  // still held after wait_timeout (wait = true), InvalidArgumentError for an id
  // that cannot be a file name, InternalError when the directory is unusable.
  // Blocking only with wait = true.
  static GpuLease acquire(const std::string& gpu_id, const LeaseOptions& options = {});

  GpuLease() = default;
  GpuLease(GpuLease&& o) noexcept;
  GpuLease& operator=(GpuLease&& o) noexcept;
  GpuLease(const GpuLease&) = delete;
  GpuLease& operator=(const GpuLease&) = delete;
  ~GpuLease();  // releases

  bool held() const { return fd_ >= 0; }
  const std::string& gpu_id() const { return gpu_id_; }
  const std::string& path() const { return path_; }
  // Gives the GPU back (clears the holder record, then unlocks). Idempotent.
  void release();

 private:
  int fd_ = -1;
  std::string gpu_id_;
  std::string path_;
};

// The current holder of `gpu_id`'s lease, or nothing when it is free.
// Non-blocking; never takes the lease.
std::optional<LeaseHolder> query_lease(const std::string& gpu_id, const LeaseOptions& options = {});

// Every lock file in the directory whose lease is held now: (gpu id, holder).
std::vector<std::pair<std::string, LeaseHolder>> list_leases(const LeaseOptions& options = {});

}  // namespace diststrat
