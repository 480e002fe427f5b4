// Synchronous packed all-reduce of a list of tensors over one Communicator:
// consecutive tensors of one dtype are copied into a reused buffer of up to
// bytes_per_pack bytes, reduced as one message, and copied back. A tensor
// larger than a pack goes alone, in place, without copies; so does a pack of
// device tensors (PackMemory given) that already lie end to end in list
// order, as views of one buffer do (a GPU model's gradients).
#pragma once

#include <string>
#include <vector>

#include "diststrat/collective.h"

namespace diststrat {

// Where the pack buffer lives and how bytes move in and out of it: host
// memory and memcpy by default; a GPU replica supplies device memory and
// copies on its stream.
class PackMemory {
 public:
  virtual ~PackMemory() = default;
  // A buffer of at least `bytes`, valid until the next call.
  virtual void* buffer(size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
};

class PackedAllReduce {
 public:
  // All ranks must pass the same tensors (count, dtype, order). `memory`
  // null = host memory.
  void run(Communicator& comm, ReduceOp op, std::vector<Tensor>& tensors,
           const std::vector<std::string>& names, size_t bytes_per_pack,
           PackMemory* memory = nullptr);

 private:
  std::vector<char> buffer_;
};

}  // namespace diststrat
