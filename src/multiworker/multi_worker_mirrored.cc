// MultiWorkerMirroredStrategy's set-up and teardown: the cluster and the
// process communicators (given, or made collectively with every rank failing
// alike), the replica numbering, the timeline, the fusion engine; on the way
// out the peers told why this rank left, and the merged timeline written.
#include <algorithm>
#include <cstring>
#include <optional>

#include "allreduce/flight_recording.h"
#include "allreduce/hierarchical.h"
#include "core/env.h"
#include "diststrat/cpu_isa.h"
#include "multiworker/multi_worker_impl.h"
#include "nn/nn_kernels.h"
#include "runtime/determinism.h"
#include "runtime/data_digest.h"

namespace diststrat {

MultiWorkerMirroredStrategy::MultiWorkerMirroredStrategy(MultiWorkerOptions options)
    : Strategy(options.log_level, "[multi_worker]"), impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.self = this;
  if (options.devices.empty()) options.devices = {Device::cpu(0)};
  resolve_replica_devices(options.devices, options.device_manager, "MultiWorkerMirroredStrategy");
  check_determinism_options(options.determinism, options.communication,
                            "MultiWorkerMirroredStrategy");
  const Algorithm algo = options.communication.algorithm;
  const bool allow_hier = algo == Algorithm::kAuto || algo == Algorithm::kHierarchical;

  if (options.elastic.enabled()) {
    DISTSTRAT_CHECK(!options.communicator && options.cluster.spec.jobs.empty(), kInvalidArgument,
                    "MultiWorkerMirroredStrategy: elastic training forms its groups through the "
                    "rendezvous ",
                    options.elastic.rendezvous, "; do not also give a communicator or a cluster");
    m.options = options;
    m.elastic = std::make_unique<ElasticRuntime>(options.elastic, options.communication);
    m.join_group(std::chrono::steady_clock::now() + options.elastic.join_timeout);
  } else if (options.communicator) {
    Communicator* c = options.communicator;
    // The given communicator runs its own algorithm; a different one asked
    // for here would be silently ignored.
    DISTSTRAT_CHECK(algo == Algorithm::kAuto || algo == c->options().algorithm, kInvalidArgument,
                    "MultiWorkerMirroredStrategy: options.communication.algorithm '",
                    algorithm_name(algo), "' differs from the given communicator's '",
                    algorithm_name(c->options().algorithm),
                    "', which decides; build the communicator with the algorithm you want");
    m.set_explicit_cluster(c->rank(), c->size());
    Placement& p = m.cluster.placement;
    if (options.node_communicator && options.cross_node_communicator) {
      p.local_rank = options.node_communicator->rank();
      p.local_size = options.node_communicator->size();
      p.node = options.cross_node_communicator->rank();
      p.num_nodes = options.cross_node_communicator->size();
      if (allow_hier && p.num_nodes > 1 && p.local_size > 1) {
        m.comms.cross = std::make_unique<HierarchicalCommunicator>(c, options.node_communicator,
                                                                   options.cross_node_communicator);
        m.comms.hierarchical = true;
      }
    }
    // Recorded like the strategy's own communicators (flight recorder,
    // straggler detection); the given one stays the caller's.
    m.comms.cross = m.comms.cross ? wrap_recorded(std::move(m.comms.cross), "world")
                                  : std::make_unique<RecordingCommunicator>(
                                        *c, "world", RecordingCommunicator::Options{});
    m.cross = m.comms.cross.get();
  } else {
    // Set-up is collective: a rank that fails it makes every rank fail,
    // naming it, within the deadline (resolve_cluster and agree_on_setup),
    // instead of leaving the others in make_process_communicators.
    const std::chrono::milliseconds timeout = options.communication.timeout;
    env::check_timeout(timeout, "MultiWorkerMirroredStrategy: communication.timeout");
    m.cluster = resolve_cluster(options.cluster, timeout);
    std::exception_ptr error;
    try {
      const std::string& type = m.cluster.info.task_type;
      DISTSTRAT_CHECK(type == "chief" || type == "worker", kInvalidArgument,
                      "MultiWorkerMirroredStrategy: this process is task ", type, "[",
                      m.cluster.info.task_index,
                      "]; only chief and worker tasks run replicas (use ParameterServerStrategy "
                      "for ps, run evaluators separately)");
      DISTSTRAT_CHECK(m.cluster.spec.num_tasks("ps") == 0, kInvalidArgument,
                      "MultiWorkerMirroredStrategy: the cluster has ps tasks; use "
                      "ParameterServerStrategy");
    } catch (...) {
      error = std::current_exception();
    }
    agree_on_setup("MultiWorkerMirroredStrategy set-up", error, timeout);
    m.comms = make_process_communicators(m.cluster, options.communication, allow_hier);
    m.cross = m.comms.cross.get();
  }
  DISTSTRAT_CHECK_EQ(m.cross->rank(), m.cluster.info.worker_index,
                     "MultiWorkerMirroredStrategy: communicator rank vs worker index");
  const int n = m.cross->size();
  const int64_t mine = static_cast<int64_t>(options.devices.size());
  // (An elastic group numbered its replicas when it formed.)
  const std::vector<int64_t> counts =
      m.elastic ? std::vector<int64_t>(static_cast<size_t>(n), mine) : m.number_replicas(mine);
  if (!m.elastic && n > 1) {
    // One CPU kernel variant on every rank, the lowest of the job, so that
    // hosts with different CPUs update bit-identically (diststrat/cpu_isa.h).
    // (An elastic group does not: a joiner may come with a lower CPU later.)
    int64_t isa = static_cast<int64_t>(cpu_isa());
    m.cross->all_reduce(&isa, 1, ReduceOp::kMin, "cpu kernel variant");
    limit_cpu_isa(static_cast<CpuIsa>(isa));
  }

