// ParameterServerStrategy: roles, variable placement, and the worker's step
// protocol (pull before a step, push after it, prefetch the next pull right
// behind the push). The worker runtime is worker.{h,cc}, its checkpoints
// strategy_checkpoint.cc; the PS side service*.cc; the wire protocol wire.h.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <unordered_map>

#include "allreduce/reduce_kernels.h"
#include "core/env.h"
#include "diststrat/config.h"
#include "diststrat/optimizer.h"
#include "io/checkpoint_internal.h"
#include "runtime/local_replicas.h"
#include "runtime/process_group.h"
#include "parameter_server/client.h"
#include "parameter_server/strategy_impl.h"
#include "parameter_server/worker.h"
#include "parameter_server/update_rule.h"
#if DISTSTRAT_HAVE_MPI
#include "allreduce/mpi_communicator.h"
#include "runtime/mpi_env.h"
#endif

namespace diststrat {

using ps::kShutdownGrace;
using ps::mark_mpi_failed_if_launched;

namespace ps {

ServiceRunner::ServiceRunner(Transport& transport, ServiceOptions options, const Logger& logger)
    : service_(transport, std::move(options), logger) {
  thread_ = std::thread([this] {
    std::exception_ptr error;
    try {
      service_.run();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mu_);
    error_ = error;
    finished_ = true;
    cv_.notify_all();
  });
}

ServiceRunner::~ServiceRunner() {
  service_.stop();
  if (thread_.joinable()) thread_.join();
}

void ServiceRunner::fail(const std::string& reason, std::chrono::milliseconds grace) {
  std::unique_lock<std::mutex> lock(mu_);
  if (finished_) return;  // every worker has left: nobody to tell
  service_.fail(reason);
  cv_.wait_for(lock, grace, [&] { return finished_; });
}

void ServiceRunner::join() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    // The loop ends by itself: when every worker is done, or declared gone
    // after the service's timeout of silence, so this wait is bounded.
    cv_.wait(lock, [&] { return finished_; });
    if (error_) std::rethrow_exception(error_);
  }
  const std::string failure = service_.failure();
  if (!failure.empty()) throw AbortedError("parameter server: " + failure);
  const std::vector<int> gone = service_.gone_workers();
  if (!gone.empty()) {
    // Name each silent worker with the step it was in (its pushed step count).
    const ServiceStats st = service_.stats();
    std::string list;
    for (int g : gone) {
      list += (list.empty() ? "" : ", ") + std::string("rank ") + std::to_string(g);
      if (static_cast<size_t>(g) < st.worker_steps.size()) {
        list += " (at step " + std::to_string(st.worker_steps[static_cast<size_t>(g)]) + ")";
      }
    }
    throw DeadlineExceededError("parameter server: worker(s) " + list +
                                " went silent and never shut down");
  }
}

}  // namespace ps

// ---------------------------------------------------------------------------

// ---------------------------------------------------------------------------

namespace ps {
namespace {
std::unique_ptr<ParameterServerStrategy::Impl> new_impl(const ParameterServerOptions& o) {
  auto impl = std::make_unique<ParameterServerStrategy::Impl>();
  impl->options = o;
  return impl;
}
}  // namespace

std::unique_ptr<ParameterServerStrategy> make_strategy(Transport& transport,
                                                       const ParameterServerOptions& options) {
  auto impl = new_impl(options);
  impl->init_layout(transport);
  return std::make_unique<ParameterServerStrategy>(std::move(impl));
}

std::unique_ptr<ParameterServerStrategy> make_strategy(std::unique_ptr<Transport> transport,
                                                       const ParameterServerOptions& options) {
  auto impl = new_impl(options);
  impl->init_layout(*transport);
  impl->owned_transport = std::move(transport);
  return std::make_unique<ParameterServerStrategy>(std::move(impl));
}

Service& local_service(ParameterServerStrategy& strategy) {
  DISTSTRAT_CHECK(!strategy.impl().services.empty(), kFailedPrecondition,
                  "no parameter-server service in this process");
  return strategy.impl().services[0]->service();
}
}  // namespace ps

