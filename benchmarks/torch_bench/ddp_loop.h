// torch_bench's measured side: the same loop as c10d_loop.cc, with this
// library's DistributedDataParallel (diststrat::torch) over
// MultiWorkerMirroredStrategy instead of the hand-written all-reduces.
#pragma once

#include <cstdint>

#include "c10d_loop.h"

namespace torch_bench {

struct DdpMode {
  bool overlap = true;            // DdpOptions::overlap
  int64_t bytes_per_bucket = -1;  // DdpOptions::bytes_per_bucket; -1 = its default
};

// Trains Config::warmup + Config::steps steps with one replica per process
// (the processes of mpirun; one process alone without it). Sets *rank and
// *world to this process's place in the job. Blocking; collective.
Result run_diststrat_ddp(const Config& config, const Data& data, const DdpMode& mode, int* rank,
                         int* world);

}  // namespace torch_bench
