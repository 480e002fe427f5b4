// MultiWorkerMirroredStrategy's state, shared by its files: set-up and
// teardown (multi_worker_mirrored.cc), the replica context
// (multi_worker_replica_context.cc), the Strategy overrides
// (multi_worker_strategy_ops.cc) and gradient application
// (multi_worker_apply.cc).
#pragma once

#include <exception>
#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/timeline.h"
#include "diststrat/multi_worker_mirrored.h"
#include "multiworker/device_reduction.h"
#include "multiworker/fusion.h"
#include "diststrat/elastic.h"
#include "runtime/elastic_rendezvous.h"
#include "runtime/local_replicas.h"
#include "runtime/process_group.h"

namespace diststrat {

// The context the step function sees on local replica `local`: the local
// replica's device and stream, a replica id counted across the workers, and
// collectives over every replica in sync.
class MultiWorkerReplicaContext : public ReplicaContext {
 public:
  MultiWorkerReplicaContext(MultiWorkerMirroredStrategy::Impl* impl, int local)
      : impl_(impl), local_(local) {}

  int replica_id() const override;
  int local_replica_id() const override { return local_; }
  int num_replicas_in_sync() const override;
  const Device& device() const override;
  Strategy& strategy() const override;
  void* stream() const override { return inner().stream(); }

  void all_reduce(ReduceOp op, std::vector<Tensor>& tensors,
                  const std::vector<std::string>& names = {}) override {
    all_reduce_async(op, tensors, names).wait();
  }
  Work all_reduce_async(ReduceOp op, std::vector<Tensor> tensors,
                        std::vector<std::string> names = {}) override;
  Tensor all_gather(const Tensor& t, const std::string& name = "") override;
  void barrier(const std::string& name = "") override;

 protected:
  std::shared_ptr<void> merge_call_impl(
      const std::function<std::shared_ptr<void>(Strategy&)>& fn) override;

 private:
  LocalReplicaContext& inner() const;
  MultiWorkerMirroredStrategy::Impl* impl_;
  int local_;
};

// An elastic worker's part of the strategy (multiworker/elastic.cc): its
// rendezvous, the group it is in, and the ElasticState whose run() is active.
struct ElasticRuntime {
  // The store is given communication.timeout per operation.
  ElasticRuntime(const ElasticOptions& options, const CommunicationOptions& communication);
  ElasticOptions options;
  std::unique_ptr<ElasticRendezvous> rendezvous;
  GroupView view;                 // the group this worker is in (valid after the first join)
  bool in_group = false;          // `view` is set
  ElasticState* state = nullptr;  // while its run() is active
  bool committing = false;        // inside a commit (its own Strategy::run calls pass)
  std::chrono::steady_clock::time_point next_poll{};  // the chief's next look for joiners
  // The chief's last warning that it could not look (said again only when
  // the reason changes, or a minute later: not at every look).
  std::string poll_warning;
  std::chrono::steady_clock::time_point poll_warned{};
  int rejoins = 0;         // times this worker was declared dead and joined anew
  bool admitting = false;  // the group left its step to admit waiting workers
  // ElasticState::run agreed on the group's state once: until then the
  // workers' variables (created without the chief's broadcast) and a
  // LibTorch module's values differ, so no step may run.
  bool state_agreed = false;
  // What distribute() made on this worker: rows, global batch, seed, flags
  // (shuffle 1, drop_remainder 2), and the digests of the features and the
  // labels (dataset_digest). The members of a group must agree, or they
  // would train on other rows or other values (ElasticState::run checks).
  std::vector<std::array<int64_t, 6>> datasets;
};

struct MultiWorkerMirroredStrategy::Impl {
  // Timeline lanes: 0 = communication thread, 1 + l = local replica l.
  static constexpr int kStepLane = 1000;
  static constexpr int kStragglerLane = 1001;

