// MPI helpers shared by the MPI-backed pieces (built only with MPI).
//
// Errors: a failing MPI call becomes an InternalError carrying the call, MPI's
// error string, file and line (DISTSTRAT_MPI_CHECK).
//
// Deadlines: every MPI call diststrat makes is bounded by the options'
// timeout, in one of three ways (docs/multi_worker.md, "Set-up and tear-down"):
//  - collectives that have a non-blocking form run as that form, polled with
//    MPI_Test against the deadline (dup, barrier, allreduce, allgather, bcast,
//    and the set-up agreement `agree`); past it they throw
//    DeadlineExceededError naming the call, and the process is marked failed
//    (the pending collective cannot be cancelled);
//  - calls that have none (MPI_Comm_split[_type], MPI_Win_allocate_shared,
//    MPI_Win_free, MPI_Comm_free, MPI_Init_thread) run only where every rank
//    is known to make them (after an agreement or a completed bounded
//    collective) and under a Watchdog: should one still not return by the
//    deadline (a rank stopped or gone in between), the process prints what
//    it was waiting for and ends with status 1, which makes the launcher end
//    the job;
//  - local calls (rank/size queries, datatypes, ops, info objects, probes).
#pragma once

#include <mpi.h>

#include <chrono>
#include <exception>
#include <string>
#include <vector>

#include "diststrat/collective.h"
#include "diststrat/dtype.h"
#include "diststrat/error.h"

namespace diststrat {

inline void check_mpi(int rc, const char* call, const char* file, int line) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw InternalError(std::string(call) + " failed: " + std::string(text, len) + " (" + file + ":" +
                      std::to_string(line) + ")");
}

namespace mpi {

// This process's rank in MPI_COMM_WORLD; -1 before MPI_Init or after
// MPI_Finalize. Thread-safe.
int world_rank();

// Marks this process's MPI state as failed: a communicator failed, was
// aborted, timed out, or was torn down while an exception propagated, so its
// peers may never meet it in MPI_Finalize. The exit handler then waits for
// MPI_Finalize only a few seconds (mpi_env.h). Process-wide, like MPI's own
// state; thread-safe.
void mark_failed();
bool failed();

// The exit meeting (runtime/exit_rendezvous.h) records here that this
// process has reached its exit, and which peers (world ranks) have reached
// theirs: a peer at its exit will not come back, so a wait for it (the
// shared-memory tear-down vote) ends, and this process stops telling
// anyone it is working (the parameter-server worker's heartbeats).
// Process-wide; thread-safe.
void note_exiting();
bool exiting();
void note_peer_at_exit(int world_rank);
bool peer_at_exit(int world_rank);

// Ends the process (std::_Exit(1), after printing "diststrat: <what> did not
// return within T ms ...") unless it is destroyed within `timeout`. Guards
// one blocking MPI call that has no non-blocking form. Not copyable.
class Watchdog {
 public:
  Watchdog(std::string what, std::chrono::milliseconds timeout);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  struct State;
  State* state_;
};

// Runs `call` under a Watchdog named `what`.
template <class F>
void bounded_call(const std::string& what, std::chrono::milliseconds timeout, F&& call) {
  Watchdog dog(what, timeout);
  call();
}

// Polls `req` until it completes or `timeout` passes; then throws
// DeadlineExceededError "rank R: <what> did not complete within T ms: some
// rank never joined it ..." and marks the process failed.
void wait(MPI_Request* req, const std::string& what, std::chrono::milliseconds timeout);

// Bounded collectives over `comm` (non-blocking forms polled by wait()).
MPI_Comm dup(MPI_Comm comm, const std::string& what, std::chrono::milliseconds timeout);
void barrier(MPI_Comm comm, const std::string& what, std::chrono::milliseconds timeout);
void allreduce_in_place(void* buf, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                        const std::string& what, std::chrono::milliseconds timeout);
void allgather(const void* in, void* out, int count, MPI_Datatype type, MPI_Comm comm,
               const std::string& what, std::chrono::milliseconds timeout);
void bcast(void* buf, int count, MPI_Datatype type, int root, MPI_Comm comm,
           const std::string& what, std::chrono::milliseconds timeout);
// MPI_Comm_free under a Watchdog (local in Open MPI and MPICH, collective by
// the standard). No-op for MPI_COMM_NULL or after MPI_Finalize.
void free_comm(MPI_Comm* comm, std::chrono::milliseconds timeout);

// The ranks of `comm` that share this rank's host, the one place that asks
// MPI (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)): this rank's position and
// count there, and for every rank of comm its node's leader (the lowest comm
// rank on that host). Collective over comm; `what` names the set-up step in
// errors ("<what>: MPI_Comm_split_type", ...), each call bounded by `timeout`.
struct NodeGroup {
  int local_rank = 0;
  int local_size = 1;
  std::vector<int> leaders;  // [comm rank] -> the comm rank leading its node
};
NodeGroup node_group(MPI_Comm comm, const std::string& what, std::chrono::milliseconds timeout);

// The set-up agreement: every rank of `comm` says whether its part of step
// `what` succeeded (`local_error` null) or failed, and learns the others'
// answers (one MPI_Iallgather, bounded by `timeout`). When every rank
// succeeded it returns. Otherwise every rank throws: a failing rank rethrows
// its own error, the others AbortedError "rank R: <what> aborted: rank F
// failed: <F's error>" (F the lowest failing rank). So a rank that fails set-up makes every rank
// fail together, with an error that names it, instead of leaving its peers
// in the next collective. Collective over comm: every rank must call it,
// failed or not.
void agree(MPI_Comm comm, const std::string& what, std::exception_ptr local_error,
           std::chrono::milliseconds timeout);

// MPI's own datatype for `dtype`: true for float32/float64/int32/int64,
// false for the 16-bit floats (which MPI does not have).
bool native_type(DType dtype, MPI_Datatype* t);
// MPI's op for `op`; kMean is MPI_SUM (divide by the rank count afterwards).
MPI_Op native_op(ReduceOp op);

}  // namespace mpi
}  // namespace diststrat

#define DISTSTRAT_MPI_CHECK(call) ::diststrat::check_mpi((call), #call, __FILE__, __LINE__)
