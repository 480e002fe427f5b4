// MPI error handling shared by the MPI-backed pieces: a failing MPI call
// becomes an InternalError carrying the call, MPI's error string, file and line.
#pragma once

#include <mpi.h>

#include <string>

#include "diststrat/error.h"

namespace diststrat {

inline void check_mpi(int rc, const char* call, const char* file, int line) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw InternalError(std::string(call) + " failed: " + std::string(text, len) + " (" + file +
                      ":" + std::to_string(line) + ")");
}

}  // namespace diststrat

#define DISTSTRAT_MPI_CHECK(call) ::diststrat::check_mpi((call), #call, __FILE__, __LINE__)
