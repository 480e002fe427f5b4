// Ring all-reduce: reduce-scatter followed by all-gather around a ring, each
// pipelined in segments so that large messages stream.
//
// The ring algorithm works as follows. The buffer is cut into n chunks (one
// per member). Member i sends to i + 1 and receives from i - 1 (mod n).
//  - Reduce-scatter, n - 1 steps: in step s member i sends chunk (i - s) and
//    receives chunk (i - s - 1), which it adds into its own copy. After the
//    last step member i holds chunk (i + 1) reduced over all members.
//  - All-gather, n - 1 steps: member i starts with chunk i + 1 and in step s
//    sends chunk (i + 1 - s) and receives chunk (i - s), overwriting its copy.
// Every member sends and receives 2 (n - 1) / n of the buffer: bandwidth
// optimal, with 2 (n - 1) latency terms.
//
// Pipelining: every chunk is cut into the same number m of segments of about
// segment_bytes. A segment received in step s is reduced and immediately sent
// on as step s + 1, so different segments are in different steps at the same
// time and the links stay busy.
//
// Receives are posted early: the all-gather's (straight into the buffer) all
// at once, the reduce-scatter's into a scratch slot each, all at once while
// the scratch stays within 64 MiB (else a window of that many bytes). Over
// MPI's TCP path a large send waits for the receiver's go-ahead (rendezvous),
// and a go-ahead sent late queues behind the data already streaming the other
// way: with receives posted one segment ahead, a 64 MiB all-reduce between two
// hosts on 1 Gbit/s links moved 0.53 of the link rate; with all of them
// posted, 0.90 (docs/multi_host.md).

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "allreduce/algorithm.h"
#include "allreduce/reduce_kernels.h"

