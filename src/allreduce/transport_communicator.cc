#include "allreduce/transport_communicator.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <set>
#include <sstream>

#include "allreduce/custom.h"
#include "allreduce/hierarchical.h"
#include "allreduce/reduce_kernels.h"
#include "core/flight_recorder.h"
#include "core/fnv1a.h"
#include "core/user_text.h"

namespace diststrat {

TransportCommunicator::TransportCommunicator(Transport& transport, CommunicationOptions options,
                                             std::vector<int> node_of,
                                             std::unique_ptr<Transport> owned,
                                             const std::vector<Algorithm>& also_runs)
    : owned_(std::move(owned)),
      transport_(&transport),
      options_(std::move(options)),
      node_of_(std::move(node_of)) {
  switch (options_.algorithm) {
    case Algorithm::kAuto:
    case Algorithm::kRing:
    case Algorithm::kHalvingDoubling:
    case Algorithm::kTree:
    case Algorithm::kReduceToOne:
    case Algorithm::kHierarchical:
    case Algorithm::kCustom:
      break;
    default:
      DISTSTRAT_CHECK(
          std::find(also_runs.begin(), also_runs.end(), options_.algorithm) != also_runs.end(),
          kInvalidArgument, "rank ", rank(), ": TransportCommunicator: algorithm '",
          algorithm_name(options_.algorithm),
          "' is not available over this transport (point-to-point messages); use "
          "auto, ring, halving_doubling, tree, reduce_to_one, hierarchical or custom");
  }
  const int n = transport_->size();
  if (node_of_.empty() || options_.hierarchical_group_size > 0) {
    node_of_.assign(n, 0);
    const int g = options_.hierarchical_group_size;
    for (int r = 0; r < n; ++r) node_of_[r] = g > 0 ? r / g : 0;
  }
  DISTSTRAT_CHECK_EQ(static_cast<int>(node_of_.size()), n, "TransportCommunicator node map");
  num_nodes_ = static_cast<int>(std::set<int>(node_of_.begin(), node_of_.end()).size());
  if (options_.algorithm == Algorithm::kCustom) {
    DISTSTRAT_CHECK(
        options_.algorithm_registry && options_.algorithm_registry->find(options_.custom_algorithm),
        kInvalidArgument, "rank ", rank(), ": custom all-reduce algorithm '",
        echo(options_.custom_algorithm), "' is not in options.algorithm_registry");
  }
}

int TransportCommunicator::next_tag() {
  const int slot = static_cast<int>(tag_blocks_++ % kTagSlots);
  return kTagBase + slot * algo::kTagsPerCall;
}

namespace {

// A CallKey as fixed-width words, identical in every process and build:
// kind, count, dtype, op, root, algorithm (-1 where the call has none),
// segment bytes, node count, and the hash of the caller's name.
constexpr int kKeyWords = 9;
using KeyWords = std::array<int64_t, kKeyWords>;
constexpr int64_t kBarrierKind = 4;  // CallKind::kBarrier
// How much of each rank's name the rare path gathers to say what differs.
constexpr size_t kNameBytes = 64;
using NameBytes = std::array<char, kNameBytes>;

const char* kind_name(int64_t kind) {
  static const char* const names[] = {"all_reduce", "broadcast", "all_gather", "reduce_scatter",
                                      "barrier"};
  return 0 <= kind && kind <= kBarrierKind ? names[kind] : "unknown call";
}

// "all_reduce of 4 float32 sum (ring) 'dense/kernel'"; also the settings in
// which it differs from `other` (segment size, node count), so that a
// mismatch in options alone still says what differs.
std::string describe_key(const KeyWords& k, const KeyWords& other, const NameBytes& name) {
  std::ostringstream os;
  os << kind_name(k[0]);
  if (k[0] != kBarrierKind) os << " of " << k[1] << " " << dtype_name(static_cast<DType>(k[2]));
  if (k[3] >= 0) os << " " << reduce_op_name(static_cast<ReduceOp>(k[3]));
  if (k[4] >= 0) os << " from root " << k[4];
  if (k[5] >= 0) os << " (" << algorithm_name(static_cast<Algorithm>(k[5])) << ")";
  if (other[6] != k[6]) os << " with " << k[6] << "-byte segments";
  if (other[7] != k[7]) os << " over " << k[7] << " node(s)";
  const std::string text(name.data(), strnlen(name.data(), name.size()));
  os << (text.empty() ? std::string(" (unnamed)") : " '" + echo(text) + "'");
  return os.str();
}

}  // namespace

void TransportCommunicator::agree_on_call(const CallKey& key) {
  static const std::string kNoName;
  const std::string& name = key.name ? *key.name : kNoName;
  KeyWords mine{};
  mine[0] = static_cast<int64_t>(key.kind);
  mine[1] = static_cast<int64_t>(key.count);
  mine[2] = static_cast<int64_t>(key.dtype);
  mine[3] = key.op ? static_cast<int64_t>(*key.op) : -1;
  mine[4] = key.root;
  mine[5] = key.algorithm ? static_cast<int64_t>(*key.algorithm) : -1;
  mine[6] = static_cast<int64_t>(algo::segment_bytes(options_));
  mine[7] = num_nodes_;
  mine[8] = static_cast<int64_t>(fnv1a(name));
  Fnv1a hash;
  hash.bytes(mine.data(), sizeof mine);
  const algo::Peers peers = algo::Peers::all(*transport_);
  if (algo::dissemination_agree(peers, hash.get(), next_tag(), deadline())) return;
  // Rare path, taken by every rank alike: gather every rank's key and the
  // start of its name to say what differs.
  const int n = size();
  std::vector<KeyWords> all(n);
  std::vector<NameBytes> names(n);
  all[rank()] = mine;
  names[rank()].fill('\0');
  head_and_tail_to(name, kNameBytes - 1, names[rank()].data());
  algo::ChunkLayout layout{[](int c) { return static_cast<size_t>(c) * kKeyWords; },
                           [](int) { return static_cast<size_t>(kKeyWords); }};
  algo::ring_all_gather(peers, all.data(), sizeof(int64_t), layout, /*shift=*/0,
                        /*segment=*/sizeof(KeyWords), next_tag(), deadline());
  algo::ChunkLayout name_layout{[](int c) { return static_cast<size_t>(c) * kNameBytes; },
                                [](int) { return kNameBytes; }};
  algo::ring_all_gather(peers, names.data(), 1, name_layout, /*shift=*/0,
                        /*segment=*/kNameBytes, next_tag(), deadline());
  int other = 1;
  while (other < n && all[other] == all[0]) ++other;
  if (other == n) {
    throw DataLossError(
        "ranks agree on the call, yet the comparison of its hashes failed: a "
        "comparison message was damaged on its way");
  }
  throw InvalidArgumentError(
      "ranks disagree on the call: rank 0 has " + describe_key(all[0], all[other], names[0]) +
      ", rank " + std::to_string(other) + " has " + describe_key(all[other], all[0], names[other]));
}

Algorithm TransportCommunicator::resolve(size_t bytes) const {
  if (options_.algorithm != Algorithm::kAuto) return options_.algorithm;
  return algo::choose_auto(options_, bytes, size(), num_nodes_);
}

void TransportCommunicator::run_algorithm(Algorithm algorithm, void* buf, size_t count, DType dtype,
                                          ReduceOp op) {
  algo::AllReduceArgs a;
  a.buf = buf;
  a.count = count;
  a.dtype = dtype;
  a.op = op;
  a.mean_divisor = size();
  a.options = &options_;
  a.deadline = deadline();
  a.tag = next_tag();
  const algo::Peers peers = algo::Peers::all(*transport_);
  switch (algorithm) {
    case Algorithm::kRing:
      return algo::ring_all_reduce(peers, a);
    case Algorithm::kHalvingDoubling:
      return algo::halving_doubling_all_reduce(peers, a);
    case Algorithm::kTree:
      return algo::tree_all_reduce(peers, a);
    case Algorithm::kReduceToOne:
      return algo::reduce_to_one_all_reduce(peers, a);
    case Algorithm::kHierarchical:
      return algo::hierarchical_all_reduce(peers, a, node_of_);
    case Algorithm::kCustom:
      return algo::run_custom(*options_.algorithm_registry->find(options_.custom_algorithm), peers,
                              a);
    default:
      throw UnimplementedError(std::string("algorithm '") + algorithm_name(algorithm) +
                               "' is not available over this transport");
  }
}

void TransportCommunicator::all_reduce(const void* in, void* out, size_t count, DType dtype,
                                       ReduceOp op, const std::string& name) {
  const size_t bytes = count * dtype_size(dtype);
  const Algorithm algorithm = resolve(bytes);
  guarded({"all_reduce", count, dtype, &op, nullptr, &name, algorithm_name(algorithm)}, [&] {
    agree_on_call({CallKind::kAllReduce, count, dtype, &op, -1, &algorithm, &name});
    flight::note_algorithm(algorithm_name(algorithm));
    if (in != out && bytes) std::memcpy(out, in, bytes);
    run_algorithm(algorithm, out, count, dtype, op);
  });
}

void TransportCommunicator::broadcast(void* buf, size_t count, DType dtype, int root,
                                      const std::string& name) {
  guarded({"broadcast", count, dtype, nullptr, &root, &name}, [&] {
    // Compared first, so that a root out of range on some ranks only
    // is an error on all of them, not a wait until the deadline.
    agree_on_call({CallKind::kBroadcast, count, dtype, nullptr, root, nullptr, &name});
    DISTSTRAT_CHECK(0 <= root && root < size(), kInvalidArgument, "root ", root,
                    " is not a rank of a group of ", size());
    const int tag = next_tag();
    algo::tree_broadcast(algo::Peers::all(*transport_), buf, count * dtype_size(dtype), root, tag,
                         deadline());
  });
}

void TransportCommunicator::all_gather(const void* in, void* out, size_t count, DType dtype,
                                       const std::string& name) {
  guarded({"all_gather", count, dtype, nullptr, nullptr, &name}, [&] {
    agree_on_call({CallKind::kAllGather, count, dtype, nullptr, -1, nullptr, &name});
    const size_t es = dtype_size(dtype), bytes = count * es;
    char* mine = static_cast<char*>(out) + rank() * bytes;
    if (bytes && mine != in) std::memcpy(mine, in, bytes);
    algo::ChunkLayout layout{[count](int c) { return c * count; }, [count](int) { return count; }};
    const int tag = next_tag();
    algo::ring_all_gather(algo::Peers::all(*transport_), out, es, layout, /*shift=*/0,
                          algo::segment_bytes(options_), tag, deadline());
  });
}

void TransportCommunicator::reduce_scatter(const void* in, void* out, size_t count, DType dtype,
                                           ReduceOp op, const std::string& name) {
  guarded({"reduce_scatter", count, dtype, &op, nullptr, &name}, [&] {
    agree_on_call({CallKind::kReduceScatter, count, dtype, &op, -1, nullptr, &name});
    const int n = size();
    const size_t es = dtype_size(dtype), bytes = count * es;
    std::vector<char> work(static_cast<size_t>(n) * bytes);
    if (!work.empty()) std::memcpy(work.data(), in, work.size());
    algo::AllReduceArgs a;
    a.buf = work.data();
    a.count = n * count;
    a.dtype = dtype;
    a.op = op;
    a.mean_divisor = n;
    a.options = &options_;
    a.deadline = deadline();
    a.tag = next_tag();
    // Ring chunk c is block c - 1, so member r ends up with block r.
    algo::ChunkLayout layout{[count, n](int c) { return ((c + n - 1) % n) * count; },
                             [count](int) { return count; }};
    algo::ring_reduce_scatter(algo::Peers::all(*transport_), a, layout);
    if (bytes) std::memmove(out, work.data() + rank() * bytes, bytes);
  });
}

void TransportCommunicator::barrier(const std::string& name) {
  guarded({"barrier", 0, DType::kFloat32, nullptr, nullptr, &name}, [&] {
    CallKey key;
    key.name = &name;
    agree_on_call(key);
  });
}

void TransportCommunicator::abort(const std::string& reason) {
  aborted_ = true;
  abort_reason_ = reason;
  transport_->abort(reason);
}

void TransportCommunicator::reset() {
  aborted_ = false;
  abort_reason_.clear();
}

}  // namespace diststrat
