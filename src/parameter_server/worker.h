// ParameterServerStrategy's worker runtime (ParameterServerStrategy::Impl):
// the job's layout (roles, PS ranks), the variables' shards, the outstanding
// dense pull, staged pushes and the progress thread, and the worker's end.
// Internal: included by the Strategy overrides (parameter_server_strategy.cc,
// strategy_setup.cc, strategy_coordination.cc), worker.cc (this struct's
// code) and strategy_checkpoint.cc.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "runtime/variable_impl.h"
#include "allreduce/inprocess.h"
#include "diststrat/checkpoint.h"
#include "diststrat/parameter_server.h"
#include "runtime/local_replicas.h"
#include "parameter_server/client.h"
#include "parameter_server/strategy_impl.h"
#include "parameter_server/shard_updater.h"

namespace diststrat {
namespace ps {

// One kRestore item: a shard's value (optional), slots and step (-1 = keep).
struct RestoreItem {
  Entry entry;
  const char* value = nullptr;                             // the shard's rows, or null
  std::vector<std::pair<std::string, const char*>> slots;  // the shard's rows of each slot
  int64_t step = -1;
  size_t value_bytes = 0, slot_bytes = 0;
};

// How long a worker that failed (or lost a PS) waits for the other PS ranks
// to take its kAbort / kDone: they are answering, or they are gone too.
constexpr std::chrono::milliseconds kShutdownGrace{3000};

// mpi::mark_failed() when this process runs under an MPI launcher.
void mark_mpi_failed_if_launched();

}  // namespace ps

struct ParameterServerStrategy::Impl {
  struct ShardPlace {
    int ps = 0;
    int64_t index = 0, offset = 0, rows = 0;
  };
  struct VarInfo {
    int64_t id = 0;
    Variable::Impl* var = nullptr;
    bool row_sparse = false;
    std::vector<ShardPlace> shards;
    size_t row_bytes = 0;        // bytes of one row (the whole value for scalars)
    bool rule_declared = false;  // this worker declared its update rule to the PS ranks (kRule)
  };
  struct StagedPush {
    ps::OptimizerConfig config;
    const VarInfo* iterations = nullptr;
    std::vector<std::pair<const VarInfo*, Tensor>> dense;
    struct Rows {
      const VarInfo* info;
      std::vector<int64_t> ids;
      Tensor values;
    };
    std::vector<Rows> sparse;
  };

  ParameterServerOptions options;
  std::unique_ptr<Transport> owned_transport;
  std::unique_ptr<InProcessTransportGroup> own_group;  // single-process mode
  Transport* transport = nullptr;
  int rank = 0, world = 1;
  std::vector<int> ps_ranks, worker_ranks;
  bool is_ps = false;
  int index = 0;  // among PS ranks or among workers
  // This process's task as TF_CONFIG / the explicit spec names it ("chief",
  // "worker" or "ps" and its index), when the cluster came from one.
  std::string task_type;
  int task_index = 0;
  std::vector<std::unique_ptr<ps::ServiceRunner>> services;  // PS loops in this process

  // Worker side.
  ParameterServerStrategy* owner = nullptr;
  std::unique_ptr<LocalReplicas> replicas;
  std::vector<Device> no_devices;
  std::mutex mu;  // serializes use of the client and the state below
  std::unique_ptr<ps::Client> client;
  std::vector<std::unique_ptr<VarInfo>> vars;  // creation order
  std::unordered_map<const Variable::Impl*, VarInfo*> info_of;
  int64_t next_ps = 0;
  bool creating_row_sparse = false;
  int64_t steps = 0;  // pushes this worker has sent (its clock)
  int64_t pushes_sent = 0;
  int64_t barrier_count = 0;
  int64_t broadcast_count = 0;
  // The update rule this worker declared (the first push's optimizer), and
  // whether a push with another optimizer config was warned about.
  ps::OptimizerConfig declared_config;
  bool warned_config = false;
  std::vector<int64_t> versions;  // per PS: version its last dense pull saw
  // The outstanding dense pull: per PS its call, reply buffer and the shards
  // it asked for (variables created later are not in it).
  std::vector<ps::Client::CallPtr> pull_calls;
  std::vector<std::vector<char>> pull_buffers;
  std::vector<std::vector<std::pair<const VarInfo*, ShardPlace>>> pull_plan;
  std::vector<StagedPush> staged;
  std::mutex staged_mu;
  // Drives outstanding transfers while the program computes (a transport
  // may move bytes only while someone calls into it).
  std::thread progress;
  std::atomic<bool> in_step{false};  // the replicas are running a step (no heartbeats)
  // Called by run() after the replicas, before their pushes are posted
  // (without mu held); a throw drops the step's pushes. A ClusterCoordinator's
  // serving worker sets it: a function whose attempt the coordinator fenced
  // pushes nothing more (cluster_coordinator.cc).
  std::function<void()> before_push;
  std::condition_variable progress_cv;
  bool progress_stop = false;
  // Where a worker's time went (logged at info level on shutdown).
  int64_t runs = 0;
  double pull_wait_s = 0, replicas_s = 0, push_post_s = 0;
  // std::uncaught_exceptions() when the strategy was made: more at
  // destruction = it is torn down by an exception (this worker failed).
  int uncaught_at_construction = std::uncaught_exceptions();

