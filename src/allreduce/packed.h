// Synchronous packed all-reduce of a list of tensors over one Communicator:
// consecutive tensors of one dtype are copied into a reused buffer of up to
// bytes_per_pack bytes, reduced as one message, and copied back. A tensor
// larger than a pack goes alone, in place, without copies.
#pragma once

#include <string>
#include <vector>

#include "diststrat/collective.h"

namespace diststrat {

class PackedAllReduce {
 public:
  // All ranks must pass the same tensors (count, dtype, order).
  void run(Communicator& comm, ReduceOp op, std::vector<Tensor>& tensors,
           const std::vector<std::string>& names, size_t bytes_per_pack);

 private:
  std::vector<char> buffer_;
};

}  // namespace diststrat
