// In-process collectives for threads of one process, over a shared address
// space: no messages and no staging copies.
//
// Every collective is a rendezvous of all ranks in three phases:
//   1. each rank publishes a descriptor of its call (kind, buffers, count,
//      dtype, op, root, tensor name) and waits at a barrier; then every rank
//      checks every descriptor against rank 0's, so a mismatch raises the same
//      InvalidArgumentError on all ranks instead of wrong numbers;
//   2. each rank works on its own slice straight out of its peers' buffers
//      (all-reduce: rank r reduces elements [lo_r, hi_r) of every rank's input
//      in one pass, block by block, into its own output and copies each block
//      while it is hot in cache into every peer's output), then waits at a
//      final barrier so that no rank returns (and reuses its buffers) while a
//      peer is still reading or writing them.
// So each rank reads n bytes of inputs and writes n bytes of outputs: the
// traffic of one memcpy, the ceiling for an all-reduce. Only rank r reads or
// writes elements [lo_r, hi_r) of any buffer, so in-place calls are safe. Descriptors are double-buffered by
// the parity of the call's sequence number: a fast rank can be at most one
// call ahead, since it cannot pass that call's first barrier alone.
//
// Every barrier has a deadline (options.timeout). A rank that times out
// reports which ranks never arrived and aborts the group, so the remaining
// waiters fail at once rather than each waiting out its own deadline.
//
// options.algorithm: kAuto and kDirect are the path above. The point-to-point
// algorithms (ring, halving-doubling, tree, reduce-to-one, hierarchical) and
// a user's kCustom one run, written once, over an in-process transport that
// the group owns (after the same descriptor check, so mismatches are still
// caught); kNccl, kMpiNative and kSharedMemory are refused at construction.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

#include "allreduce/algorithm.h"
#include "allreduce/inprocess.h"

#include "allreduce/flight_recording.h"
#include "core/flight_recorder.h"
#include "allreduce/reduce_kernels.h"
#include "allreduce/transport.h"
#include "allreduce/transport_communicator.h"
#include "core/user_text.h"
#include "diststrat/algorithm_registry.h"
#include "diststrat/collective.h"
#include "diststrat/error.h"

namespace diststrat {

namespace {

enum class Kind { kAllReduce, kBroadcast, kAllGather, kReduceScatter, kBarrier };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kAllReduce:
      return "all_reduce";
    case Kind::kBroadcast:
      return "broadcast";
    case Kind::kAllGather:
      return "all_gather";
    case Kind::kReduceScatter:
      return "reduce_scatter";
    case Kind::kBarrier:
      return "barrier";
  }
  return "?";
}

struct Descriptor {
  Kind kind = Kind::kBarrier;
  const void* in = nullptr;
  void* out = nullptr;
  size_t count = 0;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  std::string name;
};

std::string describe(const Descriptor& d) {
  std::ostringstream os;
  os << kind_name(d.kind);
  if (d.kind != Kind::kBarrier) {
    os << " of " << d.count << " " << dtype_name(d.dtype);
    if (d.kind == Kind::kAllReduce || d.kind == Kind::kReduceScatter)
      os << " " << reduce_op_name(d.op);
    if (d.kind == Kind::kBroadcast) os << " from root " << d.root;
  }
  os << (d.name.empty() ? std::string(" (unnamed)") : " '" + echo(d.name) + "'");
  return os.str();
}

bool compatible(const Descriptor& a, const Descriptor& b) {
  return a.kind == b.kind && a.count == b.count && a.dtype == b.dtype && a.op == b.op &&
         a.root == b.root && a.name == b.name;
}

bool point_to_point(Algorithm a) {
  switch (a) {
    case Algorithm::kRing:
    case Algorithm::kHalvingDoubling:
    case Algorithm::kTree:
    case Algorithm::kReduceToOne:
    case Algorithm::kHierarchical:
    case Algorithm::kCustom:
      return true;
    default:
      return false;
  }
}

}  // namespace

void check_in_process_algorithm(const CommunicationOptions& o, const std::string& who) {
  const Algorithm a = o.algorithm;
  if (a == Algorithm::kAuto || a == Algorithm::kDirect || point_to_point(a)) {
    if (a == Algorithm::kCustom) {
      DISTSTRAT_CHECK(o.algorithm_registry && o.algorithm_registry->find(o.custom_algorithm),
                      kInvalidArgument, who, ": custom all-reduce algorithm '",
                      echo(o.custom_algorithm), "' is not in options.algorithm_registry");
    }
    return;
  }
  const char* needs = a == Algorithm::kNccl ? "GPU replicas" : "MPI processes";
  throw InvalidArgumentError(who + ": algorithm '" + algorithm_name(a) + "' needs " + needs +
                             " and is not available to threads of one process; use auto, direct, "
                             "ring, halving_doubling, tree, reduce_to_one, hierarchical or custom");
}

