// The shared-memory communicator's set-up and tear-down: the shared segment
// (shm_internal.h) and the windows of allocate_buffer, and the factory.
//
// Set-up and tear-down are bounded by options.timeout too: the communicator
// duplicate and the barrier are non-blocking MPI calls polled against it;
// MPI_Comm_split_type and MPI_Win_allocate_shared (no non-blocking form) run
// under a watchdog (allreduce/mpi_util.h). The destructor frees the windows
// only after every rank has voted to (MPI_Win_free is collective; a peer
// whose process is running extends that wait, see all_agree_to_release); a rank
// that failed, or whose communicator is destroyed while an exception
// propagates, raises its abort word instead and returns at once: its peers
// fail their next barrier with AbortedError naming it within microseconds,
// and nothing delays its own error on the way to the caller's catch.

#include <sched.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "allreduce/mpi_util.h"
#include "allreduce/shm_communicator.h"
#include "allreduce/shm_internal.h"
#include "core/process_liveness.h"

namespace diststrat {

ShmCommunicator::ShmCommunicator(MPI_Comm comm, const CommunicationOptions& options)
    : options_(options) {
  const std::chrono::milliseconds t = options_.timeout;
  comm_ = mpi::dup(comm, "shm communicator set-up", t);
  DISTSTRAT_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  DISTSTRAT_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  DISTSTRAT_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  const int local_size = mpi::node_group(comm_, "shm communicator set-up", t).local_size;
  if (local_size != size_) {
    mpi::free_comm(&comm_, t);
    throw FailedPreconditionError("rank " + std::to_string(rank_) +
                                  ": the shared-memory communicator needs every rank on one "
                                  "node, but only " +
                                  std::to_string(local_size) + " of " + std::to_string(size_) +
                                  " share this one");
  }
  chunk_ = options.segment_bytes ? options.segment_bytes : shm::kDefaultChunk;
  chunk_ = std::max<size_t>(64, chunk_ / 64 * 64);
  std::vector<char*> parts;
  // MPI places the ranks' segments only 8-byte aligned; the header is
  // alignas(64) (its counters on their own cache lines, and the compiler
  // copies call records with aligned vector stores), so each part starts at
  // the next multiple of 64.
  win_ = allocate_shared_window(shm::kHeader + shm::kBuffers * chunk_ + 64, &parts);
  for (char*& part : parts) part += (64 - reinterpret_cast<uintptr_t>(part) % 64) % 64;
  new (parts[rank_]) shm::Header();
  reinterpret_cast<shm::Header*>(parts[rank_])->process = this_process();
  reinterpret_cast<shm::Header*>(parts[rank_])->world_rank = mpi::world_rank();
  reinterpret_cast<shm::Header*>(parts[rank_])->self_address =
      reinterpret_cast<uint64_t>(parts[rank_]);
  headers_.resize(size_);
  bufs_.resize(size_);
  srcs_.resize(size_);
  for (int r = 0; r < size_; ++r) {
    headers_[r] = reinterpret_cast<shm::Header*>(parts[r]);
    bufs_[r] = parts[r] + shm::kHeader;
  }
  DISTSTRAT_MPI_CHECK(MPI_Win_lock_all(MPI_MODE_NOCHECK, win_));
  // Everyone's header is constructed before anyone reads it.
  mpi::barrier(comm_, "shm communicator set-up", t);
  single_copy_ = probe_single_copy();
  oversubscribed_ = ranks_outnumber_their_cpus();
}

bool ShmCommunicator::ranks_outnumber_their_cpus() const {
  // The union of the ranks' affinity masks: ranks bound one per core
  // (mpirun's default for two ranks) each may run on one CPU only, but they
  // do not share it. (Counting each rank's own mask made them sleep at once
  // in every barrier: 2 workers of train_bench bound to a core each ran
  // 80-101k samples/s instead of 109-124k.)
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  uint64_t words[sizeof(cpu_set_t) / sizeof(uint64_t)];
  static_assert(sizeof words == sizeof cpus, "cpu_set_t is whole words");
  if (sched_getaffinity(0, sizeof cpus, &cpus) == 0) {
    std::memcpy(words, &cpus, sizeof words);
  } else {  // unknown: any CPU (every rank still takes part in the union)
    std::memset(words, 0xff, sizeof words);
  }
  mpi::allreduce_in_place(words, static_cast<int>(sizeof words / sizeof words[0]), MPI_UINT64_T,
                          MPI_BOR, comm_, "shm communicator set-up: CPUs", options_.timeout);
  std::memcpy(&cpus, words, sizeof words);
  return size_ > CPU_COUNT(&cpus);
}

bool ShmCommunicator::probe_single_copy() {
  // Read each peer's process stamp out of its own address space: this is
  // what process_vm_readv needs permission for (same user and a ptrace
  // policy that allows it: Yama's ptrace_scope 0, or the peer's consent).
  bool ok = options_.shm_single_copy && size_ > 1;
  for (int q = 0; q < size_ && ok; ++q) {
    if (q == rank_) continue;
    const shm::Header* h = headers_[q];
    int64_t pid = 0;
    iovec local{&pid, sizeof pid};
    iovec remote{reinterpret_cast<void*>(h->self_address + offsetof(shm::Header, process)),
                 sizeof pid};
    ok = h->process.pid > 0 &&
         process_vm_readv(static_cast<pid_t>(h->process.pid), &local, 1, &remote, 1, 0) ==
             static_cast<ssize_t>(sizeof pid) &&
         pid == h->process.pid;
  }
  headers_[rank_]->single_copy.store(ok ? 1 : 2, std::memory_order_release);
  mpi::barrier(comm_, "shm communicator set-up: cross-memory attach", options_.timeout);
  for (int q = 0; q < size_; ++q) {
    if (headers_[q]->single_copy.load(std::memory_order_acquire) != 1) return false;
  }
  single_copy_scratch_.resize(static_cast<size_t>(size_) * shm::kSingleCopyBlock);
  return true;
}

ShmCommunicator::~ShmCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (std::uncaught_exceptions() > uncaught_at_construction_) {
    // Destroyed during stack unwinding: this rank is leaving on an error
    // and will not meet its peers again. Tell them now (they fail their
    // next barrier naming this rank) and do not wait for their votes: that
    // wait would hold the error back from the caller's catch for up to the
    // whole deadline.
    abort("rank " + std::to_string(rank_) +
          " left the group: its communicator was destroyed while an exception propagated "
          "(that rank's own error is in its output)");
  }
  if (failed_) mpi::mark_failed();
  // MPI_Win_free is collective and has no deadline: with a peer that is
  // gone or stuck it would block forever. So each rank first publishes
  // whether it will free (not after a failure of this communicator: peers
  // may be gone) and waits, up to the usual deadline, for every other
  // rank's word; the window is freed only when all said yes, so all ranks
  // decide alike (one later than the deadline counts as gone). Otherwise
  // the window and the communicator are left to the process's end. The
  // frees run under a watchdog, for a peer stopped between vote and free.
  if (!all_agree_to_release()) {
    mpi::mark_failed();
    return;
  }
  mpi::bounded_call("shm communicator tear-down: MPI_Win_free", options_.timeout, [&] {
    for (auto& w : windows_) MPI_Win_free(&w.win);
    MPI_Win_unlock_all(win_);
    MPI_Win_free(&win_);
  });
  mpi::free_comm(&comm_, options_.timeout);
}

