// LibTorch's intra-op threads on diststrat's replica threads.
#pragma once

#include <ATen/Parallel.h>

namespace diststrat::libtorch {

// at::set_num_threads(1), once per thread: replicas that share a process each
// compute on their own thread, so LibTorch's intra-op pool would oversubscribe.
inline void single_intra_op_thread() {
  thread_local bool done = false;
  if (!done) {
    at::set_num_threads(1);
    done = true;
  }
}

}  // namespace diststrat::libtorch
