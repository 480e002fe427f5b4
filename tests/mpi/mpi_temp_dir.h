// One temporary directory for a whole mpirun job (ranks share one host here,
// or a shared file system).
#pragma once

#include <mpi.h>

#include <stdexcept>
#include <string>

#include "../common/temp_dir.h"

namespace diststrat_test {

// Rank 0 creates $TMPDIR/<prefix>XXXXXX; every rank returns its path.
// Collective over MPI_COMM_WORLD (every rank calls it, in the same order);
// blocks until rank 0 has made the directory. Rank 0 alone removes it, when
// it exits normally: tests/mpi/main.cc's final MPI_Allreduce keeps it until
// every rank has finished every test. Throws std::runtime_error on every
// rank, with rank 0's reason, when rank 0 cannot create it.
inline std::string job_temp_dir(const std::string& prefix) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::string text;        // the path, or rank 0's error
  int header[2] = {1, 0};  // {made, text size}
  if (rank == 0) {
    try {
      text = temp_dir(prefix);
    } catch (const std::exception& e) {
      text = e.what();
      header[0] = 0;
    }
    header[1] = static_cast<int>(text.size());
  }
  MPI_Bcast(header, 2, MPI_INT, 0, MPI_COMM_WORLD);
  text.resize(static_cast<size_t>(header[1]));
  MPI_Bcast(&text[0], header[1], MPI_CHAR, 0, MPI_COMM_WORLD);
  if (header[0] == 0) {
    throw std::runtime_error("rank " + std::to_string(rank) +
                             ": rank 0 could not make the job's directory: " + text);
  }
  return text;
}

}  // namespace diststrat_test