  const std::optional<std::string> env_timeline = env::text("DISTSTRAT_TIMELINE");
  m.timeline_path = env_timeline.value_or(options.timeline_path);
  if (!m.timeline_path.empty()) {
    // Written only when the strategy goes: a path that cannot be written
    // fails now, not after the job's work is done.
    Timeline::check_path(m.timeline_path, "rank " + std::to_string(m.cross->rank()) + ": " +
                                              (env_timeline ? "DISTSTRAT_TIMELINE"
                                                            : "MultiWorkerOptions::timeline_path"));
    m.timeline = std::make_unique<Timeline>(m.cross->rank());
    m.timeline->enable(true);
    for (size_t l = 0; l < options.devices.size(); ++l) {
      m.timeline->name_thread(1 + static_cast<int>(l), "replica " + std::to_string(l));
    }
    m.timeline->name_thread(Impl::kStepLane, "steps");
    m.timeline->name_thread(Impl::kStragglerLane, "stragglers");
  }
  if (auto* recorded = dynamic_cast<RecordingCommunicator*>(m.cross)) {
    recorded->set_logger(&logger());
    recorded->set_timeline(m.timeline.get(), Impl::kStragglerLane);
  }
  if (options.shard_optimizer_state) {
    // Every rank has the counts, so every rank throws alike.
    for (int r = 0; r < n; ++r) {
      DISTSTRAT_CHECK(counts[r] == mine, kUnimplemented, "rank ", m.cross->rank(),
                      ": MultiWorkerMirroredStrategy shard_optimizer_state (ZeRO-1) with ", mine,
                      " local replicas here and ", counts[r], " on worker ", r,
                      "; every worker needs the same number of local replicas");
    }
  }
  m.options = options;
  m.replicas = std::make_unique<LocalReplicas>(this, options.devices, options.communication,
                                               options.device_manager);
  // Before the engine starts: its thread owns `cross` afterwards.
  m.device = DeviceReduction::create(*m.cross, options.devices, options, m.total_replicas,
                                     &m.host_staged_reason);
  m.start_engine();
  enable_determinism(options.determinism, "MultiWorkerMirroredStrategy");
  if (options.determinism.enabled()) nn::pin_gemm_blocking();
  for (size_t l = 0; l < options.devices.size(); ++l) {
    m.contexts.push_back(
        std::make_unique<MultiWorkerReplicaContext>(impl_.get(), static_cast<int>(l)));
  }
  logger_.info("MultiWorkerMirroredStrategy: worker ", m.cross->rank(), " of ", n,
               " (cluster from ", cluster_source_name(m.cluster.source), "), ",
               options.devices.size(), " local replica(s), ", m.total_replicas, " in sync, node ",
               m.cluster.placement.node, " of ", m.cluster.placement.num_nodes,
               m.comms.hierarchical ? ", hierarchical" : "",
               m.elastic ? ", elastic (group " + std::to_string(m.elastic->view.group) + ")" : "");
  if (!m.host_staged_reason.empty() && m.host_staged_reason != "the replicas are CPUs") {
    logger_.info("MultiWorkerMirroredStrategy: worker ", m.cross->rank(),
                 ": GPU gradients staged through host memory: ", m.host_staged_reason);
  } else if (m.device) {
    logger_.info("MultiWorkerMirroredStrategy: worker ", m.cross->rank(),
                 ": GPU gradients reduced across processes by NCCL");
  }
  // A line of its own: scripts (and the cluster tests) read the line above
  // to its end.
  logger_.info("MultiWorkerMirroredStrategy: worker ", m.cross->rank(), ": cpu kernels ",
               cpu_isa_name(cpu_isa()));
}

