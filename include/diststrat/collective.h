// Collective communication on raw buffers: the layer strategies are built on,
// usable on its own. A Communicator joins `size()` ranks (replica threads of
// one process, MPI processes, or both); each rank holds its own Communicator
// object.
//
// Rules shared by every collective below:
//  - Blocking: each call returns when this rank's part is complete (its output
//    buffer holds the result and its input buffer may be reused).
//  - Ordering: all ranks must issue the same collectives in the same order with
//    matching count, dtype and op. A mismatch that the implementation detects
//    raises InvalidArgumentError on every rank naming the ranks involved.
//  - In place: passing the same pointer as input and output is allowed where
//    noted.
//  - Deadline: no call waits longer than options().timeout for peers; then it
//    throws DeadlineExceededError naming the ranks that never arrived, and the
//    communicator counts as aborted: this rank's later calls throw
//    AbortedError until reset(), and so do its peers' where they can see it
//    (threads of one process, shared memory: a peer arriving late fails the
//    call this rank gave up instead of completing it; across hosts a peer
//    finds out at its own deadline).
//  - Failure: after abort() (or another rank's abort), every pending and future
//    call throws AbortedError until the communicator is reset().
//  - Thread safety: one thread per Communicator object at a time; distinct
//    ranks' objects may be used concurrently from different threads.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "diststrat/dtype.h"
#include "diststrat/tensor.h"

namespace diststrat {

// Integer (int32/int64) kSum and kProduct wrap modulo 2^bits, as MPI's and
// NCCL's do; kMean of integers truncates toward zero. Strategy::reduce of
// PerReplica<int64_t> is exact instead (an overflow is InvalidArgumentError).
enum class ReduceOp { kSum, kMean, kMin, kMax, kProduct };
const char* reduce_op_name(ReduceOp op);

// Which all-reduce algorithm to use; kAuto lets the implementation choose by
// size, rank count and topology.
enum class Algorithm {
  kAuto,
  kDirect,           // shared address space: each rank reduces its slice out of every peer's buffer
  kRing,             // reduce-scatter + all-gather around a ring (bandwidth-optimal)
  kHalvingDoubling,  // Rabenseifner's recursive halving / doubling (latency)
  kTree,             // binomial tree reduce + broadcast (small messages)
  kReduceToOne,      // reduce to rank 0, then broadcast (TF's ReductionToOneDevice)
  kHierarchical,     // inside each node, across nodes, back inside the node
  kNccl,             // NCCL (GPU builds)
  kMpiNative,        // MPI_Allreduce
  kCustom,           // a user-registered algorithm, named by custom_algorithm
  kSharedMemory,     // ranks of one node reduce slices straight out of a shared MPI window
};
const char* algorithm_name(Algorithm algorithm);
// Parses "auto", "direct", "ring", "halving_doubling", "tree", "reduce_to_one",
// "hierarchical", "nccl", "mpi", "custom", "shm"; throws InvalidArgumentError
// otherwise.
Algorithm parse_algorithm(const std::string& name);

// Casts f32 payloads for the wire and back (Horovod / DDP fp16 compression).
enum class Compression { kNone, kFloat16, kBFloat16 };

class AlgorithmRegistry;  // diststrat/algorithm_registry.h

// Parses a timeout given in seconds ("300", "0.5", "1e2"): a finite number
// > 0 and at most 30 days, rounded up to whole milliseconds. Throws
// InvalidArgumentError quoting `text`. Pure; thread-safe.
std::chrono::milliseconds parse_timeout_seconds(const std::string& text);
// Why parse_timeout_seconds(text) would throw (its message), or "" when it
// would not: a validator for command-line flags (CLI11's check()). Pure.
std::string timeout_seconds_error(const std::string& text);
// DISTSTRAT_TIMEOUT (seconds, parsed as above); nullopt when unset or empty.
// Throws InvalidArgumentError naming the variable for any other value. Reads
// the environment on every call; thread-safe unless the environment is
// changed concurrently.
std::optional<std::chrono::milliseconds> timeout_from_env();

struct CommunicationOptions {
  // Fusion buffer size for packing small tensors into one collective;
  // 0 = everything submitted together goes into one pack.
  size_t bytes_per_pack = 4 << 20;
  // Longest wait for peers in any single collective before DeadlineExceeded;
  // it also bounds every MPI call of set-up (cluster agreement, communicator
  // and window creation) and tear-down (window and communicator release,
  // MPI_Finalize at exit). Default: DISTSTRAT_TIMEOUT seconds when that is
  // set (fractional allowed, e.g. DISTSTRAT_TIMEOUT=0.5; a value that does
  // not parse makes this constructor throw InvalidArgumentError naming the
  // variable), else 300 s. A value set in code (or by an example's
  // --timeout flag) wins over the environment.
  std::chrono::milliseconds timeout{timeout_from_env().value_or(std::chrono::seconds(300))};
  // All-reduce algorithm; kAuto picks by size, ranks and topology.
  Algorithm algorithm = Algorithm::kAuto;
  // Registered name of the algorithm used when algorithm == kCustom, looked up
  // in algorithm_registry.
  std::string custom_algorithm;
  // User-registered algorithms (see algorithm_registry.h); null = none.
  std::shared_ptr<const AlgorithmRegistry> algorithm_registry;
  // Wire compression for f32 all-reduces.
  Compression compression = Compression::kNone;
  // kAuto over point-to-point transports (MPI; on one node kAuto uses shared
  // memory instead): with more than two ranks, messages up to
  // auto_tiny_message_bytes use the binomial tree, up to
  // auto_small_message_bytes recursive halving-doubling, larger ones the
  // pipelined ring; two ranks skip the tree; several nodes use the
  // hierarchical algorithm. The defaults come from allreduce_bench on the
  // 2-core development host (docs/benchmarks.md), where with 4 ranks the tree
  // beat halving-doubling at every size up to 256 KiB and the ring won from
  // 1 MiB; measure on yours and override.
  size_t auto_tiny_message_bytes = 256 << 10;
  size_t auto_small_message_bytes = 256 << 10;
  // Segment size for pipelined algorithms (ring); 0 = implementation default
  // (1 MiB).
  size_t segment_bytes = 0;
  // Ranks per node for kHierarchical when the transport cannot tell (threads
  // of one process): ranks [k*g, (k+1)*g) form node k. 0 = ask the transport
  // (MPI: ranks sharing a host); with neither, all ranks are one node.
  int hierarchical_group_size = 0;
  // Shared-memory all-reduce of ordinary (unregistered) buffers from 8 MiB
  // on: copy straight between the processes (Linux cross-memory attach,
  // process_vm_readv/writev) instead of through the staging buffers. Used
  // only when set-up finds that every rank may read every peer's memory
  // (same user, ptrace policy allowing it; otherwise, or when any rank sets
  // this false, every rank stages).
  bool shm_single_copy = true;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const CommunicationOptions& options() const = 0;

