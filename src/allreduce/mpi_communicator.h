// MPI-backed transport and communicator (built only with DISTSTRAT_HAVE_MPI).
// Internal: includes <mpi.h>; public headers never do.
#pragma once

#include <mpi.h>

#include <chrono>
#include <memory>

#include "allreduce/transport.h"
#include "diststrat/collective.h"

namespace diststrat {

// Point-to-point transport over a duplicate of `comm` (collective over comm:
// every rank must call it). Non-blocking MPI_Isend/MPI_Irecv; waits poll
// MPI_Test with short yields/sleeps until their deadline, then throw
// DeadlineExceededError naming this rank, the peer and the tag and cancel the
// request. probe_any uses MPI_Iprobe. Messages over 1 GiB travel as several
// MPI messages. MPI must be initialised; thread level: one thread at a time
// per transport (MPI_THREAD_MULTIPLE if several transports are used from
// different threads). The duplicate (MPI_Comm_idup) and its release are
// bounded by `setup_timeout` (allreduce/mpi_util.h).
std::unique_ptr<Transport> make_mpi_transport(
    MPI_Comm comm, std::chrono::milliseconds setup_timeout = CommunicationOptions{}.timeout);

// A Communicator over the ranks of `comm` (collective over comm). all_reduce
// runs options.algorithm: the point-to-point algorithms over the MPI
// transport, kMpiNative = MPI_Iallreduce polled against the deadline,
// kSharedMemory = the shared-window path (all ranks on one node), and kAuto =
// shared memory when every rank is on one node, else hierarchical or the
// size-based choice (algorithm.h). Nodes are the hosts found by
// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) unless
// options.hierarchical_group_size groups ranks explicitly. broadcast/all_gather/reduce_scatter/barrier
// follow the same transport (shared memory on one node).
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm,
                                                    const CommunicationOptions& options);

}  // namespace diststrat
