#include <algorithm>
#include <cctype>

#include "core/user_text.h"
#include "diststrat/collective.h"
#include "diststrat/error.h"

namespace diststrat {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMean:
      return "mean";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kProduct:
      return "product";
  }
  return "unknown";
}

const char* algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kAuto:
      return "auto";
    case Algorithm::kDirect:
      return "direct";
    case Algorithm::kRing:
      return "ring";
    case Algorithm::kHalvingDoubling:
      return "halving_doubling";
    case Algorithm::kTree:
      return "tree";
    case Algorithm::kReduceToOne:
      return "reduce_to_one";
    case Algorithm::kHierarchical:
      return "hierarchical";
    case Algorithm::kNccl:
      return "nccl";
    case Algorithm::kMpiNative:
      return "mpi";
    case Algorithm::kCustom:
      return "custom";
    case Algorithm::kSharedMemory:
      return "shm";
  }
  return "unknown";
}

Algorithm parse_algorithm(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  for (Algorithm a :
       {Algorithm::kAuto, Algorithm::kDirect, Algorithm::kRing, Algorithm::kHalvingDoubling,
        Algorithm::kTree, Algorithm::kReduceToOne, Algorithm::kHierarchical, Algorithm::kNccl,
        Algorithm::kMpiNative, Algorithm::kCustom, Algorithm::kSharedMemory}) {
    if (n == algorithm_name(a)) return a;
  }
  throw InvalidArgumentError("unknown algorithm '" + echo(name) +
                             "' (auto, direct, ring, halving_doubling, tree, reduce_to_one, "
                             "hierarchical, nccl, mpi, custom, shm)");
}

}  // namespace diststrat
