#include "diststrat/fault.h"

#include <cstdlib>

#include "core/env.h"
#include "diststrat/error.h"

namespace diststrat {

const char* fault_kind_name(FaultKind kind) {
  switch (kind) {
    case FaultKind::kNone: return "none";
    case FaultKind::kThrow: return "throw";
    case FaultKind::kExit: return "exit";
    case FaultKind::kStall: return "stall";
    case FaultKind::kCorrupt: return "corrupt";
    case FaultKind::kOversize: return "oversize";
  }
  return "?";
}

FaultInjection FaultInjection::parse(const std::string& text) {
  FaultInjection f;
  if (text.empty() || text == "none") return f;
  const size_t a = text.find(':');
  const size_t b = a == std::string::npos ? a : text.find(':', a + 1);
  DISTSTRAT_CHECK(b != std::string::npos, kInvalidArgument, "fault injection '", text,
                  "': expected kind:rank:step");
  const std::string kind = text.substr(0, a);
  for (FaultKind k : {FaultKind::kThrow, FaultKind::kExit, FaultKind::kStall, FaultKind::kCorrupt,
                      FaultKind::kOversize}) {
    if (kind == fault_kind_name(k)) f.kind = k;
  }
  DISTSTRAT_CHECK(f.active(), kInvalidArgument, "fault injection '", text, "': unknown kind '",
                  kind, "' (throw, exit, stall, corrupt, oversize)");
  try {
    size_t used = 0;
    const std::string r = text.substr(a + 1, b - a - 1), s = text.substr(b + 1);
    f.rank = std::stoi(r, &used);
    DISTSTRAT_CHECK(used == r.size() && f.rank >= 0, kInvalidArgument, "bad rank");
    f.step = std::stoll(s, &used);
    DISTSTRAT_CHECK(used == s.size() && f.step >= 0, kInvalidArgument, "bad step");
  } catch (const std::exception&) {
    throw InvalidArgumentError("fault injection '" + text +
                               "': rank and step must be non-negative integers");
  }
  return f;
}

FaultInjection FaultInjection::from_env() {
  return env::parsed<FaultInjection>("DISTSTRAT_FAULT", parse).value_or(FaultInjection{});
}

}  // namespace diststrat
