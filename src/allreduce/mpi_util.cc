#include "allreduce/mpi_util.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

namespace diststrat {
namespace mpi {

namespace {
// Per process, like MPI's own state (see mark_failed).
std::atomic<bool> process_failed{false};

using Clock = std::chrono::steady_clock;

std::string ms_text(std::chrono::milliseconds t) { return std::to_string(t.count()) + " ms"; }

std::string rank_prefix() {
  const int r = world_rank();
  return r >= 0 ? "rank " + std::to_string(r) + ": " : std::string();
}
}  // namespace

int world_rank() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return -1;
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

void mark_failed() { process_failed.store(true); }
bool failed() { return process_failed.load(); }

namespace {
std::atomic<bool> process_exiting{false};
std::mutex at_exit_mu;
std::vector<int>* peers_at_exit = new std::vector<int>;  // never freed: read at exit
}  // namespace

void note_exiting() { process_exiting.store(true); }
bool exiting() { return process_exiting.load(); }

void note_peer_at_exit(int world_rank) {
  std::lock_guard<std::mutex> lock(at_exit_mu);
  if (std::find(peers_at_exit->begin(), peers_at_exit->end(), world_rank) == peers_at_exit->end()) {
    peers_at_exit->push_back(world_rank);
  }
}

bool peer_at_exit(int world_rank) {
  std::lock_guard<std::mutex> lock(at_exit_mu);
  return std::find(peers_at_exit->begin(), peers_at_exit->end(), world_rank) !=
         peers_at_exit->end();
}

struct Watchdog::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::thread thread;
};

Watchdog::Watchdog(std::string what, std::chrono::milliseconds timeout) : state_(new State) {
  State* s = state_;
  std::string message = rank_prefix() + what;
  s->thread = std::thread([s, message, timeout] {
    std::unique_lock<std::mutex> lock(s->mu);
    if (s->cv.wait_for(lock, timeout, [s] { return s->done; })) return;
    // The call cannot be interrupted; ending the process is the only bound
    // left, and the launcher then ends the job (stuck ranks included).
    std::fprintf(stderr,
                 "diststrat: %s did not return within %lld ms (a rank is stuck or gone); "
                 "exiting with status 1\n",
                 message.c_str(), static_cast<long long>(timeout.count()));
    std::fflush(stderr);
    std::_Exit(1);
  });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->done = true;
  }
  state_->cv.notify_all();
  state_->thread.join();
  delete state_;
}

void wait(MPI_Request* req, const std::string& what, std::chrono::milliseconds timeout) {
  const auto end = Clock::now() + timeout;
  for (unsigned spin = 0;; ++spin) {
    int flag = 0;
    DISTSTRAT_MPI_CHECK(MPI_Test(req, &flag, MPI_STATUS_IGNORE));
    if (flag) return;
    if (Clock::now() >= end) {
      // MPI cannot cancel a collective: the request stays pending, and this
      // process's MPI state is unusable for collectives on that communicator.
      mark_failed();
      throw DeadlineExceededError(rank_prefix() + what + " did not complete within " +
                                  ms_text(timeout) +
                                  ": some rank never joined it (stuck, gone, or failed before "
                                  "it: see the other ranks' output)");
    }
    if (spin < 256) continue;
    if (spin < 4096) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

MPI_Comm dup(MPI_Comm comm, const std::string& what, std::chrono::milliseconds timeout) {
  MPI_Comm out = MPI_COMM_NULL;
  MPI_Request req;
  DISTSTRAT_MPI_CHECK(MPI_Comm_idup(comm, &out, &req));
  wait(&req, what + " (MPI_Comm_idup)", timeout);
  return out;
}

void barrier(MPI_Comm comm, const std::string& what, std::chrono::milliseconds timeout) {
  MPI_Request req;
  DISTSTRAT_MPI_CHECK(MPI_Ibarrier(comm, &req));
  wait(&req, what + " (MPI_Ibarrier)", timeout);
}

void allreduce_in_place(void* buf, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                        const std::string& what, std::chrono::milliseconds timeout) {
  MPI_Request req;
  DISTSTRAT_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf, count, type, op, comm, &req));
  wait(&req, what + " (MPI_Iallreduce)", timeout);
}

void allgather(const void* in, void* out, int count, MPI_Datatype type, MPI_Comm comm,
               const std::string& what, std::chrono::milliseconds timeout) {
  MPI_Request req;
  DISTSTRAT_MPI_CHECK(MPI_Iallgather(in, count, type, out, count, type, comm, &req));
  wait(&req, what + " (MPI_Iallgather)", timeout);
}

