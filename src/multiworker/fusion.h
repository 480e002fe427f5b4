// The fusion engine of the multi-worker strategy: one per strategy (per
// process), with one background communication thread that owns every
// cross-process collective of the strategy, so they run in one order that is
// identical on every rank.
//
// How a fused all-reduce runs:
//  1. queue: each local replica enqueues its tensors (all_reduce_async); the
//     k-th call of every local replica forms the k-th collective call. Calls
//     are checked for agreement between local replicas (names, shapes, dtypes,
//     op) as they arrive.
//  2. pack: once all local replicas have enqueued the call, the thread
//     exchanges a signature of it (the step it was made in, op,
//     bytes_per_pack, compression, and every tensor's name, dtype and shape,
//     in order) with the other processes. Pack
//     boundaries are a deterministic function of that signature, so one check
//     per call covers every pack of it. On a mismatch every rank throws
//     InvalidArgumentError naming the first differing tensor and the ranks
//     that disagree, before any data moves. The step matters where the
//     tensors do not show it: a rank that makes no call in one step (the same
//     tensors every step) would otherwise pair its next step's gradients with
//     the others' current ones, every call one step apart, until the loop's
//     last call found no partner.
//  3. The call's tensors are cut into packs: consecutive tensors of one dtype,
//     up to bytes_per_pack bytes (0 = the whole call in one pack; a tensor
//     larger than a pack goes alone, reduced in place in local replica 0's
//     tensor). For each pack: memcpy-in (the local replicas' tensors are
//     reduced straight into the fusion buffer, the in-process step of the
//     hierarchy), optional wire compression (f32 -> f16/bf16), reduce (the
//     cross-process all-reduce: flat or hierarchical, see
//     HierarchicalCommunicator), memcpy-out (the result copied into every
//     local replica's tensor; kMean divided by the replicas in sync).
//  4. The call's Work completes; every local replica's wait() returns.
//
// Fusion and wire buffers are allocated on first use, grown only when a
// larger pack comes, and reused for every later pack. They come from the
// communicator (allocate_buffer): inside a node, shared memory that the
// ranks reduce out of each other without staging copies.
//
// Deadlines: the thread waits at most options.timeout for the other local
// replicas to enqueue a call (then DeadlineExceededError naming the missing
// local replicas); the communicator bounds every cross-process wait the same
// way and names the ranks that never arrived. After such a failure the engine
// is unusable: later calls fail at once with AbortedError carrying the
// original reason (a signature mismatch, detected before data moves on every
// rank alike, leaves it usable).
#pragma once

#include <atomic>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/timeline.h"
#include "diststrat/collective.h"
#include "diststrat/strategy.h"

namespace diststrat {

struct FusionStats {
  int64_t calls = 0;               // collective calls completed
  int64_t packs = 0;               // packs reduced across processes
  int64_t bytes = 0;               // payload bytes reduced (before compression)
  int64_t buffer_allocations = 0;  // fusion/wire buffer (re)allocations
  int64_t device_packs = 0;        // of `packs`: reduced by device_all_reduce_async's hook
};

// One pack of a fused call: tensors [begin, end) of the call, and the name
// its collective carries ("fused all_reduce #3 pack 1/2 [a .. b]").
struct FusionPack {
  size_t begin = 0, end = 0;
  std::string name;
};

class FusionEngine {
 public:
  // The device path's data movement (device_all_reduce_async below).
  using DeviceReduce = std::function<void(Communicator& cross, const std::vector<FusionPack>&)>;

  // `cross` joins one rank per process (it may be hierarchical); only the
  // engine's thread uses it. `replicas_in_sync` divides kMean results.
  FusionEngine(Communicator& cross, int num_local_replicas, int replicas_in_sync,
               CommunicationOptions options, Timeline* timeline);
  ~FusionEngine();
  FusionEngine(const FusionEngine&) = delete;
  FusionEngine& operator=(const FusionEngine&) = delete;

  // Local replica `local` enqueues its part of the next call. Non-blocking;
  // the tensors must stay alive and untouched until the Work completes.
  // Thread-safe (one thread per local replica).
  Work all_reduce_async(int local, ReduceOp op, std::vector<Tensor> tensors,
                        std::vector<std::string> names);

  // The same call for tensors in GPU memory whose data moves on the devices
  // (multiworker/device_reduction.cc, one local replica per process): queued,
  // paired and signature-checked exactly like all_reduce_async (a mismatch is
  // an InvalidArgumentError on every rank before data moves; the step is in
  // the signature), cut into the same packs, and then, on the communication
  // thread, `reduce(cross, packs)` moves the data (the host path's
  // memcpy-in/reduce/memcpy-out are not run). Its exception fails the Work
  // and, unless InvalidArgumentError, makes the engine unusable, as a host
  // collective's would. Non-blocking; thread-safe.
  Work device_all_reduce_async(int local, ReduceOp op, std::vector<Tensor> tensors,
                               std::vector<std::string> names, DeviceReduce reduce);

