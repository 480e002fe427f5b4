// Helpers shared by the algorithms in this folder, and the dissemination
// agreement: in round k (k = 1, 2, 4, ...) member i sends what it has seen to
// member i + k and receives from member i - k (mod n). After ceil(lg n)
// rounds every member has heard, directly or transitively, from all others.

#include "allreduce/algorithm.h"

#include <algorithm>

#include "allreduce/reduce_kernels.h"

namespace diststrat {
namespace algo {

Peers Peers::all(Transport& t) {
  Peers p;
  p.transport = &t;
  p.ranks.resize(t.size());
  for (int r = 0; r < t.size(); ++r) p.ranks[r] = r;
  p.me = t.rank();
  return p;
}

void AllReduceArgs::finish(void* block, size_t n) const {
  if (op == ReduceOp::kMean) kernels::scale_mean(block, n, dtype, mean_divisor);
}

void AllReduceArgs::accumulate(void* dst, const void* src, size_t n) const {
  kernels::accumulate(dst, src, n, dtype, op);
}

void slice_of(size_t count, int parts, int b, size_t* lo, size_t* hi) {
  const size_t base = count / parts, extra = count % parts;
  *lo = b * base + std::min<size_t>(b, extra);
  *hi = *lo + base + (static_cast<size_t>(b) < extra ? 1 : 0);
}

void reduce_slice_to_all(const void* const* ins, void* const* outs, int n, int self, size_t lo,
                         size_t hi, DType dtype, ReduceOp op, size_t message_bytes) {
  if (hi <= lo) return;
  const size_t es = dtype_size(dtype);
  constexpr size_t kBlockBytes = 64 << 10;  // well inside L2, so the copies read from cache
  const size_t block = std::max<size_t>(1, kBlockBytes / es);
  const bool streaming = message_bytes >= kernels::kStreamingBytes;
  // Streaming: reduce into a cache-resident block, then stream it into every
  // output. Otherwise reduce into our own output and copy from there.
  std::vector<char> scratch(streaming ? std::min(block, hi - lo) * es : 0);
  std::vector<const void*> srcs(n);
  for (size_t b = lo; b < hi; b += block) {
    const size_t len = std::min(block, hi - b);
    for (int r = 0; r < n; ++r) srcs[r] = static_cast<const char*>(ins[r]) + b * es;
    char* reduced = streaming ? scratch.data() : static_cast<char*>(outs[self]) + b * es;
    kernels::reduce(reduced, srcs.data(), n, len, dtype, op, n);
    for (int r = 0; r < n; ++r) {
      char* to = static_cast<char*>(outs[r]) + b * es;
      if (streaming) {
        kernels::copy_streaming(to, reduced, len * es);
      } else if (r != self) {
        std::memcpy(to, reduced, len * es);
      }
    }
  }
}

size_t segment_bytes(const CommunicationOptions& options) {
  return options.segment_bytes ? options.segment_bytes : size_t{1} << 20;
}

bool dissemination_agree(const Peers& peers, uint64_t value, int tag, Clock::time_point deadline) {
  const int n = peers.size();
  uint64_t seen[2] = {value, value};  // least, greatest
  for (int k = 1; k < n; k <<= 1) {
    uint64_t out[2] = {seen[0], seen[1]}, in[2] = {0, 0};
    Request r = peers.recv((peers.me - k + n) % n, in, sizeof in, tag);
    Request s = peers.send((peers.me + k) % n, out, sizeof out, tag);
    r.wait(deadline);
    s.wait(deadline);
    seen[0] = std::min(seen[0], in[0]);
    seen[1] = std::max(seen[1], in[1]);
  }
  return seen[0] == seen[1];
}

}  // namespace algo
}  // namespace diststrat
