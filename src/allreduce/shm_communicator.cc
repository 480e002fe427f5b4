// Shared-memory collectives for the ranks of one node.
//
// Every rank allocates its part of one MPI-3 shared window: a header with a
// barrier counter and an abort word, then three staging buffers of `chunk`
// bytes. All ranks map all parts, so each reads its peers' buffers directly:
// no messages and no copies beyond the ones below.
//
// All-reduce, chunk by chunk (chunks of the staging buffer size):
//  1. stage: rank r copies the slices of the chunk that the OTHER ranks own
//     into its staging buffer (its own slice it reads straight from its input);
//  2. barrier;
//  3. reduce: rank r reduces its slice [lo_r, hi_r) in one pass over its
//     input and every peer's staging buffer into its output, block by block,
//     copying each block while it is in cache into the (otherwise unused) own
//     slice of its staging buffer;
//  4. barrier;
//  5. collect: rank r copies the other ranks' reduced slices out of their
//     staging buffers into its output.
// The steps of consecutive chunks are software-pipelined: phase p collects
// chunk p-2, reduces chunk p-1 and stages chunk p, with one barrier between
// phases, so a message of k chunks costs k + 1 barriers instead of 2k.
// With chunks that fit in the caches (default 1 MiB) the staging buffers
// never leave them, so memory sees about what one memcpy of the message
// costs: the input read and the output written. The cores still pass each
// half once more between their caches through the staging buffers, which on
// the development VM takes as long as a second memcpy while the message fits
// the last-level cache (registered buffers avoid it; docs/allreduce.md).
// From kernels::kStreamingBytes on, step 3 reduces each block into the
// staging buffer and streams it into the output, and step 5 copies with
// streaming stores: outputs that large leave the caches anyway, so they cost
// no write-allocate reads. Messages up to kSmallBytes skip the slicing: each
// rank stages its whole input, meets the others at one barrier and reduces
// the whole message itself.
//
// Zero-copy all-reduce: allocate_buffer() returns memory from an extra
// shared window (one per allocation, collective). Messages past kSmallBytes
// first publish where their `in` and `out` lie (window and offset, or "not
// registered") and meet at a barrier. When every rank's buffers are
// registered, rank r reduces its slice straight out of every peer's input,
// block by block, and writes each reduced block (hot in cache) into every
// rank's output; one more barrier and the call is done: two barriers for
// any size, no staging copies at all. Otherwise the staged path below runs
// (the exchange costs it one barrier).
//
// The staging buffers rotate by chunk number (counted across calls, and a
// barrier counts as an empty chunk). A buffer is read at most two phases after
// it was written and rewritten three chunks (so at least three barriers)
// later, hence no closing barrier is needed: a rank may return while peers
// still collect its last chunk. broadcast, all_gather and reduce_scatter use
// one barrier per chunk (stage, barrier, read).
//
// Every call first publishes what it is (kind, count, dtype, reduce op,
// root) in its header, and every rank compares all ranks' calls right after
// the call's first barrier, before it reads or writes anything of a peer's:
// a rank whose call differs is named on every rank (InvalidArgumentError,
// then an abort, so a rank that looks later fails too) instead of the ranks
// exchanging bytes of different calls. Calls of nothing (count 0) meet at one
// barrier for it. The record is double-buffered by the parity of the first
// barrier's number: a peer can write the next call's record while this rank
// still compares, but not the one after (that needs this rank's next barrier).
//
// Barrier: each rank bumps its own counter (release) and waits until every
// counter has reached its value (acquire), spinning, then yielding, then
// sleeping, until the deadline; then it throws DeadlineExceededError naming
// the ranks whose counters lag. abort() raises this rank's abort word, which
// every waiting peer checks, and its reason, which they quote.
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

#include "allreduce/shm_communicator.h"

#include "core/process_liveness.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <cstring>
#include <exception>
#include <sstream>
#include <thread>
#include <vector>

#include "allreduce/algorithm.h"
#include "allreduce/mpi_util.h"
#include "allreduce/reduce_kernels.h"
#include "allreduce/transport_communicator.h"
#include "core/user_text.h"

