// The verdict on a hang from every rank's flight record.
//
// A participant is (group, group rank). Per group, the analysis walks seq
// upward over the range every member with a record retains (older seqs are
// unknown, not missing: a ring buffer forgets them) and stops at the first
// seq where members differ:
//   - mismatch: two members recorded different calls (kind, name, count,
//     dtype, op, root) under one seq;
//   - missing: some members entered seq k, others' newest seq is below k;
//     each of those is in another call (its newest queued/started one,
//     preferring its own thread) or in compute (nothing in flight);
//   - no record: a member of the group left no dump at all (checked once
//     the members that did agree).
// A missing member that waits in a call of another group leads there: that
// group is analysed too, and the verdict is the root of the chain (the
// nearest rank in compute, without a record, or mismatched), with the chain
// in the details. The first group is the largest one that diverges; a chain
// that comes back to a group it passed is a cycle (ranks waiting for each
// other) and the verdict stays at its start.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flight_record.h"

namespace diststrat::trace {

struct Verdict {
  enum class Kind { kNoDivergence, kMismatch, kMissing, kNoRecord };
  Kind kind = Kind::kNoDivergence;
  std::string line;                  // the one-line verdict
  std::vector<std::string> details;  // the chain, other suspects, notes

  // The root of the chain, for tests and scripts.
  std::string group;              // the group of the deciding call ("" when none)
  int64_t seq = -1;               // the deciding call's seq (-1 when none)
  std::string call_kind;          // that call as the ranks that entered it recorded it
  std::string tensor_name;        // its name, as recorded (not escaped)
  int culprit_rank = -1;          // group rank in `group`; -1 when none or ambiguous
  int culprit_process_rank = -1;  // its process rank; -1 when unknown
  // "mismatch", "compute", "in_call" (waits in another call: see
  // culprit_call), "exited" (its process ended normally: its record was
  // written at exit), "no_record", "unknown" (a member no thread of its
  // process is known to drive), or "" (no divergence).
  std::string culprit_state;
  std::string culprit_call;  // in_call: "broadcast #88 of group 'ps'"
};

// The verdict on these dumps (load_dir's, duplicates resolved).
// `files_skipped` (unusable files) is mentioned where a missing record may
// be one of them. Never throws on any content the reader accepts.
Verdict analyze(const std::vector<Dump>& dumps, int files_skipped = 0);

// Per group: its size, which ranks left a record, and per rank the retained
// seq range, the newest call and its state. At most `max_rows` ranks a
// group (the unusual ones first), then a count of the rest.
std::string group_table(const std::vector<Dump>& dumps, size_t max_rows = 32);

// "512 B", "4 KB", "1.2 MB" (1024-based).
std::string human_bytes(int64_t bytes);

}  // namespace diststrat::trace
