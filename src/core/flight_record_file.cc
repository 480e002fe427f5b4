// The flight recorder's record file (flight_recorder.h): the process's
// registry of recorders, its job and rank, the directory its record goes
// to, and the record written there.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/env.h"
#include "core/file_util.h"
#include "core/flight_internal.h"
#include "core/flight_recorder.h"
#include "diststrat/flight_recorder.h"

namespace diststrat {
namespace flight {
namespace detail {

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: used by the watchdog until exit
  return *r;
}

namespace {

std::string default_job() {
  if (auto id = env::text("SLURM_JOB_ID")) return "slurm" + *id;
  if (auto id = env::text("OMPI_MCA_ess_base_jobid")) return "ompi" + *id;
  return std::string();
}

// Keeps a job name safe inside a file name.
std::string file_safe(const std::string& s) {
  std::string out;
  for (char c : s.substr(0, 64)) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_' || c == '.';
    out += ok ? c : '_';
  }
  return out;
}

void make_directories(const std::string& dir) {
  for (size_t i = 1; i <= dir.size(); ++i) {
    if (i == dir.size() || dir[i] == '/') {
      const std::string part = dir.substr(0, i);
      if (::mkdir(part.c_str(), 0700) != 0 && errno != EEXIST) {
        fs::throw_errno(errno, "flight recorder: cannot create directory '" + part + "'");
      }
    }
  }
}

std::string octal_mode(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

[[noreturn]] void refuse(const Place& dir, const std::string& what) {
  throw PermissionDeniedError(
      "flight recorder: the record directory '" + dir.path + "' " + what +
      ": refused (whoever controls it could read and replace the job's records, or plant one "
      "that makes the job's processes answer it and, with DISTSTRAT_FLIGHT_RECORDER_EXIT, end); " +
      (dir.chosen ? "choose a directory of this uid that only it can write"
                  : "remove it, or set DISTSTRAT_FLIGHT_RECORDER_DIR to a directory of your own"));
}

// Writes `bytes` as `name` in the open directory `dfd`, atomically (a
// temporary file of mode 0600 renamed over it), by names relative to the
// directory checked: a path swapped meanwhile is not followed.
void write_record_at(int dfd, const std::string& dir, const std::string& name,
                     const std::string& bytes) {
  static std::atomic<uint64_t> counter{0};
  const std::string tmp =
      name + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
  auto fail = [&](const std::string& what, int err) {
    ::unlinkat(dfd, tmp.c_str(), 0);
    fs::throw_errno(err, "writing '" + dir + "/" + name + "': " + what);
  };
  fs::Fd fd(::openat(dfd, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (fd.get() < 0) fail("open of temporary file '" + tmp + "'", errno);
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("write", errno);
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd.get()) != 0) fail("fsync", errno);
  if (::close(fd.release()) != 0) fail("close", errno);
  if (::renameat(dfd, tmp.c_str(), dfd, name.c_str()) != 0) fail("rename", errno);
  ::fsync(dfd);  // the rename is durable once the directory entry is
}

}  // namespace

std::string job_of(Registry& r) {
  if (!r.job_set) {
    r.job = default_job();
    r.job_set = true;
  }
  return r.job;
}

std::string file_prefix(const std::string& job) {
  return "flight-" + (job.empty() ? std::string("solo") : file_safe(job)) + "-";
}

// flight-<job>-rank<R>-pid<P>.json; a process of no known rank (one
// process, or before the cluster is resolved) has no rank<R>- part.
std::string file_name(const std::string& job, int rank) {
  return file_prefix(job) + (rank >= 0 ? "rank" + std::to_string(rank) + "-" : std::string()) +
         "pid" + std::to_string(::getpid()) + ".json";
}

void read_environment_locked(Registry& r) {
  r.env_dir = env::text("DISTSTRAT_FLIGHT_RECORDER_DIR").value_or("");
  std::string tmp = env::text("TMPDIR").value_or("/tmp");
  r.env_tmpdir = tmp.empty() || tmp[0] != '/' ? "/tmp" : tmp;
}

Place directory_locked(Registry& r) {
  if (!r.env_dir.empty()) return {r.env_dir, true};
  if (!r.checkpoint_dir.empty()) return {r.checkpoint_dir, true};
  const std::string job = job_of(r);
  return {r.env_tmpdir + "/diststrat-flight-" +
              (job.empty() ? "pid" + std::to_string(::getpid()) : file_safe(job)),
          false};
}

Place watched_directory() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return directory_locked(r);
}

int open_directory(const Place& dir, bool create) {
  if (create) {
    if (dir.chosen) {
      make_directories(dir.path);
    } else {
      make_directories(fs::directory_of(dir.path));
      if (::mkdir(dir.path.c_str(), 0700) != 0 && errno != EEXIST) {
        fs::throw_errno(errno, "flight recorder: cannot create directory '" + dir.path + "'");
      }
    }
  }
  const int follow = dir.chosen ? 0 : O_NOFOLLOW;
  fs::Fd fd(::open(dir.path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | follow));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ENOENT && !create) return -1;
    struct stat lst;
    if ((err == ELOOP || err == ENOTDIR) && ::lstat(dir.path.c_str(), &lst) == 0) {
      refuse(dir, std::string("is ") +
                      (S_ISLNK(lst.st_mode) ? "a symbolic link" : fs::file_kind(lst.st_mode)) +
                      " (owned by uid " + std::to_string(lst.st_uid) + "), not a directory");
    }
    fs::throw_errno(err, "flight recorder: cannot open the record directory '" + dir.path + "'");
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    fs::throw_errno(errno, "flight recorder: cannot stat the record directory '" + dir.path + "'");
  }
  const uid_t me = ::geteuid();
  if (st.st_uid != me) {
    refuse(dir, "belongs to uid " + std::to_string(st.st_uid) + " (mode " + octal_mode(st.st_mode) +
                    "), not to this process's uid " + std::to_string(me));
  }
  const mode_t open_to_others = dir.chosen ? (S_IWGRP | S_IWOTH) : (S_IRWXG | S_IRWXO);
  if ((st.st_mode & open_to_others) != 0) {
    refuse(dir, "has mode " + octal_mode(st.st_mode) + " (uid " + std::to_string(st.st_uid) +
                    "): " +
                    (dir.chosen ? "others may write it"
                                : "group or others have access to it; the default must be 0700"));
  }
  return fd.release();
}

