// A Chrome trace-event recorder (open the JSON in Perfetto or
// chrome://tracing). One Timeline per strategy, not a process global: events
// are kept in memory and written by write(). Thread-safe.
#pragma once

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

namespace diststrat {

class Timeline {
 public:
  using Clock = std::chrono::steady_clock;

  // `pid` is the process lane (the rank); events carry it.
  explicit Timeline(int pid = 0);

  // Turns recording on or off (off: record calls cost a branch).
  void enable(bool on) { enabled_ = on; }
  bool enabled() const { return enabled_; }

  // Names a thread lane ("communication", "replica 0").
  void name_thread(int tid, const std::string& name);
  // A complete event ("ph":"X") from begin to end on lane tid. `args` is a
  // JSON object body without braces, e.g. "\"bytes\": 4096".
  void complete(const std::string& name, const char* category, int tid, Clock::time_point begin,
                Clock::time_point end, const std::string& args = "");
  // The recorded events as a JSON array body (comma-separated objects).
  std::string events_json() const;
  size_t num_events() const;
  // Writes {"traceEvents": [<events>...]} to `path` (creating or replacing
  // it atomically; FailedPreconditionError for a path that is a device, FIFO
  // or directory); `events` lets a caller merge other ranks' events_json().
  static void write_file(const std::string& path, const std::vector<std::string>& events);
  // Throws unless `path` can be written later: its directory exists
  // (InvalidArgumentError) and is writable (PermissionDeniedError), and it
  // is absent or a regular file (a directory, a device such as /dev/full, a
  // FIFO: InvalidArgumentError; write_file would refuse to replace it). `source` names where the path came from
  // (DISTSTRAT_TIMELINE or an option) in the message. Checked when a
  // strategy is made, so a bad path fails at once, not at the end of a job.
  static void check_path(const std::string& path, const std::string& source);

 private:
  int pid_;
  bool enabled_ = false;
  mutable std::mutex mu_;
  std::vector<std::string> events_;
};

}  // namespace diststrat
