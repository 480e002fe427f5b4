// The end-of-job meeting before MPI_Finalize, for MPI that the library
// initialized (mpi_env.h). Internal: only compiled when the build has MPI.
//
// MPI_Finalize meets every rank, and a rank that gets there first cannot
// tell a peer that is still working (evaluating, saving a checkpoint) from
// one that is stopped or gone. A fixed deadline on it either fails healthy
// jobs whose ranks end at different times or waits too long for dead ones.
// So the deadline bounds silence, not duration:
//  - from MPI_Init on, a listener thread of every rank answers on a private
//    duplicate of MPI_COMM_WORLD: once a peer has said it is at the exit,
//    the listener sends it a heartbeat every kHeartbeatPeriod until this
//    rank gets there too;
//  - at exit a rank tells every other rank it has arrived and waits for
//    every other rank's arrival. A peer that keeps sending heartbeats
//    extends the wait for as long as it works; a peer silent for `silence`
//    (stopped, its host unreachable, gone) ends it: meet() returns false
//    naming it, and the caller exits with status 1 without MPI_Finalize
//    (the launcher then ends the job).
#pragma once

#include <chrono>
#include <string>

namespace diststrat {
namespace mpi {

constexpr std::chrono::milliseconds kHeartbeatPeriod{100};
// The shortest silence that counts: ten heartbeats.
constexpr std::chrono::milliseconds kMinSilence{1000};

// Starts the listener. Collective over MPI_COMM_WORLD (one bounded
// MPI_Comm_idup), right after MPI_Init_thread, once per process; needs
// MPI_THREAD_MULTIPLE (returns false and does nothing without it).
bool start_exit_rendezvous(std::chrono::milliseconds timeout);

// Whether start_exit_rendezvous() started the listener.
bool exit_rendezvous_running();

// At exit: announces this rank and waits until every rank has arrived
// (true), or some peer not yet arrived was silent for `silence` (at least
// kMinSilence), or `bound` (0: none) passed in all (false; `why` says which
// rank and what). Stops the listener either way. Called once, by the exit handler.
bool meet_at_exit(std::chrono::milliseconds silence, std::chrono::milliseconds bound,
                  std::string* why);

}  // namespace mpi
}  // namespace diststrat