namespace diststrat {
namespace {

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

// Where a rank's all_reduce buffers lie: window index (or -1) and offset.
// Written before the call's first barrier, read by the peers after it.
// The call's shape travels along, so that a rank whose call differs is named
// before anyone reads or writes past its buffers.
struct BufferPlacement {
  int32_t in_window = -1, out_window = -1;
  uint64_t in_offset = 0, out_offset = 0;
  uint64_t count = 0;
  int32_t dtype = 0, op = 0;
};

// What a call is, as the ranks compare it (see "Every call first publishes").
enum class CallKind : uint32_t { kAllReduce = 1, kBroadcast, kAllGather, kReduceScatter, kBarrier };
struct CallRecord {
  uint32_t kind = 0;
  int32_t dtype = 0, op = -1, root = -1;
  uint64_t count = 0;
  bool operator==(const CallRecord& o) const {
    return kind == o.kind && dtype == o.dtype && op == o.op && root == o.root && count == o.count;
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
};
static_assert(sizeof(Header) <= kHeader, "header too large");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared counters need lock-free atomics");

CallRecord record(CallKind kind, size_t count, DType dtype, const ReduceOp* op, int root) {
  CallRecord r;
  r.kind = static_cast<uint32_t>(kind);
  r.count = count;
  r.dtype = kind == CallKind::kBarrier ? 0 : static_cast<int32_t>(dtype);
  r.op = op ? static_cast<int32_t>(*op) : -1;
  r.root = root;
  return r;
}

// "5 x float32 in all_gather", "4 x float32 from root 1 in broadcast", "a barrier".
std::string describe_record(const CallRecord& r) {
  static const char* const kNames[] = {"?",          "all_reduce",     "broadcast",
                                       "all_gather", "reduce_scatter", "barrier"};
  const char* kind = r.kind < 6 ? kNames[r.kind] : "?";
  if (r.kind == static_cast<uint32_t>(CallKind::kBarrier)) return "a barrier";
  const bool known = r.dtype >= 0 && r.dtype <= static_cast<int32_t>(DType::kInt64);
  std::string s =
      std::to_string(r.count) + " x " + (known ? dtype_name(static_cast<DType>(r.dtype)) : "?");
  if (r.op >= 0 && r.op <= static_cast<int32_t>(ReduceOp::kProduct)) {
    s += std::string(" ") + reduce_op_name(static_cast<ReduceOp>(r.op));
  }
  if (r.kind == static_cast<uint32_t>(CallKind::kBroadcast))
    s += " from root " + std::to_string(r.root);
  return s + " in " + kind;
}

class ShmCommunicator : public Communicator {
 public:
  ShmCommunicator(MPI_Comm comm, const CommunicationOptions& options) : options_(options) {
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
    chunk_ = options.segment_bytes ? options.segment_bytes : kDefaultChunk;
    chunk_ = std::max<size_t>(64, chunk_ / 64 * 64);
    std::vector<char*> parts;
    win_ = allocate_shared_window(kHeader + kBuffers * chunk_, &parts);
    new (parts[rank_]) Header();
    reinterpret_cast<Header*>(parts[rank_])->process = this_process();
    reinterpret_cast<Header*>(parts[rank_])->world_rank = mpi::world_rank();
    headers_.resize(size_);
    bufs_.resize(size_);
    for (int r = 0; r < size_; ++r) {
      headers_[r] = reinterpret_cast<Header*>(parts[r]);
      bufs_[r] = parts[r] + kHeader;
    }
    DISTSTRAT_MPI_CHECK(MPI_Win_lock_all(MPI_MODE_NOCHECK, win_));
    // Everyone's header is constructed before anyone reads it.
    mpi::barrier(comm_, "shm communicator set-up", t);
  }

