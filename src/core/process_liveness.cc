#include "core/process_liveness.h"

#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

namespace diststrat {
namespace {

// State (field 3) and start time (field 22) from /proc/<pid>/stat; false
// when the file cannot be read or parsed.
bool read_stat(int64_t pid, char* state, uint64_t* start_ticks) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!f || !std::getline(f, line)) return false;
  // The command name (field 2) is in parentheses and may hold spaces and
  // parentheses itself: the fields after it start after the last ')'.
  const size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  std::istringstream rest(line.substr(close + 2));
  std::string field;
  if (!(rest >> *state)) return false;
  for (int i = 4; i < 22; ++i) {
    if (!(rest >> field)) return false;
  }
  return static_cast<bool>(rest >> *start_ticks);
}

}  // namespace

ProcessStamp this_process() {
  ProcessStamp p;
  char state = 0;
  uint64_t start = 0;
  if (read_stat(static_cast<int64_t>(::getpid()), &state, &start)) {
    p.pid = static_cast<int64_t>(::getpid());
    p.start_ticks = start;
  }
  return p;
}

bool process_running(const ProcessStamp& p) {
  if (p.pid <= 0) return false;
  char state = 0;
  uint64_t start = 0;
  if (!read_stat(p.pid, &state, &start) || start != p.start_ticks) return false;
  // T: stopped, t: traced, Z: zombie, X: dead.
  return state != 'T' && state != 't' && state != 'Z' && state != 'X';
}

}  // namespace diststrat
