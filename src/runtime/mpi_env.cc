#include "runtime/mpi_env.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "diststrat/collective.h"
#include "diststrat/error.h"
#include "runtime/exit_rendezvous.h"

namespace diststrat {
namespace mpi {

bool launched_under_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE",
                        "MPI_LOCALNRANKS"}) {
    if (std::getenv(v)) return true;
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  return initialized != 0;
}

namespace {
// The longest deadline of this process's MPI strategies and process groups (bound_finalize);
// 0 = none given (the default timeout applies). Per process, like MPI's own
// state.
std::atomic<int64_t> finalize_deadline_ms{0};

int64_t default_timeout_ms() {
  try {
    return CommunicationOptions{}.timeout.count();
  } catch (const std::exception&) {  // a junk DISTSTRAT_TIMEOUT; already reported at start-up
    return std::chrono::milliseconds(std::chrono::seconds(300)).count();
  }
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  // MPI_Finalize meets every rank of the job: with one stuck or gone it never
  // returns. The ranks first meet at the exit (exit_rendezvous.h): a peer
  // still working extends the wait with its heartbeats, one silent for the
  // deadline ends this process with status 1 without MPI_Finalize (the
  // launcher then ends the job, stuck ranks included). After a failure of
  // this process's MPI state the peers may be waiting for it in a
  // collective they will only leave at their own deadline: end soon instead
  // (kFailedFinalizeGrace in all), so that the launcher ends them (and the
  // job) within seconds.
  int64_t ms = finalize_deadline_ms.load();
  if (ms <= 0) ms = default_timeout_ms();
  const bool failed = mpi::failed();
  const int rank = mpi::world_rank();
  if (exit_rendezvous_running()) {
    std::string why;
    const auto bound = failed ? kFailedFinalizeGrace : std::chrono::milliseconds(0);  // 0: none
    if (!meet_at_exit(std::chrono::milliseconds(ms), bound, &why)) {
      std::fprintf(
          stderr, "diststrat: rank %d: %s%s; exiting with status 1 without MPI_Finalize\n", rank,
          why.c_str(),
          failed ? " (after a failure in this rank's communication the exit waits at most 3 s)"
                 : "");
      std::fflush(stderr);
      std::_Exit(1);
    }
  }
  if (failed) ms = std::min<int64_t>(ms, kFailedFinalizeGrace.count());
  std::thread([ms, failed, rank] {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    std::fprintf(stderr,
                 "diststrat: rank %d: MPI_Finalize did not complete within %lld ms (%s); exiting "
                 "with status 1 without it\n",
                 rank, static_cast<long long>(ms),
                 failed ? "this rank failed and its peers may be waiting for it"
                        : "a rank is stuck or gone");
    std::fflush(stderr);
    std::_Exit(1);
  }).detach();
  MPI_Finalize();
}
}  // namespace

void bound_finalize(std::chrono::milliseconds deadline) {
  int64_t want = deadline.count(), have = finalize_deadline_ms.load();
  while (want > have && !finalize_deadline_ms.compare_exchange_weak(have, want)) {
  }
}

void ensure_initialized() { ensure_initialized(CommunicationOptions{}.timeout); }

void ensure_initialized(std::chrono::milliseconds timeout) {
  // MPI_Init may be called once per process; the mutex only orders two
  // strategies constructed concurrently by different threads.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  DISTSTRAT_CHECK(!finalized, kFailedPrecondition, "MPI was already finalized");
  int provided = 0;
  if (!initialized) {
    int rc = MPI_SUCCESS;
    // MPI_Init meets the other ranks (Open MPI exchanges addresses there), so
    // it waits for the launcher to have started every one of them: on a
    // loaded host that can take seconds, which is start-up, not a stuck rank
    // (at least kMinInitTimeout). After it the ranks are in step.
    const char* launcher_rank = nullptr;
    for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
      if (!launcher_rank) launcher_rank = std::getenv(v);
    }
    const std::string who =
        launcher_rank ? "rank " + std::string(launcher_rank).substr(0, 12) + " (the launcher's): "
                      : std::string();
    mpi::bounded_call(who + "MPI_Init_thread", std::max(timeout, kMinInitTimeout), [&] {
      rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    });
    DISTSTRAT_MPI_CHECK(rc);
    std::atexit(finalize_at_exit);
    start_exit_rendezvous(timeout);
  } else {
    MPI_Query_thread(&provided);
  }
  DISTSTRAT_CHECK(
      provided >= MPI_THREAD_SERIALIZED, kUnavailable, "MPI provides thread level ", provided,
      "; diststrat's multi-process strategies and process groups need at least "
      "MPI_THREAD_SERIALIZED "
      "(MPI_Init_thread with MPI_THREAD_MULTIPLE if they are used from several threads)");
}

Placement placement(MPI_Comm comm, std::chrono::milliseconds timeout) {
  Placement p;
  DISTSTRAT_MPI_CHECK(MPI_Comm_rank(comm, &p.rank));
  DISTSTRAT_MPI_CHECK(MPI_Comm_size(comm, &p.world_size));
  const NodeGroup g = node_group(comm, "placement", timeout);
  p.local_rank = g.local_rank;
  p.local_size = g.local_size;
  // A node is named by its lowest rank; nodes are numbered in that order.
  const int leader = g.leaders[static_cast<size_t>(p.rank)];
  const std::vector<int>& leaders = g.leaders;
  p.node = 0;
  p.num_nodes = 0;
  for (int r = 0; r < p.world_size; ++r) {
    if (leaders[r] == r) {
      if (r < leader) ++p.node;
      ++p.num_nodes;
    }
  }
  return p;
}

}  // namespace mpi
}  // namespace diststrat
