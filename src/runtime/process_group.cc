#include "core/env.h"
#include "runtime/process_group.h"

#include <atomic>
#include <exception>
#include <mutex>

#include "diststrat/process_group.h"

#include "core/cpu_isa.h"
#include "core/user_text.h"
#include "diststrat/config.h"
#include "diststrat/logging.h"
#include "allreduce/flight_recording.h"
#include "allreduce/hierarchical.h"
#include "core/flight_recorder.h"
#include "core/random_id.h"
#if DISTSTRAT_HAVE_MPI
#include "allreduce/mpi_communicator.h"
#include "runtime/mpi_env.h"
#endif

namespace diststrat {

namespace {
// A one-rank group for a single process without a launcher.
class SoloCommunicator : public Communicator {
 public:
  explicit SoloCommunicator(const CommunicationOptions& o) : group_(1, o) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const CommunicationOptions& options() const override { return c().options(); }
  void all_reduce(const void* in, void* out, size_t n, DType t, ReduceOp op,
                  const std::string& name) override {
    c().all_reduce(in, out, n, t, op, name);
  }
  void broadcast(void* buf, size_t n, DType t, int root, const std::string& name) override {
    c().broadcast(buf, n, t, root, name);
  }
  void all_gather(const void* in, void* out, size_t n, DType t, const std::string& name) override {
    c().all_gather(in, out, n, t, name);
  }
  void reduce_scatter(const void* in, void* out, size_t n, DType t, ReduceOp op,
                      const std::string& name) override {
    c().reduce_scatter(in, out, n, t, op, name);
  }
  void barrier(const std::string& name) override { c().barrier(name); }
  void abort(const std::string& reason) override { c().abort(reason); }
  void reset() override { c().reset(); }