ParameterServerStrategy::ParameterServerStrategy(std::unique_ptr<Impl> impl) try
    : Strategy(impl->options.log_level, impl->is_ps
                                            ? "[ps " + std::to_string(impl->index) + "]"
                                            : "[worker " + std::to_string(impl->index) + "]"),
      impl_(std::move(impl)) {
  if (!impl_->transport) {
    // One process: it is worker 0 and the PS ranks are threads of it.
    DISTSTRAT_CHECK(impl_->options.num_ps >= 1, kInvalidArgument,
                    "ParameterServerStrategy: num_ps ", impl_->options.num_ps,
                    " must be at least 1");
    impl_->own_group = std::make_unique<InProcessTransportGroup>(impl_->options.num_ps + 1);
    impl_->init_layout(impl_->own_group->at(0));
    impl_->attach(this);
    for (int r = 1; r <= impl_->options.num_ps; ++r) {
      impl_->services.push_back(std::make_unique<ps::ServiceRunner>(
          impl_->own_group->at(r), impl_->service_options(r - 1), logger_));
    }
    logger_.info("ParameterServerStrategy in one process: ", impl_->options.num_ps,
                 " PS thread(s)");
    return;
  }
  impl_->attach(this);
  logger_.info("ParameterServerStrategy: rank ", impl_->rank, " of ", impl_->world, " is ",
               impl_->is_ps ? "PS " : "worker ", impl_->index);
} catch (...) {
  // Set-up failed on this rank after the job's transport was made (a junk
  // environment variable, devices): its peers will not hear from it again,
  // so its exit must not wait a deadline for them (mpi_env.h); the
  // launcher then ends the job.
  mark_mpi_failed_if_launched();
}

namespace {
// The job's transport (the MPI backend seam), or null for a one-process run.
std::unique_ptr<Transport> job_transport(const ResolvedCluster& cluster,
                                         std::chrono::milliseconds timeout) {
  if (cluster.info.world_size <= 1) return nullptr;
#if DISTSTRAT_HAVE_MPI
  if (mpi::launched_under_mpi()) {
    mpi::ensure_initialized();
    return make_mpi_transport(MPI_COMM_WORLD, timeout);
  }
#endif
  throw UnimplementedError("ParameterServerStrategy: a cluster of " +
                           std::to_string(cluster.info.world_size) +
                           " processes needs MPI (launch "
                           "with mpirun)" +
                           (DISTSTRAT_HAVE_MPI ? "" : ", which this build does not have"));
}

ParameterServerOptions with_cluster(ParameterServerOptions o, const ResolvedCluster& cluster) {
  const int ps_tasks = cluster.spec.num_tasks("ps");
  if (ps_tasks > 0) o.num_ps = ps_tasks;
  return o;
}

std::unique_ptr<ParameterServerStrategy::Impl> make_job_impl_checked(
    const ParameterServerOptions& options);

std::unique_ptr<ParameterServerStrategy::Impl> make_job_impl(
    const ParameterServerOptions& options) {
  // What the Strategy base reads from the environment is checked before MPI
  // meets the other ranks, so that a junk value ends this rank before it
  // joins the job (the launcher then ends the job at once).
  Logger(options.log_level);
  FaultInjection::from_env();
  try {
    return make_job_impl_checked(options);
  } catch (...) {
    // Failed after MPI met the other ranks: see the constructor's handler.
    mark_mpi_failed_if_launched();
    throw;
  }
}

std::unique_ptr<ParameterServerStrategy::Impl> make_job_impl_checked(
    const ParameterServerOptions& options) {
  // Set-up is bounded by the job's own deadline, as the multi-worker strategy's is.
  const ResolvedCluster cluster = resolve_cluster(options.cluster, options.communication.timeout);
  auto impl = std::make_unique<ParameterServerStrategy::Impl>();
  impl->options = with_cluster(options, cluster);
  impl->owned_transport = job_transport(cluster, options.communication.timeout);
#if DISTSTRAT_HAVE_MPI
  if (impl->owned_transport && mpi::launched_under_mpi()) {
    mpi::bound_finalize(std::max(options.communication.timeout, options.worker_timeout));
  }
#endif
  if (impl->owned_transport) {
    impl->init_layout(*impl->owned_transport);
    const std::string want = impl->is_ps ? "ps" : "worker";
    const bool agrees =
        cluster.info.task_type == want || (want == "worker" && cluster.info.task_type == "chief");
    DISTSTRAT_CHECK(cluster.spec.num_tasks("ps") == 0 || agrees, kInvalidArgument,
                    "ParameterServerStrategy: rank ", impl->rank, " is task '",
                    cluster.info.task_type, "' in the cluster but a ", want,
                    " by rank order (chief, worker, ps)");
    // cluster() reports the task the spec names (TF_CONFIG's chief is
    // "chief:0", its worker:0 is "worker:0" though it is worker index 1).
    const bool named =
        cluster.source == ClusterSource::kExplicit || cluster.source == ClusterSource::kTfConfig;
    if (named && agrees) {
      impl->task_type = cluster.info.task_type;
      impl->task_index = cluster.info.task_index;
    }
  }
  return impl;
}
}  // namespace

ParameterServerStrategy::ParameterServerStrategy(ParameterServerOptions options)
    : ParameterServerStrategy(make_job_impl(options)) {}

