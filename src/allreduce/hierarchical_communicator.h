// A Communicator that runs all-reduce hierarchically over three groups of the
// same ranks: `intra` (the ranks of this node), `inter` (this rank and the
// ranks with the same local rank on the other nodes) and `flat` (everyone).
//
// The all-reduce works as follows (Horovod's hierarchical all-reduce):
//   1. the buffer, padded to a multiple of the node size L, is reduce-scattered
//      inside the node: local rank i holds block i of the node's sum;
//   2. block i is all-reduced across nodes among the local ranks i (each node
//      sends 1/L of the data over the slow links, L streams in parallel);
//   3. the blocks are all-gathered inside the node.
// kMean is summed in every stage and divided once by size() at the end.
// Every node must have the same number of ranks (checked at construction).
// Broadcast, all-gather, reduce-scatter and barrier use `flat`.
// The sub-calls carry a block count and kSum, not the caller's call, so the
// all-reduce first gathers every rank's count, dtype and op over `flat` (one
// all_gather of 3 int64, through whatever path flat's collectives take): a
// mismatch anywhere is the same InvalidArgumentError on every rank, never
// wrong numbers.
#pragma once

#include <memory>
#include <vector>

#include "diststrat/collective.h"

namespace diststrat {

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
