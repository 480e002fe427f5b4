// Internal interface between the collective algorithms and the communicators
// that run them. Every algorithm is written once, against a `Peers` view of a
// Transport (a subset of its ranks, renumbered 0..n-1), so the same code runs
// over the in-process transport, MPI point-to-point, or any later transport,
// and the hierarchical algorithm can run the others on sub-groups.
//
// Conventions shared by all algorithms:
//  - They work in place on `buf` (the communicator copies in -> out first).
//  - kMean is reduced as a sum; the rank that ends up owning a finished block
//    divides it by `mean_divisor` (so each element is scaled exactly once).
//  - Every wait uses `deadline`; transports throw DeadlineExceededError naming
//    this rank, the peer and the tag, and the communicator prefixes the op,
//    tensor and algorithm.
//  - Tags: an algorithm uses tags [tag, tag + kTagsPerCall); all ranks compute
//    the same tag for the same call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "allreduce/transport.h"
#include "diststrat/collective.h"

namespace diststrat {
namespace algo {

constexpr int kTagsPerCall = 8;

// A group of ranks of one transport, numbered 0..size()-1 by their position
// in `ranks` (global transport ranks).
struct Peers {
  Transport* transport = nullptr;
  std::vector<int> ranks;  // global rank of each member
  int me = 0;              // my index in ranks

  static Peers all(Transport& t);
  int size() const { return static_cast<int>(ranks.size()); }
  Request send(int member, const void* data, size_t bytes, int tag) const {
    return transport->send(ranks[member], data, bytes, tag);
  }
  Request recv(int member, void* data, size_t bytes, int tag) const {
    return transport->recv(ranks[member], data, bytes, tag);
  }
};

struct AllReduceArgs {
  void* buf = nullptr;  // in/out, count elements
  size_t count = 0;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int mean_divisor = 1;  // divisor applied to finished blocks when op == kMean
  const CommunicationOptions* options = nullptr;
  Clock::time_point deadline;
  int tag = 0;

  size_t elem() const { return dtype_size(dtype); }
  char* at(size_t element) const { return static_cast<char*>(buf) + element * elem(); }
  // Divides a finished block by mean_divisor when op is kMean.
  void finish(void* block, size_t n) const;
  // dst[i] = op(dst[i], src[i]) (kMean accumulates as a sum).
  void accumulate(void* dst, const void* src, size_t n) const;
};

// Elements [lo, hi) of `count` in block b when count is split into `parts`.
void slice_of(size_t count, int parts, int b, size_t* lo, size_t* hi);

// The shared-address-space all-reduce step (in-process "direct", and shared
// memory with registered buffers): elements [lo, hi) of the n inputs are
// reduced block by block, and each block, still in cache, is written into
// every output. So a rank reads its slice of every input once and writes its
// slice of every output once. kMean divides by n. `message_bytes` (the whole
// all-reduce's size) picks how outputs are written: from
// kernels::kStreamingBytes on with streaming stores (no write-allocate
// reads; outputs that large leave the caches anyway).
void reduce_slice_to_all(const void* const* ins, void* const* outs, int n, int self, size_t lo,
                         size_t hi, DType dtype, ReduceOp op, size_t message_bytes);

// Segment size in bytes that pipelined algorithms use.
size_t segment_bytes(const CommunicationOptions& options);

// ---- all-reduce algorithms (each in its own .cc) ----
void ring_all_reduce(const Peers& peers, const AllReduceArgs& a);
void halving_doubling_all_reduce(const Peers& peers, const AllReduceArgs& a);
void tree_all_reduce(const Peers& peers, const AllReduceArgs& a);
void reduce_to_one_all_reduce(const Peers& peers, const AllReduceArgs& a);
// The hierarchical all-reduce, which runs these on sub-groups: hierarchical.h.

// Building blocks shared by several algorithms.
// Binomial-tree reduce of buf to member `root` (others' buf is clobbered).
void tree_reduce(const Peers& peers, const AllReduceArgs& a, int root);
// Binomial-tree broadcast of `bytes` of buf from member `root`.
void tree_broadcast(const Peers& peers, void* buf, size_t bytes, int root, int tag,
                    Clock::time_point deadline);

// Ring pieces over a chunk layout: chunk c of the ring is elements
// [offset(c), offset(c) + length(c)) of the buffer.
struct ChunkLayout {
  std::function<size_t(int)> offset;
  std::function<size_t(int)> length;
};
// After it, member me holds chunk (me + 1) % n fully reduced (and finished).
void ring_reduce_scatter(const Peers& peers, const AllReduceArgs& a, const ChunkLayout& layout);
// Member me starts owning chunk `owned(me)` = (me + shift) % n; afterwards all
// members hold every chunk. Copies raw bytes of `elem` sized elements.
void ring_all_gather(const Peers& peers, void* buf, size_t elem, const ChunkLayout& layout,
                     int shift, size_t segment, int tag, Clock::time_point deadline);

// Dissemination barrier that also compares one value per member: returns,
// on every member alike, whether all members passed the same `value` (each
// round carries the least and greatest value seen so far). ceil(log2 n)
// rounds of 16-byte messages.
bool dissemination_agree(const Peers& peers, uint64_t value, int tag, Clock::time_point deadline);

// ---- selection ----
// The algorithm kAuto picks for an all-reduce of `bytes` over `ranks` ranks on
// `nodes` nodes, given the thresholds in `options`.
Algorithm choose_auto(const CommunicationOptions& options, size_t bytes, int ranks, int nodes);

}  // namespace algo
}  // namespace diststrat