ParameterServerStrategy::~ParameterServerStrategy() {
  if (!impl_->is_ps && impl_->runs) {
    logger_.info(impl_->runs, " runs: ", impl_->pull_wait_s * 1e3, " ms waiting for pulls, ",
                 impl_->replicas_s * 1e3, " ms in the replicas, ", impl_->push_post_s * 1e3,
                 " ms posting pushes");
  }
  impl_->stop_progress();
  const bool unwinding = std::uncaught_exceptions() > impl_->uncaught_at_construction;
  impl_->shutdown(unwinding, logger_);
  if (impl_->is_ps && unwinding) {
    // This PS rank failed (in the program's code, before or instead of
    // join()): its workers learn it at their next request, not at their
    // deadline; they leave (kAbort) and the loop ends, or the grace passes.
    for (auto& s : impl_->services) {
      s->fail("it left during an exception (its own error is in its output)",
              std::min<std::chrono::milliseconds>(impl_->options.communication.timeout,
                                                  kShutdownGrace));
    }
    impl_->mark_failed();
  }
  // In-process PS threads end once every worker is done; a PS rank's own
  // loop is stopped if the program did not join() it.
  for (auto& s : impl_->services) {
    if (!impl_->is_ps) {
      try {
        s->join();
      } catch (const std::exception& e) {
        logger_.error("parameter-server thread: ", e.what());
      }
    }
  }
  impl_->services.clear();
}

int ParameterServerStrategy::num_local_replicas() const {
  return impl_->replicas ? impl_->replicas->size() : 0;
}
int ParameterServerStrategy::num_replicas_in_sync() const {
  return std::max(1, num_local_replicas()) * impl_->num_workers();
}
const std::vector<Device>& ParameterServerStrategy::devices() const {
  return impl_->replicas ? impl_->replicas->devices() : impl_->no_devices;
}
int ParameterServerStrategy::first_local_replica() const {
  return impl_->is_ps ? 0 : impl_->index * num_local_replicas();
}

ClusterInfo ParameterServerStrategy::cluster() const {
  ClusterInfo c;
  // The spec's task when there is one; else the role by rank order.
  c.task_type = !impl_->task_type.empty() ? impl_->task_type : impl_->is_ps ? "ps" : "worker";
  c.task_index = !impl_->task_type.empty() ? impl_->task_index : impl_->index;
  c.rank = impl_->own_group ? 0 : impl_->rank;
  c.world_size = impl_->own_group ? 1 : impl_->world;
  c.num_workers = impl_->num_workers();
  c.worker_index = impl_->is_ps ? -1 : impl_->index;  // PS ranks run no replicas (as cluster.h)
  return c;
}

bool ParameterServerStrategy::is_ps() const { return impl_->is_ps; }

void ParameterServerStrategy::join() {
  DISTSTRAT_CHECK(impl_->is_ps, kFailedPrecondition, "ParameterServerStrategy::join on worker ",
                  impl_->index, ": only PS ranks join");
  try {
    impl_->services.at(0)->join();
  } catch (...) {
    // A worker failed or went silent: it may never meet this rank at exit.
    impl_->mark_failed();
    throw;
  }
}

