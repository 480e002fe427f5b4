// Exclusive per-host GPU leases, so that two jobs never silently share a GPU.
//
// A lease is <lock_dir>/gpu-<id>.lock, created by its holder (mode 0644) and
// write-locked by it (an OFD fcntl lock). The holder's pid, user, command line
// and start time are written into the file, so a second job that asks for the
// same GPU gets an error that names the holder (or, with LeaseOptions::wait,
// waits up to a deadline). The kernel drops the lock when the holding process
// dies, however it dies, so a crashed job never leaves a GPU held; its file
// stays until its owner's next acquire removes it. Nothing at the path is
// followed through a link, changed unless the job created it, or read beyond
// a few KiB; other users can neither rewrite a holder's record nor take a held
// GPU (threat model: docs/gpu.md). The lease logic needs no GPU: ids are plain
// strings ("GPU-<uuid>" for real devices, anything for tests).
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
  // It and every directory above it must be owned by root or by this user and
  // be sticky if others can write to it (else PermissionDeniedError); it is
  // not followed if it is a symbolic link. On a host shared by several users,
  // have root create it: `install -d -m 1777 -o root -g root DIR`.
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
  // that cannot be a file name, PermissionDeniedError naming the file (or
  // directory) and its owner when the directory is unsafe (see lock_dir) or the
  // lock path holds something this job may not use: a link, a FIFO or other
  // non-regular file, another user's file that no one holds (stale or
  // planted: only its owner or root can remove it). UnavailableError when a
  // process that is not a holder keeps a read lock on our own stale file.
  // Blocking only with wait = true (besides a grace of 200 ms for a file that
  // its creator has not locked yet).
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
  // Gives the GPU back (removes the lock file, then unlocks). Idempotent.
  void release();

 private:
  int fd_ = -1;
  int dir_fd_ = -1;  // the lease directory, to remove our file by name
  std::string gpu_id_;
  std::string path_;
};

// The current holder of `gpu_id`'s lease, or nothing when it is free (or the
// directory does not exist). Non-blocking; never takes the lease, never creates
// the directory; reads at most 4 KiB. LeaseHolder::user is the file's owner.
// Throws PermissionDeniedError for an unsafe directory (its records could be
// forged). Thread-safe.
std::optional<LeaseHolder> query_lease(const std::string& gpu_id, const LeaseOptions& options = {});

// Every lock file in the directory whose lease is held now: (gpu id, holder).
// Same rules as query_lease; entries that are not regular files are skipped.
std::vector<std::pair<std::string, LeaseHolder>> list_leases(const LeaseOptions& options = {});

}  // namespace diststrat
