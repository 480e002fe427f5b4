// resolve_cluster: explicit spec, TF_CONFIG, or the MPI launcher.
#include <cstdlib>
#include <string>

#include "core/env.h"
#include "diststrat/cluster.h"
#include "diststrat/config.h"
#include "diststrat/error.h"
#if DISTSTRAT_HAVE_MPI
#include "multiworker/mpi_env.h"
#endif

namespace diststrat {

namespace {
// Every rank a worker: what a plain `mpirun -np N` job is.
ClusterSpec workers_only(int rank, int size) {
  ClusterSpec spec;
  auto& w = spec.jobs["worker"];
  for (int r = 0; r < size; ++r) w.push_back("rank" + std::to_string(r) + ":" + std::to_string(r + 1));
  spec.task_type = "worker";
  spec.task_index = rank;
  return spec;
}
}  // namespace

ResolvedCluster resolve_cluster(const ClusterConfig& config) {
  ResolvedCluster out;
  bool have_spec = false;
  if (!config.spec.jobs.empty()) {
    config.spec.validate();
    out.spec = config.spec;
    out.source = ClusterSource::kExplicit;
    have_spec = true;
  } else if (config.use_tf_config) {
    const char* tf = std::getenv("TF_CONFIG");
    if (tf && *tf) {
      out.spec = ClusterSpec::from_tf_config(tf);
      out.source = ClusterSource::kTfConfig;
      have_spec = true;
    }
  }

  bool from_mpi = false;
#if DISTSTRAT_HAVE_MPI
  if (mpi::launched_under_mpi()) {
    mpi::ensure_initialized();
    out.placement = mpi::placement(MPI_COMM_WORLD);
    from_mpi = true;
  }
#endif
  if (from_mpi) {
    const Placement& p = out.placement;
    if (have_spec) {
      // The launcher's ranks must agree with the spec's rank order.
      DISTSTRAT_CHECK(out.spec.world_size() == p.world_size, kInvalidArgument, "cluster spec (",
                      cluster_source_name(out.source), ") has ", out.spec.world_size(),
                      " training processes but the MPI launcher started ", p.world_size);
      DISTSTRAT_CHECK(out.spec.rank() == p.rank, kInvalidArgument, "cluster spec (",
                      cluster_source_name(out.source), "): task ", out.spec.task_type, "[",
                      out.spec.task_index, "] has rank ", out.spec.rank(),
                      " in chief/worker/ps order but MPI rank ", p.rank);
    } else {
      out.spec = workers_only(p.rank, p.world_size);
      out.source = ClusterSource::kMpi;
    }
  } else if (have_spec) {
    // No launcher: one process per node as far as we can tell.
    Placement& p = out.placement;
    p.rank = std::max(0, out.spec.rank());
    p.world_size = out.spec.world_size();
    p.local_rank = 0;
    p.local_size = 1;
    p.node = p.rank;
    p.num_nodes = p.world_size;
  }
  out.info = out.spec.jobs.empty() ? ClusterInfo{} : out.spec.info();
  const int vnode = static_cast<int>(
      env::integer("DISTSTRAT_VIRTUAL_NODE_SIZE", 0, 1'000'000).value_or(config.virtual_node_size));
  out.placement = virtual_nodes(out.placement, vnode);
  return out;
}

}  // namespace diststrat
