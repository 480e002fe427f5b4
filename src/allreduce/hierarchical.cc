// The hierarchical all-reduce (hierarchical.h): the stages run in order, and
// its two forms: the leader form over one Transport, the scattered form over
// three Communicators.

#include "allreduce/hierarchical.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <vector>

#include "allreduce/call_text.h"
#include "allreduce/reduce_kernels.h"
#include "allreduce/transport_communicator.h"
#include "core/flight_recorder.h"
#include "core/fnv1a.h"
#include "core/user_text.h"

namespace diststrat {
namespace algo {

void run_stages(NodeStages& stages) {
  const NodeStages::Part part = stages.reduce_in_node();
  if (part.held) stages.all_reduce_across_nodes(part);
  stages.return_in_node();
}

namespace {

// The leader form: members grouped by node (node_of[i]); the lowest member of
// each group is its leader.
class LeaderStages final : public NodeStages {
 public:
  LeaderStages(const Peers& peers, const AllReduceArgs& a, const std::vector<int>& node_of)
      : a_(a) {
    const int n = peers.size();
    DISTSTRAT_CHECK_EQ(static_cast<int>(node_of.size()), n, "hierarchical all-reduce node map");
    std::map<int, std::vector<int>> groups;  // node -> members, ascending
    for (int i = 0; i < n; ++i) groups[node_of[i]].push_back(i);
    local_.transport = peers.transport;
    leaders_.transport = peers.transport;
    for (const auto& [node, members] : groups) {
      leaders_.ranks.push_back(peers.ranks[members[0]]);
      if (node == node_of[peers.me]) {
        leaders_.me = static_cast<int>(leaders_.ranks.size()) - 1;
        for (int m : members) local_.ranks.push_back(peers.ranks[m]);
        local_.me =
            static_cast<int>(std::find(members.begin(), members.end(), peers.me) - members.begin());
      }
    }
  }

  Part reduce_in_node() override {
    tree_reduce(local_, a_, 0);  // tags a.tag
    if (local_.me != 0) return {};
    return {a_.buf, a_.count, true};
  }

  void all_reduce_across_nodes(const Part&) override {
    AllReduceArgs inner = a_;
    inner.tag = a_.tag + 2;  // ring: +2, +3; halving-doubling: +2 .. +5
    if (a_.count * a_.elem() > a_.options->auto_small_message_bytes) {
      ring_all_reduce(leaders_, inner);
    } else {
      halving_doubling_all_reduce(leaders_, inner);
    }
  }

  void return_in_node() override {
    tree_broadcast(local_, a_.buf, a_.count * a_.elem(), 0, a_.tag + 6, a_.deadline);
  }

 private:
  const AllReduceArgs& a_;
  Peers local_;    // the members of this node
  Peers leaders_;  // the leader of every node
};

}  // namespace

void hierarchical_all_reduce(const Peers& peers, const AllReduceArgs& a,
                             const std::vector<int>& node_of) {
  LeaderStages stages(peers, a, node_of);
  run_stages(stages);
}

}  // namespace algo

namespace {

// The scattered form over the node's and the cross-node communicators.
class ScatteredStages final : public algo::NodeStages {
 public:
  ScatteredStages(Communicator& intra, Communicator& inter, const void* in, void* out, size_t count,
                  DType dtype, ReduceOp sum_op, const std::string& name, std::vector<char>* scratch)
      : intra_(intra),
        inter_(inter),
        in_(in),
        out_(out),
        count_(count),
        dtype_(dtype),
        sum_op_(sum_op),
        name_(name),
        scratch_(*scratch) {}

  Part reduce_in_node() override {
    const size_t esz = dtype_size(dtype_);
    const int L = intra_.size();
    block_ = (count_ + L - 1) / L;
    const size_t padded = block_ * L;
    if (scratch_.size() < padded * esz) scratch_.resize(padded * esz);
    char* s = scratch_.data();
    if (count_) std::memcpy(s, in_, count_ * esz);
    // Padding takes part in the reductions but is never copied out.
    if (padded > count_) std::memset(s + count_ * esz, 0, (padded - count_) * esz);
    mine_ = s + static_cast<size_t>(intra_.rank()) * block_ * esz;
    intra_.reduce_scatter(s, mine_, block_, dtype_, sum_op_, name_ + " (node reduce-scatter)");
    return {mine_, block_, true};
  }

  void all_reduce_across_nodes(const Part& part) override {
    inter_.all_reduce(part.data, part.data, part.count, dtype_, sum_op_, name_ + " (across nodes)");
  }

  void return_in_node() override {
    char* s = scratch_.data();
    intra_.all_gather(mine_, s, block_, dtype_, name_ + " (node all-gather)");
    if (count_) std::memcpy(out_, s, count_ * dtype_size(dtype_));
  }