  // Marks this process's MPI state failed (mpi::mark_failed), so that its
  // exit does not wait a full deadline for peers that may never come.
  void mark_failed() const;
  // The worker's end: drains, then tells every PS it is done, or, when it
  // failed, that it failed (kAbort), so that the PS fails the other workers'
  // requests at once naming it. After a failure nothing waits a second full
  // deadline: an unreachable PS is skipped, the others get
  // kShutdownGrace, and the exit waits at most mpi::kFailedFinalizeGrace.
  void shutdown(bool unwinding, const Logger& logger);

  int num_workers() const { return static_cast<int>(worker_ranks.size()); }
  // Checkpoints (strategy_checkpoint.cc); callers hold mu
  // for post_restore, restore_from takes it.
  void post_restore(const std::vector<std::vector<ps::RestoreItem>>& per_ps,
                    const std::string& what);
  CheckpointMetadata restore_from(const std::string& path,
                                  const std::vector<std::pair<std::string, Tensor>>& expected,
                                  const std::vector<std::string>& optional,
                                  const RestoreOptions& options);
  bool chief() const { return !is_ps && index == 0; }
  Logger& log() { return owner->logger(); }

  void init_layout(Transport& t);

  // The checkpoint directory of this process's PS ranks: the options', or
  // the environment's override.
  std::string checkpoint_dir() const;

  ps::ServiceOptions service_options(int ps_index) const;

  void attach(ParameterServerStrategy* s);

  // The worker's background thread: completes outstanding transfers while
  // the program computes (a transport may move bytes only while someone
  // calls into it; in-process transports need no polling), and sends each
  // PS a heartbeat (kAlive) when this worker has sent it nothing for a
  // quarter of the worker timeout, so that a worker busy outside the
  // strategy (evaluating, saving) for longer than the timeout is not taken
  // for gone: the PS's timeout bounds silence, not work. Not while the
  // replicas run a step: a step stuck for the timeout (a hung device) is
  // silence, as the multi-worker strategy's deadline bounds a step; nor once
  // the process is at its exit with the strategy alive (std::exit): it will
  // not shut down, and the PS must take it for gone.
  void progress_loop();

  void stop_progress();

  void require_worker(const char* what) const {
    DISTSTRAT_CHECK(!is_ps, kFailedPrecondition, "ParameterServerStrategy::", what, " on PS rank ",
                    rank, ": PS ranks hold shards and serve; call join() there");
  }

  VarInfo& info(const Variable::Impl& v);

  static ps::Entry entry_of(const VarInfo& vi, const ShardPlace& sp);
  static Shape shard_shape(const VarInfo& vi, const ShardPlace& sp);

  // ---- dense pulls -------------------------------------------------------

  // Posts a pull of every dense variable from every PS (an empty one to a PS
  // without dense shards, so that each PS sees the clock).
  void post_dense_pull();

  // Completes the outstanding dense pull and copies it into the caches.
  void finish_dense_pull();

  // Drops a prefetched pull (its data predates a write this worker made).
  void discard_dense_pull();

  // ---- pushes ----------------------------------------------------------------

  // Declares the update rule of the variables this push is the first to
  // touch (kRule; the PS ranks fix it from the chief's declaration and check
  // every other worker's against it). Blocks: once per variable.
  void declare_rules(const StagedPush& s);

  // Sends `config` as the rule of `vars` to the PS ranks holding them and
  // waits for every acknowledgement.
  void post_rules(const std::vector<const VarInfo*>& vars, const ps::OptimizerConfig& config,
                  bool replace, const std::string& what);

  void post_push(StagedPush& s);

  // ---- blocking helpers --------------------------------------------------

  void wait_all(std::vector<ps::Client::CallPtr>& calls) {
    for (auto& c : calls) client->wait(c);
  }

  Tensor pull_whole(const VarInfo& vi);

  // Checks ids (int64 [n], each in [0, rows)) of row-sparse `vi`.
  std::vector<int64_t> checked_ids(const VarInfo& vi, const Tensor& ids, const char* what);
};

}  // namespace diststrat