void ParameterServerStrategy::place_variable(Variable::Impl& var, const Initializer& init) {
  Impl& m = *impl_;
  m.require_worker("create_variable");
  std::lock_guard<std::mutex> lock(m.mu);
  auto vi = std::make_unique<Impl::VarInfo>();
  vi->id = var.creation_index;
  vi->var = &var;
  vi->row_sparse = m.creating_row_sparse;
  DISTSTRAT_CHECK(!vi->row_sparse || var.shape.rank() >= 1, kInvalidArgument,
                  "row-sparse variable '", var.name, "' needs at least one dimension");
  const int64_t rows = var.shape.rank() == 0 ? 1 : var.shape[0];
  vi->row_bytes =
      dtype_size(var.dtype) * static_cast<size_t>(rows ? var.shape.num_elements() / rows : 0);
  if (var.shape.rank() == 0) vi->row_bytes = dtype_size(var.dtype);
  int64_t n = 1;
  if (var.shape.rank() >= 1 && m.options.partitioner) {
    n = m.options.partitioner(var.shape, var.dtype);
    DISTSTRAT_CHECK(n >= 1 && n <= std::max<int64_t>(1, rows), kInvalidArgument,
                    "partitioner split '", var.name, "' ", var.shape.to_string(), " into ", n,
                    " shards");
  }
  for (const auto& [offset, count] : shard_rows(rows, n)) {
    Impl::ShardPlace sp;
    sp.ps = static_cast<int>(m.next_ps++ % static_cast<int64_t>(m.ps_ranks.size()));
    sp.index = static_cast<int64_t>(vi->shards.size());
    sp.offset = offset;
    sp.rows = count;
    vi->shards.push_back(sp);
  }
  // The chief initializes and sends the value; the others only declare the
  // variable and wait until the chief's value is there.
  Tensor value;
  if (!vi->row_sparse) {
    var.copies.emplace_back(var.shape, var.dtype);
    init(var.copies[0]);
    value = var.copies[0];
  } else if (m.chief()) {
    value = Tensor(var.shape, var.dtype);
    init(value);
  }
  auto owner = std::make_shared<Tensor>(value);
  std::vector<ps::Client::CallPtr> calls;
  for (const Impl::ShardPlace& sp : vi->shards) {
    ps::Writer w;
    w.put<int64_t>(vi->id).put_string(var.name).put<int32_t>(static_cast<int32_t>(var.dtype));
    w.put_shape(var.shape).put<int64_t>(sp.index).put<int64_t>(n).put<int64_t>(sp.offset);
    w.put<int64_t>(sp.rows).put<uint8_t>(m.chief() ? 1 : 0);
    const size_t bytes = m.chief() ? static_cast<size_t>(sp.rows) * vi->row_bytes : 0;
    const char* data =
        m.chief() ? static_cast<const char*>(value.data()) + sp.offset * vi->row_bytes : nullptr;
    calls.push_back(m.client->post(sp.ps, ps::Op::kCreate, w.bytes(), owner, data, bytes, nullptr,
                                   0, "create of '" + var.name + "'"));
  }
  m.wait_all(calls);
  m.info_of[&var] = vi.get();
  m.vars.push_back(std::move(vi));
}

Variable ParameterServerStrategy::create_row_sparse_variable(const std::string& name,
                                                             const Shape& shape, DType dtype,
                                                             const Initializer& init,
                                                             const VariableOptions& options) {
  impl_->creating_row_sparse = true;
  try {
    Variable v = create_variable(name, shape, dtype, init, options);
    impl_->creating_row_sparse = false;
    return v;
  } catch (...) {
    impl_->creating_row_sparse = false;
    throw;
  }
}

void ParameterServerStrategy::inject_corruption(ReplicaContext&, int64_t) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);  // guards the client
  if (fault_injection().kind == FaultKind::kOversize) {
    m.client->oversize_next_push();
  } else {
    m.client->corrupt_next_push();
  }
}

void ParameterServerStrategy::run_replicas(const std::function<void(ReplicaContext&)>& fn) {
  Impl& m = *impl_;
  m.require_worker("run");
  const auto t0 = Clock::now();
  {
    std::lock_guard<std::mutex> lock(m.mu);
    // An earlier push's rejection is reported first; a failed pull is not
    // kept, so the next run pulls afresh.
    std::exception_ptr earlier = m.client->take_deferred();
    try {
      if (m.pull_calls.empty()) m.post_dense_pull();
      m.finish_dense_pull();
    } catch (...) {
      m.pull_calls.clear();
      if (!earlier) earlier = m.client->take_deferred();  // completed by the wait
      if (!earlier) throw;
    }
    if (!earlier) earlier = m.client->take_deferred();
    if (earlier) std::rethrow_exception(earlier);
  }
  const auto t1 = Clock::now();
  try {
    m.in_step = true;
    m.replicas->run(fn);
    m.in_step = false;
  } catch (...) {
    m.in_step = false;
    std::lock_guard<std::mutex> lock(m.staged_mu);
    m.staged.clear();
    throw;
  }
  const auto t2 = Clock::now();
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<Impl::StagedPush> staged;
  {
    std::lock_guard<std::mutex> slock(m.staged_mu);
    staged.swap(m.staged);
  }
  for (Impl::StagedPush& s : staged) m.post_push(s);
  // Prefetch: the next step's pull travels behind the push.
  if (!staged.empty()) m.post_dense_pull();
  m.client->poll();
  m.progress_cv.notify_all();
  ++m.runs;
  m.pull_wait_s += std::chrono::duration<double>(t1 - t0).count();
  m.replicas_s += std::chrono::duration<double>(t2 - t1).count();
  m.push_post_s += std::chrono::duration<double>(Clock::now() - t2).count();
}

void ParameterServerStrategy::apply_gradients(
    ReplicaContext& ctx, Optimizer& optimizer,
    const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) {
  apply_gradients(ctx, optimizer, grads_and_vars, {});
}

