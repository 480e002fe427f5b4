// Runs a user-registered all-reduce (algorithm_registry.h) over a Transport.
#pragma once

#include "allreduce/algorithm.h"
#include "diststrat/algorithm_registry.h"

namespace diststrat {
namespace algo {

void run_custom(const CustomAllReduce& fn, const Peers& peers, const AllReduceArgs& a);

}  // namespace algo
}  // namespace diststrat
