// Internals of the shared-memory communicator (shm_communicator.h): the
// segment every rank maps, the call records the ranks compare, and the class
// whose members the shm_*.cc files define, one job each:
//   shm_communicator.cc  set-up and tear-down of the segment and the windows
//   shm_call.cc          one call's barriers, its comparison, abort, reset
//   shm_all_reduce.cc    all-reduce: the staged path and the registered one
//   shm_collectives.cc   broadcast, all_gather, reduce_scatter, barrier
//
// Every rank allocates its part of one MPI-3 shared window: a header with a
// barrier counter and an abort word, then three staging buffers of `chunk`
// bytes. All ranks map all parts, so each reads its peers' buffers directly:
// no messages and no copies beyond the ones each collective describes.
//
// Large all-reduces on ordinary (unregistered) buffers copy straight
// between the processes instead (Linux cross-memory attach,
// process_vm_readv/writev), when set-up found that every rank may read every
// peer's memory; see shm_all_reduce.cc.
//
// The staging buffers rotate by chunk number (counted across calls, and a
// barrier counts as an empty chunk). A buffer is read at most two phases after
// it was written and rewritten three chunks (so at least three barriers)
// later, hence no closing barrier is needed: a rank may return while peers
// still collect its last chunk. broadcast, all_gather and reduce_scatter use
// one barrier per chunk (stage, barrier, read).
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "allreduce/call_text.h"
#include "allreduce/transport.h"
#include "core/process_liveness.h"
#include "diststrat/collective.h"

namespace diststrat {
namespace shm {

constexpr size_t kHeader = 1024;          // keeps the buffers cache-line (and page-ish) aligned
constexpr size_t kSmallBytes = 16 << 10;  // all-reduce chunks up to this skip slicing
// Staging buffer size: small enough that the buffers stay in the caches,
// large enough that the barrier per chunk is amortised. Measured with
// allreduce_bench --algos shm,mpi --segment-bytes on the 2-core development
// host (busy with other jobs): 1-4 MiB chunks beat MPI_Allreduce by 1.4-1.8x
// at 16-64 MiB, 256 KiB chunks only by 1.1-1.2x (a descheduled peer stalls
// every barrier).
constexpr size_t kDefaultChunk = 1 << 20;
constexpr int kBuffers = 3;  // staging buffers per rank, used round-robin by chunk number
// All-reduces of ordinary buffers from this size on copy between the
// processes directly where they may (CommunicationOptions::shm_single_copy):
// allreduce_bench on the 2-core development VM, docs/benchmarks.md.
constexpr size_t kSingleCopyBytes = 8u << 20;
// Bytes per process_vm_readv/writev of the single-copy path: the blocks stay
// in the L2 cache between the read, the reduction and the write.
constexpr size_t kSingleCopyBlock = 256 << 10;

// Where a rank's all_reduce buffers lie: window index (or -1) and offset.
// Written before the call's first barrier, read by the peers after it.
// The call's shape travels along, so that a rank whose call differs is named
// before anyone reads or writes past its buffers.
struct BufferPlacement {
  int32_t in_window = -1, out_window = -1;
  uint64_t in_offset = 0, out_offset = 0;
  uint64_t count = 0;
  int32_t dtype = 0, op = 0;
  // `in` and `out` as this process addresses them (the single-copy path).
  uint64_t in_address = 0, out_address = 0;
};

// What a call is, as the ranks compare it (see shm_call.cc).
enum class CallKind : uint32_t { kAllReduce = 1, kBroadcast, kAllGather, kReduceScatter, kBarrier };
struct CallRecord {
  uint32_t kind = 0;
  int32_t dtype = 0, op = -1, root = -1;
  uint64_t count = 0;
  // The caller's name: its hash (compared) and its start (for the message).
  uint64_t name_hash = 0;
  char name[48] = {};
  bool operator==(const CallRecord& o) const {
    return kind == o.kind && dtype == o.dtype && op == o.op && root == o.root && count == o.count &&
           name_hash == o.name_hash;
  }
};

struct alignas(64) Header {
  std::atomic<uint64_t> arrived{0};
  char pad0[56];
  std::atomic<uint32_t> aborted{0};
  char pad1[60];
  BufferPlacement placement;
  char pad2[64 - sizeof(BufferPlacement)];
  // Destructor: 1 = this rank will free the windows, 2 = it will not.
  std::atomic<uint32_t> release{0};
  char pad3[60];
  // Why this rank aborted (NUL-terminated), written before `aborted` is set.
  char abort_reason[256];
  // This rank's current call, by the parity of its first barrier's number.
  CallRecord calls[2];
  // reset(): how many resets this rank has entered, and its barrier count
  // when it entered the last one (written before reset_epoch).
  alignas(64) std::atomic<uint64_t> reset_epoch{0};
  uint64_t reset_barriers = 0;
  // The rank's process and world rank, so that a peer can tell it is alive
  // or at its exit (the release vote).
  ProcessStamp process;
  int32_t world_rank = -1;
  // The rank whose failure this rank's abort passes on (itself for its own),
  // written before `aborted` is set; see abort().
  int32_t abort_origin = -1;
  // Where this header lies in its own process (for the set-up probe of
  // cross-memory attach), and the probe's outcome: 1 = this rank could read
  // every peer's memory, 2 = it could not or may not.
  uint64_t self_address = 0;
  std::atomic<uint32_t> single_copy{0};
  // The barrier this rank gave up at its deadline (0: none since the last
  // reset), written after its abort word: a late peer that finds this
  // rank's arrival at that barrier or a later one must not go on.
  std::atomic<uint64_t> gave_up_at{0};
};
static_assert(sizeof(Header) <= kHeader, "header too large");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared counters need lock-free atomics");

CallRecord record(CallKind kind, size_t count, DType dtype, const ReduceOp* op, int root,
                  const std::string& name);

}  // namespace shm

class ShmCommunicator : public Communicator {
 public:
  ShmCommunicator(MPI_Comm comm, const CommunicationOptions& options);
  ~ShmCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const CommunicationOptions& options() const override { return options_; }

