// What InProcessGroup (threads of one process) can run, for the strategies
// that build one over their local replicas.
#pragma once

#include <string>

#include "diststrat/collective.h"

namespace diststrat {

// Throws InvalidArgumentError naming `who` and the algorithm unless a group
// of threads of one process runs options.algorithm: kAuto and kDirect (the
// shared-address-space reduction), the point-to-point algorithms over the
// in-process transport (kRing, kHalvingDoubling, kTree, kReduceToOne,
// kHierarchical) and kCustom (with its function in options.algorithm_registry).
// kNccl, kMpiNative and kSharedMemory need GPUs or MPI.
void check_in_process_algorithm(const CommunicationOptions& options, const std::string& who);

}  // namespace diststrat
