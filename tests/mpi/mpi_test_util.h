// Helpers the mpirun tests share: this process's place in MPI_COMM_WORLD, and
// whether the run groups ranks into virtual nodes.
#pragma once

#include <mpi.h>

#include <cstdlib>

namespace diststrat_test {

inline int world_size() {
  int s = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}
inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
// DISTSTRAT_VIRTUAL_NODE_SIZE groups the ranks into virtual nodes (ctest's
// *_virtual_nodes cases), so the multi-node paths run on one host.
inline bool virtual_nodes() {
  const char* v = std::getenv("DISTSTRAT_VIRTUAL_NODE_SIZE");
  return v && std::atoi(v) > 0;
}

}  // namespace diststrat_test
