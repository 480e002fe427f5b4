#include "diststrat/multi_worker_mirrored.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>

#include "allreduce/reduce_kernels.h"
#include "runtime/collective_check.h"
#include "core/fnv1a.h"
#include "core/env.h"
#include "core/timeline.h"
#include "diststrat/optimizer.h"
#include "runtime/local_replicas.h"
#include "multiworker/fusion.h"
#include "allreduce/hierarchical.h"
#include "runtime/process_group.h"

namespace diststrat {

namespace {

using Clock = Timeline::Clock;

// Timeline lanes: 0 = communication thread, 1 + l = local replica l.
constexpr int kStepLane = 1000;

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

}  // namespace

struct MultiWorkerMirroredStrategy::Impl {
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
  // std::uncaught_exceptions() when the strategy was made: more at
  // destruction = destroyed during stack unwinding.
  int uncaught_at_construction = std::uncaught_exceptions();
  // The first error of a local replica (run_replicas), for the reason the
  // destructor gives the peers.
  std::string last_error;
  std::mutex error_mu;

  int rank() const { return cross->rank(); }

  // Concatenates every worker's `local` along axis 0 (row counts may differ).
  // Runs on the communication thread via engine->run.
  Tensor cross_gather(const Tensor& local, const std::string& name) {
    DISTSTRAT_CHECK(local.shape().rank() >= 1, kInvalidArgument, "rank ", rank(), ": gather '",
                    name, "' of a scalar: reshape to [1]");
    const int n = cross->size();
    if (n == 1) return local;
    Tensor out;
    engine->run(
        [&](Communicator& c) {
          int64_t rows = local.shape()[0];
          std::vector<int64_t> all_rows(n);
          c.all_gather(&rows, all_rows.data(), 1, DType::kInt64, name + "/rows");
          const int64_t max_rows = *std::max_element(all_rows.begin(), all_rows.end());
          int64_t row_elems = 1;
          for (size_t i = 1; i < local.shape().rank(); ++i) row_elems *= local.shape()[i];
          const size_t esz = dtype_size(local.dtype());
          const size_t padded = static_cast<size_t>(max_rows * row_elems);
          std::vector<char> mine(padded * esz), gathered(padded * esz * n);
          if (local.nbytes()) std::memcpy(mine.data(), local.data(), local.nbytes());
          c.all_gather(mine.data(), gathered.data(), padded, local.dtype(), name);
          std::vector<int64_t> dims = local.shape().dims();
          dims[0] = 0;
          for (int64_t r : all_rows) dims[0] += r;
          out = Tensor(Shape(dims), local.dtype());
          char* dst = static_cast<char*>(out.data());
          for (int r = 0; r < n; ++r) {
            const size_t bytes = static_cast<size_t>(all_rows[r] * row_elems) * esz;
            if (bytes) std::memcpy(dst, gathered.data() + r * padded * esz, bytes);
            dst += bytes;
          }
        },
        "all_gather '" + name + "'");
    return out;
  }

