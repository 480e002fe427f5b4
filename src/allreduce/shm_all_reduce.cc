// The shared-memory communicator's all-reduce: the staged path through the
// staging buffers, and the registered (zero-copy) path.
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
// Single-copy all-reduce of ordinary buffers (from shm::kSingleCopyBytes on,
// where set-up found that every rank may read every peer's memory, see
// probe_single_copy): the placement exchange below also publishes the
// addresses of `in` and `out`; rank r then reads its slice of every peer's
// input with process_vm_readv, 256 KiB at a time, into a scratch block,
// reduces it with its own input into its output and writes the reduced
// block with process_vm_writev into every peer's output, then meets the
// others once more. Two barriers for any size, like the registered path: a
// rank does its whole share while a peer is descheduled, where the staged
// pipeline waits for the peer at every chunk (on a loaded machine the
// staged path lost 2-4x to that, docs/benchmarks.md). In place is safe:
// rank r reads and writes only slice r of each peer's buffers, and reads a
// block before it writes it.
//
// Zero-copy all-reduce: allocate_buffer() returns memory from an extra
// shared window (one per allocation, collective). Messages past kSmallBytes
// first publish where their `in` and `out` lie (window and offset, or "not
// registered") and meet at a barrier. When every rank's buffers are
// registered, rank r reduces its slice straight out of every peer's input,
// block by block, and writes each reduced block (hot in cache) into every
// rank's output; one more barrier and the call is done: two barriers for
// any size, no staging copies at all. Otherwise the single-copy path or
// the staged path below runs (the exchange costs it one barrier).

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "allreduce/algorithm.h"
#include "allreduce/reduce_kernels.h"
#include "allreduce/shm_internal.h"
#include "allreduce/transport_communicator.h"
#include "core/user_text.h"

