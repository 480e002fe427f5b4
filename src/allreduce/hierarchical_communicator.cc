#include "allreduce/hierarchical_communicator.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

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
}

void HierarchicalCommunicator::compare_call(size_t count, DType dtype, ReduceOp op,
                                            const std::string& name) {
  const int n = flat_->size();
  const int64_t mine[3] = {static_cast<int64_t>(count), static_cast<int64_t>(dtype),
                           static_cast<int64_t>(op)};
  std::vector<int64_t> all(3 * static_cast<size_t>(n));
  const std::string what = "rank " + std::to_string(flat_->rank()) + ": " +
                           describe_call("all_reduce", count, dtype, &op, name) + " (hierarchical)";
  try {
    flat_->all_gather(mine, all.data(), 3, DType::kInt64, name + " (call comparison)");
  } catch (const Error& e) {
    // Another kind of call on some rank meets this gather: say which call
    // this rank was making.
    throw_error(e.code(), what + ": comparing the call across ranks: " + e.message());
  }
  int other = 1;
  while (other < n && std::equal(all.begin(), all.begin() + 3, all.begin() + 3 * other)) ++other;
  if (other == n) return;
  auto call_of = [&](int r) {
    const int64_t* k = all.data() + 3 * r;
    const ReduceOp rop = static_cast<ReduceOp>(k[2]);
    return describe_call("all_reduce", static_cast<size_t>(k[0]), static_cast<DType>(k[1]), &rop,
                         "");
  };
  throw InvalidArgumentError(what + ": ranks disagree on the call: rank 0 has " + call_of(0) +
                             ", rank " + std::to_string(other) + " has " + call_of(other));
}

void HierarchicalCommunicator::all_reduce(const void* in, void* out, size_t count, DType dtype,
                                          ReduceOp op, const std::string& name) {
  compare_call(count, dtype, op, name);
  const size_t esz = dtype_size(dtype);
  const ReduceOp sum_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
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
