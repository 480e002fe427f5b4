// ParameterServerStrategy's set-up and roles: the job's transport (the MPI
// seam) and layout, the strategy made from an Impl (the factories of
// strategy_impl.h), its end, and what a rank is (PS or worker, its task).
#include <algorithm>
#include <exception>
#include <string>

#include "core/env.h"
#include "diststrat/config.h"
#include "runtime/local_replicas.h"
#include "runtime/process_group.h"
#include "parameter_server/strategy_impl.h"
#include "parameter_server/worker.h"
#if DISTSTRAT_HAVE_MPI
#include "allreduce/mpi_communicator.h"
#include "runtime/mpi_env.h"
#endif

namespace diststrat {

using ps::kShutdownGrace;
using ps::mark_mpi_failed_if_launched;

std::unique_ptr<ParameterServerStrategy> ParameterServerAccess::make(std::unique_ptr<Impl> impl) {
  return std::unique_ptr<ParameterServerStrategy>(new ParameterServerStrategy(std::move(impl)));
}

namespace ps {
namespace {
std::unique_ptr<ParameterServerAccess::Impl> new_impl(const ParameterServerOptions& o) {
  auto impl = std::make_unique<ParameterServerAccess::Impl>();
  impl->options = o;
  return impl;
}
}  // namespace

std::unique_ptr<ParameterServerStrategy> make_strategy(Transport& transport,
                                                       const ParameterServerOptions& options) {
  auto impl = new_impl(options);
  impl->init_layout(transport);
  return ParameterServerAccess::make(std::move(impl));
}

std::unique_ptr<ParameterServerStrategy> make_strategy(std::unique_ptr<Transport> transport,
                                                       const ParameterServerOptions& options) {
  auto impl = new_impl(options);
  impl->init_layout(*transport);
  impl->owned_transport = std::move(transport);
  return ParameterServerAccess::make(std::move(impl));
}

Service& local_service(ParameterServerStrategy& strategy) {
  ParameterServerAccess::Impl& impl = ParameterServerAccess::impl(strategy);
  DISTSTRAT_CHECK(!impl.services.empty(), kFailedPrecondition,
                  "no parameter-server service in this process");
  return impl.services[0]->service();
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
                                         std::chrono::milliseconds timeout,
                                         bool survive_worker_loss) {
  if (cluster.info.world_size <= 1) return nullptr;
#if DISTSTRAT_HAVE_MPI
  if (mpi::launched_under_mpi()) {
    mpi::ensure_initialized();
    return make_mpi_transport(MPI_COMM_WORLD, timeout);
  }
#endif
  // Without a launcher (TF_CONFIG, a ClusterSpec) the processes meet over
  // TCP at the chief's store (runtime/process_group.h); the service's
  // receive loop probes any source, which the TCP transport has.
  return make_tcp_job_transport(cluster, timeout, "parameter_server", !survive_worker_loss);
}

ParameterServerOptions with_cluster(ParameterServerOptions o, const ResolvedCluster& cluster) {
  const int ps_tasks = cluster.spec.num_tasks("ps");
  if (ps_tasks > 0) o.num_ps = ps_tasks;
  return o;
}

std::unique_ptr<ParameterServerAccess::Impl> make_job_impl_checked(
    const ParameterServerOptions& options);

std::unique_ptr<ParameterServerAccess::Impl> make_job_impl(const ParameterServerOptions& options) {
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

std::unique_ptr<ParameterServerAccess::Impl> make_job_impl_checked(
    const ParameterServerOptions& options) {
  // Set-up is bounded by the job's own deadline, as the multi-worker strategy's is.
  env::check_timeout(options.communication.timeout,
                     "ParameterServerStrategy: communication.timeout");
  if (options.worker_timeout.count() != 0)
    env::check_timeout(options.worker_timeout, "ParameterServerStrategy: worker_timeout");
  const ResolvedCluster cluster = resolve_cluster(options.cluster, options.communication.timeout);
  auto impl = std::make_unique<ParameterServerAccess::Impl>();
  impl->options = with_cluster(options, cluster);
  impl->owned_transport =
      job_transport(cluster, options.communication.timeout, options.survive_worker_loss);
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
        cluster.source == ClusterSource::kExplicit || cluster.source == ClusterSource::kTfConfig ||
        (cluster.source == ClusterSource::kSlurm && !options.cluster.slurm.jobs.empty());
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

}  // namespace diststrat