  ~ShmCommunicator() override {
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

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const CommunicationOptions& options() const override { return options_; }

  std::shared_ptr<void> allocate_buffer(size_t bytes) override {
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

  void all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                  const std::string& name) override {
    Call call(this, describe_call("all_reduce", count, dtype, &op, name) + " (shm)",
              record(CallKind::kAllReduce, count, dtype, &op, -1));
    if (count == 0) return call.empty();
    const size_t es = dtype_size(dtype);
    const size_t per = chunk_ / es;
    const char* src = static_cast<const char*>(in);
    char* dst = static_cast<char*>(out);
    std::vector<const void*> srcs(size_);
    if (count * es <= std::min(kSmallBytes, chunk_)) {
      // One barrier: stage everything, then each rank reduces the whole.
      const int b = static_cast<int>(chunks_++ % kBuffers);
      std::memcpy(buf(rank_, b), src, count * es);
      call.barrier();
      for (int q = 0; q < size_; ++q) srcs[q] = buf(q, b);
      srcs[rank_] = src;
      kernels::reduce(dst, srcs.data(), size_, count, dtype, op, size_);
      return;
    }
    // Publish where the buffers lie; if every rank's are registered, reduce
    // straight out of each other's memory.
    BufferPlacement& mine = headers_[rank_]->placement;
    locate(in, count * es, &mine.in_window, &mine.in_offset);
    locate(out, count * es, &mine.out_window, &mine.out_offset);
    mine.count = count;
    mine.dtype = static_cast<int32_t>(dtype);
    mine.op = static_cast<int32_t>(op);
    call.barrier();
    check_same_call(name);
    if (all_registered()) return reduce_in_place_of_peers(count, dtype, op, call);
    const size_t nchunks = (count + per - 1) / per;
    const bool streaming = count * es >= kernels::kStreamingBytes;
    const uint64_t first = chunks_;
    chunks_ += nchunks;
    auto len_of = [&](size_t k) { return std::min(per, count - k * per); };
    auto staging = [&](int q, size_t k) {
      return buf(q, static_cast<int>((first + k) % kBuffers));
    };
    // 1. stage the slices of chunk k that the others own.
    auto stage = [&](size_t k) {
      const size_t len = len_of(k);
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        size_t lo, hi;
        algo::slice_of(len, size_, q, &lo, &hi);
        std::memcpy(staging(rank_, k) + lo * es, src + (k * per + lo) * es, (hi - lo) * es);
      }
    };
    // 3. reduce my slice of chunk k out of everyone's memory, block by block
    // into my output, and publish each block (hot in cache) for the others.
    auto reduce = [&](size_t k) {
      size_t lo, hi;
      algo::slice_of(len_of(k), size_, rank_, &lo, &hi);
      const size_t block = std::max<size_t>(1, (32 << 10) / es);
      for (size_t j = lo; j < hi; j += block) {
        const size_t m = std::min(block, hi - j);
        for (int q = 0; q < size_; ++q) srcs[q] = staging(q, k) + j * es;
        srcs[rank_] = src + (k * per + j) * es;
        char* mine = dst + (k * per + j) * es;
        char* published = staging(rank_, k) + j * es;
        if (streaming) {
          kernels::reduce(published, srcs.data(), size_, m, dtype, op, size_);
          kernels::copy_streaming(mine, published, m * es);
        } else {
          kernels::reduce(mine, srcs.data(), size_, m, dtype, op, size_);
          std::memcpy(published, mine, m * es);
        }
      }
    };
    // 5. collect the other ranks' reduced slices of chunk k.
    auto collect = [&](size_t k) {
      const size_t len = len_of(k);
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        size_t lo, hi;
        algo::slice_of(len, size_, q, &lo, &hi);
        char* to = dst + (k * per + lo) * es;
        const char* from = staging(q, k) + lo * es;
        if (streaming) {
          kernels::copy_streaming(to, from, (hi - lo) * es);
        } else {
          std::memcpy(to, from, (hi - lo) * es);
        }
      }
    };
    // Software pipeline: phase p collects chunk p-2, reduces chunk p-1 and
    // stages chunk p; one barrier between phases (so one per chunk).
    for (size_t p = 0; p <= nchunks + 1; ++p) {
      if (p >= 2) collect(p - 2);
      if (p >= 1 && p - 1 < nchunks) reduce(p - 1);
      if (p < nchunks) stage(p);
      if (p <= nchunks) call.barrier();
    }
  }

