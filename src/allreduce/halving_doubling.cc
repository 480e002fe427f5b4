// Recursive halving-doubling all-reduce (Rabenseifner's algorithm).
//
// For a power-of-two group of p members:
//  - Reduce-scatter by recursive halving, lg p steps: the buffer is seen as p
//    blocks. In the step with distance d = p/2, p/4, ..., 1 a member pairs
//    with member ^ d; of the block range both hold, the member whose bit d is
//    set keeps the upper half and the other the lower half; each sends the
//    half it gives up and adds the partner's copy of the half it keeps. After
//    the last step member i holds block i fully reduced.
//  - All-gather by recursive doubling, lg p steps, in the reverse order of
//    distances: partners swap the ranges they hold, doubling them each step.
// Each member moves 2 (p - 1) / p of the buffer in 2 lg p messages: the
// bandwidth of the ring with logarithmic latency.
//
// Non-power-of-two n: let p be the largest power of two <= n and r = n - p.
// Among the first 2r members, each even member sends its whole buffer to the
// odd member after it, which adds it in, and the even members sit out. The p
// remaining members ("new rank" = i / 2 for odd i < 2r, i - r otherwise) run
// the algorithm above; then each odd member < 2r sends the result back to its
// even partner.

#include <vector>

#include "allreduce/algorithm.h"

namespace diststrat {
namespace algo {

void halving_doubling_all_reduce(const Peers& peers, const AllReduceArgs& a) {
  const int n = peers.size(), me = peers.me;
  const size_t es = a.elem(), bytes = a.count * es;
  if (n == 1) {
    a.finish(a.buf, a.count);
    return;
  }
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int r = n - p;

  // Fold the extra members in.
  std::vector<char> scratch;
  int new_rank;
  if (me < 2 * r) {
    if (me % 2 == 0) {
      peers.send(me + 1, a.buf, bytes, a.tag).wait(a.deadline);
      peers.recv(me + 1, a.buf, bytes, a.tag + 1).wait(a.deadline);
      return;
    }
    scratch.resize(bytes);
    peers.recv(me - 1, scratch.data(), bytes, a.tag).wait(a.deadline);
    a.accumulate(a.buf, scratch.data(), a.count);
    new_rank = me / 2;
  } else {
    new_rank = me - r;
  }
  // Member index of new rank q.
  auto member = [r](int q) { return q < r ? 2 * q + 1 : q + r; };
  auto block_lo = [&](int b) {
    size_t lo, hi;
    slice_of(a.count, p, b, &lo, &hi);
    return lo;
  };  // block b starts at block_lo(b); block p "starts" at count

  // Recursive halving: blocks [blo, bhi) held so far.
  int blo = 0, bhi = p;
  std::vector<int> lo_hist, hi_hist;
  for (int d = p / 2; d >= 1; d /= 2) {
    const int partner = member(new_rank ^ d);
    const int mid = (blo + bhi) / 2;
    int keep_lo, keep_hi, give_lo, give_hi;
    if (new_rank & d) {
      keep_lo = mid, keep_hi = bhi, give_lo = blo, give_hi = mid;
    } else {
      keep_lo = blo, keep_hi = mid, give_lo = mid, give_hi = bhi;
    }
    const size_t klo = block_lo(keep_lo), khi = keep_hi == p ? a.count : block_lo(keep_hi);
    const size_t glo = block_lo(give_lo), ghi = give_hi == p ? a.count : block_lo(give_hi);
    if (scratch.size() < (khi - klo) * es) scratch.resize((khi - klo) * es);
    Request rr = peers.recv(partner, scratch.data(), (khi - klo) * es, a.tag + 2);
    Request sr = peers.send(partner, a.at(glo), (ghi - glo) * es, a.tag + 2);
    rr.wait(a.deadline);
    a.accumulate(a.at(klo), scratch.data(), khi - klo);
    sr.wait(a.deadline);
    lo_hist.push_back(blo);
    hi_hist.push_back(bhi);
    blo = keep_lo, bhi = keep_hi;
  }
  {
    const size_t lo = block_lo(blo), hi = bhi == p ? a.count : block_lo(bhi);
    a.finish(a.at(lo), hi - lo);
  }
  // Recursive doubling: undo the halving steps in reverse.
  int step = static_cast<int>(lo_hist.size()) - 1;
  for (int d = 1; d < p; d *= 2, --step) {
    const int partner = member(new_rank ^ d);
    const int plo = lo_hist[step], phi = hi_hist[step];
    // The partner holds the other half of [plo, phi).
    const int other_lo = blo == plo ? bhi : plo, other_hi = blo == plo ? phi : blo;
    const size_t mlo = block_lo(blo), mhi = bhi == p ? a.count : block_lo(bhi);
    const size_t olo = block_lo(other_lo), ohi = other_hi == p ? a.count : block_lo(other_hi);
    Request rr = peers.recv(partner, a.at(olo), (ohi - olo) * es, a.tag + 3);
    Request sr = peers.send(partner, a.at(mlo), (mhi - mlo) * es, a.tag + 3);
    rr.wait(a.deadline);
    sr.wait(a.deadline);
    blo = plo, bhi = phi;
  }
  // Hand the result back to the folded-in even member.
  if (me < 2 * r) peers.send(me - 1, a.buf, bytes, a.tag + 1).wait(a.deadline);
}

}  // namespace algo
}  // namespace diststrat
