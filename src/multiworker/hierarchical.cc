#include "multiworker/hierarchical.h"

#include <cstring>

#include "allreduce/reduce_kernels.h"
#include "allreduce/transport_communicator.h"

namespace diststrat {

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
  compare_ = dynamic_cast<TransportCommunicator*>(flat_);
}

void HierarchicalCommunicator::all_reduce(const void* in, void* out, size_t count, DType dtype,
                                          ReduceOp op, const std::string& name) {
  const size_t esz = dtype_size(dtype);
  const ReduceOp sum_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  if (compare_) {
    compare_->compare_call({TransportCommunicator::CallKind::kAllReduce, count, dtype, &op},
                           describe_call("all_reduce", count, dtype, &op, name) + " (hierarchical)");
  }
  const int L = intra_->size();
  if (L == 1 || inter_->size() == 1) {
    Communicator& c = L == 1 ? *inter_ : *intra_;
    c.all_reduce(in, out, count, dtype, sum_op, name);
  } else {
    const size_t block = (count + L - 1) / L;
    const size_t padded = block * L;
    if (scratch_.size() < padded * esz) scratch_.resize(padded * esz);
    char* s = scratch_.data();
    if (count) std::memcpy(s, in, count * esz);
    // Padding takes part in the reductions but is never copied out.
    if (padded > count) std::memset(s + count * esz, 0, (padded - count) * esz);
    char* mine = s + static_cast<size_t>(intra_->rank()) * block * esz;
    intra_->reduce_scatter(s, mine, block, dtype, sum_op, name + " (node reduce-scatter)");
    inter_->all_reduce(mine, mine, block, dtype, sum_op, name + " (across nodes)");
    intra_->all_gather(mine, s, block, dtype, name + " (node all-gather)");
    if (count) std::memcpy(out, s, count * esz);
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
