// kAuto over point-to-point transports. The cost models (p ranks, n bytes,
// latency a, inverse bandwidth b):
//   tree              2 lg p (a + n b)
//   halving-doubling  2 lg p a + 2 (p-1)/p n b
//   ring              2 (p-1) a + 2 (p-1)/p n b   (pipelined: overlaps steps)
// so the tree wins for tiny messages, halving-doubling for small ones, and
// the pipelined ring once bandwidth dominates. Crossovers come from
// CommunicationOptions (defaults measured by benchmarks/allreduce_bench on
// the development host); with more than one node the hierarchical algorithm
// keeps the slow links to one message per node.

#include "allreduce/algorithm.h"

namespace diststrat {
namespace algo {

Algorithm choose_auto(const CommunicationOptions& options, size_t bytes, int ranks, int nodes) {
  if (nodes > 1 && nodes < ranks) return Algorithm::kHierarchical;
  if (ranks <= 2) {
    // With two ranks every algorithm exchanges the same messages; halving-
    // doubling does it in one round each way without extra copies.
    return bytes <= options.auto_small_message_bytes ? Algorithm::kHalvingDoubling
                                                     : Algorithm::kRing;
  }
  if (bytes <= options.auto_tiny_message_bytes) return Algorithm::kTree;
  if (bytes <= options.auto_small_message_bytes) return Algorithm::kHalvingDoubling;
  return Algorithm::kRing;
}

}  // namespace algo
}  // namespace diststrat
