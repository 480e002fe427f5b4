// MPI process environment for the multi-worker strategy: initialization (if
// the program has not done it), error conversion, and node placement.
// Internal: only compiled when the build has MPI.
#pragma once

#include <mpi.h>

#include <string>

#include "diststrat/cluster.h"

namespace diststrat {
namespace mpi {

// True when a launcher (mpirun, srun with PMI/PMIx) started this process.
bool launched_under_mpi();
// Initializes MPI with MPI_THREAD_MULTIPLE if nobody has yet (and finalizes
// it at exit); throws UnavailableError when the library gives less than
// MPI_THREAD_SERIALIZED.
void ensure_initialized();
// Rank, size and node grouping of `comm` (MPI_Comm_split_type SHARED).
Placement placement(MPI_Comm comm);
// A failing MPI call as InternalError carrying the call, the MPI error string,
// file and line.
[[noreturn]] void throw_error(int code, const char* call, const char* file, int line);

}  // namespace mpi
}  // namespace diststrat

#define DISTSTRAT_MPI_CALL(call)                                                   \
  do {                                                                              \
    const int ds_mpi_rc_ = (call);                                                  \
    if (ds_mpi_rc_ != MPI_SUCCESS) ::diststrat::mpi::throw_error(ds_mpi_rc_, #call, __FILE__, __LINE__); \
  } while (0)
