// The one place diststrat reads its DISTSTRAT_* environment variables.
//
// Every variable is read through these helpers, so every one is validated
// alike: unset or empty = not given (std::nullopt); anything else must parse,
// or the call throws InvalidArgumentError quoting the variable and its value
// and saying what was expected. No helper caches: each call reads the
// environment (getenv; thread-safe as long as nobody calls setenv
// concurrently). The variables and their meanings are listed in
// docs/troubleshooting.md ("Environment variables").
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace diststrat {
class Logger;
namespace env {

// The raw text of `name`; nullopt when unset or empty.
std::optional<std::string> text(const char* name);
// A boolean: 1/0, true/false, yes/no, on/off (any case).
std::optional<bool> flag(const char* name);
// A decimal integer in [lo, hi].
std::optional<int64_t> integer(const char* name, int64_t lo, int64_t hi);
// A duration in seconds, fractional allowed ("30", "0.5", "1e2"); see
// parse_timeout_seconds (diststrat/collective.h) for the accepted range.
std::optional<std::chrono::milliseconds> seconds(const char* name);
// A duration given in code (an option's value) must be > 0 and at most 30
// days, as parse_timeout_seconds accepts: a larger one overflows the
// deadlines computed from it (now + timeout) into the past, and every wait
// would fail at once. InvalidArgumentError naming `what` otherwise.
void check_timeout(std::chrono::milliseconds value, const std::string& what);
// Any other format: `parse` turns the text into a T or throws; its error is
// rethrown as InvalidArgumentError prefixed with "NAME='value': ".
template <class T, class Parse>
std::optional<T> parsed(const char* name, Parse parse);

// Throws InvalidArgumentError "NAME='value': <what>".
[[noreturn]] void fail(const char* name, const std::string& value, const std::string& what);

// The DISTSTRAT_* variables anything in this project reads (env_vars.cc):
// the library, the scripts, the tests and benchmarks (`reader`).
struct KnownVariable {
  const char* name;
  const char* reader;
};
const std::vector<KnownVariable>& known_variables();
bool is_known(const std::string& name);
// The known name nearest to `name` (edit distance).
std::string closest_known(const std::string& name);
// One line per DISTSTRAT_* variable in the environment that is not known,
// naming the closest known one; sorted.
std::vector<std::string> unknown_variable_warnings();
// Logs those lines as warnings, once per process (every strategy calls it).
void warn_unknown_variables_once(const Logger& logger);

}  // namespace env
}  // namespace diststrat

#include "diststrat/error.h"

namespace diststrat {
namespace env {

template <class T, class Parse>
std::optional<T> parsed(const char* name, Parse parse) {
  const std::optional<std::string> v = text(name);
  if (!v) return std::nullopt;
  try {
    return parse(*v);
  } catch (const Error& e) {
    fail(name, *v, e.message());
  }
}

}  // namespace env
}  // namespace diststrat
