// resolve_cluster: explicit spec, TF_CONFIG, or the MPI launcher.
#include <cstdlib>
#include <exception>
#include <string>

#include "core/env.h"
#include "diststrat/cluster.h"
#include "diststrat/collective.h"
#include "diststrat/config.h"
#include "diststrat/error.h"
#include "diststrat/slurm.h"
#include "runtime/process_group.h"
#if DISTSTRAT_HAVE_MPI
#include "runtime/mpi_env.h"
#endif

namespace diststrat {

namespace {
// Every rank a worker: what a plain `mpirun -np N` job is.
ClusterSpec workers_only(int rank, int size) {
  ClusterSpec spec;
  auto& w = spec.jobs["worker"];
  for (int r = 0; r < size; ++r)
    w.push_back("rank" + std::to_string(r) + ":" + std::to_string(r + 1));
  spec.task_type = "worker";
  spec.task_index = rank;
  return spec;
}

// The spec from the configuration alone (explicit, else TF_CONFIG, else an
// srun step's variables, with its placement); false when there is none.
bool spec_of(const ClusterConfig& config, ResolvedCluster* out) {
  if (!config.spec.jobs.empty()) {
    config.spec.validate();
    out->spec = config.spec;
    out->source = ClusterSource::kExplicit;
    return true;
  }
  if (config.use_tf_config) {
    if (auto tf = env::text("TF_CONFIG")) {
      out->spec = ClusterSpec::from_tf_config(*tf);
      out->source = ClusterSource::kTfConfig;
      return true;
    }
  }
  if (config.use_slurm && in_slurm_step()) {
    SlurmOptions o = config.slurm;
    o.auto_set_gpu = false;  // resolve_cluster changes no environment
    SlurmClusterResolver slurm(o);
    out->spec = slurm.cluster_spec();
    out->placement = slurm.placement();
    out->source = ClusterSource::kSlurm;
    return true;
  }
  return false;
}

// Placement, spec and virtual nodes agreed; `have_spec` from spec_of.
void finish(const ClusterConfig& config, bool have_spec, bool from_mpi, ResolvedCluster* out) {
  if (from_mpi) {
    const Placement& p = out->placement;
    if (have_spec) {
      // The launcher's ranks must agree with the spec's rank order.
      DISTSTRAT_CHECK(out->spec.world_size() == p.world_size, kInvalidArgument, "cluster spec (",
                      cluster_source_name(out->source), ") has ", out->spec.world_size(),
                      " training processes but the MPI launcher started ", p.world_size,
                      out->source == ClusterSource::kSlurm
                          ? " (srun starts the tasks as one MPI job only with --mpi=pmix)"
                          : "");
      DISTSTRAT_CHECK(out->spec.rank() == p.rank, kInvalidArgument, "cluster spec (",
                      cluster_source_name(out->source), "): task ", out->spec.task_type, "[",
                      out->spec.task_index, "] has rank ", out->spec.rank(),
                      " in chief/worker/ps order but MPI rank ", p.rank);
    } else {
      out->spec = workers_only(p.rank, p.world_size);
      out->source = ClusterSource::kMpi;
    }
  } else if (have_spec && out->source != ClusterSource::kSlurm) {
    // No launcher: one process per node as far as we can tell (Slurm says
    // where each task is).
    Placement& p = out->placement;
    p.rank = std::max(0, out->spec.rank());
    p.world_size = out->spec.world_size();
    p.local_rank = 0;
    p.local_size = 1;
    p.node = p.rank;
    p.num_nodes = p.world_size;
  }
  out->info = out->spec.jobs.empty() ? ClusterInfo{} : out->spec.info();
  const int vnode = static_cast<int>(
      env::integer("DISTSTRAT_VIRTUAL_NODE_SIZE", 0, 1'000'000).value_or(config.virtual_node_size));
  out->placement = virtual_nodes(out->placement, vnode);
}
}  // namespace

ResolvedCluster resolve_cluster(const ClusterConfig& config) {
  return resolve_cluster(config, std::nullopt);
}

ResolvedCluster resolve_cluster(const ClusterConfig& config,
                                std::optional<std::chrono::milliseconds> timeout) {
  ResolvedCluster out;
#if DISTSTRAT_HAVE_MPI
  if (mpi::launched_under_mpi()) {
    // Under a launcher every rank takes every collective step of set-up, even
    // one whose configuration is bad: its error is carried to the agreement
    // at the end, where every rank fails together naming it (instead of the
    // others waiting for it in the next collective).
    const std::chrono::milliseconds t = timeout ? *timeout : CommunicationOptions{}.timeout;
    mpi::ensure_initialized(t);
    if (timeout) mpi::bound_finalize(*timeout);
    // The first agreement also makes sure that every rank is here before
    // any enters placement's MPI_Comm_split_type (no non-blocking form).
    std::exception_ptr error;
    bool have_spec = false;
    try {
      have_spec = spec_of(config, &out);
    } catch (...) {
      error = std::current_exception();
    }
    mpi::agree(MPI_COMM_WORLD, "resolve_cluster", error, t);
    out.placement = mpi::placement(MPI_COMM_WORLD, t);
    try {
      finish(config, have_spec, true, &out);
    } catch (...) {
      error = std::current_exception();
    }
    mpi::agree(MPI_COMM_WORLD, "resolve_cluster", error, t);
    return out;
  }
#endif
  (void)timeout;
  const bool have_spec = spec_of(config, &out);
  finish(config, have_spec, false, &out);
  return out;
}

}  // namespace diststrat