void bcast(void* buf, int count, MPI_Datatype type, int root, MPI_Comm comm,
           const std::string& what, std::chrono::milliseconds timeout) {
  MPI_Request req;
  DISTSTRAT_MPI_CHECK(MPI_Ibcast(buf, count, type, root, comm, &req));
  wait(&req, what + " (MPI_Ibcast)", timeout);
}

void free_comm(MPI_Comm* comm, std::chrono::milliseconds timeout) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized || *comm == MPI_COMM_NULL) return;
  bounded_call("MPI_Comm_free", timeout, [&] { MPI_Comm_free(comm); });
}

NodeGroup node_group(MPI_Comm comm, const std::string& what, std::chrono::milliseconds timeout) {
  int rank = 0, size = 1;
  DISTSTRAT_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  DISTSTRAT_MPI_CHECK(MPI_Comm_size(comm, &size));
  MPI_Comm local = MPI_COMM_NULL;
  int rc = MPI_SUCCESS;
  bounded_call(what + ": MPI_Comm_split_type", timeout, [&] {
    rc = MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
  });
  DISTSTRAT_MPI_CHECK(rc);
  NodeGroup g;
  DISTSTRAT_MPI_CHECK(MPI_Comm_rank(local, &g.local_rank));
  DISTSTRAT_MPI_CHECK(MPI_Comm_size(local, &g.local_size));
  // Split with key = comm rank: local rank 0 is the node's lowest comm rank.
  int leader = rank;
  bcast(&leader, 1, MPI_INT, 0, local, what + ": node leader", timeout);
  free_comm(&local, timeout);
  g.leaders.resize(static_cast<size_t>(size));
  allgather(&leader, g.leaders.data(), 1, MPI_INT, comm, what + ": node map", timeout);
  return g;
}

namespace {
// One rank's answer in the set-up agreement.
struct Vote {
  int32_t failed = 0;
  char message[1020] = {};
};
static_assert(sizeof(Vote) == 1024, "vote size");

std::string message_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}
}  // namespace

void agree(MPI_Comm comm, const std::string& what, std::exception_ptr local_error,
           std::chrono::milliseconds timeout) {
  int rank = 0, size = 1;
  DISTSTRAT_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  DISTSTRAT_MPI_CHECK(MPI_Comm_size(comm, &size));
  Vote mine;
  if (local_error) {
    mine.failed = 1;
    const std::string m = message_of(local_error);
    std::memcpy(mine.message, m.data(), std::min(m.size(), sizeof(mine.message) - 1));
  }
  std::vector<Vote> all(static_cast<size_t>(size));
  try {
    allgather(&mine, all.data(), static_cast<int>(sizeof(Vote)), MPI_BYTE, comm,
              "set-up agreement (" + what + ")", timeout);
  } catch (...) {
    // Our own error says more than the deadline that followed it.
    if (local_error) std::rethrow_exception(local_error);
    throw;
  }
  if (local_error) std::rethrow_exception(local_error);
  int first = -1, others = 0;
  for (int r = 0; r < size; ++r) {
    if (!all[r].failed) continue;
    if (first < 0) {
      first = r;
    } else {
      ++others;
    }
  }
  if (first < 0) return;
  all[first].message[sizeof(Vote::message) - 1] = '\0';
  throw AbortedError("rank " + std::to_string(rank) + ": " + what + " aborted: rank " +
                     std::to_string(first) + " failed: " + all[first].message +
                     (others ? " (and " + std::to_string(others) + " more rank(s) failed)" : ""));
}

bool native_type(DType dtype, MPI_Datatype* t) {
  switch (dtype) {
    case DType::kFloat32:
      *t = MPI_FLOAT;
      return true;
    case DType::kFloat64:
      *t = MPI_DOUBLE;
      return true;
    case DType::kInt32:
      *t = MPI_INT32_T;
      return true;
    case DType::kInt64:
      *t = MPI_INT64_T;
      return true;
    default:
      return false;
  }
}

MPI_Op native_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      return MPI_SUM;
    case ReduceOp::kProduct:
      return MPI_PROD;
    case ReduceOp::kMin:
      return MPI_MIN;
    case ReduceOp::kMax:
      return MPI_MAX;
  }
  return MPI_SUM;
}

}  // namespace mpi
}  // namespace diststrat
