// The merged flight record as Chrome trace events, in the shape the
// library's Timeline writes (src/core/timeline.h), so that a user can load
// both into Perfetto at once: one process lane per dump (pid = process
// rank), one thread lane per (group, thread) of it, a complete event ("X")
// per call with its fields as args, and an instant event at the dump.
// Timestamps are microseconds on the system clock (the dump's
// epoch_unix_us + its own times), as the Timeline's are. A call still in
// flight, or one without an end, ends at the dump time.
#pragma once

#include <string>
#include <vector>

#include "flight_record.h"

namespace diststrat::trace {

// Thread lanes of the flight record start here, clear of the Timeline's
// own (0 communication, 1.. replicas, 1000 steps).
constexpr int kFirstFlightLane = 2000;
// The pid of a dump whose process rank is unknown: this + its position.
constexpr int kUnknownRankPid = 2000000;  // above every process rank (kMaxGroupSize)

// One JSON object per element (Timeline::write_file's `events`).
std::vector<std::string> chrome_trace_events(const std::vector<Dump>& dumps);

}  // namespace diststrat::trace