void ParameterServerStrategy::apply_gradients(
    ReplicaContext& ctx, Optimizer& optimizer,
    const std::vector<std::pair<Tensor, Variable>>& grads_and_vars,
    const std::vector<SparseGradient>& sparse) {
  Impl& m = *impl_;
  const ps::OptimizerConfig config = ps::describe_optimizer(optimizer);
  std::vector<Tensor> grads;
  std::vector<std::string> names;
  for (const auto& [g, v] : grads_and_vars) {
    const Impl::VarInfo& vi = m.info(v.impl());
    DISTSTRAT_CHECK(!vi.row_sparse, kInvalidArgument, "apply_gradients: variable '", v.name(),
                    "' is row-sparse: pass its gradient as a SparseGradient");
    DISTSTRAT_CHECK(g.shape() == v.shape() && g.dtype() == v.dtype(), kInvalidArgument,
                    "apply_gradients: gradient ", g.debug_string(), " does not match variable '",
                    v.name(), "' ", dtype_name(v.dtype()), v.shape().to_string());
    grads.push_back(g);
    names.push_back(v.name() + "/grad");
  }
  for (const SparseGradient& s : sparse) {
    const Impl::VarInfo& vi = m.info(s.variable.impl());
    DISTSTRAT_CHECK(vi.row_sparse, kInvalidArgument, "apply_gradients: variable '",
                    s.variable.name(), "' is not row-sparse: pass a dense gradient");
    DISTSTRAT_CHECK(s.values.defined() && s.values.dtype() == DType::kFloat32, kInvalidArgument,
                    "apply_gradients: row gradient of '", s.variable.name(),
                    "' must be float32, got ",
                    s.values.defined() ? s.values.debug_string() : "an undefined tensor");
    std::vector<int64_t> want = s.variable.shape().dims();
    want[0] = s.ids.defined() && s.ids.shape().rank() == 1 ? s.ids.shape()[0] : -1;
    DISTSTRAT_CHECK(s.values.shape().dims() == want, kInvalidArgument,
                    "apply_gradients: row gradient ", s.values.debug_string(), " of '",
                    s.variable.name(), "' does not match ", want[0], " ids of rows ",
                    s.variable.shape().to_string());
  }
  // Inside the worker, replicas are synchronous: dense gradients are summed
  // over the local replicas, row gradients concatenated.
  const bool local_many = m.replicas->size() > 1;
  if (local_many && !grads.empty()) {
    for (Tensor& g : grads) g = g.clone();
    ctx.all_reduce(ReduceOp::kSum, grads, names);  // on the GPUs for GPU replicas
  }
  for (Tensor& g : grads) stage_to_host(g);     // pushed from host memory
  std::vector<std::pair<Tensor, Tensor>> rows;  // (ids, values) per sparse gradient
  for (const SparseGradient& s : sparse) {
    if (local_many) {
      rows.emplace_back(ctx.all_gather(s.ids, s.variable.name() + "/ids"),
                        ctx.all_gather(s.values, s.variable.name() + "/rows"));
    } else {
      rows.emplace_back(s.ids, s.values);
    }
    stage_to_host(rows.back().first);
    stage_to_host(rows.back().second);
  }
  ctx.merge_call([&](Strategy&) {
    Impl::StagedPush push;
    push.config = config;
    push.iterations = &m.info(optimizer.iterations().impl());
    for (size_t k = 0; k < grads.size(); ++k) {
      push.dense.emplace_back(&m.info(grads_and_vars[k].second.impl()),
                              local_many ? grads[k] : grads[k].clone());
    }
    for (size_t k = 0; k < sparse.size(); ++k) {
      const Impl::VarInfo& vi = m.info(sparse[k].variable.impl());
      const std::vector<int64_t> ids = m.checked_ids(vi, rows[k].first, "push");
      // Sum duplicate ids so each row is updated once.
      std::unordered_map<int64_t, size_t> first;
      Impl::StagedPush::Rows r{&vi, {}, {}};
      const int64_t re =
          rows[k].second.shape().num_elements() / std::max<int64_t>(1, rows[k].second.shape()[0]);
      std::vector<float> acc;
      const float* src = rows[k].second.data<float>();
      for (size_t i = 0; i < ids.size(); ++i) {
        auto [it, fresh] = first.emplace(ids[i], r.ids.size());
        if (fresh) {
          r.ids.push_back(ids[i]);
          acc.insert(acc.end(), src + i * re, src + (i + 1) * re);
        } else {
          float* dst = acc.data() + it->second * re;
          for (int64_t j = 0; j < re; ++j) dst[j] += src[i * re + j];
        }
      }
      std::vector<int64_t> d = sparse[k].variable.shape().dims();
      d[0] = static_cast<int64_t>(r.ids.size());
      r.values = Tensor(Shape(d), DType::kFloat32);
      if (!acc.empty()) std::memcpy(r.values.data(), acc.data(), acc.size() * sizeof(float));
      push.sparse.push_back(std::move(r));
    }
    std::lock_guard<std::mutex> lock(m.staged_mu);
    m.staged.push_back(std::move(push));
  });
}