std::string nonce_field(uint64_t nonce) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "\"nonce\": \"%016llx\"", static_cast<unsigned long long>(nonce));
  return buf;
}

// `items` (JSON objects, comma-separated) into a list that `out` is writing.
void append_listed(std::string& out, const std::string& items) {
  if (items.empty()) return;
  if (out.back() != '[') out += ',';
  out += items;
}

void write_exit_record() {
  Registry& r = registry();
  {
    // From now on the watchdog answers no peer: a process lingering in its
    // exit (MPI_Finalize) is not stuck, and its record stays the exit one.
    std::lock_guard<std::mutex> lock(r.mu);
    // A forked child that exits is not the rank: the record is its parent's.
    if (r.watchdog_pid != ::getpid()) return;
    r.exiting = true;
  }
  dump_record(Trigger::kExit, "the process exited normally", /*on_watchdog=*/false);
}

std::string dump_record(Trigger trigger, const std::string& reason, bool on_watchdog) {
  if (capacity() == 0) return std::string();
  Registry& r = registry();
  std::lock_guard<std::mutex> one_at_a_time(r.dump_mu);
  const bool failure = trigger == Trigger::kFailure || trigger == Trigger::kPeer;
  std::string path;
  try {
    Place dir;
    if (on_watchdog) {
      dir = watched_directory();
    } else {
      std::lock_guard<std::mutex> lock(r.mu);
      read_environment_locked(r);
      dir = directory_locked(r);
    }
    // A failure of its own, also one whose record the episode's first record
    // stands for (a rank answered as a peer, then failing in its next call).
    if (trigger == Trigger::kFailure) r.own_failure = true;
    if (failure && r.last_failure_dump_us >= 0 && now_us() - r.last_failure_dump_us < kEpisodeUs &&
        fs::directory_of(r.last_failure_path) == dir.path) {
      return r.last_failure_path;
    }
    std::string out;
    out.reserve(1 << 16);
    // An exit record never replaces a record of this process's own failure:
    // that one shows where it waited. It does replace a peer record: a
    // process that went on to exit normally (the peer record may have caught
    // it closing its groups) was not stuck.
    if (trigger == Trigger::kExit && r.own_failure) return std::string();
    static const char* const kTriggers[] = {"failure", "signal", "request", "peer", "exit"};
    out += "{\"format\": \"diststrat-flight-record\", \"version\": 1, \"trigger\": \"";
    out += kTriggers[static_cast<int>(trigger)];
    out += '"';
    uint64_t nonce;
    {
      std::lock_guard<std::mutex> lock(r.mu);
      nonce = r.nonce;
    }
    // On the first line, which the watchdog reads (see set_nonce).
    if (nonce != 0) out += ", " + nonce_field(nonce);
    out += ",\n \"reason\": ";
    json_text(out, reason.substr(0, 2000));
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    std::string job;
    std::lock_guard<std::mutex> lock(r.mu);
    job = job_of(r);
    out += ",\n \"process\": {\"rank\": " + std::to_string(r.rank) +
           ", \"size\": " + std::to_string(r.size) + ", \"host\": ";
    json_text(out, host, std::strlen(host));
    out += ", \"pid\": " + std::to_string(::getpid()) + ", \"job\": ";
    json_text(out, job);
    out += "},\n \"dump_time_us\": " + std::to_string(now_us()) +
           ", \"epoch_unix_us\": " + std::to_string(epoch_unix_us()) + ",\n \"calls\": [";
    // An exit record is written by every process of every job that ends
    // well, and a kept directory collects them: the newest calls say where
    // the process left.
    const bool at_exit = trigger == Trigger::kExit;
    for (const Recorder* rec : r.live) rec->append_json(out, at_exit ? kExitCalls : SIZE_MAX);
    for (size_t i = 0; at_exit && i < r.closed.size(); ++i) append_listed(out, r.closed[i].first);
    out += "\n ],\n \"members\": [";
    for (const Recorder* rec : r.live) rec->append_member_json(out);
    for (size_t i = 0; at_exit && i < r.closed.size(); ++i) append_listed(out, r.closed[i].second);
    out += "\n ]\n}\n";
    const fs::Fd dfd(open_directory(dir, /*create=*/true));
    const std::string name = file_name(job, r.rank);
    write_record_at(dfd.get(), dir.path, name, out);
    path = dir.path + "/" + name;
    if (failure) {
      r.last_failure_dump_us = now_us();
      r.last_failure_path = path;
    }
  } catch (const std::exception& e) {
    // At a normal end there is nothing to act on: no word.
    if (trigger != Trigger::kExit) {
      std::fprintf(stderr, "diststrat: the flight record was not written: %s\n", e.what());
    }
    return std::string();
  }
  return path;
}

}  // namespace detail

using detail::Registry;
using detail::registry;

void set_process(int rank, int size) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.rank = rank;
  r.size = size;
}

void set_job(const std::string& job) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.job = job;
  r.job_set = true;
  if (!r.live.empty()) detail::start_watchdog_locked(r);
}

void set_checkpoint_directory(const std::string& dir) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.checkpoint_dir = dir;
}

void set_nonce(uint64_t nonce) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.nonce = nonce;
}

std::string directory() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  detail::read_environment_locked(r);
  return detail::directory_locked(r).path;
}

std::string dump(Trigger trigger, const std::string& reason) {
  return detail::dump_record(trigger, reason, /*on_watchdog=*/false);
}

std::string dump_note(const std::string& path) {
  return path.empty() ? std::string() : " [flight record: " + path + "]";
}

}  // namespace flight

// diststrat/flight_recorder.h
std::string dump_flight_record(const std::string& reason) {
  return flight::dump(flight::Trigger::kRequest, reason);
}
std::string flight_record_directory() { return flight::directory(); }

}  // namespace diststrat