  void broadcast(void* data, size_t count, DType dtype, int root,
                 const std::string& name) override {
    Call call(this,
              describe_call("broadcast", count, dtype, nullptr, name) + " from root " +
                  std::to_string(root) + " (shm)",
              record(CallKind::kBroadcast, count, dtype, nullptr, root));
    const size_t bytes = count * dtype_size(dtype);
    if (root < 0 || root >= size_ || bytes == 0) {
      // Met first, so a root out of range on some ranks only is a
      // disagreement named on all of them; on every rank, the same error.
      call.empty();
      DISTSTRAT_CHECK(0 <= root && root < size_, kInvalidArgument, "rank ", rank_, ": broadcast '",
                      echo(name), "': root ", root, " is not a rank of a group of ", size_);
      return;
    }
    char* p = static_cast<char*>(data);
    for (size_t off = 0; off < bytes; off += chunk_) {
      const size_t len = std::min(chunk_, bytes - off);
      const int b = static_cast<int>(chunks_++ % kBuffers);
      if (rank_ == root) std::memcpy(buf(rank_, b), p + off, len);
      call.barrier();
      if (rank_ != root) std::memcpy(p + off, buf(root, b), len);
    }
  }

  void all_gather(const void* in, void* out, size_t count, DType dtype,
                  const std::string& name) override {
    Call call(this, describe_call("all_gather", count, dtype, nullptr, name) + " (shm)",
              record(CallKind::kAllGather, count, dtype, nullptr, -1));
    const size_t bytes = count * dtype_size(dtype);
    if (bytes == 0) return call.empty();
    const char* src = static_cast<const char*>(in);
    char* dst = static_cast<char*>(out);
    for (size_t off = 0; off < bytes; off += chunk_) {
      const size_t len = std::min(chunk_, bytes - off);
      const int b = static_cast<int>(chunks_++ % kBuffers);
      std::memcpy(buf(rank_, b), src + off, len);
      call.barrier();
      for (int q = 0; q < size_; ++q) {
        char* d = dst + q * bytes + off;
        if (q == rank_ && d == src + off) continue;  // in place
        std::memcpy(d, buf(q, b), len);
      }
    }
  }

  void reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                      const std::string& name) override {
    Call call(this, describe_call("reduce_scatter", count, dtype, &op, name) + " (shm)",
              record(CallKind::kReduceScatter, count, dtype, &op, -1));
    if (count == 0) return call.empty();
    const size_t es = dtype_size(dtype);
    // Each chunk stages `per` elements of every rank's block.
    const size_t per = std::max<size_t>(1, chunk_ / (es * size_));
    const char* src = static_cast<const char*>(in);
    char* dst = static_cast<char*>(out);
    std::vector<const void*> srcs(size_);
    for (size_t base = 0; base < count; base += per) {
      const size_t len = std::min(per, count - base);
      const int b = static_cast<int>(chunks_++ % kBuffers);
      for (int q = 0; q < size_; ++q) {
        if (q != rank_)
          std::memcpy(buf(rank_, b) + q * len * es, src + (q * count + base) * es, len * es);
      }
      call.barrier();
      for (int q = 0; q < size_; ++q) srcs[q] = buf(q, b) + rank_ * len * es;
      srcs[rank_] = src + (rank_ * count + base) * es;
      kernels::reduce(dst + base * es, srcs.data(), size_, len, dtype, op, size_);
    }
    // The output may alias the input (out == in + rank * count): later chunks
    // of our own block are read from `in` only by us, so this is safe.
  }

  void barrier(const std::string& name) override {
    Call call(this,
              std::string("barrier") + (name.empty() ? "" : " '" + echo(name) + "'") + " (shm)",
              record(CallKind::kBarrier, 0, DType::kFloat32, nullptr, -1));
    ++chunks_;  // keeps the buffer parity rule simple: a barrier is an empty chunk
    call.barrier();
  }