Tensor ParameterServerStrategy::gather_rows(const Variable& var, const Tensor& ids) {
  Impl& m = *impl_;
  m.require_worker("gather_rows");
  std::lock_guard<std::mutex> lock(m.mu);
  const Impl::VarInfo& vi = m.info(var.impl());
  const std::vector<int64_t> id = m.checked_ids(vi, ids, "gather_rows");
  std::vector<int64_t> dims = var.shape().dims();
  dims[0] = static_cast<int64_t>(id.size());
  Tensor out{Shape(dims), var.dtype()};
  // Route each id to its shard; one pull per PS with one entry per shard.
  struct Part {
    std::vector<ps::Entry> entries;
    std::vector<int64_t> ids;
    std::vector<size_t> positions;  // where each returned row goes
    std::vector<char> buffer;
  };
  std::vector<Part> parts(m.ps_ranks.size());
  for (const Impl::ShardPlace& sp : vi.shards) {
    ps::Entry e = Impl::entry_of(vi, sp);
    e.sparse = 1;
    Part& part = parts[sp.ps];
    for (size_t k = 0; k < id.size(); ++k) {
      if (id[k] < sp.offset || id[k] >= sp.offset + sp.rows) continue;
      part.ids.push_back(id[k]);
      part.positions.push_back(k);
      ++e.num_ids;
    }
    if (e.num_ids) part.entries.push_back(e);
  }
  std::vector<ps::Client::CallPtr> calls;
  for (size_t p = 0; p < parts.size(); ++p) {
    Part& part = parts[p];
    if (part.entries.empty()) continue;
    ps::Writer w;
    w.put<int64_t>(-1).put<int64_t>(static_cast<int64_t>(part.entries.size()));
    for (const ps::Entry& e : part.entries) ps::write_entry(w, e);
    part.buffer.resize(part.ids.size() * vi.row_bytes);
    calls.push_back(m.client->post(static_cast<int>(p), ps::Op::kPull, w.bytes(), nullptr,
                                   part.ids.data(), part.ids.size() * sizeof(int64_t),
                                   part.buffer.data(), part.buffer.size(),
                                   "gather_rows of '" + var.name() + "'"));
  }
  m.wait_all(calls);
  char* dst = static_cast<char*>(out.data());
  for (Part& part : parts) {
    for (size_t k = 0; k < part.positions.size(); ++k) {
      std::memcpy(dst + part.positions[k] * vi.row_bytes, part.buffer.data() + k * vi.row_bytes,
                  vi.row_bytes);
    }
  }
  return out;
}

void ParameterServerStrategy::flush() {
  Impl& m = *impl_;
  m.require_worker("flush");
  std::lock_guard<std::mutex> lock(m.mu);
  m.client->drain();
  m.client->throw_deferred();
}

ParameterServerStats ParameterServerStrategy::stats() {
  Impl& m = *impl_;
  m.require_worker("stats");
  std::lock_guard<std::mutex> lock(m.mu);
  // Each reply: version, rejected, staleness sum, staleness max, step gap,
  // non-finite pushes skipped, worker count, then each worker's steps (all int64).
  const size_t bytes = (7 + m.worker_ranks.size()) * sizeof(int64_t);
  std::vector<std::vector<char>> replies(m.ps_ranks.size(), std::vector<char>(bytes));
  std::vector<ps::Client::CallPtr> calls;
  for (int p = 0; p < m.client->num_ps(); ++p) {
    calls.push_back(m.client->post(p, ps::Op::kStats, {}, nullptr, nullptr, 0, replies[p].data(),
                                   bytes, "stats"));
  }
  m.wait_all(calls);
  ParameterServerStats out;
  out.pushes_sent = m.pushes_sent;
  int64_t staleness_sum = 0;
  for (const std::vector<char>& reply : replies) {
    ps::Reader r(reply.data(), reply.size(), "stats reply");
    const int64_t applied = r.get<int64_t>();
    out.pushes_applied += applied;
    out.pushes_rejected += r.get<int64_t>();
    staleness_sum += r.get<int64_t>();
    out.max_staleness = std::max(out.max_staleness, r.get<int64_t>());
    out.max_step_gap = std::max(out.max_step_gap, r.get<int64_t>());
    out.pushes_nonfinite += r.get<int64_t>();
    const int64_t n = r.get<int64_t>();
    // Checked before it sizes anything: the reply must count our workers.
    DISTSTRAT_CHECK(n == static_cast<int64_t>(m.worker_ranks.size()), kInternal,
                    "stats reply: protocol error: ", n, " workers, this job has ",
                    m.worker_ranks.size());
    out.worker_steps.resize(static_cast<size_t>(n), 0);
    for (int64_t i = 0; i < n; ++i) {
      out.worker_steps[i] = std::max(out.worker_steps[i], r.get<int64_t>());
    }
  }
  out.mean_staleness =
      out.pushes_applied ? static_cast<double>(staleness_sum) / out.pushes_applied : 0.0;
  return out;
}

