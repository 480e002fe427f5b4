#include "core/env.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "core/user_text.h"
#include "diststrat/collective.h"

namespace diststrat {

namespace {
// A plain decimal number: digits with at most one '.', at least one digit,
// then an optional exponent (e/E, optional sign, digits). No sign, no hex,
// no "inf"/"nan", no spaces: what strtod accepts beyond this is a typo here.
bool is_decimal(const std::string& t) {
  size_t i = 0, digits = 0;
  while (i < t.size() && std::isdigit(static_cast<unsigned char>(t[i]))) ++i, ++digits;
  if (i < t.size() && t[i] == '.') {
    ++i;
    while (i < t.size() && std::isdigit(static_cast<unsigned char>(t[i]))) ++i, ++digits;
  }
  if (digits == 0) return false;
  if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
    ++i;
    if (i < t.size() && (t[i] == '+' || t[i] == '-')) ++i;
    size_t exp = 0;
    while (i < t.size() && std::isdigit(static_cast<unsigned char>(t[i]))) ++i, ++exp;
    if (exp == 0) return false;
  }
  return i == t.size();
}
}  // namespace

namespace env {
void check_timeout(std::chrono::milliseconds value, const std::string& what) {
  constexpr std::chrono::milliseconds kMax = std::chrono::hours(24 * 30);
  DISTSTRAT_CHECK(value.count() > 0 && value <= kMax, kInvalidArgument, what, " of ", value.count(),
                  " ms: a timeout must be > 0 ms and at most 30 days (", kMax.count(), " ms)");
}
}  // namespace env

std::chrono::milliseconds parse_timeout_seconds(const std::string& text) {
  // 30 days: longer than any job waits for a peer, and far from overflowing
  // the clocks' time_point arithmetic.
  constexpr double kMax = 30.0 * 24 * 3600;
  // Deadlines are whole milliseconds: a smaller value would silently become
  // one (or zero).
  constexpr double kMin = 0.001;
  double secs = 0;
  if (is_decimal(text)) {
    errno = 0;
    secs = std::strtod(text.c_str(), nullptr);
    if (errno == ERANGE && secs != 0) secs = HUGE_VAL;
  }
  if (!is_decimal(text) || !std::isfinite(secs) || !(secs > 0) || secs > kMax) {
    throw InvalidArgumentError("timeout '" + echo(text) +
                               "': expected seconds, a decimal number > 0 and at most 2592000 "
                               "(30 days), e.g. 300 or 0.5");
  }
  if (secs < kMin) {
    throw InvalidArgumentError("timeout '" + echo(text) +
                               "': below the minimum; a timeout is at least 0.001 seconds (1 ms)");
  }
  // Whole milliseconds, rounded up (0.0015 s waits 2 ms, never less).
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(secs * 1000.0 - 1e-9)));
}

std::string timeout_seconds_error(const std::string& text) {
  try {
    parse_timeout_seconds(text);
    return "";
  } catch (const Error& e) {
    return e.message();
  }
}

std::optional<std::chrono::milliseconds> timeout_from_env() {
  return env::seconds("DISTSTRAT_TIMEOUT");
}

namespace env {

void fail(const char* name, const std::string& value, const std::string& what) {
  throw InvalidArgumentError(std::string(name) + "='" + echo(value) + "': " + what);
}

std::optional<std::string> text(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

std::optional<bool> flag(const char* name) {
  const std::optional<std::string> v = text(name);
  if (!v) return std::nullopt;
  std::string t = *v;
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  if (t == "1" || t == "true" || t == "yes" || t == "on") return true;
  if (t == "0" || t == "false" || t == "no" || t == "off") return false;
  fail(name, *v, "expected 1 or 0 (also true/false, yes/no, on/off)");
}

std::optional<int64_t> integer(const char* name, int64_t lo, int64_t hi) {
  const std::optional<std::string> v = text(name);
  if (!v) return std::nullopt;
  const char* s = v->c_str();
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(s, &end, 10);
  if (std::isspace(static_cast<unsigned char>(*s)) || end == s || *end != '\0' || errno == ERANGE ||
      x < lo || x > hi) {
    fail(name, *v, "expected an integer from " + std::to_string(lo) + " to " + std::to_string(hi));
  }
  return static_cast<int64_t>(x);
}

std::optional<std::chrono::milliseconds> seconds(const char* name) {
  return parsed<std::chrono::milliseconds>(name, parse_timeout_seconds);
}

}  // namespace env
}  // namespace diststrat
