// Checks every ReplicaContext collective runs on what it is given, before
// any byte is read: one rule for every strategy's replica contexts.
#pragma once

#include <string>
#include <vector>

#include "diststrat/strategy.h"

namespace diststrat {

// Throws InvalidArgumentError naming `op`, the tensor (names[i], or its
// index), its device and the replica's device unless each tensor is defined
// and lives where replica `ctx` works on it: host memory on a CPU replica,
// the replica's own GPU on a GPU replica (`host_ok`: host memory as well,
// for collectives that stage through the host).
void check_replica_tensors(const ReplicaContext& ctx, const char* op,
                           const std::vector<Tensor>& tensors,
                           const std::vector<std::string>& names, bool host_ok = false);

}  // namespace diststrat