  // out[i] = op over all ranks of in[i], for i < count. In place allowed.
  // `name` names the tensor in error messages; communicators that compare
  // the ranks' calls (every one but NCCL's) compare it too, so give the same
  // name on every rank.
  virtual void all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                          const std::string& name = "") = 0;
  // Copies root's `count` elements of `buf` into every rank's `buf`.
  virtual void broadcast(void* buf, size_t count, DType dtype, int root,
                         const std::string& name = "") = 0;
  // out (size() * count elements) receives every rank's `count` elements of
  // `in`, ordered by rank. In place allowed when in == out + rank() * count.
  virtual void all_gather(const void* in, void* out, size_t count, DType dtype,
                          const std::string& name = "") = 0;
  // `in` holds size() * count elements; rank r's `out` receives block r of the
  // reduction. In place allowed when out == in + rank() * count.
  virtual void reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                              const std::string& name = "") = 0;
  // Returns once every rank has entered the barrier.
  virtual void barrier(const std::string& name = "") = 0;

  // Makes every pending and future collective of every rank of this group
  // throw AbortedError(reason). Thread-safe; non-blocking.
  virtual void abort(const std::string& reason) = 0;
  // Clears an abort once all ranks are idle (no collective in flight), so the
  // group can be used again. Across processes every rank calls it and it
  // returns once all have (blocking, deadline-bounded), so the next call may
  // follow at once; in one process (InProcessGroup) one rank's call resets the
  // group. Not thread-safe with collectives.
  virtual void reset() = 0;

  // Memory that this communicator reduces without staging copies: inside a
  // node, a shared-memory window that every rank maps, so all_reduce reads
  // the peers' inputs and writes their outputs directly when EVERY rank's
  // `in` and `out` lie in such buffers (otherwise it stages, as for any
  // memory). Collective and blocking: every rank calls it in the same order
  // with the same `bytes` (it is not deadline-bounded; call it at setup).
  // 64-byte aligned; the memory stays valid until the communicator is
  // destroyed, so drop the pointer before the communicator. Default (and
  // every communicator without shared memory): ordinary host memory.
  virtual std::shared_ptr<void> allocate_buffer(size_t bytes);

  // Typed wrappers.
  template <typename T>
  void all_reduce(T* data, size_t count, ReduceOp op, const std::string& name = "") {
    all_reduce(data, data, count, dtype_of<T>(), op, name);
  }
  template <typename T>
  void broadcast(T* data, size_t count, int root, const std::string& name = "") {
    broadcast(data, count, dtype_of<T>(), root, name);
  }
  // Tensor wrappers (in place).
  void all_reduce(Tensor& t, ReduceOp op, const std::string& name = "") {
    all_reduce(t.data(), t.data(), static_cast<size_t>(t.num_elements()), t.dtype(), op, name);
  }
  void broadcast(Tensor& t, int root, const std::string& name = "") {
    broadcast(t.data(), static_cast<size_t>(t.num_elements()), t.dtype(), root, name);
  }
};

// A group of `size` communicators for threads of one process. Rank r's
// communicator is at(r); hand each to the thread that plays rank r.
class InProcessGroup {
 public:
  explicit InProcessGroup(int size, CommunicationOptions options = {});
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int size() const;
  Communicator& at(int rank);

  struct State;  // implementation detail

 private:
  std::unique_ptr<State> state_;
  std::vector<std::unique_ptr<Communicator>> comms_;
};

}  // namespace diststrat