namespace diststrat {

void ShmCommunicator::all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                                 const std::string& name) {
  Call call(this, {"all_reduce", count, dtype, &op, nullptr, &name, "shm"},
            shm::record(shm::CallKind::kAllReduce, count, dtype, &op, -1, name));
  if (count == 0) return call.empty();
  const size_t es = dtype_size(dtype);
  const size_t per = chunk_ / es;
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  std::vector<const void*>& srcs = srcs_;
  if (count * es <= std::min(shm::kSmallBytes, chunk_)) {
    // One barrier: stage everything, then each rank reduces the whole.
    const int b = static_cast<int>(chunks_++ % shm::kBuffers);
    std::memcpy(buf(rank_, b), src, count * es);
    call.barrier();
    for (int q = 0; q < size_; ++q) srcs[q] = buf(q, b);
    srcs[rank_] = src;
    kernels::reduce(dst, srcs.data(), size_, count, dtype, op, size_);
    return;
  }
  // Publish where the buffers lie; if every rank's are registered, reduce
  // straight out of each other's memory.
  shm::BufferPlacement& mine = headers_[rank_]->placement;
  locate(in, count * es, &mine.in_window, &mine.in_offset);
  locate(out, count * es, &mine.out_window, &mine.out_offset);
  mine.count = count;
  mine.dtype = static_cast<int32_t>(dtype);
  mine.op = static_cast<int32_t>(op);
  mine.in_address = reinterpret_cast<uint64_t>(in);
  mine.out_address = reinterpret_cast<uint64_t>(out);
  call.barrier();
  check_same_call(name);
  if (all_registered()) return reduce_in_place_of_peers(count, dtype, op, call);
  // Every rank takes the same branch: the count was compared above and the
  // probe's outcome is the same everywhere.
  if (single_copy_ && count * es >= shm::kSingleCopyBytes)
    return reduce_across_processes(in, out, count, dtype, op, call);
  const size_t nchunks = (count + per - 1) / per;
  const bool streaming = count * es >= kernels::kStreamingBytes;
  const uint64_t first = chunks_;
  chunks_ += nchunks;
  auto len_of = [&](size_t k) { return std::min(per, count - k * per); };
  auto staging = [&](int q, size_t k) {
    return buf(q, static_cast<int>((first + k) % shm::kBuffers));
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

namespace {

// Copies `bytes` between `local` here and `remote` in process `pid`
// (process_vm_writev when `write`, else process_vm_readv); 0 or the errno.
int cross_copy(int64_t pid, bool write, void* local, uint64_t remote, size_t bytes) {
  char* here = static_cast<char*>(local);
  while (bytes > 0) {
    iovec l{here, bytes};
    iovec r{reinterpret_cast<void*>(remote), bytes};
    const ssize_t n = write ? process_vm_writev(static_cast<pid_t>(pid), &l, 1, &r, 1, 0)
                            : process_vm_readv(static_cast<pid_t>(pid), &l, 1, &r, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? errno : EIO;
    here += n;
    remote += static_cast<uint64_t>(n);
    bytes -= static_cast<size_t>(n);
  }
  return 0;
}

}  // namespace

void ShmCommunicator::reduce_across_processes(const void* in, void* out, size_t count, DType dtype,
                                              ReduceOp op, Call& call) {
  const size_t es = dtype_size(dtype);
  const bool streaming = count * es >= kernels::kStreamingBytes;
  size_t lo, hi;
  algo::slice_of(count, size_, rank_, &lo, &hi);
  const size_t block = std::max<size_t>(1, shm::kSingleCopyBlock / es);
  // One block per rank: peer q's input block at q, the reduced block (when
  // streaming) at this rank's own place.
  auto scratch = [&](int q) { return single_copy_scratch_.data() + q * shm::kSingleCopyBlock; };
  std::vector<const void*>& srcs = srcs_;
  for (size_t j = lo; j < hi; j += block) {
    const size_t m = std::min(block, hi - j);
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) {
        srcs[q] = static_cast<const char*>(in) + j * es;
        continue;
      }
      const int err = cross_copy(headers_[q]->process.pid, false, scratch(q),
                                 headers_[q]->placement.in_address + j * es, m * es);
      if (err) cross_copy_failed("read rank " + std::to_string(q) + "'s input", err);
      srcs[q] = scratch(q);
    }
    char* mine = static_cast<char*>(out) + j * es;
    char* reduced = streaming ? scratch(rank_) : mine;
    kernels::reduce(reduced, srcs.data(), size_, m, dtype, op, size_);
    if (streaming) kernels::copy_streaming(mine, reduced, m * es);
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      const int err = cross_copy(headers_[q]->process.pid, true, reduced,
                                 headers_[q]->placement.out_address + j * es, m * es);
      if (err) cross_copy_failed("write rank " + std::to_string(q) + "'s output", err);
    }
  }
  // Nobody returns (and reuses its buffers) before every slice is written.
  call.barrier();
}

void ShmCommunicator::cross_copy_failed(const std::string& what, int err) {
  const std::string msg = "rank " + std::to_string(rank_) +
                          ": all_reduce (shm, single copy): could not " + what + ": " +
                          std::strerror(err);
  abort(msg);
  throw InternalError(msg);
}

void ShmCommunicator::locate(const void* p, size_t bytes, int32_t* window, uint64_t* offset) const {
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

void ShmCommunicator::check_same_call(const std::string& name) {
  const shm::BufferPlacement& a = headers_[0]->placement;
  for (int q = 1; q < size_; ++q) {
    const shm::BufferPlacement& b = headers_[q]->placement;
    if (b.count == a.count && b.dtype == a.dtype && b.op == a.op) continue;
    auto what = [](const shm::BufferPlacement& p) {
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

bool ShmCommunicator::all_registered() const {
  for (int q = 0; q < size_; ++q) {
    const shm::BufferPlacement& p = headers_[q]->placement;
    if (p.in_window < 0 || p.out_window < 0) return false;
  }
  return true;
}

void ShmCommunicator::reduce_in_place_of_peers(size_t count, DType dtype, ReduceOp op, Call& call) {
  std::vector<const void*> ins(size_);
  std::vector<void*> outs(size_);
  for (int q = 0; q < size_; ++q) {
    const shm::BufferPlacement& p = headers_[q]->placement;
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

}  // namespace diststrat