 private:
  Communicator& c() const { return const_cast<InProcessGroup&>(group_).at(0); }
  InProcessGroup group_;
};
}  // namespace

void agree_on_setup(const std::string& what, std::exception_ptr local_error,
                    std::chrono::milliseconds timeout) {
#if DISTSTRAT_HAVE_MPI
  if (mpi::launched_under_mpi()) {
    mpi::ensure_initialized(timeout);
    mpi::agree(MPI_COMM_WORLD, what, local_error, timeout);
    return;
  }
#endif
  (void)what;
  (void)timeout;
  if (local_error) std::rethrow_exception(local_error);
}

#if DISTSTRAT_HAVE_MPI
namespace {
// The MPI communicators of `cluster` (see make_process_communicators).
ProcessCommunicators make_mpi_process_communicators(const Placement& p,
                                                    const CommunicationOptions& options,
                                                    bool allow_hierarchical) {
  ProcessCommunicators out;
  const std::chrono::milliseconds t = options.timeout;
  CommunicationOptions flat_opts = options;
  if (flat_opts.algorithm == Algorithm::kHierarchical) flat_opts.algorithm = Algorithm::kAuto;
  // Every node must have as many ranks for the hierarchical split.
  int sizes[2] = {p.local_size, -p.local_size};
  mpi::allreduce_in_place(sizes, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD,
                          "make_process_communicators: node sizes", t);
  const bool uniform = sizes[0] == -sizes[1];
  if (allow_hierarchical && p.num_nodes > 1 && p.local_size > 1 && uniform) {
    // Every rank takes this branch (the condition is agreed), and every rank
    // has completed the allreduce above, so all enter the splits.
    MPI_Comm node_comm = MPI_COMM_NULL, cross_comm = MPI_COMM_NULL;
    int rc[2] = {MPI_SUCCESS, MPI_SUCCESS};
    mpi::bounded_call("make_process_communicators: MPI_Comm_split", t, [&] {
      rc[0] = MPI_Comm_split(MPI_COMM_WORLD, p.node, p.rank, &node_comm);
      if (rc[0] == MPI_SUCCESS)
        rc[1] = MPI_Comm_split(MPI_COMM_WORLD, p.local_rank, p.rank, &cross_comm);
    });
    DISTSTRAT_MPI_CHECK(rc[0]);
    DISTSTRAT_MPI_CHECK(rc[1]);
    // Inside a node: kAuto (the shared-memory path); across nodes: MPI
    // itself (its network transport), even when the "nodes" are virtual.
    // (Compressed f16/bf16 packs too: the MPI communicator reduces them
    // with its own MPI_Ops.)
    CommunicationOptions inter_opts = options;
    inter_opts.algorithm = Algorithm::kMpiNative;
    CommunicationOptions intra_opts = flat_opts;
    auto flat = make_mpi_communicator(MPI_COMM_WORLD, flat_opts);
    auto intra = make_mpi_communicator(node_comm, intra_opts);
    auto inter = make_mpi_communicator(cross_comm, inter_opts);
    mpi::free_comm(&node_comm, t);
    mpi::free_comm(&cross_comm, t);
    out.cross = std::make_unique<HierarchicalCommunicator>(std::move(flat), std::move(intra),
                                                           std::move(inter));
    out.hierarchical = true;
  } else {
    out.cross = make_mpi_communicator(MPI_COMM_WORLD, flat_opts);
  }
  return out;
}
}  // namespace
#endif

ProcessCommunicators make_process_communicators(const ResolvedCluster& cluster,
                                                const CommunicationOptions& options,
                                                bool allow_hierarchical) {
  const Placement& p = cluster.placement;
#if DISTSTRAT_HAVE_MPI
  if (mpi::launched_under_mpi()) {
    mpi::ensure_initialized(options.timeout);
    mpi::bound_finalize(options.timeout);
    try {
      ProcessCommunicators out = make_mpi_process_communicators(p, options, allow_hierarchical);
      // Every collective of the job's processes is recorded (flight
      // recorder, straggler detection): "world" for the process's first
      // group, "world.1", ... for the next ones (every rank makes its groups
      // and strategies in the same order, so the names agree).
      flight::set_process(p.rank, p.world_size);
      static std::atomic<int> groups{0};
      const int k = groups++;
      if (k == 0) {
        // The run's flight-record nonce (flight::set_nonce): world rank 0's.
        uint64_t nonce = random_id();
        mpi::bcast(&nonce, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD,
                   "make_process_communicators: the flight-record nonce", options.timeout);
        flight::set_nonce(nonce);
      }
      out.cross = wrap_recorded(std::move(out.cross),
                                k == 0 ? std::string("world") : "world." + std::to_string(k));
      return out;
    } catch (...) {
      // Peers may be waiting for this rank in a set-up collective.
      mpi::mark_failed();
      throw;
    }
  }
#endif
  if (p.world_size > 1) {
    // Started by anything but an MPI launcher: the processes meet at the
    // chief's address over TCP.
    (void)allow_hierarchical;  // TransportCommunicator's kAuto knows the hosts
    static std::atomic<int> tcp_groups{0};
    const int k = tcp_groups++;
    return make_tcp_process_communicators(
        cluster, options, k == 0 ? std::string("world") : "world." + std::to_string(k));
  }
  ProcessCommunicators out;
  // (Recorded already: its InProcessGroup's calls are.)
  out.cross = std::make_unique<SoloCommunicator>(options);
  return out;
}

// ---- ProcessGroup (diststrat/process_group.h) ----

struct ProcessGroup::Impl {
  ResolvedCluster cluster;
  ProcessCommunicators comms;
  // std::uncaught_exceptions() at construction: more at destruction =
  // destroyed during stack unwinding.
  int uncaught_at_construction = std::uncaught_exceptions();
  Communicator& comm() const { return *comms.cross; }

