// The flight recorder's record file (flight_recorder.h): the process's
// registry of recorders, its job and rank, the directory its record goes
// to, and the record written there.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

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

std::string directory_locked(Registry& r) {
  if (!r.env_dir.empty()) return r.env_dir;
  if (!r.checkpoint_dir.empty()) return r.checkpoint_dir;
  const std::string job = job_of(r);
  return r.env_tmpdir + "/diststrat-flight-" +
         (job.empty() ? "pid" + std::to_string(::getpid()) : file_safe(job));
}

// The directory as last read on a program's thread (the watchdog's).
std::string watched_directory() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return directory_locked(r);
}

std::string dump_record(Trigger trigger, const std::string& reason, bool on_watchdog) {
  if (capacity() == 0) return std::string();
  Registry& r = registry();
  std::lock_guard<std::mutex> one_at_a_time(r.dump_mu);
  const bool failure = trigger == Trigger::kFailure || trigger == Trigger::kPeer;
  std::string path, dir;
  try {
    dir = on_watchdog ? watched_directory() : directory();
    if (failure && r.last_failure_dump_us >= 0 && now_us() - r.last_failure_dump_us < kEpisodeUs &&
        fs::directory_of(r.last_failure_path) == dir) {
      return r.last_failure_path;
    }
    std::string out;
    out.reserve(1 << 16);
    static const char* const kTriggers[] = {"failure", "signal", "request", "peer"};
    out += "{\"format\": \"diststrat-flight-record\", \"version\": 1, \"trigger\": \"";
    out += kTriggers[static_cast<int>(trigger)];
    out += "\",\n \"reason\": ";
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
    for (const Recorder* rec : r.live) rec->append_json(out);
    out += "\n ],\n \"members\": [";
    for (const Recorder* rec : r.live) rec->append_member_json(out);
    out += "\n ]\n}\n";
    make_directories(dir);
    path = dir + "/" + file_name(job, r.rank);
    write_file_atomically(path, out.data(), out.size());
    if (failure) {
      r.last_failure_dump_us = now_us();
      r.last_failure_path = path;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "diststrat: the flight record was not written: %s\n", e.what());
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

std::string directory() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  detail::read_environment_locked(r);
  return detail::directory_locked(r);
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