namespace diststrat {
namespace algo {
namespace {

int mod(int a, int n) { return ((a % n) + n) % n; }

// Segment j of a chunk of `len` elements cut into m segments.
void segment(size_t len, int m, int j, size_t* lo, size_t* hi) { slice_of(len, m, j, lo, hi); }

int segments_for(const ChunkLayout& layout, int n, size_t elem, size_t segment_bytes) {
  size_t largest = 0;
  for (int c = 0; c < n; ++c) largest = std::max(largest, layout.length(c));
  const size_t per = std::max<size_t>(1, segment_bytes / elem);
  return static_cast<int>(std::max<size_t>(1, (largest + per - 1) / per));
}

// How many of a reduce-scatter's `total` receives (of up to `slot_bytes`
// each) are posted ahead: all of them while their scratch stays within
// kRecvAheadBytes, else as many as fit (at least 2: double buffering).
constexpr size_t kRecvAheadBytes = size_t{64} << 20;
int recv_window(int total, size_t slot_bytes) {
  const size_t fit = std::max<size_t>(2, kRecvAheadBytes / slot_bytes);
  return static_cast<int>(std::min<size_t>(static_cast<size_t>(total), fit));
}

}  // namespace

void ring_reduce_scatter(const Peers& peers, const AllReduceArgs& a, const ChunkLayout& layout) {
  const int n = peers.size(), me = peers.me;
  if (n == 1) {
    a.finish(a.at(layout.offset(0)), layout.length(0));
    return;
  }
  const int right = mod(me + 1, n), left = mod(me - 1, n);
  const size_t es = a.elem();
  const int m = segments_for(layout, n, es, segment_bytes(*a.options));
  size_t max_seg = 0;
  for (int c = 0; c < n; ++c) max_seg = std::max(max_seg, (layout.length(c) + m - 1) / m);
  const int total = (n - 1) * m;
  const int window = recv_window(total, std::max<size_t>(1, max_seg) * es);
  // Not zero-filled: every byte of a slot is received before it is read (up
  // to 64 MiB; its pages are touched as the receives land).
  std::unique_ptr<char[]> scratch(
      new char[static_cast<size_t>(window) * std::max<size_t>(1, max_seg) * es]);
  auto slot = [&](int k) { return scratch.get() + static_cast<size_t>(k % window) * max_seg * es; };

  std::vector<Request> sends;
  sends.reserve(static_cast<size_t>(n) * m);
  auto send_seg = [&](int chunk, int j) {
    size_t lo, hi;
    segment(layout.length(chunk), m, j, &lo, &hi);
    sends.push_back(peers.send(right, a.at(layout.offset(chunk) + lo), (hi - lo) * es, a.tag));
  };
  // Step 0 sends our own chunk.
  for (int j = 0; j < m; ++j) send_seg(me, j);

  std::vector<Request> recvs(total);
  auto post_recv = [&](int k) {
    const int s = k / m, j = k % m;
    const int chunk = mod(me - s - 1, n);
    size_t lo, hi;
    segment(layout.length(chunk), m, j, &lo, &hi);
    recvs[k] = peers.recv(left, slot(k), (hi - lo) * es, a.tag);
  };
  for (int k = 0; k < window - 1 && k < total; ++k) post_recv(k);
  for (int k = 0; k < total; ++k) {
    if (k + window - 1 < total) post_recv(k + window - 1);
    recvs[k].wait(a.deadline);
    const int s = k / m, j = k % m;
    const int chunk = mod(me - s - 1, n);
    size_t lo, hi;
    segment(layout.length(chunk), m, j, &lo, &hi);
    char* dst = a.at(layout.offset(chunk) + lo);
    a.accumulate(dst, slot(k), hi - lo);
    if (s + 1 < n - 1) {
      send_seg(chunk, j);  // on to the next step
    } else {
      a.finish(dst, hi - lo);  // chunk (me + 1) is complete
    }
  }
  wait_all(sends, a.deadline);
}

void ring_all_gather(const Peers& peers, void* buf, size_t es, const ChunkLayout& layout, int shift,
                     size_t segment_bytes_, int tag, Clock::time_point deadline) {
  const int n = peers.size(), me = peers.me;
  if (n == 1) return;
  const int right = mod(me + 1, n), left = mod(me - 1, n);
  const int m = segments_for(layout, n, es, segment_bytes_);
  char* base = static_cast<char*>(buf);
  auto ptr = [&](int chunk, size_t lo) { return base + (layout.offset(chunk) + lo) * es; };
  std::vector<Request> sends;
  sends.reserve(static_cast<size_t>(n) * m);
  const int owned = mod(me + shift, n);
  auto send_seg = [&](int chunk, int j) {
    size_t lo, hi;
    segment(layout.length(chunk), m, j, &lo, &hi);
    sends.push_back(peers.send(right, ptr(chunk, lo), (hi - lo) * es, tag));
  };
  for (int j = 0; j < m; ++j) send_seg(owned, j);
  // Receives go straight into the buffer: all of them are posted at once.
  const int total = (n - 1) * m;
  std::vector<Request> recvs(total);
  auto post = [&](int k) {
    const int s = k / m, j = k % m;
    const int chunk = mod(owned - s - 1, n);
    size_t lo, hi;
    segment(layout.length(chunk), m, j, &lo, &hi);
    recvs[k] = peers.recv(left, ptr(chunk, lo), (hi - lo) * es, tag);
  };
  for (int k = 0; k < total; ++k) post(k);
  for (int k = 0; k < total; ++k) {
    recvs[k].wait(deadline);
    const int s = k / m, j = k % m;
    if (s + 1 < n - 1) send_seg(mod(owned - s - 1, n), j);
  }
  wait_all(sends, deadline);
}

void ring_all_reduce(const Peers& peers, const AllReduceArgs& a) {
  const int n = peers.size();
  const size_t count = a.count;
  ChunkLayout layout{[count, n](int c) {
                       size_t lo, hi;
                       slice_of(count, n, c, &lo, &hi);
                       return lo;
                     },
                     [count, n](int c) {
                       size_t lo, hi;
                       slice_of(count, n, c, &lo, &hi);
                       return hi - lo;
                     }};
  ring_reduce_scatter(peers, a, layout);
  ring_all_gather(peers, a.buf, a.elem(), layout, /*shift=*/1, segment_bytes(*a.options), a.tag + 1,
                  a.deadline);
}

}  // namespace algo
}  // namespace diststrat
