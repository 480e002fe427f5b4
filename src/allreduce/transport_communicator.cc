#include "allreduce/transport_communicator.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <sstream>

#include "allreduce/custom.h"
#include "allreduce/reduce_kernels.h"
#include "core/user_text.h"

namespace diststrat {

std::string describe_call(const char* kind, size_t count, DType dtype, const ReduceOp* op,
                          const std::string& name) {
  std::ostringstream os;
  os << kind << " of " << count << " " << dtype_name(dtype);
  if (op) os << " " << reduce_op_name(*op);
  if (!name.empty()) os << " '" << echo(name) << "'";
  return os.str();
}

TransportCommunicator::TransportCommunicator(Transport& transport, CommunicationOptions options,
                                             std::vector<int> node_of,
                                             std::unique_ptr<Transport> owned,
                                             const std::vector<Algorithm>& also_runs)
    : owned_(std::move(owned)), transport_(&transport), options_(std::move(options)),
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
      DISTSTRAT_CHECK(std::find(also_runs.begin(), also_runs.end(), options_.algorithm) != also_runs.end(),
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
    DISTSTRAT_CHECK(options_.algorithm_registry &&
                        options_.algorithm_registry->find(options_.custom_algorithm),
                    kInvalidArgument, "rank ", rank(), ": custom all-reduce algorithm '",
                    echo(options_.custom_algorithm), "' is not in options.algorithm_registry");
  }
}

int TransportCommunicator::next_tag() {
  const int slot = static_cast<int>(calls_++ % kTagSlots);
  return kTagBase + slot * algo::kTagsPerCall;
}

Algorithm TransportCommunicator::resolve(size_t bytes) const {
  if (options_.algorithm != Algorithm::kAuto) return options_.algorithm;
  return algo::choose_auto(options_, bytes, size(), num_nodes_);
}

void TransportCommunicator::run_algorithm(Algorithm algorithm, void* buf, size_t count,
                                          DType dtype, ReduceOp op) {
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
    case Algorithm::kRing: return algo::ring_all_reduce(peers, a);
    case Algorithm::kHalvingDoubling: return algo::halving_doubling_all_reduce(peers, a);
    case Algorithm::kTree: return algo::tree_all_reduce(peers, a);
    case Algorithm::kReduceToOne: return algo::reduce_to_one_all_reduce(peers, a);
    case Algorithm::kHierarchical: return algo::hierarchical_all_reduce(peers, a, node_of_);
    case Algorithm::kCustom:
      return algo::run_custom(*options_.algorithm_registry->find(options_.custom_algorithm),
                              peers, a);
    default:
      throw UnimplementedError(std::string("algorithm '") + algorithm_name(algorithm) +
                               "' is not available over this transport");
  }
}

void TransportCommunicator::all_reduce(const void* in, void* out, size_t count, DType dtype,
                                       ReduceOp op, const std::string& name) {
  const size_t bytes = count * dtype_size(dtype);
  const Algorithm algorithm = resolve(bytes);
  guarded(describe_call("all_reduce", count, dtype, &op, name) + " (" +
              algorithm_name(algorithm) + ")",
          [&] {
            if (in != out && bytes) std::memcpy(out, in, bytes);
            run_algorithm(algorithm, out, count, dtype, op);
          });
}

void TransportCommunicator::broadcast(void* buf, size_t count, DType dtype, int root,
                                      const std::string& name) {
  DISTSTRAT_CHECK(0 <= root && root < size(), kInvalidArgument, "rank ", rank(), ": broadcast '",
                  echo(name), "': root ", root, " is not a rank of a group of ", size());
  guarded(describe_call("broadcast", count, dtype, nullptr, name) + " from root " +
              std::to_string(root),
          [&] {
            const int tag = next_tag();
            algo::tree_broadcast(algo::Peers::all(*transport_), buf, count * dtype_size(dtype),
                                 root, tag, deadline());
          });
}

void TransportCommunicator::all_gather(const void* in, void* out, size_t count, DType dtype,
                                       const std::string& name) {
  guarded(describe_call("all_gather", count, dtype, nullptr, name), [&] {
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
  guarded(describe_call("reduce_scatter", count, dtype, &op, name), [&] {
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
  guarded(std::string("barrier") + (name.empty() ? "" : " '" + echo(name) + "'"), [&] {
    const int tag = next_tag();
    algo::dissemination_barrier(algo::Peers::all(*transport_), tag, deadline());
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