void ParameterServerStrategy::barrier(const std::string& name) {
  Impl& m = *impl_;
  m.require_worker("barrier");
  std::lock_guard<std::mutex> lock(m.mu);
  ps::Writer w;
  w.put<int64_t>(++m.barrier_count);
  auto c = m.client->post(0, ps::Op::kBarrier, w.bytes(), nullptr, nullptr, 0, nullptr, 0,
                          "barrier '" + name + "'");
  m.client->wait(c);
}

std::vector<ShardSnapshot> ParameterServerStrategy::local_shards() const {
  DISTSTRAT_CHECK(impl_->is_ps, kFailedPrecondition,
                  "local_shards on a worker: PS ranks hold the shards");
  return impl_->services.at(0)->service().snapshot();
}

void ParameterServerStrategy::restore_local_shards(const std::vector<ShardSnapshot>& shards) {
  DISTSTRAT_CHECK(impl_->is_ps, kFailedPrecondition,
                  "restore_local_shards on a worker: PS ranks hold the shards");
  impl_->services.at(0)->service().restore(shards);
}

Tensor ParameterServerStrategy::read_variable(const Variable::Impl& var,
                                              const ReplicaContext& ctx) const {
  const Impl::VarInfo& vi = impl_->info(var);
  DISTSTRAT_CHECK(!vi.row_sparse, kFailedPrecondition, "read of row-sparse variable '", var.name,
                  "': it is not pulled whole; use gather_rows");
  return read_on_replica_device(var.copies[0], ctx.device());
}

Tensor ParameterServerStrategy::variable_value(const Variable::Impl& var) const {
  Impl& m = *impl_;
  m.require_worker("value");
  std::lock_guard<std::mutex> lock(m.mu);
  return m.pull_whole(m.info(var));
}

void ParameterServerStrategy::assign_variable(Variable::Impl& var, const Tensor& value) {
  Impl& m = *impl_;
  m.require_worker("assign");
  DISTSTRAT_CHECK(value.shape() == var.shape && value.dtype() == var.dtype, kInvalidArgument,
                  "assign to variable '", var.name, "' ", dtype_name(var.dtype),
                  var.shape.to_string(), " from ", value.debug_string());
  std::lock_guard<std::mutex> lock(m.mu);
  const Impl::VarInfo& vi = m.info(var);
  auto owner = std::make_shared<Tensor>(value.clone());
  std::vector<ps::Client::CallPtr> calls;
  for (const Impl::ShardPlace& sp : vi.shards) {
    ps::Entry e = Impl::entry_of(vi, sp);
    e.shape = Impl::shard_shape(vi, sp);
    ps::Writer w;
    w.put<int64_t>(1);
    ps::write_entry(w, e);
    calls.push_back(m.client->post(
        sp.ps, ps::Op::kAssign, w.bytes(), owner,
        static_cast<const char*>(owner->data()) + sp.offset * vi.row_bytes,
        static_cast<size_t>(sp.rows) * vi.row_bytes, nullptr, 0, "assign to '" + var.name + "'"));
  }
  m.wait_all(calls);
  if (!vi.row_sparse) var.copies[0].copy_from(value);
  m.discard_dense_pull();  // the next run pulls what we just wrote
}

void ParameterServerStrategy::update(Variable& var, const std::function<void(Tensor&)>& fn) {
  Tensor v = var.value();
  fn(v);
  var.assign(v);
}

Tensor ParameterServerStrategy::reduce_tensors_across(ReduceOp op,
                                                      const std::vector<Tensor>& local) {
  impl_->require_worker("reduce");
  // As reduce_across: this worker's replicas, so kMean divides by their
  // number (the base class divides by every worker's replicas).
  const std::vector<Tensor> host = impl_->replicas->to_host(local);
  if (op != ReduceOp::kMean) return Strategy::reduce_tensors_across(op, host);
  Tensor out = Strategy::reduce_tensors_across(ReduceOp::kSum, host);
  kernels::scale_mean(out.data(), static_cast<size_t>(out.num_elements()), out.dtype(),
                      static_cast<int>(host.size()));
  return out;
}

