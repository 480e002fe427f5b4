#include "diststrat/fault.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "core/env.h"
#include "core/user_text.h"
#include "diststrat/error.h"

namespace diststrat {

const char* fault_kind_name(FaultKind kind) {
  switch (kind) {
    case FaultKind::kNone:
      return "none";
    case FaultKind::kThrow:
      return "throw";
    case FaultKind::kExit:
      return "exit";
    case FaultKind::kStall:
      return "stall";
    case FaultKind::kCorrupt:
      return "corrupt";
    case FaultKind::kOversize:
      return "oversize";
  }
  return "?";
}

FaultInjection FaultInjection::parse(const std::string& text) {
  FaultInjection f;
  // Keywords ignore case, like the log levels (DISTSTRAT_LOG_LEVEL=WARNING).
  std::string lower = text;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower.empty() || lower == "none") return f;
  const size_t a = text.find(':');
  const size_t b = a == std::string::npos ? a : text.find(':', a + 1);
  DISTSTRAT_CHECK(b != std::string::npos, kInvalidArgument, "fault injection '", echo(text),
                  "': expected kind:rank:step");
  const std::string kind = lower.substr(0, a);
  for (FaultKind k : {FaultKind::kThrow, FaultKind::kExit, FaultKind::kStall, FaultKind::kCorrupt,
                      FaultKind::kOversize}) {
    if (kind == fault_kind_name(k)) f.kind = k;
  }
  DISTSTRAT_CHECK(f.active(), kInvalidArgument, "fault injection '", echo(text),
                  "': unknown kind '", echo(text.substr(0, a)),
                  "' (throw, exit, stall, corrupt, oversize; any case)");
  // Digits only: stoi/stoll would skip leading spaces and accept a sign.
  const auto digits = [](const std::string& x) {
    return !x.empty() && x.size() <= 18 &&
           std::all_of(x.begin(), x.end(), [](unsigned char c) { return std::isdigit(c); });
  };
  const std::string r = text.substr(a + 1, b - a - 1), s = text.substr(b + 1);
  DISTSTRAT_CHECK(digits(r) && digits(s), kInvalidArgument, "fault injection '", echo(text),
                  "': rank and step must be non-negative integers (digits only, no spaces)");
  try {
    f.rank = std::stoi(r);
    f.step = std::stoll(s);
  } catch (const std::exception&) {
    throw InvalidArgumentError("fault injection '" + echo(text) + "': rank or step out of range");
  }
  return f;
}

FaultInjection FaultInjection::from_env() {
  return env::parsed<FaultInjection>("DISTSTRAT_FAULT", parse).value_or(FaultInjection{});
}

}  // namespace diststrat