  // One thread at a time: a call made while another thread's is in flight
  // would mix the two calls' bytes (and barriers) on this rank. It fails
  // instead, and aborts the group so that every rank fails loudly.
  // The call in flight is kept as its kind and the caller's name (alive
  // while it is in flight) and written out only for the message: formatting
  // it on every call doubled a small all-reduce's time with a long name.
  std::mutex mu;
  bool busy = false;                            // under mu
  const char* in_flight_kind = "";              // under mu
  const std::string* in_flight_name = nullptr;  // under mu; the caller's
  class Use {
   public:
    Use(Impl& m, const char* kind, const std::string* name = nullptr) : m_(m) {
      std::string other;
      {
        std::lock_guard<std::mutex> lock(m_.mu);
        if (!m_.busy) {
          m_.busy = true;
          m_.in_flight_kind = kind;
          m_.in_flight_name = name;
          return;
        }
        other = call(m_.in_flight_kind, m_.in_flight_name);
      }
      const std::string what = call(kind, name);
      const std::string who = "rank " + std::to_string(m_.comm().rank());
      m_.comm().abort(who + " used the group from two threads at once (" + what + " during " +
                      other + "); the group is aborted");
      throw FailedPreconditionError(who + ": ProcessGroup " + what + " was called while " + other +
                                    " is in flight on another thread: a group serves one thread at "
                                    "a time (make one group per thread); the group is aborted");
    }
    ~Use() {
      std::lock_guard<std::mutex> lock(m_.mu);
      m_.busy = false;
    }
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    Impl& m_;
  };
  // "barrier 'x'", "reset".
  static std::string call(const char* kind, const std::string* name) {
    return !name || name->empty() ? std::string(kind)
                                  : std::string(kind) + " '" + echo(*name) + "'";
  }
};

ProcessGroup::ProcessGroup(ProcessGroupOptions options) : impl_(std::make_unique<Impl>()) {
  const std::chrono::milliseconds timeout = options.communication.timeout;
  // Checked before any MPI call: every rank computes it from the same code.
  env::check_timeout(timeout, "ProcessGroup: options.communication.timeout");
  Impl& m = *impl_;
  // Set-up is collective: a rank that fails it makes every rank fail, naming
  // it, within the deadline (as for MultiWorkerMirroredStrategy).
  m.cluster = resolve_cluster(options.cluster, timeout);
  std::exception_ptr error;
  try {
    // Every DISTSTRAT_* value that does not parse is a set-up error, as for
    // the strategies (whose logger reads it; a group has no logger of its
    // own), checked inside the agreement: a rank with a bad value (one rank
    // given another DISTSTRAT_CPU) fails every rank's set-up naming it,
    // instead of leaving the others in MPI_Init until its watchdog.
    Logger(LogLevel::kWarning);
    cpu::isa_from_env();  // DISTSTRAT_CPU: the reduction kernels' variant
    cpu_isa();
    DISTSTRAT_CHECK(m.cluster.info.rank >= 0 && m.cluster.info.task_type != "evaluator",
                    kInvalidArgument, "ProcessGroup: this process is task ",
                    m.cluster.info.task_type, "[", m.cluster.info.task_index,
                    "], which is not one of the job's training processes (chief, worker, ps)");
  } catch (...) {
    error = std::current_exception();
  }
  agree_on_setup("ProcessGroup set-up", error, timeout);
  const Algorithm algo = options.communication.algorithm;
  m.comms =
      make_process_communicators(m.cluster, options.communication,
                                 algo == Algorithm::kAuto || algo == Algorithm::kHierarchical);
  DISTSTRAT_CHECK_EQ(m.comm().rank(), m.cluster.info.rank,
                     "ProcessGroup: communicator rank vs process rank");
}

ProcessGroup::~ProcessGroup() {
  // Destroyed while an exception propagates: this rank will not meet its
  // peers again; tell them (a peer in a collective fails now, naming this
  // rank) instead of letting them wait out the deadline.
  if (std::uncaught_exceptions() > impl_->uncaught_at_construction) {
    impl_->comm().abort("rank " + std::to_string(impl_->comm().rank()) +
                        " left the group: its ProcessGroup was destroyed while an exception "
                        "propagated (that rank's own error is in its output)");
  }
}

int ProcessGroup::rank() const { return impl_->comm().rank(); }
int ProcessGroup::size() const { return impl_->comm().size(); }
const CommunicationOptions& ProcessGroup::options() const { return impl_->comm().options(); }
const ResolvedCluster& ProcessGroup::cluster() const { return impl_->cluster; }
bool ProcessGroup::hierarchical() const { return impl_->comms.hierarchical; }

void ProcessGroup::all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                              const std::string& name) {
  Impl::Use use(*impl_, "all_reduce", &name);
  impl_->comm().all_reduce(in, out, count, dtype, op, name);
}
void ProcessGroup::broadcast(void* buf, size_t count, DType dtype, int root,
                             const std::string& name) {
  Impl::Use use(*impl_, "broadcast", &name);
  impl_->comm().broadcast(buf, count, dtype, root, name);
}
void ProcessGroup::all_gather(const void* in, void* out, size_t count, DType dtype,
                              const std::string& name) {
  Impl::Use use(*impl_, "all_gather", &name);
  impl_->comm().all_gather(in, out, count, dtype, name);
}
void ProcessGroup::reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                                  const std::string& name) {
  Impl::Use use(*impl_, "reduce_scatter", &name);
  impl_->comm().reduce_scatter(in, out, count, dtype, op, name);
}
void ProcessGroup::barrier(const std::string& name) {
  Impl::Use use(*impl_, "barrier", &name);
  impl_->comm().barrier(name);
}
void ProcessGroup::abort(const std::string& reason) { impl_->comm().abort(reason); }
void ProcessGroup::reset() {
  Impl::Use use(*impl_, "reset");
  impl_->comm().reset();
}
StragglerReport ProcessGroup::straggler_report() const {
  const auto* recorded = dynamic_cast<const RecordingCommunicator*>(&impl_->comm());
  return recorded ? recorded->straggler_report() : StragglerReport{};
}

std::shared_ptr<void> ProcessGroup::allocate_buffer(size_t bytes) {
  Impl::Use use(*impl_, "allocate_buffer");
  return impl_->comm().allocate_buffer(bytes);
}

}  // namespace diststrat
