// What a collective call is, for its error messages: the communicators
// (shared memory, MPI, transports, hierarchical) name a failed call alike.
#pragma once

#include <cstddef>
#include <string>

#include "diststrat/collective.h"

namespace diststrat {

// "all_reduce of 4 float32 sum 'dense/kernel'" (the name echoed, escaped).
std::string describe_call(const char* kind, size_t count, DType dtype, const ReduceOp* op,
                          const std::string& name);

// What a collective call is, as its error messages name it: "all_reduce of 4
// float32 sum 'dense/kernel' (ring)", "broadcast of 2 int64 from root 1
// (shm)", "barrier 'x'". It keeps the call's arguments (pointers into the
// caller's frame: it lives no longer than the call) and writes the text only
// when a message needs it: formatting it on every call took two thirds of a
// 4-byte shared-memory all-reduce (0.7 us, 0.2-0.3 us without; docs/benchmarks.md).
struct CallText {
  const char* kind = "";              // "all_reduce", ..., "barrier"
  size_t count = 0;                   // not shown for a barrier
  DType dtype = DType::kFloat32;      // not shown for a barrier
  const ReduceOp* op = nullptr;       // reductions only
  const int* root = nullptr;          // broadcast only
  const std::string* name = nullptr;  // the caller's name, if any
  const char* via = nullptr;          // the path, shown in parentheses
  std::string str() const;
};

}  // namespace diststrat