  std::shared_ptr<void> allocate_buffer(size_t bytes) override;

  void all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                  const std::string& name) override;
  void broadcast(void* data, size_t count, DType dtype, int root, const std::string& name) override;
  void all_gather(const void* in, void* out, size_t count, DType dtype,
                  const std::string& name) override;
  void reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                      const std::string& name) override;
  void barrier(const std::string& name) override;

  // Thread-safe (abort may come from any thread while a collective runs):
  // abort_mu_ guards abort_reason_ and this rank's header reason.
  // A rank that aborts because a peer's abort failed its call passes that
  // peer's failure on (its origin and reason), not its own leaving: a third
  // rank that sees this rank's abort word first still names the rank that
  // failed.
  void abort(const std::string& reason) override;

  // Clears this rank's abort word and meets every peer in its reset, so that
  // no rank's next call sees a peer's abort word from before (a stale "aborted
  // by rank q") or a peer's barrier count or staging buffer rotation left
  // apart by the failed call (a mismatch, an abort or a deadline can leave
  // ranks a barrier or chunks apart): all ranks continue from the largest
  // barrier count any of them reached and from chunk 0. Collective: every
  // rank calls it, with no collective in flight; DeadlineExceededError
  // naming the ranks that did not reset within the timeout.
  void reset() override;

  // Whether the set-up found this node's ranks sharing CPUs (more ranks than
  // the union of their affinity masks holds); then a waiting rank sleeps
  // soon instead of yielding.
  bool oversubscribed() const { return oversubscribed_; }

 private:
  // One collective call: its description for errors and its barriers.
  class Call {
   public:
    // Publishes `rec` for the comparison after the first barrier.
    Call(ShmCommunicator* c, const CallText& what, const shm::CallRecord& rec);
    // A call that moves nothing: meet (and compare) once, as an empty chunk.
    void empty();
    void barrier();

   private:
    void compare_calls();
    void check_abort();
    [[noreturn]] void timeout(uint64_t target);
    ShmCommunicator* c_;
    CallText what_;
    Clock::time_point deadline_;
    int slot_ = 0;
    bool compared_ = false;
  };

  char* buf(int r, int b) const { return bufs_[r] + static_cast<size_t>(b) * chunk_; }

  // A shared window of `bytes` per rank (collective over comm_); `parts`
  // receives every rank's part as mapped in this process.
  MPI_Win allocate_shared_window(size_t bytes, std::vector<char*>* parts) const;

  // The window holding [p, p + bytes), or -1.
  void locate(const void* p, size_t bytes, int32_t* window, uint64_t* offset) const;

  // Every rank sees the same placements, so all of them throw alike; the
  // abort keeps a peer that is slower to look from going on with the group.
  void check_same_call(const std::string& name);

  bool all_registered() const;

  // Lets MPI move what this process owes others while it spins on shared
  // memory: e.g. the completion notice of a rendezvous receive, without
  // which the sender's MPI_Isend never completes. A rank that finished its
  // last point-to-point call and then waited here without calling MPI left
  // its peer stuck in that send (seen as a deadline in the MPI tests).
  void progress() const;

  // The destructor's vote (see ~ShmCommunicator).
  bool all_agree_to_release();

  // Set-up: whether every rank may read every peer's memory
  // (process_vm_readv); collective, all ranks reach the same answer.
  bool probe_single_copy();
  // Set-up: whether this node's ranks outnumber the CPUs they may run on
  // together; collective.
  bool ranks_outnumber_their_cpus() const;

  // Ordinary buffers, single copy: this rank reads its slice of every
  // peer's input out of the peer's memory, block by block, reduces it and
  // writes the block into every peer's output, then meets the others.
  void reduce_across_processes(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                               Call& call);
  // Aborts the group and throws InternalError naming `what` and errno `err`.
  [[noreturn]] void cross_copy_failed(const std::string& what, int err);

  // Every rank's buffers are in shared windows: this rank reduces its slice
  // from every input into its own output, block by block, copies each block
  // into the peers' outputs while it is in cache, then meets the others.
  void reduce_in_place_of_peers(size_t count, DType dtype, ReduceOp op, Call& call);

  CommunicationOptions options_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Win win_ = MPI_WIN_NULL;
  int rank_ = 0, size_ = 1;
  size_t chunk_ = 0;
  std::vector<shm::Header*> headers_;
  std::vector<char*> bufs_;
  // The reductions' source pointers, one per rank (a call allocates nothing).
  std::vector<const void*> srcs_;
  struct Window {
    MPI_Win win = MPI_WIN_NULL;
    size_t bytes = 0;
    std::vector<char*> bases;  // every rank's part, mapped here
  };
  std::vector<Window> windows_;  // from allocate_buffer
  uint64_t barriers_ = 0;        // barriers this rank has entered
  uint64_t chunks_ = 0;          // chunks processed (buffer parity)
  uint64_t resets_ = 0;          // reset() calls (the header's reset_epoch)
  bool single_copy_ = false;     // probe_single_copy() at set-up
  // More ranks on this node than the CPUs they may run on together (the
  // union of their affinity masks): a waiting rank sleeps soon after its
  // spin instead of yielding (Call::barrier).
  bool oversubscribed_ = false;
  std::vector<char> single_copy_scratch_;  // the peers' blocks and the reduced one
  std::mutex abort_mu_;
  std::string abort_reason_;  // guarded by abort_mu_
  // The first peer failure this rank saw (origin rank, reason), passed on by
  // abort(); guarded by abort_mu_.
  int observed_origin_ = -1;
  std::string observed_reason_;
  void observe_abort(int origin, const std::string& reason) {
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (observed_origin_ >= 0) return;
    observed_origin_ = origin;
    observed_reason_ = reason;
  }
  std::string own_abort_reason() {
    std::lock_guard<std::mutex> lock(abort_mu_);
    return abort_reason_;
  }
  // std::uncaught_exceptions() at construction (more at destruction =
  // destroyed during stack unwinding).
  const int uncaught_at_construction_ = std::uncaught_exceptions();
  // A call failed or the communicator was aborted: peers may be gone, so the
  // destructor skips the collective window release.
  std::atomic<bool> failed_{false};
};

}  // namespace diststrat
