// The hierarchical all-reduce: inside each node first, then across nodes,
// then back inside each node. Written once (algo::run_stages) over the
// stages its groups provide (algo::NodeStages):
//  1. reduce inside the node: the ranks of a node reduce their buffers so that
//     the node's sum is held in parts, each part by one rank of the node
//     (intra-node links are the cheap ones);
//  2. all-reduce across nodes: every part is all-reduced among the ranks that
//     hold it, one per node, so that each part crosses the slow links once
//     per node instead of once per rank;
//  3. return inside the node: every rank of the node gets every part.
//
// Two forms of the node stages, by what the groups can do:
//  - leader (algo::hierarchical_all_reduce, kHierarchical over one Transport):
//    one part, the whole buffer, held by the lowest rank of the node: a
//    binomial-tree reduce to it, the leaders all-reduce (the ring for messages
//    above auto_small_message_bytes, halving-doubling below it), a
//    binomial-tree broadcast back. Nodes may have different sizes. kMean is
//    summed and divided once, by the leaders' algorithm as it finishes blocks.
//  - scattered (HierarchicalCommunicator, Horovod's): L parts for nodes of L
//    ranks: the buffer, padded to a multiple of L, is reduce-scattered inside
//    the node (local rank i holds block i of the node's sum), block i is
//    all-reduced across nodes among the local ranks i (1/L of the data each,
//    L streams in parallel), and the blocks are all-gathered inside the node.
//    Every node must have the same number of ranks. Runs over three
//    Communicators, so each level takes its own best path (the multi-worker
//    strategy and ProcessGroup: shared memory inside a host, MPI across).
//    kMean is summed in every stage and divided once by size() at the end.
// The forms sum in different orders (a binomial tree vs the intra
// communicator's reduce-scatter), so each keeps its own: results stay
// bit-identical to what each path computed before, and the leader form is
// the one that handles nodes of different sizes.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "allreduce/algorithm.h"
#include "diststrat/collective.h"

namespace diststrat {
namespace algo {

// The three stages of the hierarchical all-reduce as one form runs them.
class NodeStages {
 public:
  // What a rank holds of its node's sum after stage 1: `count` elements at
  // `data`, all-reduced across nodes in stage 2 when `held`.
  struct Part {
    void* data = nullptr;
    size_t count = 0;
    bool held = false;
  };
  // Stage 1: reduce inside the node; returns this rank's part (not held: it
  // takes no part in stage 2).
  virtual Part reduce_in_node() = 0;
  // Stage 2: all-reduce `part` with the ranks holding it on the other nodes.
  virtual void all_reduce_across_nodes(const Part& part) = 0;
  // Stage 3: every rank of the node gets the whole result.
  virtual void return_in_node() = 0;

 protected:
  ~NodeStages() = default;
};

// The hierarchical all-reduce: stages 1, 2 (on the ranks that hold a part)
// and 3.
void run_stages(NodeStages& stages);

// The leader form over one Transport (see the top of this file). Groups ranks
// by `node_of` (same value = same node); tags [a.tag, a.tag + 7).
void hierarchical_all_reduce(const Peers& peers, const AllReduceArgs& a,
                             const std::vector<int>& node_of);

}  // namespace algo

// The scattered form (see the top of this file): a Communicator over three
// groups of the same ranks: `intra` (the ranks of this node), `inter` (this
// rank and the ranks with the same local rank on the other nodes) and `flat`
// (everyone). With one node, or one rank per node, all_reduce is the plain
// all-reduce of the one group that spans the ranks.
// Every node must have the same number of ranks (checked at construction).
// Broadcast, all-gather, reduce-scatter and barrier use `flat`.
// The sub-calls carry a block count and kSum, not the caller's call, so the
// all-reduce first gathers every rank's count, dtype and op over `flat` (one
// all_gather of 3 int64, through whatever path flat's collectives take): a
// mismatch anywhere is the same InvalidArgumentError on every rank, never
// wrong numbers.
class HierarchicalCommunicator : public Communicator {
 public:
  HierarchicalCommunicator(std::unique_ptr<Communicator> flat, std::unique_ptr<Communicator> intra,
                           std::unique_ptr<Communicator> inter);
  // Non-owning variant (tests over InProcessGroups).
  HierarchicalCommunicator(Communicator* flat, Communicator* intra, Communicator* inter);

  int rank() const override { return flat_->rank(); }
  int size() const override { return flat_->size(); }
  const CommunicationOptions& options() const override { return flat_->options(); }

  void all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                  const std::string& name = "") override;
  void broadcast(void* buf, size_t count, DType dtype, int root,
                 const std::string& name = "") override {
    flat_->broadcast(buf, count, dtype, root, name);
  }
  void all_gather(const void* in, void* out, size_t count, DType dtype,
                  const std::string& name = "") override {
    flat_->all_gather(in, out, count, dtype, name);
  }
  void reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                      const std::string& name = "") override {
    flat_->reduce_scatter(in, out, count, dtype, op, name);
  }
  void barrier(const std::string& name = "") override { flat_->barrier(name); }
  void abort(const std::string& reason) override;
  void reset() override;

  Communicator& intra() { return *intra_; }
  Communicator& inter() { return *inter_; }

 private:
  void check_layout();
  void compare_call(size_t count, DType dtype, ReduceOp op, const std::string& name);
  std::vector<std::unique_ptr<Communicator>> owned_;
  Communicator* flat_;
  Communicator* intra_;
  Communicator* inter_;
  std::vector<char> scratch_;
};

}  // namespace diststrat
