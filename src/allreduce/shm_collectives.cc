// The shared-memory communicator's other collectives: broadcast, all_gather
// and reduce_scatter, one barrier per chunk of the staging buffers (stage,
// barrier, read), and barrier.

#include <algorithm>
#include <cstring>
#include <vector>

#include "allreduce/reduce_kernels.h"
#include "allreduce/shm_internal.h"
#include "allreduce/transport_communicator.h"
#include "core/user_text.h"

namespace diststrat {

void ShmCommunicator::broadcast(void* data, size_t count, DType dtype, int root,
                                const std::string& name) {
  Call call(this, {"broadcast", count, dtype, nullptr, &root, &name, "shm"},
            shm::record(shm::CallKind::kBroadcast, count, dtype, nullptr, root, name));
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
    const int b = static_cast<int>(chunks_++ % shm::kBuffers);
    if (rank_ == root) std::memcpy(buf(rank_, b), p + off, len);
    call.barrier();
    if (rank_ != root) std::memcpy(p + off, buf(root, b), len);
  }
}

void ShmCommunicator::all_gather(const void* in, void* out, size_t count, DType dtype,
                                 const std::string& name) {
  Call call(this, {"all_gather", count, dtype, nullptr, nullptr, &name, "shm"},
            shm::record(shm::CallKind::kAllGather, count, dtype, nullptr, -1, name));
  const size_t bytes = count * dtype_size(dtype);
  if (bytes == 0) return call.empty();
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  for (size_t off = 0; off < bytes; off += chunk_) {
    const size_t len = std::min(chunk_, bytes - off);
    const int b = static_cast<int>(chunks_++ % shm::kBuffers);
    std::memcpy(buf(rank_, b), src + off, len);
    call.barrier();
    for (int q = 0; q < size_; ++q) {
      char* d = dst + q * bytes + off;
      if (q == rank_ && d == src + off) continue;  // in place
      std::memcpy(d, buf(q, b), len);
    }
  }
}

void ShmCommunicator::reduce_scatter(const void* in, void* out, size_t count, DType dtype,
                                     ReduceOp op, const std::string& name) {
  Call call(this, {"reduce_scatter", count, dtype, &op, nullptr, &name, "shm"},
            shm::record(shm::CallKind::kReduceScatter, count, dtype, &op, -1, name));
  if (count == 0) return call.empty();
  const size_t es = dtype_size(dtype);
  // Each chunk stages `per` elements of every rank's block.
  const size_t per = std::max<size_t>(1, chunk_ / (es * size_));
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  std::vector<const void*>& srcs = srcs_;
  for (size_t base = 0; base < count; base += per) {
    const size_t len = std::min(per, count - base);
    const int b = static_cast<int>(chunks_++ % shm::kBuffers);
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

void ShmCommunicator::barrier(const std::string& name) {
  Call call(this, {"barrier", 0, DType::kFloat32, nullptr, nullptr, &name, "shm"},
            shm::record(shm::CallKind::kBarrier, 0, DType::kFloat32, nullptr, -1, name));
  ++chunks_;  // keeps the buffer parity rule simple: a barrier is an empty chunk
  call.barrier();
}

}  // namespace diststrat
