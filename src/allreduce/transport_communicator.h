// A Communicator that runs the algorithms of this folder over a Transport:
// all_reduce by the algorithm that options().algorithm names (kAuto chooses by
// size, rank count and node count), broadcast by binomial tree, all_gather
// and reduce_scatter around the pipelined ring, barrier by dissemination.
// The same class serves the in-process transport (tests, and any group of
// threads) and MPI point-to-point; MPI's factory adds MPI_Allreduce and the
// shared-memory path on top (mpi_communicator.h).
//
// Every collective first compares what each rank is calling (kind, count,
// dtype, op, root, algorithm, segment size, node count and the caller's
// name) in one dissemination exchange of 16-byte messages (ceil(log2 size)
// rounds) of a hash: a mismatch is the same InvalidArgumentError on every
// rank, before any byte of the call moves, naming both calls, instead of
// wrong numbers or a wait until the deadline. Comparing the name catches a
// skipped or reordered collective at the first mispaired call, even where
// the two calls agree in everything else.
//
// Tags: each comparison and each collective takes the next block of 8 tags,
// kTagBase + (k mod kTagSlots) * 8 + [0, 8), all within [16384, 24576)
// (the comparison is also a barrier, so ranks are never more than a call
// apart and the wrap-around cannot mix calls); other protocols sharing the
// transport must stay outside that range (the parameter-server service's
// tags start at 0x5053000).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "allreduce/algorithm.h"
#include "allreduce/call_text.h"
#include "allreduce/transport.h"
#include "diststrat/collective.h"

namespace diststrat {

class TransportCommunicator : public Communicator {
 public:
  static constexpr int kTagBase = 16384;
  static constexpr int kTagSlots = 1024;

  // `transport` must outlive the communicator unless `owned` holds it.
  // `node_of[r]` = node of rank r, for kHierarchical and kAuto. A positive
  // options.hierarchical_group_size overrides it (groups of that many
  // consecutive ranks); with neither, all ranks are one node.
  // options.algorithm must be kAuto, a point-to-point algorithm (kRing,
  // kHalvingDoubling, kTree, kReduceToOne, kHierarchical), kCustom with its
  // function registered, or one of `also_runs` (what a subclass adds, such as
  // MPI's kMpiNative); otherwise InvalidArgumentError naming it.
  TransportCommunicator(Transport& transport, CommunicationOptions options,
                        std::vector<int> node_of = {}, std::unique_ptr<Transport> owned = nullptr,
                        const std::vector<Algorithm>& also_runs = {});

  int rank() const override { return transport_->rank(); }
  int size() const override { return transport_->size(); }
  const CommunicationOptions& options() const override { return options_; }

  void all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                  const std::string& name = "") override;
  void broadcast(void* buf, size_t count, DType dtype, int root,
                 const std::string& name = "") override;
  void all_gather(const void* in, void* out, size_t count, DType dtype,
                  const std::string& name = "") override;
  void reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                      const std::string& name = "") override;
  void barrier(const std::string& name = "") override;
  void abort(const std::string& reason) override;
  // Clears this communicator's abort flag. The transport's abort is sticky:
  // after a transport abort build a new communicator.
  void reset() override;

  // The algorithm all_reduce will run for `bytes` (kAuto resolved).
  Algorithm resolve(size_t bytes) const;
  int num_nodes() const { return num_nodes_; }
  const std::vector<int>& node_of() const { return node_of_; }
  Transport& transport() { return *transport_; }

 protected:
  // What a rank is calling, as the comparison at the top of this file sees it.
  enum class CallKind { kAllReduce, kBroadcast, kAllGather, kReduceScatter, kBarrier };
  struct CallKey {
    CallKind kind = CallKind::kBarrier;
    size_t count = 0;
    DType dtype = DType::kFloat32;
    const ReduceOp* op = nullptr;          // reductions only
    int root = -1;                         // broadcast only
    const Algorithm* algorithm = nullptr;  // all_reduce only (kAuto resolved)
    const std::string* name = nullptr;     // the caller's name ("" when null)
  };
  // The comparison every collective here starts with: returns when every
  // rank passed the same `key`; otherwise every rank throws
  // InvalidArgumentError "ranks disagree on the call: rank 0 has ..., rank R
  // has ..." (R the first rank that differs from rank 0). Also a barrier.
  void agree_on_call(const CallKey& key);
  // Runs `fn`, turning any Error it throws into the same code with a message
  // prefixed by this rank, the op, the tensor and the call number.
  template <typename Fn>
  void guarded(const CallText& what, Fn&& fn) {
    const long call = calls_++;
    if (aborted_) {
      throw AbortedError("rank " + std::to_string(rank()) + ": " + what.str() +
                         " aborted: " + abort_reason_);
    }
    try {
      fn();
    } catch (const Error& e) {
      const std::string msg = "rank " + std::to_string(rank()) + ": " + what.str() + " (call #" +
                              std::to_string(call) + "): " + e.message();
      // A call given up at its deadline leaves the ranks apart (a late peer
      // may still complete it): later calls fail until reset().
      if (e.code() == ErrorCode::kDeadlineExceeded && !aborted_) {
        aborted_ = true;
        abort_reason_ = msg;
      }
      throw_error(e.code(), msg);
    }
  }
  // Next tag block.
  int next_tag();
  // In-place all-reduce of buf with a point-to-point algorithm.
  void run_algorithm(Algorithm algorithm, void* buf, size_t count, DType dtype, ReduceOp op);
  Clock::time_point deadline() const { return Clock::now() + options_.timeout; }

  std::unique_ptr<Transport> owned_;
  Transport* transport_;
  CommunicationOptions options_;
  std::vector<int> node_of_;
  int num_nodes_ = 1;
  long calls_ = 0;       // collectives started (error messages' call #)
  long tag_blocks_ = 0;  // tag blocks handed out
  bool aborted_ = false;
  std::string abort_reason_;
};

}  // namespace diststrat
