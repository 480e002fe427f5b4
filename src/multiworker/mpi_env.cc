#include "multiworker/mpi_env.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "diststrat/error.h"

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
// The longest deadline of this process's MPI strategies (bound_finalize);
// 0 = MPI_Finalize unbounded. Per process, like MPI's own state.
std::atomic<int64_t> finalize_deadline_ms{0};

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  // MPI_Finalize meets every rank of the job: with one stuck or gone it never
  // returns. Past the deadline this process ends with status 1 without it
  // (the launcher then ends the job, stuck ranks included).
  const int64_t ms = finalize_deadline_ms.load();
  if (ms > 0) {
    std::thread([ms] {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      std::fprintf(stderr,
                   "diststrat: MPI_Finalize did not complete within %lld ms (a rank is stuck or "
                   "gone); exiting with status 1 without it\n",
                   static_cast<long long>(ms));
      std::fflush(stderr);
      std::_Exit(1);
    }).detach();
  }
  MPI_Finalize();
}
}  // namespace

void bound_finalize(std::chrono::milliseconds deadline) {
  int64_t want = deadline.count(), have = finalize_deadline_ms.load();
  while (want > have && !finalize_deadline_ms.compare_exchange_weak(have, want)) {
  }
}

void ensure_initialized() {
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
    DISTSTRAT_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    std::atexit(finalize_at_exit);
  } else {
    MPI_Query_thread(&provided);
  }
  DISTSTRAT_CHECK(provided >= MPI_THREAD_SERIALIZED, kUnavailable,
                  "MPI provides thread level ", provided,
                  "; the multi-worker strategy needs at least MPI_THREAD_SERIALIZED");
}

Placement placement(MPI_Comm comm) {
  Placement p;
  DISTSTRAT_MPI_CHECK(MPI_Comm_rank(comm, &p.rank));
  DISTSTRAT_MPI_CHECK(MPI_Comm_size(comm, &p.world_size));
  MPI_Comm node_comm;
  DISTSTRAT_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, p.rank, MPI_INFO_NULL, &node_comm));
  DISTSTRAT_MPI_CHECK(MPI_Comm_rank(node_comm, &p.local_rank));
  DISTSTRAT_MPI_CHECK(MPI_Comm_size(node_comm, &p.local_size));
  // A node is named by its lowest rank; nodes are numbered in that order.
  int leader = p.rank;
  DISTSTRAT_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &leader, 1, MPI_INT, MPI_MIN, node_comm));
  MPI_Comm_free(&node_comm);
  std::vector<int> leaders(p.world_size);
  DISTSTRAT_MPI_CHECK(MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, comm));
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