void MultiWorkerMirroredStrategy::Impl::set_explicit_cluster(int rank, int size) {
  cluster = ResolvedCluster{};
  cluster.source = ClusterSource::kExplicit;
  ClusterSpec& spec = cluster.spec;
  for (int r = 0; r < size; ++r) {
    spec.jobs["worker"].push_back("worker" + std::to_string(r) + ":" + std::to_string(r + 1));
  }
  spec.task_index = rank;
  cluster.info = spec.info();
  Placement& p = cluster.placement;
  p.rank = rank;
  p.world_size = size;
  p.node = rank;
  p.num_nodes = size;
}

std::vector<int64_t> MultiWorkerMirroredStrategy::Impl::number_replicas(int64_t mine) {
  // Replica numbering: workers in rank order, each with its local devices.
  const int n = cross->size();
  std::vector<int64_t> counts(n, mine);
  if (n > 1) cross->all_gather(&mine, counts.data(), 1, DType::kInt64, "local replica counts");
  first_local = 0;
  total_replicas = 0;
  for (int r = 0; r < n; ++r) {
    if (r < cross->rank()) first_local += static_cast<int>(counts[r]);
    total_replicas += static_cast<int>(counts[r]);
  }
  return counts;
}

void MultiWorkerMirroredStrategy::Impl::start_engine() {
  engine = std::make_unique<FusionEngine>(*cross, static_cast<int>(options.devices.size()),
                                          total_replicas, options.communication, timeline.get());
}

void MultiWorkerMirroredStrategy::Impl::write_timeline() {
  if (!timeline) return;
  const std::string mine = timeline->events_json();
  const int n = cross->size();
  std::vector<std::string> all{mine};
  if (n > 1) {
    all.assign(n, "");
    engine->run(
        [&](Communicator& c) {
          int64_t len = static_cast<int64_t>(mine.size());
          std::vector<int64_t> lens(n);
          c.all_gather(&len, lens.data(), 1, DType::kInt64, "timeline/lengths");
          const size_t words =
              static_cast<size_t>(*std::max_element(lens.begin(), lens.end()) + 7) / 8;
          std::vector<int64_t> padded(words, 0), gathered(words * n);
          std::memcpy(padded.data(), mine.data(), mine.size());
          c.all_gather(padded.data(), gathered.data(), words, DType::kInt64, "timeline/events");
          for (int r = 0; r < n; ++r) {
            all[r].assign(reinterpret_cast<const char*>(gathered.data() + r * words),
                          static_cast<size_t>(lens[r]));
          }
        },
        "timeline gather");
  }
  if (rank() == 0) Timeline::write_file(timeline_path, all);
}

namespace {
// From the destructor: nothing may escape, but a lost timeline is said
// (the error names the path and the errno).
void write_own_timeline(const Logger& logger, const Timeline& timeline, const std::string& path) {
  try {
    Timeline::write_file(path, {timeline.events_json()});
  } catch (const std::exception& e) {
    logger.warning("timeline: could not write ", path, "; this rank's events are lost: ", e.what());
  }
}
}  // namespace

