// A process group: one Communicator for the whole job, made and used outside
// any strategy (what c10d::ProcessGroup is to LibTorch programs).
//
//   ```cpp fragment=process_group mpi
//   // mpirun -np 4 ./train
//   ds::ProcessGroup pg;                          // collective: every process constructs it
//   ds::broadcast_tensors(pg, params, 0, names);  // the chief's values on every rank
//   pg.all_reduce(grad, ds::ReduceOp::kMean, "fc/grad");
//   ```
//
// - Who is in it: the cluster of resolve_cluster (diststrat/cluster.h), the
//   same resolution MultiWorkerMirroredStrategy uses: an explicit ClusterSpec
//   (options.cluster.spec), else TF_CONFIG, else the MPI launcher. One rank
//   per training process (chief, worker and ps tasks, in that order); rank()
//   is the process rank, which under mpirun is the MPI_COMM_WORLD rank. An
//   evaluator is not part of it (InvalidArgumentError). One process without
//   a launcher (or an explicit one-process spec): a one-rank group, no MPI.
//   Several processes without a launcher: UnimplementedError (needs mpirun).
// - How it moves bytes: inside a host over shared memory (MPI-3 shared
//   windows); with several hosts (or virtual nodes,
//   DISTSTRAT_VIRTUAL_NODE_SIZE) of more than one rank each, as many on each,
//   and algorithm kAuto or kHierarchical, the all-reduce is hierarchical
//   (inside the node, across nodes over MPI, back); otherwise (any other
//   algorithm, one rank per node, nodes of different sizes) it reduces flat
//   over all ranks. Virtual nodes on one host change only the grouping: a
//   flat group there still runs over shared memory.
//   broadcast / all_gather / reduce_scatter / barrier run over all ranks.
// - Collectives: those of Communicator (diststrat/collective.h), with its
//   rules: blocking, in place where noted, every rank issues the same
//   collectives in the same order, each bounded by options.timeout, then
//   DeadlineExceededError naming the ranks that never arrived; after a
//   deadline or abort() the group is unusable: destroy it and make another
//   (later calls throw AbortedError quoting the deadline: on that rank, and
//   on one host on every rank, the late one included).
//   Ranks whose calls differ (kind of collective, count, dtype, reduce op,
//   root, or the name the caller gave) all throw InvalidArgumentError naming
//   the first odd rank and both calls, before any byte moves: on one host,
//   compared in shared memory (and the group is aborted); across hosts or
//   virtual nodes, by one small message exchange per call (ceil(log2 size)
//   rounds) (docs/process_group.md). So a rank that skips or reorders a
//   collective fails at the first mispaired call, on every rank; give the
//   same name on every rank to calls that belong together.
// - Thread safety: one thread at a time per group (a group is one rank's
//   Communicator). A call made while another thread's call on the same group
//   is in flight throws FailedPreconditionError naming both and aborts the
//   group (every rank's calls then fail with AbortedError); abort() alone may
//   be called from any thread. Several groups and strategies of one process may be used
//   from different threads at once (MPI is initialized with
//   MPI_THREAD_MULTIPLE when the library initializes it; a program that
//   initializes MPI itself must ask for MPI_THREAD_MULTIPLE for that).
// - Set-up and tear-down: construction is collective over the job's
//   processes and every MPI call of it is bounded by options.timeout (as for
//   the strategy, docs/multi_worker.md "Set-up and tear-down"); a rank whose
//   set-up fails (TF_CONFIG, an evaluator task, a spec that disagrees with
//   its MPI rank) makes every rank's constructor throw, the others
//   AbortedError naming it. The destructor is collective too: ranks of one
//   host wait (at most options.timeout) for each other to release the shared
//   windows; destroy groups and strategies in the same order on every rank.
//   A group destroyed while an exception propagates does not wait: it aborts;
//   peers on its host waiting in a collective with it fail at once with
//   AbortedError naming this rank (through shared memory), peers elsewhere at
//   their deadline or when the launcher ends the job.
// - MPI's lifetime: a group never finalizes MPI. If no one had initialized
//   MPI, the first group (or strategy, or resolve_cluster) initializes it and
//   the library finalizes it at exit, bounded by the longest timeout of the
//   process's groups and strategies. A program that initialized MPI itself
//   finalizes it, after destroying every group. Groups and
//   MultiWorkerMirroredStrategy coexist in one process, created in either
//   order, each with its own MPI communicators (their messages never meet),
//   and groups may be created one after another.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "diststrat/cluster.h"
#include "diststrat/collective.h"
#include "diststrat/flight_recorder.h"
#include "diststrat/tensor.h"

