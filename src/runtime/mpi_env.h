// MPI process environment for the multi-worker strategy: initialization (if
// the program has not done it), error conversion, and node placement.
// Internal: only compiled when the build has MPI.
#pragma once

#include <mpi.h>

#include <chrono>
#include <string>

#include "allreduce/mpi_util.h"

#include "diststrat/cluster.h"

namespace diststrat {
namespace mpi {

// True when a launcher (mpirun, srun with PMI/PMIx) started this process.
bool launched_under_mpi();
// Initializes MPI with MPI_THREAD_MULTIPLE if nobody has yet (and finalizes
// it at exit); throws UnavailableError when the library gives less than
// MPI_THREAD_SERIALIZED. MPI_Init_thread meets every rank of the job: it runs
// under a Watchdog of `timeout` (at least kMinInitTimeout). Thread-safe.
void ensure_initialized(std::chrono::milliseconds timeout);
// MPI_Init_thread waits at least this long (it meets ranks the launcher may
// still be starting).
constexpr std::chrono::milliseconds kMinInitTimeout{30000};
// The same with CommunicationOptions' default timeout (DISTSTRAT_TIMEOUT or
// 300 s).
void ensure_initialized();
// Bounds the exit that ensure_initialized registered (the meeting of the
// ranks, exit_rendezvous.h, then MPI_Finalize) by `deadline` of silence (the
// longest one given wins; none given: the default timeout): a peer still
// working extends the wait with its heartbeats, however long it works; one
// that sends nothing for the deadline makes this process exit with status 1
// without finalizing, so a rank that is stuck or gone cannot hang the
// others' exit and a healthy job never fails for ending unevenly. When this
// process's MPI state failed (mpi::mark_failed: a communicator failed,
// timed out, or was torn down during an exception) its peers may never
// arrive, and the meeting waits at most kFailedFinalizeGrace, so that a
// failing rank ends soon and the launcher ends the job. Thread-safe.
void bound_finalize(std::chrono::milliseconds deadline);
constexpr std::chrono::milliseconds kFailedFinalizeGrace{3000};
// Rank, size and node grouping of `comm` (MPI_Comm_split_type SHARED, under
// a Watchdog; the other collectives non-blocking, bounded by `timeout`).
// Collective over comm.
Placement placement(MPI_Comm comm, std::chrono::milliseconds timeout);

}  // namespace mpi
}  // namespace diststrat
