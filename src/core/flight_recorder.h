// The flight recorder: the last N collective calls of every communicator of
// this process, one ring buffer per group member, written out as one JSON
// file per process (docs/flight_recorder.md has the format) when a call
// fails (deadline, abort, mismatch), on SIGUSR2, on request
// (dump_flight_record), and by a watchdog thread when another process of the
// same job has written its record after a failure -- so that a rank stuck in
// its own compute, which never reaches a deadline, leaves its record too.
// `diststrat-trace analyze DIR` merges the files into one verdict.
//
// Cost: a recorded call takes one uncontended mutex twice, two clock reads
// and a copy of at most kNameBytes of its name into a preallocated slot; no
// allocation once the ring is warm. DISTSTRAT_FLIGHT_RECORDER=N sets N
// (default 2048; 0 turns recording and dumps off).
// DISTSTRAT_FLIGHT_RECORDER_SITES=1 also keeps each call's site (a short
// backtrace, symbolized only when a record is written; about 1-2 us more
// per call).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace diststrat {
namespace flight {

enum class State : uint8_t { kQueued, kStarted, kCompleted, kFailed, kAborted };
const char* state_name(State s);

// Why a record is written; "failure" dumps make the job's other processes
// write theirs (their watchdog), the others do not. kExit: a process of a
// job exits normally (return from main, exit()) without a failure record
// of its own: the record (the newest calls of its groups, also of those it
// closed) says it ended, so that a rank that finished its loop is not taken
// for one that died.
enum class Trigger { kFailure, kSignal, kRequest, kPeer, kExit };

// Microseconds since this process's recorder clock started (steady).
int64_t now_us();

// One rank's calls in one group. Thread-safe; begin/end from the calling
// thread, the dump from any thread.
class Recorder {
 public:
  static constexpr size_t kNameBytes = 96;
  static constexpr int kSiteFrames = 6;

  // `group` must name the same group alike on every member (seq numbers are
  // per group and member). Registers with the process's dump.
  Recorder(std::string group, int group_rank, int group_size);
  ~Recorder();
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  bool on() const { return ring_size_ > 0; }
  // Records a call starting now; returns its sequence number (for end()).
  // `kind`, `dtype`, `op` ("" when none) and `algorithm` must be static
  // strings (kept as pointers).
  uint64_t begin(const char* kind, const std::string& name, uint64_t count, const char* dtype,
                 const char* op, int root, uint64_t bytes);
  void set_algorithm(uint64_t seq, const char* algorithm);
  // Marks the call done; `error` for kFailed / kAborted.
  void end(uint64_t seq, State state, const std::string& error = std::string());
  // After a reset() of the group every member starts a new numbering: the
  // group name gets a "#rN" suffix (N = resets so far).
  void restart();

  // The retained calls (at most the `newest` ones) as JSON objects, oldest
  // first, each preceded by a comma unless `out` ends with '['.
  void append_json(std::string& out, size_t newest = SIZE_MAX) const;
  // This member as a JSON object (group, group_rank, group_size, thread of
  // its creation), likewise: a member with no call yet is still known.
  void append_member_json(std::string& out) const;
  // This rank's compute time before each call: from the end of its previous
  // call to the start of this one (microseconds; -1 for the first).
  int64_t last_gap_us() const;

 private:
  struct Entry {
    uint64_t seq = 0;
    int64_t start_us = -1, end_us = -1;
    uint64_t count = 0, bytes = 0;
    int32_t root = -1;
    uint32_t thread = 0;
    const char* kind = "";
    const char* dtype = "";
    const char* op = "";
    const char* algorithm = "";
    State state = State::kQueued;
    uint8_t name_len = 0;
    uint64_t name_hash = 0;  // of the whole name
    uint8_t site_frames = 0;
    void* site[kSiteFrames];  // the caller's return addresses (sites on)
    char name[kNameBytes];
    std::string error;  // allocates only on failure
    // Written by the recording thread without the lock (note_waiting).
    std::atomic<int32_t> waiting_on{-1};
  };
  Entry* find(uint64_t seq);

  mutable std::mutex mu_;
  std::string group_;
  const std::string base_group_;
  const int group_rank_, group_size_;
  std::unique_ptr<Entry[]> ring_;
  size_t ring_size_ = 0;
  uint64_t next_seq_ = 0;
  int resets_ = 0;
  int64_t last_end_us_ = -1, last_gap_us_ = -1;
  uint32_t creator_thread_ = 0;
};

// Names the algorithm of the call this thread is recording (if any): for
// communicators that choose one per call. `algorithm` must be static.
void note_algorithm(const char* algorithm);
// The rank (in the call's group) the call this thread is recording now
// waits for; a record written meanwhile shows it ("waiting_on"). A relaxed
// store: cheap enough for every wait of a transfer.
void note_waiting(int peer);

// This process's place in the job, written into its dumps (rank -1 =
// unknown) and its file name. Set by whatever resolves the cluster.
void set_process(int rank, int size);
// The job the process belongs to (its dumps' file names and the watchdog's
// test for "a process of my job"); default: Slurm's job id, else Open MPI's
// job id, else none (a lone process: no peers to wake).
void set_job(const std::string& job);
// A checkpoint directory: where dumps go when DISTSTRAT_FLIGHT_RECORDER_DIR
// is not set.
void set_checkpoint_directory(const std::string& dir);
// The run's nonce: a random number every process of the run holds alike,
// set where the job's communicator is made (the world rank 0's, broadcast;
// an elastic group's rank 0's, through the store). Every record carries it
// on its first line, and the watchdog answers a failure record only when it
// carries the same (and this uid wrote it), so that another run under the
// same job name (a second srun step, a requeued job, a new elastic run at
// the same URL) cannot make this one write or end. Not a secret from the
// same uid, which can read the records. 0 (the default) = none: the
// watchdog answers nobody.
void set_nonce(uint64_t nonce);

// Where this process's record goes: DISTSTRAT_FLIGHT_RECORDER_DIR, else the
// checkpoint directory, else $TMPDIR (or /tmp)/diststrat-flight-<job>. A
// record is written there only when the directory is safe (this uid's,
// nobody else may write it; the default: 0700 and not a symlink), else it
// is refused, with the reason on stderr.
std::string directory();
// Writes every live recorder of the process into
// <directory>/flight-<job>-rank<R>-pid<P>.json (atomically); returns the
// path, or "" when recording is off or the write failed (reported on
// stderr: a dump never throws, it runs on error paths).
std::string dump(Trigger trigger, const std::string& reason);
// A sentence for an error message: "flight record: <path>" (or "").
std::string dump_note(const std::string& path);

}  // namespace flight
}  // namespace diststrat
