// Finding the culprit of a hang, and the slow rank: the flight recorder and
// straggler detection (docs/flight_recorder.md).
//
// Flight recorder. Every communicator of the process (strategies',
// ProcessGroup's, InProcessGroup's, elastic groups') records its last N
// collective calls per rank: sequence number per group, kind, the caller's
// name, count, dtype, op, root, algorithm, start/end times and state. Each
// process writes its record as one JSON file:
//   - when one of its collectives fails (deadline, abort, mismatch), before
//     the error reaches the caller; the error message ends with
//     "[flight record: PATH]";
//   - on SIGUSR2, in a process of a job (Slurm, Open MPI, elastic), unless
//     the program handles SIGUSR2 itself (a lone process, or recording off:
//     no handler, no watchdog thread);
//   - on dump_flight_record();
//   - when another process of the same job wrote its record after a failure
//     (a watchdog thread; so a rank stuck in its own compute, which never
//     reaches a deadline, leaves its record too). With
//     DISTSTRAT_FLIGHT_RECORDER_EXIT=1 the watchdog then ends the process
//     (exit status 1), as NCCL's watchdog does; off by default, and not for
//     elastic jobs, whose survivors go on after a peer fails.
// Where: DISTSTRAT_FLIGHT_RECORDER_DIR, else flight-records/ in the
// directory of the process's latest CheckpointManager, else
// $TMPDIR/diststrat-flight-<job>; used only when it is this uid's and
// nobody else may write it (the default: mode 0700, not a symlink), else
// the record is not written and stderr says why. The watchdog answers only
// a record of this uid and run (its nonce). N:
// DISTSTRAT_FLIGHT_RECORDER=N (default 2048, at most 65536; 0 = no
// recording, no dumps).
// `diststrat-trace analyze DIR` (built with the tools) merges the files
// into one verdict: the earliest collective where ranks diverge, who never
// entered it and what each of those was doing instead.
//
// Straggler detection. In synchronous training every step takes the
// slowest rank's time. Each rank measures its own compute time before every
// collective of its strategy (from the end of its previous collective to
// the start of the next; no clock sync needed); every 50 calls the ranks
// exchange those times (one small all_gather, recorded like any call). A
// rank whose trimmed-mean compute time is at least 20 % above the median
// rank's (and 0.25 ms above it) is flagged in that window's report; flagged
// in two windows running it is a straggler: the group's rank 0 logs a
// warning naming it and its host. DISTSTRAT_STRAGGLER_WINDOW=N changes the
// window (0 = off).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace diststrat {

// Writes this process's flight record now; returns the file's path ("" when
// recording is off or the write failed, which is reported on stderr).
// Thread-safe; blocking (a file write).
std::string dump_flight_record(const std::string& reason = "on request");
// Where this process's record goes (see above).
std::string flight_record_directory();

struct StragglerReport {
  struct Rank {
    int rank = 0;                   // in the strategy's (or group's) communicator
    std::string host;               // its host name
    double median_compute_ms = 0;   // median compute time before a call
    double mean_compute_ms = 0;     // trimmed mean (the 10 % longest left out)
    double arrived_last_share = 0;  // share of the window's calls it came to last
    bool straggler = false;
  };
  std::vector<Rank> ranks;  // empty until the first window is complete
  int64_t windows = 0;      // windows evaluated so far
  int calls_per_window = 0;
  std::string warning;  // the last warning line ("" when none yet)
};

}  // namespace diststrat
