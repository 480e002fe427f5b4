// A small leveled logger. Each strategy owns one (no process-global logger),
// with its level from the options, overridden by DISTSTRAT_LOG_LEVEL
// (debug|info|warning|error|off) when that variable is set.
//
// Rules: logging never communicates; log() may be called from any thread
// (lines are written whole); set_sink and set_level from the thread that
// owns the strategy, before run().
#pragma once

#include <functional>
#include <mutex>
#include <string>

#include "diststrat/device.h"
#include "diststrat/error.h"

namespace diststrat {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kOff = 4 };

// Parses "debug", "info", "warning"/"warn", "error", "off" (any case).
LogLevel parse_log_level(const std::string& text);

class Logger {
 public:
  using Sink = std::function<void(LogLevel, const std::string&)>;

  // `level` is used unless DISTSTRAT_LOG_LEVEL is set (the env wins, so that a
  // deployed job can be made verbose without rebuilding). `prefix` is put in
  // front of every line, e.g. "[rank 1]".
  explicit Logger(LogLevel level = LogLevel::kWarning, std::string prefix = "");

  LogLevel level() const { return level_; }
  void set_level(LogLevel level) { level_ = level; }
  bool enabled(LogLevel level) const { return level >= level_ && level_ != LogLevel::kOff; }
  // Replaces the default sink (stderr). Thread-safe to call log() concurrently.
  void set_sink(Sink sink);

  void log(LogLevel level, const std::string& message) const;
  template <typename... Args>
  void debug(const Args&... a) const {
    emit(LogLevel::kDebug, a...);
  }
  template <typename... Args>
  void info(const Args&... a) const {
    emit(LogLevel::kInfo, a...);
  }
  template <typename... Args>
  void warning(const Args&... a) const {
    emit(LogLevel::kWarning, a...);
  }
  template <typename... Args>
  void error(const Args&... a) const {
    emit(LogLevel::kError, a...);
  }

 private:
  template <typename... Args>
  void emit(LogLevel level, const Args&... a) const {
    if (enabled(level)) log(level, detail::str_cat(a...));
  }
  LogLevel level_;
  std::string prefix_;
  Sink sink_;
  mutable std::mutex mu_;
};

// Device placement logging (TensorFlow's tf.debugging.set_log_device_placement):
// when enabled, every variable creation, collective and op the library runs
// reports the device it ran on, one line each:
//   "diststrat placement: op dense_forward on /device:GPU:1"
// Off by default; DISTSTRAT_LOG_DEVICE_PLACEMENT=1 (or 0) overrides the
// constructor's value. Thread-safe.
class PlacementLog {
 public:
  using Sink = std::function<void(const std::string&)>;
  explicit PlacementLog(bool enabled = false);

  bool enabled() const { return enabled_; }
  void set_enabled(bool on) { enabled_ = on; }
  // Replaces the default sink (stderr); the sink gets the line without the
  // "diststrat placement: " prefix.
  void set_sink(Sink sink);
  // Records "<kind> <name> on <device>" when enabled, e.g. kind "variable",
  // "collective all_reduce", "op".
  void record(const std::string& kind, const std::string& name, const Device& device) const;

 private:
  bool enabled_;
  Sink sink_;
  mutable std::mutex mu_;
};

}  // namespace diststrat