  // ZeRO-1 collectives over every replica in sync (R = ranks x local
  // replicas; every rank must have the same number of local replicas), one
  // message each (no packing), signature-checked like all_reduce. Global
  // replica g = rank * num_local_replicas + local.
  // reduce_scatter: `in` holds R * B elements, `out` B; out = block g of the
  // op over every replica's `in` (the local replicas are reduced in-process
  // first, then one cross-process reduce_scatter of L * B per rank).
  // all_gather: `in` holds B, `out` R * B: every replica's `in` in replica
  // order. Non-blocking like all_reduce_async; InvalidArgumentError (in the
  // Work) for sizes that do not fit. Thread-safe (one thread per local replica).
  // With `device` (one local replica; tensors in GPU memory): checked the
  // same way, then `device(cross, {{0, 1, name}})` moves the data on the
  // devices (device_reduction.cc) instead of the host collective.
  Work reduce_scatter_async(int local, ReduceOp op, Tensor in, Tensor out, std::string name,
                            DeviceReduce device = nullptr);
  Work all_gather_async(int local, Tensor in, Tensor out, std::string name,
                        DeviceReduce device = nullptr);

  // Runs fn(cross) on the communication thread as the next call, once every
  // local replica has submitted it (fn of local replica 0 runs).
  Work submit(int local, std::function<void(Communicator&)> fn, std::string what);
  // The same from cross-replica context: one submission stands for every
  // local replica. Blocks until fn has run; rethrows its exception.
  void run(std::function<void(Communicator&)> fn, std::string what);

  // Fails every call that is not complete yet with AbortedError(reason) and
  // makes the engine unusable (a replica failed mid-step).
  void abort(const std::string& reason);
  // abort(reason) if a call is waiting for local replicas or queued; returns
  // whether it did. (A replica that failed after its calls completed leaves
  // the ranks in step.)
  bool abort_if_pending(const std::string& reason);

  // The training step (Strategy::run index, agreed by every rank of the
  // group) that calls enqueued from now on belong to; -1 outside a step. A
  // call carries the value it found when its first part came, and ranks whose
  // calls carry different steps fail the signature check. Thread-safe.
  void set_step(int64_t step) { step_.store(step); }

  // Fault injection: the next all_reduce call sends a corrupted signature
  // hash (bits flipped) to the other ranks, as a damaged message would.
  // Thread-safe.
  void corrupt_next_signature() { corrupt_next_signature_ = true; }

  int rank() const { return rank_; }
  const CommunicationOptions& options() const { return options_; }
  FusionStats stats() const;

 private:
  enum class Kind { kAllReduce, kReduceScatter, kAllGather };
  struct Part {
    bool present = false;
    Kind kind = Kind::kAllReduce;
    Tensor out;  // reduce_scatter / all_gather: the result
    ReduceOp op = ReduceOp::kSum;
    std::vector<Tensor> tensors;
    std::vector<std::string> names;
    std::function<void(Communicator&)> task;
    DeviceReduce device_reduce;  // device_all_reduce_async (local replica 0's runs)
  };
  struct Call {
    bool is_task = false;
    std::string what;
    std::vector<Part> parts;
    int arrived = 0;
    Timeline::Clock::time_point first_arrival;
    std::string local_mismatch;  // non-empty: local replicas disagree
    int64_t step = -1;           // set_step's value at the first part (-1: no step)
    std::shared_ptr<Work::State> work;
  };

  Work enqueue(int local, Part part, bool is_task, const std::string& what, bool all_local);
  void loop();
  void execute(Call& call);
  void execute_all_reduce(Call& call);
  void execute_sharded(Call& call);  // reduce_scatter / all_gather
  // Why `part`, local replica `local`'s part of `call`, differs from what
  // another local replica enqueued for it; empty when they agree.
  std::string describe_local_mismatch(const Call& call, int local, const Part& part, bool is_task,
                                      const std::string& what) const;
  // The call's signature as text (one header line, one line per tensor) and
  // its 64-bit hash (what the ranks exchange first).
  std::string signature_header(ReduceOp op) const;
  std::string signature(const Call& call) const;
  uint64_t signature_hash(const Call& call) const;
  void check_signatures(const Call& call);
  // Memory from cross_.allocate_buffer (collective; see fusion.cc).
  struct Buffer {
    std::shared_ptr<void> memory;
    size_t bytes = 0;
    char* data() const { return static_cast<char*>(memory.get()); }
  };
  void ensure(Buffer& buf, size_t bytes);

  Communicator& cross_;
  std::atomic<bool> corrupt_next_signature_{false};
  std::atomic<int64_t> step_{-1};
  const int num_local_;
  const int replicas_in_sync_;
  const CommunicationOptions options_;
  Timeline* timeline_;
  const int rank_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Call>> calls_;  // calls_[i] has sequence base_ + i
  int64_t base_ = 0;
  std::vector<int64_t> next_seq_;  // per local replica
  bool stop_ = false;
  std::string broken_;  // non-empty: the engine failed for this reason
  FusionStats stats_;
  int64_t executed_ = 0;  // calls run across processes (same count on every rank)

  Buffer buffer_, wire_;  // only the engine thread touches them
  Buffer shard_;          // ZeRO-1 collectives' staging (engine thread only)
  std::thread thread_;
};

}  // namespace diststrat