void ParameterServerStrategy::add_to_metric(const std::string& name, double sum, double count) {
  Impl& m = *impl_;
  m.require_worker("add_to_metric");
  DISTSTRAT_CHECK(std::isfinite(count) && count >= 0, kInvalidArgument, "worker ", m.index,
                  ": add_to_metric '", name.substr(0, 200), "': count ", count,
                  " is not a finite number >= 0");
  std::lock_guard<std::mutex> lock(m.mu);
  ps::Writer w;
  w.put_string(name).put<double>(sum).put<double>(count);
  auto c = m.client->post(0, ps::Op::kMetric, w.bytes(), nullptr, nullptr, 0, nullptr, 0,
                          "add to metric '" + name.substr(0, 200) + "'");
  m.client->detach(c);
  m.client->poll();
  m.progress_cv.notify_all();
}

MetricTotals ParameterServerStrategy::read_metric(const std::string& name) {
  Impl& m = *impl_;
  m.require_worker("read_metric");
  std::lock_guard<std::mutex> lock(m.mu);
  ps::Writer w;
  w.put_string(name).put<double>(0.0).put<double>(0.0);
  double totals[2] = {0, 0};
  auto c = m.client->post(0, ps::Op::kMetric, w.bytes(), nullptr, nullptr, 0, totals, sizeof totals,
                          "read of metric '" + name.substr(0, 200) + "'");
  m.client->wait(c);
  return MetricTotals{totals[0], totals[1]};
}

Tensor ParameterServerStrategy::gather_across(const std::vector<Tensor>& local) {
  impl_->require_worker("gather");
  return Strategy::gather_across(impl_->replicas->to_host(local));
}

void ParameterServerStrategy::update_hyperparameters(const Optimizer& optimizer) {
  Impl& m = *impl_;
  m.require_worker("update_hyperparameters");
  DISTSTRAT_CHECK(
      m.chief(), kFailedPrecondition, "worker ", m.index,
      ": update_hyperparameters: only the chief (worker 0) changes the PS ranks' update rules");
  const ps::OptimizerConfig config = ps::describe_optimizer(optimizer);
  ps::make_update_rule(config);  // the PS ranks check it too; fail here first
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<const Impl::VarInfo*> vars;
  for (const auto& vi : m.vars) {
    if (vi->rule_declared) vars.push_back(vi.get());
  }
  if (!vars.empty()) m.post_rules(vars, config, true, "update of the hyper-parameters");
  m.declared_config = config;
  m.warned_config = false;
}

bool ParameterServerStrategy::agree_to_stop(Strategy&, int64_t step, bool signalled) {
  Impl& m = *impl_;
  m.require_worker("PreemptionHandler::should_stop");
  std::lock_guard<std::mutex> lock(m.mu);
  ps::Writer w;
  w.put<int64_t>(step).put<uint8_t>(signalled ? 1 : 0);
  int64_t stop = 0;
  auto c = m.client->post(0, ps::Op::kStopCheck, w.bytes(), nullptr, nullptr, 0, &stop, sizeof stop,
                          "preemption check at step " + std::to_string(step));
  m.client->wait(c);
  return stop != 0;
}

void ParameterServerStrategy::broadcast(Tensor& t, int root_worker, const std::string& name) {
  Impl& m = *impl_;
  m.require_worker("broadcast");
  if (m.num_workers() == 1) return;
  DISTSTRAT_CHECK(root_worker >= 0 && root_worker < m.num_workers(), kInvalidArgument,
                  "broadcast '", name, "': root worker ", root_worker, " of ", m.num_workers());
  DISTSTRAT_CHECK(t.defined() && t.device().is_cpu(), kInvalidArgument, "broadcast '", name,
                  "': a host tensor is needed");
  std::lock_guard<std::mutex> lock(m.mu);
  const bool root = m.index == root_worker;
  ps::Writer w;
  w.put<int64_t>(++m.broadcast_count)
      .put<uint8_t>(root ? 1 : 0)
      .put<int64_t>(static_cast<int64_t>(t.nbytes()));
  const std::string what = "broadcast '" + name + "'";
  auto c = root ? m.client->post(0, ps::Op::kBroadcast, w.bytes(), std::make_shared<Tensor>(t),
                                 t.data(), t.nbytes(), nullptr, 0, what)
                : m.client->post(0, ps::Op::kBroadcast, w.bytes(), nullptr, nullptr, 0, t.data(),
                                 t.nbytes(), what);
  m.client->wait(c);
}

double ParameterServerStrategy::reduce_across(ReduceOp op, const std::vector<double>& local) {
  // Workers never meet: reduce over this worker's replicas only.
  if (op != ReduceOp::kMean) return Strategy::reduce_across(op, local);
  return Strategy::reduce_across(ReduceOp::kSum, local) / static_cast<double>(local.size());
}

}  // namespace diststrat