struct InProcessGroup::State {
  State(int n, CommunicationOptions opts) : size(n), options(std::move(opts)) {
    for (auto& s : slots) s.resize(n);
    arrived_gen.assign(n, -1);
    seq.assign(n, 0);
    if (point_to_point(options.algorithm)) make_transport();
  }

  // The point-to-point algorithms' transport and per-rank communicators,
  // built afresh after an abort (a transport abort is sticky).
  void make_transport() {
    p2p_comms.clear();
    transports = std::make_unique<InProcessTransportGroup>(size);
    for (int r = 0; r < size; ++r) {
      p2p_comms.push_back(std::make_unique<TransportCommunicator>(transports->at(r), options));
    }
  }

  const int size;
  const CommunicationOptions options;
  std::unique_ptr<InProcessTransportGroup> transports;  // point-to-point algorithms only
  std::vector<std::unique_ptr<TransportCommunicator>> p2p_comms;

  std::mutex mu;
  std::condition_variable cv;
  long gen = 0;                   // completed barriers
  int arrived = 0;                // ranks waiting in the current barrier
  std::vector<long> arrived_gen;  // per rank: the barrier generation it last entered
  bool aborted = false;
  std::string abort_reason;
  std::atomic<long> gen_atomic{0};

  std::vector<Descriptor> slots[2];  // by call parity
  std::vector<long> seq;             // per rank: calls issued

  // Waits until all ranks have arrived at this barrier, the deadline passes
  // (DeadlineExceeded, and the group is aborted) or the group is aborted.
  void barrier(int rank, const Descriptor& d, long call, const char* phase) {
    std::unique_lock<std::mutex> lock(mu);
    throw_if_aborted(rank, d);
    const long my_gen = gen;
    arrived_gen[rank] = my_gen;
    if (++arrived == size) {
      arrived = 0;
      ++gen;
      gen_atomic.store(gen, std::memory_order_release);
      lock.unlock();
      cv.notify_all();
      return;
    }
    // Brief spin first: with one thread per core the peers usually arrive
    // within microseconds, and a futex sleep/wake costs more than that.
    lock.unlock();
    const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
    while (gen_atomic.load(std::memory_order_acquire) == my_gen &&
           std::chrono::steady_clock::now() < spin_until) {
      std::this_thread::yield();
    }
    lock.lock();
    // For the flight record: the first rank not here yet.
    for (int r = 0; r < size && gen == my_gen; ++r) {
      if (arrived_gen[r] != my_gen) {
        flight::note_waiting(r);
        break;
      }
    }
    const auto deadline = std::chrono::steady_clock::now() + options.timeout;
    while (gen == my_gen) {
      throw_if_aborted(rank, d, my_gen);
      if (cv.wait_until(lock, deadline) == std::cv_status::timeout && gen == my_gen) {
        note_first_missing(my_gen);  // whom it waited for at the end, not at the start
        std::ostringstream missing;
        int n_missing = 0;
        for (int r = 0; r < size; ++r) {
          if (arrived_gen[r] != my_gen) missing << (n_missing++ ? ", " : "") << r;
        }
        std::ostringstream msg;
        msg << "rank " << rank << ": " << describe(d) << " (call #" << call << ", " << phase
            << "): rank" << (n_missing > 1 ? "s " : " ") << missing.str()
            << " did not arrive within " << options.timeout.count() << " ms";
        aborted = true;
        abort_reason = msg.str();
        cv.notify_all();
        throw DeadlineExceededError(msg.str());
      }
    }
  }

  // For the flight record: the first rank that has not arrived at call
  // generation `my_gen` (the one noted when the wait began may have come
  // since: under load the ranks arrive in any order).
  void note_first_missing(long my_gen) {
    for (int r = 0; r < size; ++r) {
      if (arrived_gen[r] != my_gen) {
        flight::note_waiting(r);
        return;
      }
    }
  }

  void throw_if_aborted(int rank, const Descriptor& d, long my_gen = -1) {
    if (aborted) {
      if (my_gen >= 0) note_first_missing(my_gen);
      throw AbortedError("rank " + std::to_string(rank) + ": " + describe(d) +
                         " aborted: " + abort_reason);
    }
  }
};

namespace {

class InProcessCommunicator : public Communicator {
 public:
  InProcessCommunicator(InProcessGroup::State* state, int rank) : s_(state), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return s_->size; }
  const CommunicationOptions& options() const override { return s_->options; }

