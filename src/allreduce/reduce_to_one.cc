// Reduce-to-one + broadcast (TensorFlow's ReductionToOneDevice): every member
// sends its whole buffer to member 0, which adds the buffers in as they
// arrive (in rank order, so results are deterministic), then sends the result
// to every member. Simple and exact, but member 0 moves 2 (n - 1) buffers: a
// baseline, and fine for tiny messages or two members.

#include <vector>

#include "allreduce/algorithm.h"

namespace diststrat {
namespace algo {

void reduce_to_one_all_reduce(const Peers& peers, const AllReduceArgs& a) {
  const int n = peers.size();
  const size_t bytes = a.count * a.elem();
  if (peers.me != 0) {
    peers.send(0, a.buf, bytes, a.tag).wait(a.deadline);
    peers.recv(0, a.buf, bytes, a.tag + 1).wait(a.deadline);
    return;
  }
  if (n > 1) {
    // Double-buffered: the next receive lands while the current one is added.
    std::vector<char> scratch(2 * (bytes ? bytes : 1));
    char* slot[2] = {scratch.data(), scratch.data() + (bytes ? bytes : 1)};
    Request next = peers.recv(1, slot[1 & 1], bytes, a.tag);
    for (int r = 1; r < n; ++r) {
      Request cur = std::move(next);
      cur.wait(a.deadline);
      if (r + 1 < n) next = peers.recv(r + 1, slot[(r + 1) & 1], bytes, a.tag);
      a.accumulate(a.buf, slot[r & 1], a.count);
    }
  }
  a.finish(a.buf, a.count);
  std::vector<Request> sends;
  for (int r = 1; r < n; ++r) sends.push_back(peers.send(r, a.buf, bytes, a.tag + 1));
  wait_all(sends, a.deadline);
}

}  // namespace algo
}  // namespace diststrat
