// The cross-process communicators of a multi-worker job: the seam where the
// MPI backend is plugged in.
#pragma once

#include <memory>

#include "diststrat/cluster.h"
#include "diststrat/collective.h"

namespace diststrat {

struct ProcessCommunicators {
  // One rank per process; hierarchical when `hierarchical`.
  std::unique_ptr<Communicator> cross;
  bool hierarchical = false;
};

// Builds the communicators of `cluster` (collective over the job's processes).
// With one process and no MPI launcher: a one-rank in-process group. With
// several nodes (real or virtual) and hierarchical allowed: a
// HierarchicalCommunicator over node-local and cross-node MPI communicators.
// Throws UnimplementedError for a multi-process cluster in a build without MPI.
ProcessCommunicators make_process_communicators(const ResolvedCluster& cluster,
                                                const CommunicationOptions& options,
                                                bool allow_hierarchical);

}  // namespace diststrat
