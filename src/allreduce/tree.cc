// Binomial-tree all-reduce: a binomial-tree reduce to member 0 followed by a
// binomial-tree broadcast from it. 2 lg n message latencies and the full
// buffer on every edge: the choice for small messages, where latency rules.
//
// Reduce (relative to the root, v = (i - root) mod n): in round k
// (mask = 1, 2, 4, ...) a member whose bit k is set sends its partial result
// to v - mask and is done; otherwise it receives from v + mask (if that
// member exists) and adds it in. After ceil(lg n) rounds the root holds the
// total.
// Broadcast is the mirror image: a member receives from v - (its lowest set
// bit), then sends to v + mask for every mask below that bit, largest first.

#include <vector>

#include "allreduce/algorithm.h"

namespace diststrat {
namespace algo {

void tree_reduce(const Peers& peers, const AllReduceArgs& a, int root) {
  const int n = peers.size();
  const int v = (peers.me - root + n) % n;
  const size_t bytes = a.count * a.elem();
  std::vector<char> scratch;
  for (int mask = 1; mask < n; mask <<= 1) {
    if (v & mask) {
      peers.send((v - mask + root) % n, a.buf, bytes, a.tag).wait(a.deadline);
      return;
    }
    if (v + mask < n) {
      if (scratch.empty()) scratch.resize(bytes ? bytes : 1);
      peers.recv((v + mask + root) % n, scratch.data(), bytes, a.tag).wait(a.deadline);
      a.accumulate(a.buf, scratch.data(), a.count);
    }
  }
}

void tree_broadcast(const Peers& peers, void* buf, size_t bytes, int root, int tag,
                    Clock::time_point deadline) {
  const int n = peers.size();
  const int v = (peers.me - root + n) % n;
  int mask = 1;
  while (mask < n) {
    if (v & mask) {
      peers.recv((v - mask + root) % n, buf, bytes, tag).wait(deadline);
      break;
    }
    mask <<= 1;
  }
  std::vector<Request> sends;
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (v + mask < n) sends.push_back(peers.send((v + mask + root) % n, buf, bytes, tag));
  }
  wait_all(sends, deadline);
}

void tree_all_reduce(const Peers& peers, const AllReduceArgs& a) {
  tree_reduce(peers, a, 0);
  if (peers.me == 0) a.finish(a.buf, a.count);
  tree_broadcast(peers, a.buf, a.count * a.elem(), 0, a.tag + 1, a.deadline);
}

}  // namespace algo
}  // namespace diststrat
