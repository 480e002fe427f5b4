// NCCL communicators behind the Communicator interface.
//
// Every communicator is created non-blocking (ncclConfig_t::blocking = 0), so
// creation and every collective are waited for by polling
// ncclCommGetAsyncError and the stream against the communication deadline;
// past it the communicator is aborted (ncclCommAbort) and the call throws
// DeadlineExceededError. Errors become diststrat::Error with the NCCL call,
// its error string, file and line.
//
// Hooking a multi-process strategy (MultiWorkerMirroredStrategy) up:
//   std::string id;                                    // NCCL_UNIQUE_ID_BYTES bytes
//   if (rank == 0) id = backend.nccl_unique_id();
//   broadcast id over the job's host communicator (MPI_Bcast of the bytes);
//   auto comm = backend.nccl_communicator(id, rank, size, ordinal, replica_stream, options);
// (GpuBackend is reached through DeviceManager::impl().backend.) Each process
// passes one rank per local GPU; a process with several GPUs creates its
// ranks' communicators from different threads or inside one group.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "diststrat/collective.h"

namespace diststrat {
namespace gpu {

// One communicator per local device (rank r: ordinals[r], streams[r]).
std::vector<std::unique_ptr<Communicator>> make_nccl_local_group(
    const std::vector<int>& ordinals, const std::vector<void*>& streams,
    const CommunicationOptions& options);

std::string make_nccl_unique_id();

// The version of the NCCL library loaded at run time (ncclGetVersion), e.g.
// "2.27.7": the header, the link-time and the run-time library may come from
// different places (toolkit, Python wheel).
std::string nccl_version_string();

std::unique_ptr<Communicator> make_nccl_communicator(const std::string& unique_id, int rank,
                                                     int size, int ordinal, void* stream,
                                                     const CommunicationOptions& options);

}  // namespace gpu
}  // namespace diststrat