  // Thread-safe (abort may come from any thread while a collective runs):
  // abort_mu_ guards abort_reason_ and this rank's header reason.
  // A rank that aborts because a peer's abort failed its call passes that
  // peer's failure on (its origin and reason), not its own leaving: a third
  // rank that sees this rank's abort word first still names the rank that
  // failed.
  void abort(const std::string& reason) override {
    failed_ = true;
    mpi::mark_failed();
    std::lock_guard<std::mutex> lock(abort_mu_);
    abort_reason_ = reason;
    Header* h = headers_[rank_];
    if (h->aborted.load(std::memory_order_relaxed)) return;  // the first reason stays
    const bool passed_on = observed_origin_ >= 0 && observed_origin_ != rank_;
    const std::string& text = passed_on ? observed_reason_ : reason;
    const size_t n = std::min(text.size(), sizeof(h->abort_reason) - 1);
    std::memcpy(h->abort_reason, text.data(), n);
    h->abort_reason[n] = '\0';
    h->abort_origin = passed_on ? observed_origin_ : rank_;
    h->aborted.store(1, std::memory_order_release);
  }

  // Clears this rank's abort word and meets every peer in its reset, so that
  // no rank's next call sees a peer's abort word from before (a stale "aborted
  // by rank q") or a peer's barrier count or staging buffer rotation left
  // apart by the failed call (a mismatch, an abort or a deadline can leave
  // ranks a barrier or chunks apart): all ranks continue from the largest
  // barrier count any of them reached and from chunk 0. Collective: every
  // rank calls it, with no collective in flight; DeadlineExceededError
  // naming the ranks that did not reset within the timeout.
  void reset() override {
    Header* mine = headers_[rank_];
    {
      std::lock_guard<std::mutex> lock(abort_mu_);
      abort_reason_.clear();
      observed_origin_ = -1;
      observed_reason_.clear();
      mine->abort_reason[0] = '\0';
      mine->abort_origin = -1;
      mine->aborted.store(0, std::memory_order_release);
    }
    const uint64_t epoch = ++resets_;
    mine->reset_barriers = barriers_;
    mine->reset_epoch.store(epoch, std::memory_order_release);
    const auto deadline = Clock::now() + options_.timeout;
    uint64_t top = barriers_;
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      for (unsigned spin = 0; headers_[q]->reset_epoch.load(std::memory_order_acquire) < epoch;
           ++spin) {
        if (Clock::now() >= deadline) {
          std::string missing;
          for (int p = 0; p < size_; ++p) {
            if (p != rank_ && headers_[p]->reset_epoch.load(std::memory_order_acquire) < epoch)
              missing += (missing.empty() ? "" : ", ") + std::to_string(p);
          }
          failed_ = true;
          throw DeadlineExceededError("rank " + std::to_string(rank_) + ": reset: rank(s) " +
                                      missing + " did not call reset() within " +
                                      std::to_string(options_.timeout.count()) +
                                      " ms (every rank of the group must reset it)");
        }
        if (spin >= 1024) std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      top = std::max(top, headers_[q]->reset_barriers);
    }
    // Every rank computes the same `top` (the values were written before the
    // epochs it waited for). A rank behind it moves its counter up; a rank
    // that already left its reset has not passed `top` yet, since its next
    // barrier waits for everybody else's.
    barriers_ = top;
    mine->arrived.store(top, std::memory_order_release);
    chunks_ = 0;
    failed_ = false;
  }

 private:
  class Call;

  char* buf(int r, int b) const { return bufs_[r] + static_cast<size_t>(b) * chunk_; }