  void all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                  const std::string& name) override {
    Descriptor d{Kind::kAllReduce, in, out, count, dtype, op, 0, name};
    const long call = publish_and_check(d);
    if (!s_->p2p_comms.empty()) {
      try {
        s_->p2p_comms[static_cast<size_t>(rank_)]->all_reduce(in, out, count, dtype, op, name);
      } catch (const Error& e) {
        abort(e.message());  // the peers waiting on this rank fail at once
        throw;
      }
      return;
    }
    const auto& slots = s_->slots[call & 1];
    size_t lo, hi;
    algo::slice_of(count, s_->size, rank_, &lo, &hi);
    std::vector<const void*> ins(s_->size);
    std::vector<void*> outs(s_->size);
    for (int r = 0; r < s_->size; ++r) {
      ins[r] = slots[r].in;
      outs[r] = slots[r].out;
    }
    algo::reduce_slice_to_all(ins.data(), outs.data(), s_->size, rank_, lo, hi, dtype, op,
                              count * dtype_size(dtype));
    s_->barrier(rank_, d, call, "reduce");
  }

  void broadcast(void* buf, size_t count, DType dtype, int root, const std::string& name) override {
    DISTSTRAT_CHECK(0 <= root && root < s_->size, kInvalidArgument, "broadcast '", echo(name),
                    "': root ", root, " is not a rank of a group of ", s_->size);
    Descriptor d{Kind::kBroadcast, buf, buf, count, dtype, ReduceOp::kSum, root, name};
    const long call = publish_and_check(d);
    if (rank_ != root && count) {
      std::memcpy(buf, s_->slots[call & 1][root].in, count * dtype_size(dtype));
    }
    s_->barrier(rank_, d, call, "copy");
  }

  void all_gather(const void* in, void* out, size_t count, DType dtype,
                  const std::string& name) override {
    Descriptor d{Kind::kAllGather, in, out, count, dtype, ReduceOp::kSum, 0, name};
    const long call = publish_and_check(d);
    const size_t bytes = count * dtype_size(dtype);
    for (int r = 0; r < s_->size; ++r) {
      char* dst = static_cast<char*>(out) + r * bytes;
      const void* src = s_->slots[call & 1][r].in;
      if (bytes && dst != src) std::memcpy(dst, src, bytes);
    }
    s_->barrier(rank_, d, call, "copy");
  }

  void reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                      const std::string& name) override {
    Descriptor d{Kind::kReduceScatter, in, out, count, dtype, op, 0, name};
    const long call = publish_and_check(d);
    const size_t bytes = count * dtype_size(dtype);
    if (count) {
      std::vector<const void*> srcs(s_->size);
      for (int r = 0; r < s_->size; ++r) {
        srcs[r] = static_cast<const char*>(s_->slots[call & 1][r].in) + rank_ * bytes;
      }
      kernels::reduce(out, srcs.data(), s_->size, count, dtype, op, s_->size);
    }
    s_->barrier(rank_, d, call, "reduce");
  }

  void barrier(const std::string& name) override {
    Descriptor d;
    d.name = name;
    publish_and_check(d);
  }

  void abort(const std::string& reason) override {
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      if (!s_->aborted) {
        s_->aborted = true;
        s_->abort_reason = reason;
      }
    }
    s_->cv.notify_all();
    if (s_->transports) s_->transports->at(rank_).abort(reason);
  }

  void reset() override {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->transports) s_->make_transport();
    s_->aborted = false;
    s_->abort_reason.clear();
    s_->arrived = 0;
    s_->arrived_gen.assign(s_->size, -1);
    s_->seq.assign(s_->size, 0);
  }

 private:
  // Phase 1: publish this rank's descriptor, meet the others, and check that
  // every rank issued the same call. Returns the call's sequence number.
  long publish_and_check(const Descriptor& d) {
    long call;
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      call = s_->seq[rank_]++;
      s_->slots[call & 1][rank_] = d;
    }
    s_->barrier(rank_, d, call, "rendezvous");
    const auto& slots = s_->slots[call & 1];
    for (int r = 1; r < s_->size; ++r) {
      if (!compatible(slots[0], slots[r])) {
        throw InvalidArgumentError("rank " + std::to_string(rank_) + ": mismatched collective #" +
                                   std::to_string(call) + ": rank 0 called " + describe(slots[0]) +
                                   " but rank " + std::to_string(r) + " called " +
                                   describe(slots[r]));
      }
    }
    return call;
  }

  InProcessGroup::State* s_;
  int rank_;
};

}  // namespace

InProcessGroup::InProcessGroup(int size, CommunicationOptions options) {
  DISTSTRAT_CHECK_GE(size, 1, "InProcessGroup size");
  check_in_process_algorithm(options, "InProcessGroup");
  state_ = std::make_unique<State>(size, std::move(options));
  // One reset() resets every member, and a slow replica thread is not what
  // straggler detection is for: calls are recorded, no windows exchanged.
  static std::atomic<int> groups{0};
  const std::string group_name = "in-process#" + std::to_string(groups++);
  RecordingCommunicator::Options recording;
  recording.stragglers = false;
  recording.members_reset_together = false;
  for (int r = 0; r < size; ++r)
    comms_.push_back(wrap_recorded(std::make_unique<InProcessCommunicator>(state_.get(), r),
                                   group_name, recording));
}

InProcessGroup::~InProcessGroup() = default;
int InProcessGroup::size() const { return state_->size; }
Communicator& InProcessGroup::at(int rank) {
  DISTSTRAT_CHECK(0 <= rank && rank < size(), kInvalidArgument, "InProcessGroup::at(", rank,
                  "): group has ", size(), " ranks");
  return *comms_[rank];
}

}  // namespace diststrat
