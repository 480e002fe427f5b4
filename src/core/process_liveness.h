// Whether another process on this host is alive: used where a rank waits
// for a peer it shares memory with and the wait must last as long as the
// peer works, not a fixed time (the deadline then counts only while the peer
// is not running).
#pragma once

#include <cstdint>

namespace diststrat {

// A process, named so that a recycled pid is another process: its pid and
// its start time (clock ticks since boot, /proc/<pid>/stat field 22).
struct ProcessStamp {
  int64_t pid = 0;
  uint64_t start_ticks = 0;
};

// This process's stamp ({0, 0} where /proc cannot be read).
ProcessStamp this_process();

// True while the process `p` exists with that start time and is neither
// stopped (SIGSTOP, a debugger), a zombie nor dead. False for {0, 0} and
// wherever /proc cannot tell.
bool process_running(const ProcessStamp& p);

}  // namespace diststrat
