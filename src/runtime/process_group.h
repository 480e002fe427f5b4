// The cross-process communicators of a multi-worker job: the seam where the
// MPI backend is plugged in.
#pragma once

#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <string>

#include "diststrat/cluster.h"
#include "diststrat/collective.h"

namespace diststrat {

class Transport;

struct ProcessCommunicators {
  // One rank per process; hierarchical when `hierarchical`.
  std::unique_ptr<Communicator> cross;
  bool hierarchical = false;
  // A job without a launcher: the chief's store (tcp_store.h), kept while
  // the group lives, since peers may still read addresses from it after
  // the chief has connected to all of them.
  std::shared_ptr<void> store;
};

// Builds the communicators of `cluster` (collective over the job's processes).
// With one process and no MPI launcher: a one-rank in-process group. With
// several nodes (real or virtual) and hierarchical allowed: a
// HierarchicalCommunicator over node-local and cross-node MPI communicators.
// Throws UnimplementedError for a multi-process cluster in a build without MPI.
// resolve_cluster (diststrat/cluster.h) with every MPI call of it bounded by
// `timeout` (nullopt: CommunicationOptions' default), which also bounds
// MPI_Finalize at exit. Under a launcher it is collective, and a rank whose
// configuration fails (malformed TF_CONFIG, a spec that disagrees with its
// MPI rank) makes every rank throw, naming it (mpi::agree).
ResolvedCluster resolve_cluster(const ClusterConfig& config,
                                std::optional<std::chrono::milliseconds> timeout);

// The set-up agreement of a multi-process strategy: under an MPI launcher
// every process says whether its set-up step `what` succeeded (`local_error`
// null) and, if one failed, every process throws (mpi::agree), within
// `timeout`. Without a launcher it rethrows `local_error`, if any.
// Collective under a launcher: every process must call it, failed or not.
void agree_on_setup(const std::string& what, std::exception_ptr local_error,
                    std::chrono::milliseconds timeout);

// Builds the communicators of `cluster` (collective over the job's processes).
// With one process and no MPI launcher: a one-rank in-process group. With
// several nodes (real or virtual) and hierarchical allowed: a
// HierarchicalCommunicator over node-local and cross-node MPI communicators.
// Without a launcher, a multi-process cluster (TF_CONFIG, a ClusterSpec, an
// srun step without PMIx) meets over TCP: make_tcp_process_communicators.
// Throws UnimplementedError for that in a build without Gloo.
// Every MPI call is bounded by options.timeout (allreduce/mpi_util.h); a
// rank that fails in here marks its MPI state failed, so that it exits soon
// and the launcher ends the job.
ProcessCommunicators make_process_communicators(const ResolvedCluster& cluster,
                                                const CommunicationOptions& options,
                                                bool allow_hierarchical);

// The communicators of a job started without a launcher: the chief (rank 0)
// serves a store (tcp_store.h) at its listed address, every rank publishes
// its TCP address there under "<group>/tcp/<rank>" and connects the full
// mesh (allreduce/tcp_transport.h), and TransportCommunicator runs the library's
// algorithms over it, comparing every call across ranks. Collective; bounded
// by options.timeout: a rank that never came is named with its task and
// address (DeadlineExceededError). `group` names the group's keys ("world",
// "world.1": every process makes its groups in the same order).
ProcessCommunicators make_tcp_process_communicators(const ResolvedCluster& cluster,
                                                    const CommunicationOptions& options,
                                                    const std::string& group);

// The same mesh as a bare Transport, for the parameter server (whose service
// receives with probe_any, which the TCP transport has). The chief's store
// lives as long as the transport. Same errors. `peer_failure_breaks_group`:
// TcpTransportOptions' (false: a rank that dies fails only the transfers
// that need it).
std::unique_ptr<Transport> make_tcp_job_transport(const ResolvedCluster& cluster,
                                                  std::chrono::milliseconds timeout,
                                                  const std::string& group,
                                                  bool peer_failure_breaks_group = true);

}  // namespace diststrat
