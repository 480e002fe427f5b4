// The table of every DISTSTRAT_* environment variable anything in this
// project reads (the library, its tools, scripts and tests), and the start-up
// warning for a name that is not in it: a misspelled variable
// (DISTSTRAT_TIMEOUTS=5) is otherwise silently ignored. A variable added
// anywhere goes into this table (the test EnvVars.EveryVariableReadInTheTreeIsKnown
// scans the tree for reads that are missing here).
#include <unistd.h>  // environ

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "core/env.h"
#include "core/user_text.h"
#include "diststrat/logging.h"

namespace diststrat {
namespace env {

namespace {

const KnownVariable kKnown[] = {
    // Read by the library (docs/troubleshooting.md, "Environment variables").
    {"DISTSTRAT_TIMEOUT", "library"},
    {"DISTSTRAT_LOG_LEVEL", "library"},
    {"DISTSTRAT_LOG_DEVICE_PLACEMENT", "library"},
    {"DISTSTRAT_FAULT", "library"},
    {"DISTSTRAT_TIMELINE", "library"},
    {"DISTSTRAT_VIRTUAL_NODE_SIZE", "library"},
    {"DISTSTRAT_GPU_LEASE", "library"},
    {"DISTSTRAT_GPU_LEASE_DIR", "library"},
    {"DISTSTRAT_PS_CHECKPOINT_DIR", "library"},
    {"DISTSTRAT_WORKER_ID", "library"},
    {"DISTSTRAT_FLIGHT_RECORDER", "library"},
    {"DISTSTRAT_FLIGHT_RECORDER_DIR", "library"},
    {"DISTSTRAT_FLIGHT_RECORDER_EXIT", "library"},
    {"DISTSTRAT_FLIGHT_RECORDER_SITES", "library"},
    {"DISTSTRAT_STRAGGLER_WINDOW", "library"},
    {"DISTSTRAT_CPU", "library"},
    // Read by scripts/ (build and test drivers).
    {"DISTSTRAT_CMAKE_ARGS", "scripts"},
    {"DISTSTRAT_BUILD_DIR", "scripts"},
    {"DISTSTRAT_FUZZ_BUILD_DIR", "scripts"},
    {"DISTSTRAT_BUILD_JOBS", "scripts"},  // scripts/container.sh: compile jobs in the image
    {"DISTSTRAT_CONTAINER_NICE", "scripts"},
    {"DISTSTRAT_DEBIAN_MIRROR", "scripts"},
    {"DISTSTRAT_DEBIAN_SUITE", "scripts"},
    // Read by tests only.
    {"DISTSTRAT_TEMP_DIR_TEST_REPORT", "tests"},
    {"DISTSTRAT_PS_STOPPED_STEPS", "tests"},
    {"DISTSTRAT_PS_STOPPED_STOPS", "tests"},
    {"DISTSTRAT_CONTAINER_TESTS", "tests"},  // opts in to the container tests
};

// Edit distance (insert, delete, substitute one character).
size_t distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

const std::vector<KnownVariable>& known_variables() {
  static const std::vector<KnownVariable> known(std::begin(kKnown), std::end(kKnown));
  return known;
}

bool is_known(const std::string& name) {
  for (const KnownVariable& v : kKnown) {
    if (name == v.name) return true;
  }
  return false;
}

std::string closest_known(const std::string& name) {
  std::string best;
  size_t best_d = 0;
  for (const KnownVariable& v : kKnown) {
    // A name longer than any known one by far is not a typo of one; the cap
    // keeps the quadratic distance cheap for whatever the environment holds.
    const size_t d = distance(name.substr(0, 64), v.name);
    if (best.empty() || d < best_d) best = v.name, best_d = d;
  }
  return best;
}

std::vector<std::string> unknown_variable_warnings() {
  std::vector<std::string> out;
  static const char kPrefix[] = "DISTSTRAT_";
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const char* entry = *e;
    if (std::strncmp(entry, kPrefix, sizeof(kPrefix) - 1) != 0) continue;
    const char* eq = std::strchr(entry, '=');
    const std::string name = eq ? std::string(entry, eq) : std::string(entry);
    if (is_known(name)) continue;
    out.push_back("unknown environment variable " + echo(name) + " is ignored (did you mean " +
                  closest_known(name) +
                  "? the known DISTSTRAT_* variables are listed in docs/troubleshooting.md)");
  }
  std::sort(out.begin(), out.end());
  return out;
}

void warn_unknown_variables_once(const Logger& logger) {
  // Once per process: the environment does not change between strategies,
  // and a test suite or a program with several strategies needs the line once.
  static std::once_flag once;
  std::call_once(once, [&] {
    for (const std::string& w : unknown_variable_warnings()) logger.warning(w);
  });
}

}  // namespace env
}  // namespace diststrat