  void write_timeline() {
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
};

namespace {

int MultiWorkerReplicaContext::replica_id() const { return impl_->first_local + local_; }
int MultiWorkerReplicaContext::num_replicas_in_sync() const { return impl_->total_replicas; }
const Device& MultiWorkerReplicaContext::device() const {
  return impl_->replicas->devices()[local_];
}
Strategy& MultiWorkerReplicaContext::strategy() const { return *impl_->self; }
LocalReplicaContext& MultiWorkerReplicaContext::inner() const {
  return impl_->replicas->context(local_);
}

Work MultiWorkerReplicaContext::all_reduce_async(ReduceOp op, std::vector<Tensor> tensors,
                                                 std::vector<std::string> names) {
  try {
    check_replica_tensors(*this, "all_reduce", tensors, names);
  } catch (...) {
    return Work::completed(std::current_exception());
  }
  const bool on_gpu = std::any_of(tensors.begin(), tensors.end(),
                                  [](const Tensor& t) { return t.device().is_gpu(); });
  if (!on_gpu)
    return impl_->engine->all_reduce_async(local_, op, std::move(tensors), std::move(names));
  // GPU tensors: staged through host memory (copies on this replica's
  // stream), reduced by the fusion engine like host tensors, copied back.
  // Completes before returning, so no overlap with later device work.
  std::vector<Tensor> host = tensors;
  for (Tensor& h : host) stage_to_host(h);
  impl_->engine->all_reduce_async(local_, op, host, std::move(names)).wait();
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].copy_from(host[i]);
  return Work::completed();
}

Tensor MultiWorkerReplicaContext::all_gather(const Tensor& t, const std::string& name) {
  // In-process first (rows ordered by local replica = by replica id), then
  // across workers once per process.
  const Tensor local = inner().all_gather(t, name);
  if (local.device().is_cpu()) {
    return merge_call([&](Strategy&) { return impl_->cross_gather(local, name); });
  }
  Tensor host = local;
  stage_to_host(host);
  const Tensor all = merge_call([&](Strategy&) { return impl_->cross_gather(host, name); });
  Tensor out(all.shape(), all.dtype(), local.device());
  out.copy_from(all);
  return out;
}

void MultiWorkerReplicaContext::barrier(const std::string& name) {
  merge_call([&](Strategy&) {
    impl_->engine->run([&](Communicator& c) { c.barrier(name); }, "barrier '" + name + "'");
  });
}

std::shared_ptr<void> MultiWorkerReplicaContext::merge_call_impl(
    const std::function<std::shared_ptr<void>(Strategy&)>& fn) {
  return inner().merge_call(fn);
}

}  // namespace

MultiWorkerMirroredStrategy::MultiWorkerMirroredStrategy(MultiWorkerOptions options)
    : Strategy(options.log_level, "[multi_worker]"), impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.self = this;
  if (options.devices.empty()) options.devices = {Device::cpu(0)};
  resolve_replica_devices(options.devices, options.device_manager, "MultiWorkerMirroredStrategy");
  const Algorithm algo = options.communication.algorithm;
  const bool allow_hier = algo == Algorithm::kAuto || algo == Algorithm::kHierarchical;

