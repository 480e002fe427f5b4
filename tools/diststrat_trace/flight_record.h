// A flight record (format "diststrat-flight-record", version 1) as the
// analysis tool reads it: one JSON file per process, holding that process's
// last collective calls on every communicator it belongs to.
//
// A dump comes from outside (a dying process, a copied or half-written
// file, some other program's JSON), so the reader trusts nothing: every
// field is checked for its type and range, and a file that fails any check
// is skipped as a whole with one line that names it and says why.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace diststrat::trace {

enum class CallState { kQueued, kStarted, kCompleted, kFailed, kAborted };
const char* state_name(CallState s);
inline bool in_flight(CallState s) { return s == CallState::kQueued || s == CallState::kStarted; }
// A call a rank was in when the record was written: in flight, or ended by
// its failure (the library writes the record as a call fails, and a rank
// keeps the first record of a failure; the call it failed in is where it
// waited).
inline bool stuck_in(CallState s) {
  return in_flight(s) || s == CallState::kFailed || s == CallState::kAborted;
}

// Bounds the reader enforces, so that no later loop or sum can run away on a
// hostile file: group sizes and ranks up to kMaxGroupSize, seq numbers,
// counts, bytes and times up to kMaxValue (sums of two stay in int64_t).
constexpr int kMaxGroupSize = 1 << 20;
constexpr int64_t kMaxValue = int64_t{1} << 60;
// Larger files are skipped unread: a ring buffer of calls is far smaller, and
// the parsed JSON takes about ten times the file in memory.
constexpr int64_t kMaxFileBytes = int64_t{256} << 20;
// Arrays and objects nest at most this deep: a record nests 4 deep (the
// record, calls, a call, its waiting_on). Deeper files are refused before
// they are parsed: parsed nesting takes about 20 times its text, and
// freeing it allocates again.
constexpr int kMaxNesting = 32;
// The bound on the tool's memory (docs/flight_recorder.md): at most this
// many bytes per byte of the largest file (the parsed form of one file at a
// time), plus as many per byte of all usable records together (what is kept
// of them and the analysis), whatever the files claim.
constexpr size_t kMemoryPerFileByte = 32;

// One recorded collective call. Times are microseconds on the dumping
// process's clock, -1 when the call did not reach that point.
struct Call {
  std::string group;
  int group_rank = 0;
  int group_size = 1;
  int64_t seq = 0;
  int thread = 0;
  std::string kind;       // all_reduce, broadcast, ... (other strings possible)
  std::string name;       // the caller's tensor name(s); may be ""
  std::string name_hash;  // of the whole name (optional; a long name is cut in `name`)
  int64_t count = -1;
  std::string dtype;
  std::string op;  // "" when none
  int64_t root = -1;
  std::string algorithm;
  int64_t bytes = -1;
  int64_t enqueue_us = -1;
  int64_t start_us = -1;
  int64_t end_us = -1;
  CallState state = CallState::kQueued;
  std::vector<int> waiting_on;  // group ranks not yet heard from (optional)
  std::string error;            // failed/aborted only (optional)
  std::string site;             // call site (optional)
};

// A member the process holds (optional list): known even before its first
// call.
struct MemberDecl {
  std::string group;
  int group_rank = 0;
  int group_size = 1;
  int thread = 0;  // the thread that made it
};

// One process's dump.
struct Dump {
  std::string file;  // the file name, without its directory
  int rank = -1;     // job-level process rank, -1 when unknown
  int size = 0;
  std::string host;
  int64_t pid = 0;
  std::string job;       // process.job (optional): the job the process belongs to
  bool has_job = false;  // process.job present ("" = a process of no job: its own)
  // failure | peer | signal | request | exit (optional). exit: written as
  // the process closed its last group normally (no exception in flight, no
  // failure of its own): it ended, it does not compute.
  std::string trigger;
  std::string reason;
  int64_t dump_time_us = 0;
  int64_t epoch_unix_us = 0;  // only for lining up a merged trace
  std::vector<Call> calls;    // oldest first
  std::vector<MemberDecl> members;
  // Participants (group, group rank) this file records that another file
  // records too and that the other file's copy was chosen for: their calls
  // are left out of the analysis (load_dir fills it).
  std::set<std::pair<std::string, int>> superseded;
};

// Parses one dump's text into *out. On failure returns false and sets *why
// to a short reason: "truncated JSON at byte 812", "not a flight record
// (format 'x')", "calls[3].seq is a string, not an integer".
bool parse_dump(const std::string& text, Dump* out, std::string* why);

struct LoadResult {
  std::vector<Dump> dumps;  // the usable ones, in file name order
  // One line per skipped file ("skipping flight-rank2.json: truncated JSON
  // at byte 812") and per note about a usable one (a participant recorded
  // twice), in file name order.
  std::vector<std::string> messages;
  int files_seen = 0;     // *.json entries in the directory
  int files_skipped = 0;  // of those, how many are not in `dumps`
  // Set when there is nothing to analyze: the directory cannot be read, has
  // no *.json file, or every one was skipped.
  std::string error;
};

// Reads every *.json file in `dir` (not its subdirectories; other names are
// ignored). Never throws for bad input: a bad file is a message, a bad
// directory is `error`. Where two files record the same participant, the
// newer record of it (higher newest seq; on a tie, the later dump of the
// same process; then the first file by name) is used, and a file all of
// whose participants another file records better is skipped as a duplicate.
// With records of several processes, each process's own groups
// (in-process#N, gpu-local#N) are named after it: "in-process#0 of process
// 2 (pid 873)".
LoadResult load_dir(const std::string& dir);

// `s` as messages quote it: control characters escaped, at most `max_bytes`
// bytes (cut at a character boundary), then "... (N bytes)".
std::string echo_text(const std::string& s, size_t max_bytes = 120);

}  // namespace diststrat::trace