  MultiWorkerMirroredStrategy* self;
  MultiWorkerOptions options;
  ResolvedCluster cluster;
  ProcessCommunicators comms;
  Communicator* cross = nullptr;
  int first_local = 0;
  int total_replicas = 1;
  std::string timeline_path;
  std::unique_ptr<Timeline> timeline;
  std::unique_ptr<LocalReplicas> replicas;
  std::unique_ptr<FusionEngine> engine;
  std::vector<std::unique_ptr<MultiWorkerReplicaContext>> contexts;
  int64_t steps = 0;
  // Added to the Strategy::run index to give the step every rank of the
  // group agrees on (the call signatures compare it): 0 in a fixed group; in
  // an elastic one, set when a group agrees on its state, so that members
  // that ran different numbers of steps (a joiner, survivors of a failed
  // step) number the group's next step alike (ElasticState::run).
  int64_t step_offset = 0;
  // std::uncaught_exceptions() when the strategy was made: more at
  // destruction = destroyed during stack unwinding.
  int uncaught_at_construction = std::uncaught_exceptions();
  // The first error of a local replica (run_replicas), for the reason the
  // destructor gives the peers.
  std::string last_error;
  std::mutex error_mu;

  std::unique_ptr<ElasticRuntime> elastic;  // null unless options.elastic.enabled()
  // GPU gradients across processes through NCCL (device_reduction.h); null:
  // host staging (`host_staged_reason` says why). Declared last: destroyed
  // first, after the engine's thread (the destructor joins it) is gone.
  std::string host_staged_reason;
  std::unique_ptr<DeviceReduction> device;

  int rank() const { return cross->rank(); }

  // The cluster of a group given as a communicator (or an elastic group):
  // `size` workers, this one `rank`, one node each.
  void set_explicit_cluster(int rank, int size);
  // Numbers the replicas over the workers of `cross` (collective): sets
  // first_local and total_replicas; returns every worker's local count.
  std::vector<int64_t> number_replicas(int64_t mine);
  // Makes the fusion engine over `cross`.
  void start_engine();
  // Elastic: joins the next group through the rendezvous (the first one when
  // this worker has none) and connects to it: comms, cross, cluster (not the
  // engine or the numbering). Blocks until `deadline`.
  void join_group(std::chrono::steady_clock::time_point deadline);
  // Elastic: leaves the current group: the engine and the communicator fail
  // what is in flight with AbortedError(reason) (peers see the connections
  // close) and are destroyed.
  void leave_group(const std::string& reason);
  // Elastic: the hook at the start of every Strategy::run (the commit and
  // the chief's look for joiners).
  void before_step();

  // Concatenates every worker's `local` along axis 0 (row counts may differ).
  // Runs on the communication thread via engine->run.
  Tensor cross_gather(const Tensor& local, const std::string& name);
  // Gathers every rank's timeline events; rank 0 writes the merged file.
  void write_timeline();
};

// The update of this replica's copies with reduced gradients: grads[j] for
// variable grads_and_vars[order[j]] (apply_gradients after its all-reduce,
// apply_reduced_gradients directly); `t0` when the reduction began (the
// timeline's "wait for gradients").
void update_local_copies(MultiWorkerMirroredStrategy::Impl& m, ReplicaContext& ctx,
                         Optimizer& optimizer,
                         const std::vector<std::pair<Tensor, Variable>>& grads_and_vars,
                         const std::vector<size_t>& order, const std::vector<Tensor>& grads,
                         Timeline::Clock::time_point t0);

// ElasticState::run, when a group forms (elastic_agreement.cc; collective):
// the members compare the data they distributed and
// `optimizer_settings` ((name, value) pairs: the optimizers' configuration
// and what ElasticState::agree_on added) with the member whose state the
// group takes (`source`, when steps[source] >= 0) or, in a group without
// state, with the settings most members hold. A member that differs throws
// InvalidArgumentError naming the field and both values and leaves; the
// others throw AbortedError and re-form without it.
void agree_on_settings(MultiWorkerMirroredStrategy::Impl& m, const std::vector<int64_t>& steps,
                       int source,
                       const std::vector<std::pair<std::string, std::string>>& optimizer_settings);

}  // namespace diststrat
