// Intra-node shared-memory communicator (built only with DISTSTRAT_HAVE_MPI).
#pragma once

#include <mpi.h>

#include <memory>

#include "diststrat/collective.h"

namespace diststrat {

// A Communicator for ranks of `comm` that all share one node (collective over
// comm; FailedPreconditionError otherwise). Each rank owns a slice of an MPI-3
// shared window (MPI_Win_allocate_shared over
// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)) of three buffers of
// options.segment_bytes (default 1 MiB) each; see shm_internal.h.
std::unique_ptr<Communicator> make_shm_communicator(MPI_Comm comm,
                                                    const CommunicationOptions& options);

}  // namespace diststrat
