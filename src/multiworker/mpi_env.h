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
// MPI_THREAD_SERIALIZED.
void ensure_initialized();
// Bounds the MPI_Finalize that ensure_initialized registered at exit by
// `deadline` (the longest one given wins): past it the process exits with
// status 1 without finalizing, so a rank that is stuck or gone cannot hang
// the others' exit. Thread-safe.
void bound_finalize(std::chrono::milliseconds deadline);
// Rank, size and node grouping of `comm` (MPI_Comm_split_type SHARED).
Placement placement(MPI_Comm comm);

}  // namespace mpi
}  // namespace diststrat