namespace diststrat {

struct ProcessGroupOptions {
  // Timeout (of every collective, and of every MPI call of set-up and
  // tear-down; must be > 0), algorithm, segment sizes, and bytes_per_pack,
  // which broadcast_tensors packs by. Defaults as in CommunicationOptions
  // (DISTSTRAT_TIMEOUT or 300 s; kAuto; 4 MiB packs).
  CommunicationOptions communication;
  // Where the cluster comes from (explicit spec, TF_CONFIG, mpirun) and the
  // virtual node grouping (DISTSTRAT_VIRTUAL_NODE_SIZE overrides).
  ClusterConfig cluster;
};

class ProcessGroup final : public Communicator {
 public:
  // Blocking and collective: every training process of the job constructs
  // it (see above). Throws InvalidArgumentError for a timeout <= 0 (before
  // any MPI call), and the errors of resolve_cluster.
  explicit ProcessGroup(ProcessGroupOptions options = {});
  // Collective (see above); never throws.
  ~ProcessGroup() override;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const override;
  int size() const override;
  const CommunicationOptions& options() const override;

  // Communicator's collectives (diststrat/collective.h), over every process.
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
  void reset() override;
  std::shared_ptr<void> allocate_buffer(size_t bytes) override;
  using Communicator::all_reduce;
  using Communicator::broadcast;

  // Where the cluster came from, this task, and the node grouping.
  const ResolvedCluster& cluster() const;
  // True when all_reduce runs hierarchically (several nodes).
  bool hierarchical() const;
  // Who slows the group's calls down: each rank's compute time before each
  // collective over the latest window (diststrat/flight_recorder.h).
  // Thread-safe.
  StragglerReport straggler_report() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Copies root's `tensors` into every rank's `tensors`, in place (e.g. a
// model's parameters from the chief at start-up). Every rank passes the same
// list: the same number of tensors, in the same order, with the same dtypes,
// shapes and names (or no names on every rank), and the same root. `names[i]` names
// tensors[i] in errors; empty = "#i". Tensors must be defined and in host
// memory; their storage may be owned or wrapped (Tensor::wrap,
// Tensor::from_dlpack).
//
// Packed: consecutive tensors are copied into buffers of up to
// comm.options().bytes_per_pack bytes (0 = all in one) and each buffer is one
// broadcast; a tensor of at least bytes_per_pack bytes is broadcast on its
// own, straight from and into its memory. Before any data moves, the ranks
// exchange a signature of their lists (one all_gather; a second one only
// when something differs): a rank with an extra or a missing tensor, another
// dtype, shape or name, another root or bytes_per_pack, or an invalid
// argument (root out of range, an undefined or GPU tensor, names of the
// wrong length) makes EVERY rank throw InvalidArgumentError naming the rank
// and the first tensor that differs (e.g. "rank 1 has 'fc/bias' float32[5],
// root 0 has 'fc/bias' float32[4]"); no tensor is written and the
// communicator stays usable.
//
// Blocking, collective over comm, same order on every rank; one thread per
// communicator. Each collective is bounded by comm.options().timeout
// (DeadlineExceededError naming the ranks that never arrived).
void broadcast_tensors(Communicator& comm, std::vector<Tensor>& tensors, int root = 0,
                       const std::vector<std::string>& names = {});

}  // namespace diststrat