MultiWorkerMirroredStrategy::~MultiWorkerMirroredStrategy() {
  // Destroyed while an exception propagates (a step, a data loader or the
  // caller's own code failed): the peers are not coming to a collective
  // with this rank any more. Nothing here waits for them, so the error
  // reaches the caller's catch at once; the communicators tell the peers
  // (their destructors, see ShmCommunicator).
  const bool unwinding = std::uncaught_exceptions() > impl_->uncaught_at_construction;
  if (!impl_->cross) return;  // an elastic worker whose last re-forming failed: nothing to tell
  if (unwinding && impl_->engine) {
    const std::string reason =
        "rank " + std::to_string(impl_->rank()) + " left the group during an exception" +
        (impl_->last_error.empty() ? std::string(" (its own error is in its output)")
                                   : ": " + impl_->last_error);
    impl_->engine->abort_if_pending(reason);
    // The communicators this strategy made: a collective in flight on the
    // communication thread fails now (so the join below does not wait for
    // it), and the peers learn the reason (the shared-memory abort word).
    if (impl_->comms.cross && !impl_->options.communicator) impl_->comms.cross->abort(reason);
    if (impl_->device) impl_->device->abort(reason);
  }
  if (impl_->timeline && !unwinding) {
    try {
      impl_->write_timeline();
    } catch (const std::exception& e) {
      // A peer is gone: keep this rank's events in a file of its own.
      const std::string path = impl_->timeline_path + ".rank" + std::to_string(impl_->rank());
      logger_.warning("timeline: writing the merged ", impl_->timeline_path, " failed (", e.what(),
                      "); writing ", path);
      write_own_timeline(logger_, *impl_->timeline, path);
    }
  } else if (impl_->timeline) {
    write_own_timeline(logger_, *impl_->timeline,
                       impl_->timeline_path + ".rank" + std::to_string(impl_->rank()));
  }
  impl_->engine.reset();  // joins the communication thread before the communicators go
}

int MultiWorkerMirroredStrategy::num_replicas_in_sync() const { return impl_->total_replicas; }
bool MultiWorkerMirroredStrategy::replicas_may_change() const { return elastic(); }

void MultiWorkerMirroredStrategy::note_distributed(const Dataset& dataset, int64_t global_batch,
                                                   const DistributeOptions& options) {
  if (!impl_->elastic) return;
  const DatasetDigest digest = dataset_digest(dataset);
  impl_->elastic->datasets.push_back(
      {dataset.size(), global_batch, static_cast<int64_t>(options.seed),
       (options.shuffle ? 1 : 0) | (options.drop_remainder ? 2 : 0),
       static_cast<int64_t>(digest.features), static_cast<int64_t>(digest.labels)});
}
bool MultiWorkerMirroredStrategy::elastic() const { return impl_->elastic != nullptr; }
bool MultiWorkerMirroredStrategy::uses_nccl() const { return impl_->device != nullptr; }
int64_t MultiWorkerMirroredStrategy::membership_group() const {
  return impl_->elastic ? impl_->elastic->view.group : 0;
}
const std::vector<Device>& MultiWorkerMirroredStrategy::devices() const {
  return impl_->replicas->devices();
}
int MultiWorkerMirroredStrategy::first_local_replica() const { return impl_->first_local; }
const Placement& MultiWorkerMirroredStrategy::placement() const { return impl_->cluster.placement; }
bool MultiWorkerMirroredStrategy::hierarchical() const { return impl_->comms.hierarchical; }

StragglerReport MultiWorkerMirroredStrategy::straggler_report() const {
  const auto* recorded = dynamic_cast<const RecordingCommunicator*>(impl_->cross);
  return recorded ? recorded->straggler_report() : StragglerReport{};
}

ClusterInfo MultiWorkerMirroredStrategy::cluster() const {
  ClusterInfo i = impl_->cluster.info;
  i.num_workers = impl_->cross->size();
  i.worker_index = impl_->cross->rank();
  return i;
}

MultiWorkerStats MultiWorkerMirroredStrategy::stats() const {
  const FusionStats f = impl_->engine->stats();
  return MultiWorkerStats{f.calls, f.packs, f.bytes, f.buffer_allocations, f.device_packs};
}

void MultiWorkerMirroredStrategy::write_timeline() { impl_->write_timeline(); }

void MultiWorkerMirroredStrategy::inject_corruption(ReplicaContext&, int64_t) {
  impl_->engine->corrupt_next_signature();
}

}  // namespace diststrat