  // A shared window of `bytes` per rank (collective over comm_); `parts`
  // receives every rank's part as mapped in this process.
  MPI_Win allocate_shared_window(size_t bytes, std::vector<char*>* parts) const {
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

  // The window holding [p, p + bytes), or -1.
  void locate(const void* p, size_t bytes, int32_t* window, uint64_t* offset) const {
    const char* c = static_cast<const char*>(p);
    for (size_t w = 0; w < windows_.size(); ++w) {
      const char* base = windows_[w].bases[rank_];
      if (c >= base && c + bytes <= base + windows_[w].bytes) {
        *window = static_cast<int32_t>(w);
        *offset = static_cast<uint64_t>(c - base);
        return;
      }
    }
    *window = -1;
    *offset = 0;
  }

  // Every rank sees the same placements, so all of them throw alike; the
  // abort keeps a peer that is slower to look from going on with the group.
  void check_same_call(const std::string& name) {
    const BufferPlacement& a = headers_[0]->placement;
    for (int q = 1; q < size_; ++q) {
      const BufferPlacement& b = headers_[q]->placement;
      if (b.count == a.count && b.dtype == a.dtype && b.op == a.op) continue;
      auto what = [](const BufferPlacement& p) {
        return std::to_string(p.count) + " x " + dtype_name(static_cast<DType>(p.dtype)) + " " +
               reduce_op_name(static_cast<ReduceOp>(p.op));
      };
      const std::string msg = "rank " + std::to_string(rank_) + ": all_reduce '" + echo(name) +
                              "' (shm): ranks disagree on the call: rank 0 has " + what(a) +
                              ", rank " + std::to_string(q) + " has " + what(b);
      abort(msg);
      throw InvalidArgumentError(msg);
    }
  }

  bool all_registered() const {
    for (int q = 0; q < size_; ++q) {
      const BufferPlacement& p = headers_[q]->placement;
      if (p.in_window < 0 || p.out_window < 0) return false;
    }
    return true;
  }

  // Lets MPI move what this process owes others while it spins on shared
  // memory: e.g. the completion notice of a rendezvous receive, without
  // which the sender's MPI_Isend never completes. A rank that finished its
  // last point-to-point call and then waited here without calling MPI left
  // its peer stuck in that send (seen as a deadline in the MPI tests).
  void progress() const {
    int flag = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, MPI_STATUS_IGNORE);
  }

