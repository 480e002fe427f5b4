// What the flight recorder's three files share (internal to them): the
// process's registry of recorders and where its records go. The rings are in
// flight_recorder.cc, the record file and its directory in
// flight_record_file.cc, the watchdog in flight_watchdog.cc.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/file_util.h"
#include "core/flight_recorder.h"

namespace diststrat {
namespace flight {
namespace detail {

// Failures within this long of the last record written for one are the
// same episode (see Registry::last_failure_dump_us).
constexpr int64_t kEpisodeUs = 10 * 1000 * 1000;
// Calls per group in an exit record (Trigger::kExit), and how many closed
// groups it shows.
constexpr size_t kExitCalls = 16;
constexpr size_t kClosedGroups = 64;

// The wall clock (microseconds since 1970) at this process's recorder epoch.
int64_t epoch_unix_us();
// DISTSTRAT_FLIGHT_RECORDER (the ring size; 0 = off), read once.
size_t capacity();
// Appends `p[0, n)` as a JSON string (quoted, escaped).
void json_text(std::string& out, const char* p, size_t n);
void json_text(std::string& out, const std::string& s);

struct Registry {
  std::mutex mu;  // guards everything below
  std::vector<Recorder*> live;
  // In a process of a job: the newest calls (JSON) and the member entry of
  // the groups closed last, for the exit record.
  std::deque<std::pair<std::string, std::string>> closed;
  bool exiting = false;    // write_exit_record has run
  pid_t watchdog_pid = 0;  // the process that started the watchdog
  // A call of this process failed (a record was asked for its own failure,
  // not only a peer's). Guarded by dump_mu.
  bool own_failure = false;
  int rank = -1, size = 0;
  std::string job, checkpoint_dir;
  bool job_set = false;
  std::mutex dump_mu;  // one dump at a time
  int64_t last_peer_dump_us = -1;
  // The last record written after a failure (or a peer's), and when: the
  // first record of a failure is the one that shows where every rank
  // waited, so later failures of the same episode (the others' calls
  // failing one after another, a stuck rank waking) do not overwrite it.
  int64_t last_failure_dump_us = -1;
  std::string last_failure_path;
  // The watchdog.
  bool watchdog_started = false;
  int signal_pipe[2] = {-1, -1};
  // The environment's part of the directory and DISTSTRAT_FLIGHT_RECORDER_EXIT,
  // read on the program's threads only: getenv races with setenv, which
  // MPI_Init and PMIx call while the watchdog may already run (a Slurm job's
  // process has its job from the start). The watchdog uses the values read
  // last (when a communicator was made or a record written).
  std::string env_dir, env_tmpdir = "/tmp";
  bool exit_on_peer_failure = false;
  // The run's nonce (set_nonce; 0 = none yet).
  uint64_t nonce = 0;
};

Registry& registry();

std::string job_of(Registry& r);
// "flight-<job>-": the start of every record file name of the job.
std::string file_prefix(const std::string& job);
// This process's record file name.
std::string file_name(const std::string& job, int rank);
void read_environment_locked(Registry& r);

// Where the records go, and whether someone chose it (the variable or a
// checkpoint directory) or it is the default under $TMPDIR.
struct Place {
  std::string path;
  bool chosen = false;
};
Place directory_locked(Registry& r);
// The directory as last read on a program's thread (the watchdog's).
Place watched_directory();
// Opens the directory (O_DIRECTORY; the default with O_NOFOLLOW), creating
// it with mode 0700 when `create` and it is missing, and checks the open
// directory (fstat, so a swap after the check does not help): it must be
// this process's uid's (geteuid), and nobody else may write it; the default,
// a predictable name in a directory every user can write, must also be a
// real directory (not a symlink) with no permission for group or others.
// Throws PermissionDeniedError naming the path, its owner's uid and mode
// otherwise. Returns the descriptor (the caller closes it); a missing
// directory without `create`: -1.
int open_directory(const Place& dir, bool create);
// `"nonce": "<16 hex digits>"`, as the record's first line carries it.
std::string nonce_field(uint64_t nonce);

std::string dump_record(Trigger trigger, const std::string& reason, bool on_watchdog);
// At a normal end of a process of a job (return from main, exit()): a
// record that says so, so that a rank that finished its loop is not taken
// for one that died. Not after a failure record of its own (dump_record).
void write_exit_record();
// Starts the watchdog thread once the process belongs to a job.
void start_watchdog_locked(Registry& r);

}  // namespace detail
}  // namespace flight
}  // namespace diststrat