 private:
  Communicator& intra_;
  Communicator& inter_;
  const void* in_;
  void* out_;
  size_t count_;
  DType dtype_;
  ReduceOp sum_op_;
  const std::string& name_;
  std::vector<char>& scratch_;
  size_t block_ = 0;      // elements per local rank's block
  char* mine_ = nullptr;  // this rank's block in scratch
};

}  // namespace

HierarchicalCommunicator::HierarchicalCommunicator(std::unique_ptr<Communicator> flat,
                                                   std::unique_ptr<Communicator> intra,
                                                   std::unique_ptr<Communicator> inter)
    : flat_(flat.get()), intra_(intra.get()), inter_(inter.get()) {
  owned_.push_back(std::move(flat));
  owned_.push_back(std::move(intra));
  owned_.push_back(std::move(inter));
  check_layout();
}

HierarchicalCommunicator::HierarchicalCommunicator(Communicator* flat, Communicator* intra,
                                                   Communicator* inter)
    : flat_(flat), intra_(intra), inter_(inter) {
  check_layout();
}

void HierarchicalCommunicator::check_layout() {
  DISTSTRAT_CHECK(flat_ && intra_ && inter_, kInvalidArgument,
                  "HierarchicalCommunicator needs flat, intra and inter communicators");
  DISTSTRAT_CHECK_EQ(intra_->size() * inter_->size(), flat_->size(),
                     "HierarchicalCommunicator on rank ", flat_->rank(),
                     ": every node must have the same number of ranks (node size x nodes)");
}

void HierarchicalCommunicator::compare_call(size_t count, DType dtype, ReduceOp op,
                                            const std::string& name) {
  // Per rank: count, dtype, op, the hash of the name and its first
  // kNameWords * 8 bytes (for the message).
  constexpr size_t kNameWords = 6, kWords = 4 + kNameWords;
  const int n = flat_->size();
  int64_t mine[kWords] = {static_cast<int64_t>(count), static_cast<int64_t>(dtype),
                          static_cast<int64_t>(op), static_cast<int64_t>(fnv1a(name))};
  head_and_tail_to(name, kNameWords * 8 - 1, reinterpret_cast<char*>(mine + 4));
  std::vector<int64_t> all(kWords * static_cast<size_t>(n));
  // Written out only for a message (not on every call).
  auto what = [&] {
    return "rank " + std::to_string(flat_->rank()) + ": " +
           CallText{"all_reduce", count, dtype, &op, nullptr, &name, "hierarchical"}.str();
  };
  try {
    // One fixed name: the names are compared in the gathered words.
    flat_->all_gather(mine, all.data(), kWords, DType::kInt64, "hierarchical call comparison");
  } catch (const Error& e) {
    // Another kind of call on some rank meets this gather: say which call
    // this rank was making.
    throw_error(e.code(), what() + ": comparing the call across ranks: " + e.message());
  }
  int other = 1;
  while (other < n && std::equal(all.begin(), all.begin() + 4, all.begin() + kWords * other)) {
    ++other;
  }
  if (other == n) return;
  auto call_of = [&](int r) {
    const int64_t* k = all.data() + kWords * r;
    const ReduceOp rop = static_cast<ReduceOp>(k[2]);
    const char* text = reinterpret_cast<const char*>(k + 4);
    const std::string their(text, strnlen(text, kNameWords * 8));
    return describe_call("all_reduce", static_cast<size_t>(k[0]), static_cast<DType>(k[1]), &rop,
                         their) +
           (their.empty() ? " (unnamed)" : "");
  };
  throw InvalidArgumentError(what() + ": ranks disagree on the call: rank 0 has " + call_of(0) +
                             ", rank " + std::to_string(other) + " has " + call_of(other));
}

void HierarchicalCommunicator::all_reduce(const void* in, void* out, size_t count, DType dtype,
                                          ReduceOp op, const std::string& name) {
  compare_call(count, dtype, op, name);
  flight::note_algorithm("hierarchical");
  const ReduceOp sum_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  const int L = intra_->size();
  if (L == 1 || inter_->size() == 1) {
    Communicator& c = L == 1 ? *inter_ : *intra_;
    c.all_reduce(in, out, count, dtype, sum_op, name);
  } else {
    ScatteredStages stages(*intra_, *inter_, in, out, count, dtype, sum_op, name, &scratch_);
    algo::run_stages(stages);
  }
  if (op == ReduceOp::kMean) kernels::scale_mean(out, count, dtype, size());
}

void HierarchicalCommunicator::abort(const std::string& reason) {
  flat_->abort(reason);
  intra_->abort(reason);
  inter_->abort(reason);
}

void HierarchicalCommunicator::reset() {
  flat_->reset();
  intra_->reset();
  inter_->reset();
}

}  // namespace diststrat