  // The destructor's vote (see ~ShmCommunicator).
  bool all_agree_to_release() {
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

  // Every rank's buffers are in shared windows: this rank reduces its slice
  // from every input into its own output, block by block, copies each block
  // into the peers' outputs while it is in cache, then meets the others.
  void reduce_in_place_of_peers(size_t count, DType dtype, ReduceOp op, Call& call) {
    std::vector<const void*> ins(size_);
    std::vector<void*> outs(size_);
    for (int q = 0; q < size_; ++q) {
      const BufferPlacement& p = headers_[q]->placement;
      ins[q] = windows_[p.in_window].bases[q] + p.in_offset;
      outs[q] = windows_[p.out_window].bases[q] + p.out_offset;
    }
    size_t lo, hi;
    algo::slice_of(count, size_, rank_, &lo, &hi);
    algo::reduce_slice_to_all(ins.data(), outs.data(), size_, rank_, lo, hi, dtype, op,
                              count * dtype_size(dtype));
    // Nobody returns (and reuses its buffers) before every slice is written.
    call.barrier();
  }

  // One collective call: its description for errors and its barriers.
  class Call {
   public:
    // Publishes `rec` for the comparison after the first barrier.
    Call(ShmCommunicator* c, std::string what, const CallRecord& rec)
        : c_(c), what_(std::move(what)) {
      deadline_ = Clock::now() + c_->options_.timeout;
      check_abort();
      slot_ = static_cast<int>((c_->barriers_ + 1) % 2);
      c_->headers_[c_->rank_]->calls[slot_] = rec;
    }
    // A call that moves nothing: meet (and compare) once, as an empty chunk.
    void empty() {
      ++c_->chunks_;
      barrier();
    }
    void barrier() {
      const uint64_t target = ++c_->barriers_;
      c_->headers_[c_->rank_]->arrived.store(target, std::memory_order_release);
      for (int q = 0; q < c_->size_; ++q) {
        if (q == c_->rank_) continue;
        auto& counter = c_->headers_[q]->arrived;
        for (unsigned spin = 0; counter.load(std::memory_order_acquire) < target; ++spin) {
          if ((spin & 63) == 0) {
            check_abort();
            if (Clock::now() >= deadline_) timeout(target);
            if (spin >= 1024) c_->progress();
          }
          if (spin < 1024) continue;
          if (spin < 16384) {
            std::this_thread::yield();
          } else {
            std::this_thread::sleep_for(std::chrono::microseconds(50));
          }
        }
      }
      if (!compared_) {
        compared_ = true;
        compare_calls();
      }
    }

   private:
    // Every rank sees the same records, so every rank throws alike.
    void compare_calls() {
      const CallRecord& first = c_->headers_[0]->calls[slot_];
      for (int q = 1; q < c_->size_; ++q) {
        const CallRecord& other = c_->headers_[q]->calls[slot_];
        if (other == first) continue;
        const std::string msg = "rank " + std::to_string(c_->rank_) + ": " + what_ +
                                ": ranks disagree on the call: rank 0 has " +
                                describe_record(first) + ", rank " + std::to_string(q) + " has " +
                                describe_record(other);
        c_->abort(msg);
        throw InvalidArgumentError(msg);
      }
    }
    void check_abort() {
      for (int q = 0; q < c_->size_; ++q) {
        if (c_->headers_[q]->aborted.load(std::memory_order_acquire)) {
          c_->failed_ = true;
          const Header* h = c_->headers_[q];
          if (q == c_->rank_) {
            throw AbortedError("rank " + std::to_string(c_->rank_) + ": " + what_ +
                               " aborted by rank " + std::to_string(q) + ": " +
                               c_->own_abort_reason());
          }
          // The rank whose failure it is (q itself, or the one q passes on).
          const int origin =
              h->abort_origin >= 0 && h->abort_origin < c_->size_ ? h->abort_origin : q;
          const std::string reason(h->abort_reason,
                                   strnlen(h->abort_reason, sizeof(h->abort_reason)));
          c_->observe_abort(origin, reason);
          throw AbortedError("rank " + std::to_string(c_->rank_) + ": " + what_ +
                             " aborted by rank " + std::to_string(origin) +
                             (reason.empty() ? std::string() : ": " + reason));
        }
      }
    }
    [[noreturn]] void timeout(uint64_t target) {
      std::ostringstream missing;
      int n = 0;
      for (int q = 0; q < c_->size_; ++q) {
        if (c_->headers_[q]->arrived.load(std::memory_order_acquire) < target) {
          missing << (n++ ? ", " : "") << q;
        }
      }
      c_->failed_ = true;
      throw DeadlineExceededError("rank " + std::to_string(c_->rank_) + ": " + what_ + ": rank" +
                                  (n > 1 ? "s " : " ") + missing.str() + " did not arrive within " +
                                  std::to_string(c_->options_.timeout.count()) + " ms");
    }
    ShmCommunicator* c_;
    std::string what_;
    Clock::time_point deadline_;
    int slot_ = 0;
    bool compared_ = false;
  };

  CommunicationOptions options_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Win win_ = MPI_WIN_NULL;
  int rank_ = 0, size_ = 1;
  size_t chunk_ = 0;
  std::vector<Header*> headers_;
  std::vector<char*> bufs_;
  struct Window {
    MPI_Win win = MPI_WIN_NULL;
    size_t bytes = 0;
    std::vector<char*> bases;  // every rank's part, mapped here
  };
  std::vector<Window> windows_;  // from allocate_buffer
  uint64_t barriers_ = 0;        // barriers this rank has entered
  uint64_t chunks_ = 0;          // chunks processed (buffer parity)
  uint64_t resets_ = 0;          // reset() calls (the header's reset_epoch)
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

}  // namespace

std::unique_ptr<Communicator> make_shm_communicator(MPI_Comm comm,
                                                    const CommunicationOptions& options) {
  return std::make_unique<ShmCommunicator>(comm, options);
}

}  // namespace diststrat