  if (options.communicator) {
    Communicator* c = options.communicator;
    // The given communicator runs its own algorithm; a different one asked
    // for here would be silently ignored.
    DISTSTRAT_CHECK(algo == Algorithm::kAuto || algo == c->options().algorithm, kInvalidArgument,
                    "MultiWorkerMirroredStrategy: options.communication.algorithm '",
                    algorithm_name(algo), "' differs from the given communicator's '",
                    algorithm_name(c->options().algorithm),
                    "', which decides; build the communicator with the algorithm you want");
    m.cluster.source = ClusterSource::kExplicit;
    ClusterSpec& spec = m.cluster.spec;
    for (int r = 0; r < c->size(); ++r) {
      spec.jobs["worker"].push_back("worker" + std::to_string(r) + ":" + std::to_string(r + 1));
    }
    spec.task_index = c->rank();
    m.cluster.info = spec.info();
    Placement& p = m.cluster.placement;
    p.rank = c->rank();
    p.world_size = c->size();
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
    } else {
      p.node = p.rank;
      p.num_nodes = p.world_size;
    }
    m.cross = m.comms.cross ? m.comms.cross.get() : c;
  } else {
    // Set-up is collective: a rank that fails it makes every rank fail,
    // naming it, within the deadline (resolve_cluster and agree_on_setup),
    // instead of leaving the others in make_process_communicators.
    const std::chrono::milliseconds timeout = options.communication.timeout;
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

  // Replica numbering: workers in rank order, each with its local devices.
  const int n = m.cross->size();
  int64_t mine = static_cast<int64_t>(options.devices.size());
  std::vector<int64_t> counts(n, mine);
  if (n > 1) m.cross->all_gather(&mine, counts.data(), 1, DType::kInt64, "local replica counts");
  m.total_replicas = 0;
  for (int r = 0; r < n; ++r) {
    if (r < m.cross->rank()) m.first_local += static_cast<int>(counts[r]);
    m.total_replicas += static_cast<int>(counts[r]);
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
    m.timeline->name_thread(kStepLane, "steps");
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
  m.engine =
      std::make_unique<FusionEngine>(*m.cross, static_cast<int>(options.devices.size()),
                                     m.total_replicas, options.communication, m.timeline.get());
  for (size_t l = 0; l < options.devices.size(); ++l) {
    m.contexts.push_back(
        std::make_unique<MultiWorkerReplicaContext>(impl_.get(), static_cast<int>(l)));
  }
  logger_.info("MultiWorkerMirroredStrategy: worker ", m.cross->rank(), " of ", n,
               " (cluster from ", cluster_source_name(m.cluster.source), "), ",
               options.devices.size(), " local replica(s), ", m.total_replicas, " in sync, node ",
               m.cluster.placement.node, " of ", m.cluster.placement.num_nodes,
               m.comms.hierarchical ? ", hierarchical" : "");
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
const std::vector<Device>& MultiWorkerMirroredStrategy::devices() const {
  return impl_->replicas->devices();
}
int MultiWorkerMirroredStrategy::first_local_replica() const { return impl_->first_local; }
const Placement& MultiWorkerMirroredStrategy::placement() const { return impl_->cluster.placement; }
bool MultiWorkerMirroredStrategy::hierarchical() const { return impl_->comms.hierarchical; }

ClusterInfo MultiWorkerMirroredStrategy::cluster() const {
  ClusterInfo i = impl_->cluster.info;
  i.num_workers = impl_->cross->size();
  i.worker_index = impl_->cross->rank();
  return i;
}

MultiWorkerStats MultiWorkerMirroredStrategy::stats() const {
  const FusionStats f = impl_->engine->stats();
  return MultiWorkerStats{f.calls, f.packs, f.bytes, f.buffer_allocations};
}

void MultiWorkerMirroredStrategy::write_timeline() { impl_->write_timeline(); }

void MultiWorkerMirroredStrategy::inject_corruption(ReplicaContext&, int64_t) {
  impl_->engine->corrupt_next_signature();
}

void MultiWorkerMirroredStrategy::run_replicas(const std::function<void(ReplicaContext&)>& fn) {
  Impl& m = *impl_;
  const auto t0 = Clock::now();
  m.replicas->run([&](ReplicaContext& inner) {
    const int l = inner.local_replica_id();
    try {
      fn(*m.contexts[l]);
    } catch (const AbortedError&) {
      throw;
    } catch (const std::exception& e) {
      // The other local replicas may be waiting on a call this one never
      // completes: fail those calls now (their wait() throws AbortedError).
      const std::string reason = "rank " + std::to_string(m.rank()) + ": local replica " +
                                 std::to_string(l) + " failed: " + e.what();
      {
        std::lock_guard<std::mutex> lock(m.error_mu);
        if (m.last_error.empty()) m.last_error = reason;
      }
      m.engine->abort_if_pending(reason);
      throw;
    }
  });
  if (m.timeline) {
    m.timeline->complete("step " + std::to_string(m.steps), "step", kStepLane, t0, Clock::now());
  }
  ++m.steps;
}

void MultiWorkerMirroredStrategy::place_variable(Variable::Impl& var, const Initializer& init) {
  Tensor initial(var.shape, var.dtype);
  init(initial);
  // Worker 0 (the chief) decides the initial value for everyone.
  if (impl_->cross->size() > 1) broadcast(initial, 0, var.name + "/initial value");
  impl_->replicas->place_copies(var, initial);
}

std::shared_ptr<DeviceManager> MultiWorkerMirroredStrategy::device_manager() const {
  return impl_->replicas->gpus();
}

void MultiWorkerMirroredStrategy::update(Variable& var, const std::function<void(Tensor&)>& fn) {
  impl_->replicas->for_each_copy(var.impl().copies, fn);
}

Tensor MultiWorkerMirroredStrategy::variable_value(const Variable::Impl& var) const {
  const bool aggregated = var.options.synchronization == VariableSynchronization::kOnRead &&
                          var.options.aggregation != VariableAggregation::kNone &&
                          var.options.aggregation != VariableAggregation::kOnlyFirstReplica;
  if (aggregated || var.copies.empty() || var.copies[0].device().is_cpu()) {
    return Strategy::variable_value(var);  // reduce_tensors_across stages GPU copies
  }
  return impl_->replicas->to_host(var.copies[0]);
}

void MultiWorkerMirroredStrategy::assign_variable(Variable::Impl& var, const Tensor& value) {
  DISTSTRAT_CHECK(value.shape() == var.shape && value.dtype() == var.dtype, kInvalidArgument,
                  "rank ", impl_->rank(), ": assign to variable '", var.name, "' ",
                  dtype_name(var.dtype), var.shape.to_string(), " from ", value.debug_string());
  impl_->replicas->for_each_copy(var.copies, [&](Tensor& c) { c.copy_from(value); });
}

void MultiWorkerMirroredStrategy::broadcast(Tensor& t, int root_worker, const std::string& name) {
  Impl& m = *impl_;
  DISTSTRAT_CHECK(0 <= root_worker && root_worker < m.cross->size(), kInvalidArgument, "rank ",
                  m.rank(), ": broadcast '", name, "' from worker ", root_worker, " of ",
                  m.cross->size());
  if (m.cross->size() == 1) return;
  // A GPU tensor is broadcast through a host copy.
  Tensor host = t.device().is_gpu() ? m.replicas->to_host(t) : t;
  m.engine->run(
      [&](Communicator& c) {
        c.broadcast(host.data(), static_cast<size_t>(host.num_elements()), host.dtype(),
                    root_worker, name);
      },
      "broadcast '" + name + "'");
  if (t.device().is_gpu()) {
    ScopedExec scoped(m.replicas->scope(m.replicas->replica_of(t.device()), /*with_stream=*/false));
    t.copy_from(host);
  }
}

void MultiWorkerMirroredStrategy::barrier(const std::string& name) {
  impl_->engine->run([&](Communicator& c) { c.barrier(name); }, "barrier '" + name + "'");
}

double MultiWorkerMirroredStrategy::reduce_across(ReduceOp op, const std::vector<double>& local) {
  DISTSTRAT_CHECK(!local.empty(), kInvalidArgument, "reduce of no values");
  const ReduceOp sum_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  std::vector<const void*> srcs;
  for (const double& v : local) srcs.push_back(&v);
  double acc = 0;
  kernels::reduce(&acc, srcs.data(), static_cast<int>(srcs.size()), 1, DType::kFloat64, sum_op, 1);
  if (impl_->cross->size() > 1) {
    impl_->engine->run(
        [&](Communicator& c) {
          c.all_reduce(&acc, &acc, 1, DType::kFloat64, sum_op, "strategy.reduce");
        },
        "strategy.reduce");
  }
  if (op == ReduceOp::kMean) acc /= num_replicas_in_sync();
  return acc;
}

Tensor MultiWorkerMirroredStrategy::reduce_tensors_across(ReduceOp op,
                                                          const std::vector<Tensor>& local) {
  DISTSTRAT_CHECK(!local.empty(), kInvalidArgument, "reduce of no tensors");
  const ReduceOp sum_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  Tensor out = Strategy::reduce_tensors_across(sum_op, impl_->replicas->to_host(local));
  const size_t count = static_cast<size_t>(out.num_elements());
  if (impl_->cross->size() > 1) {
    impl_->engine->run(
        [&](Communicator& c) {
          c.all_reduce(out.data(), out.data(), count, out.dtype(), sum_op, "strategy.reduce");
        },
        "strategy.reduce");
  }
  if (op == ReduceOp::kMean)
    kernels::scale_mean(out.data(), count, out.dtype(), num_replicas_in_sync());
  return out;
}

Tensor MultiWorkerMirroredStrategy::gather_across(const std::vector<Tensor>& local) {
  return impl_->cross_gather(Strategy::gather_across(impl_->replicas->to_host(local)), "gather");
}

void MultiWorkerMirroredStrategy::apply_gradients(
    ReplicaContext& ctx, Optimizer& optimizer,
    const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) {
  Impl& m = *impl_;
  const int local = ctx.local_replica_id();
  if (m.options.shard_optimizer_state) {
    // ZeRO-1 through the fusion engine (Optimizer::apply_sharded). The
    // flat vector's layout (the variables in creation order, their names and
    // sizes) is in the collective's name, which the call signature checks:
    // workers passing other variables of the same total size (or creating
    // them in another order) fail alike instead of mixing their state.
    std::vector<const Variable*> layout;
    for (const auto& gv : grads_and_vars) layout.push_back(&gv.second);
    std::stable_sort(layout.begin(), layout.end(), [](const Variable* a, const Variable* b) {
      return a->impl().creation_index < b->impl().creation_index;
    });
    Fnv1a h;
    for (const Variable* v : layout) {
      h.text(v->name());
      h.value<int64_t>(v->shape().num_elements());
    }
    std::ostringstream what;
    what << "sharded gradients of " << layout.size() << " variable(s)";
    if (!layout.empty())
      what << " '" << layout.front()->name() << "'..'" << layout.back()->name() << "'";
    what << " (layout " << std::hex << h.get() << ")";
    const std::string scatter_name = what.str();
    ShardedCollectives c;
    // The engine reduces host memory: GPU replicas' buffers are staged
    // through the host, as their all-reduce is.
    const auto staged = [&](const Tensor& in, Tensor& out,
                            const std::function<void(const Tensor&, Tensor&)>& op) {
      if (in.device().is_cpu() && out.device().is_cpu()) {
        op(in, out);
        return;
      }
      Tensor host_in(in.shape(), in.dtype()), host_out(out.shape(), out.dtype());
      host_in.copy_from(in);
      op(host_in, host_out);
      out.copy_from(host_out);
    };
    c.reduce_scatter = [&](const Tensor& in, Tensor& out) {
      staged(in, out, [&](const Tensor& i, Tensor& o) {
        m.engine->reduce_scatter_async(local, ReduceOp::kSum, i, o, scatter_name).wait();
      });
    };
    c.all_gather = [&](const Tensor& in, Tensor& out) {
      staged(in, out, [&](const Tensor& i, Tensor& o) {
        m.engine->all_gather_async(local, i, o, "sharded variables").wait();
      });
    };
    c.sum = [&](double v) {
      Tensor host(Shape{1}, DType::kFloat64);
      host.data<double>()[0] = v;
      // The replica's all-reduce takes tensors on its device.
      std::vector<Tensor> t{ctx.device().is_gpu() ? Tensor(Shape{1}, DType::kFloat64, ctx.device())
                                                  : host};
      if (ctx.device().is_gpu()) t[0].copy_from(host);
      ctx.all_reduce(ReduceOp::kSum, t, {"sharded gradient norm"});
      if (ctx.device().is_gpu()) host.copy_from(t[0]);
      return host.data<double>()[0];
    };
    optimizer.apply_sharded(ctx, grads_and_vars, c);
    return;
  }
  // Reverse creation order: the order backprop produces gradients in, so the
  // enqueue order (and the packs) is the same whatever order the caller used.
  std::vector<size_t> order(grads_and_vars.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return grads_and_vars[a].second.impl().creation_index >
           grads_and_vars[b].second.impl().creation_index;
  });
  std::vector<Tensor> grads;
  std::vector<std::string> names;
  for (size_t k : order) {
    grads.push_back(grads_and_vars[k].first);  // reduced in place, as under MirroredStrategy
    names.push_back(grads_and_vars[k].second.name() + "/grad");
  }
  const auto t0 = Clock::now();
  Work work = ctx.all_reduce_async(ReduceOp::kSum, grads, names);
  work.wait();
  const auto t1 = Clock::now();
  Tensor iterations = optimizer.iterations().read(ctx);
  const int64_t step = iterations.data<int64_t>()[0] + 1;
  const std::vector<std::string> slot_names = optimizer.slot_names();
  for (size_t j = 0; j < order.size(); ++j) {
    Variable::Impl& var = grads_and_vars[order[j]].second.impl();
    std::vector<Tensor*> slots;
    for (const std::string& s : slot_names) slots.push_back(&var.slot(s)[local]);
    optimizer.update_tensor(var.copies[local], grads[j], slots, step);
  }
  iterations.data<int64_t>()[0] = step;
  if (m.timeline) {
    m.timeline->complete("wait for gradients", "replica", 1 + local, t0, t1);
    m.timeline->complete("apply", "replica", 1 + local, t1, Clock::now());
  }
}

}  // namespace diststrat
