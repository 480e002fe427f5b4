#include "diststrat/logging.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>

#include "core/env.h"

namespace diststrat {

LogLevel parse_log_level(const std::string& text) {
  std::string t = text;
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  if (t == "debug") return LogLevel::kDebug;
  if (t == "info") return LogLevel::kInfo;
  if (t == "warning" || t == "warn") return LogLevel::kWarning;
  if (t == "error") return LogLevel::kError;
  if (t == "off" || t == "none") return LogLevel::kOff;
  throw InvalidArgumentError("unknown log level '" + text +
                             "' (expected debug, info, warning, error or off)");
}

Logger::Logger(LogLevel level, std::string prefix) : level_(level), prefix_(std::move(prefix)) {
  if (auto env = env::parsed<LogLevel>("DISTSTRAT_LOG_LEVEL", parse_log_level)) level_ = *env;
}

void Logger::set_sink(Sink sink) {
  std::lock_guard<std::mutex> lock(mu_);
  sink_ = std::move(sink);
}

void Logger::log(LogLevel level, const std::string& message) const {
  if (!enabled(level)) return;
  static const char* kNames[] = {"D", "I", "W", "E"};
  std::lock_guard<std::mutex> lock(mu_);
  if (sink_) {
    sink_(level, prefix_.empty() ? message : prefix_ + " " + message);
    return;
  }
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  std::tm tm{};
  localtime_r(&t, &tm);
  char stamp[16];
  std::strftime(stamp, sizeof(stamp), "%H:%M:%S", &tm);
  std::fprintf(stderr, "diststrat %s %s %s%s%s\n", kNames[static_cast<int>(level)], stamp,
               prefix_.c_str(), prefix_.empty() ? "" : " ", message.c_str());
}

PlacementLog::PlacementLog(bool enabled) : enabled_(enabled) {
  if (auto env = env::flag("DISTSTRAT_LOG_DEVICE_PLACEMENT")) enabled_ = *env;
}

void PlacementLog::set_sink(Sink sink) {
  std::lock_guard<std::mutex> lock(mu_);
  sink_ = std::move(sink);
}

void PlacementLog::record(const std::string& kind, const std::string& name,
                          const Device& device) const {
  if (!enabled_) return;
  const std::string line = kind + " " + name + " on " + device.to_string();
  std::lock_guard<std::mutex> lock(mu_);
  if (sink_) {
    sink_(line);
  } else {
    std::fprintf(stderr, "diststrat placement: %s\n", line.c_str());
  }
}

}  // namespace diststrat