std::shared_ptr<void> ShmCommunicator::allocate_buffer(size_t bytes) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  Window w;
  w.bytes = rounded;
  // 64 spare bytes to align each part to a cache line (MPI aligns less;
  // the parts are mapped page-aligned, so a part's misalignment is the
  // same in every process).
  w.win = allocate_shared_window(rounded + 64, &w.bases);
  for (char*& part : w.bases) part += (64 - reinterpret_cast<uintptr_t>(part) % 64) % 64;
  char* mine = w.bases[rank_];
  windows_.push_back(std::move(w));
  // The window is freed with the communicator (freeing is collective too).
  return std::shared_ptr<void>(mine, [](void*) {});
}

MPI_Win ShmCommunicator::allocate_shared_window(size_t bytes, std::vector<char*>* parts) const {
  // Collective without a non-blocking form: entered only once every rank
  // has come this far (a bounded barrier, which names a missing peer by
  // its deadline instead of hanging in the allocation), then watched.
  mpi::barrier(comm_, "shm communicator: before MPI_Win_allocate_shared", options_.timeout);
  MPI_Info info;
  MPI_Info_create(&info);
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  void* base = nullptr;
  MPI_Win win = MPI_WIN_NULL;
  int rc = MPI_SUCCESS;
  mpi::bounded_call("shm communicator: MPI_Win_allocate_shared", options_.timeout, [&] {
    rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(bytes), 1, info, comm_, &base, &win);
  });
  MPI_Info_free(&info);
  DISTSTRAT_MPI_CHECK(rc);
  parts->assign(size_, nullptr);
  for (int r = 0; r < size_; ++r) {
    MPI_Aint sz;
    int disp;
    void* p = nullptr;
    DISTSTRAT_MPI_CHECK(MPI_Win_shared_query(win, r, &sz, &disp, &p));
    (*parts)[r] = static_cast<char*>(p);
  }
  return win;
}

void ShmCommunicator::progress() const {
  int flag = 0;
  MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, MPI_STATUS_IGNORE);
}

bool ShmCommunicator::all_agree_to_release() {
  const bool mine = !failed_;
  headers_[rank_]->release.store(mine ? 1 : 2, std::memory_order_release);
  if (!mine) return false;
  // The deadline bounds a peer's silence, not its work: a peer whose
  // process is running (it may be evaluating or saving before it destroys
  // its communicator) extends the wait; one stopped or gone for the
  // deadline counts as gone.
  for (int q = 0; q < size_; ++q) {
    Clock::time_point last_running = Clock::now(), next_look = last_running;
    for (unsigned spin = 0;; ++spin) {
      const uint32_t v = headers_[q]->release.load(std::memory_order_acquire);
      if (v == 1) break;
      if (v == 2) return false;
      const auto now = Clock::now();
      if (now >= next_look) {
        // A peer at its exit (std::exit with its strategy alive) never votes.
        if (mpi::peer_at_exit(headers_[q]->world_rank)) return false;
        if (process_running(headers_[q]->process)) last_running = now;
        next_look = now + std::chrono::milliseconds(50);
      }
      if (now - last_running >= options_.timeout) return false;
      if ((spin & 63) == 0) progress();
      if (spin >= 1024) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return true;
}

std::unique_ptr<Communicator> make_shm_communicator(MPI_Comm comm,
                                                    const CommunicationOptions& options) {
  return std::make_unique<ShmCommunicator>(comm, options);
}

}  // namespace diststrat
