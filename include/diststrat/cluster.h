// Cluster resolution: who this process is in a multi-process job.
//
// Four sources, tried in this order by resolve_cluster():
//  1. explicit configuration in code (ClusterConfig with a ClusterSpec set);
//  2. TensorFlow's TF_CONFIG environment variable (the same JSON):
//       {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"],
//                    "ps": ["host3:2222"]},
//        "task": {"type": "worker", "index": 0}}
//  3. Slurm, inside an srun step (diststrat/slurm.h): the hosts, tasks per
//     node and this task's rank from the step's SLURM_* variables, roles
//     from ClusterConfig::slurm.jobs;
//  4. the MPI launcher (mpirun / srun with PMIx): rank and size of
//     MPI_COMM_WORLD, every rank a worker, node grouping from
//     MPI_Comm_split_type(MPI_COMM_TYPE_SHARED).
// Under MPI, a cluster from 1.-3. must agree with MPI's rank and size.
//
// Jobs: "chief" (at most one task; it is worker 0 of the replicas in sync),
// "worker", "ps" (parameter servers) and "evaluator" (runs no replicas, is not
// part of the training ranks). Without a chief job, worker 0 is the chief.
//
// Process ranks are assigned in job order chief, worker, ps (then task index):
// that is the MPI rank a process must have when TF_CONFIG is combined with
// mpirun. Evaluators get no training rank.
//
// Thread safety: plain values; the functions are reentrant.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "diststrat/strategy.h"

namespace diststrat {

// The jobs of a cluster and this process's task in it.
struct ClusterSpec {
  // Job name -> task addresses ("host:port"), indexed by task index. Jobs
  // with an empty address list are treated as absent.
  std::map<std::string, std::vector<std::string>> jobs;
  std::string task_type = "worker";
  int task_index = 0;

  // Parses and validates TF_CONFIG JSON. Throws InvalidArgumentError naming
  // the problem for every malformed case: not JSON, not an object, missing
  // "cluster" or "task", unknown job name, a job that is not a list of
  // "host:port" strings, duplicate addresses, more than one chief, a task type
  // that is not a job of the cluster, an index that is not an integer or out
  // of range, unknown top-level keys.
  static ClusterSpec from_tf_config(const std::string& json);

  // Throws InvalidArgumentError if the spec is malformed (same rules).
  void validate() const;

  // Tasks of a job (0 if absent).
  int num_tasks(const std::string& job) const;
  // Training processes: chief + worker + ps.
  int world_size() const;
  // Processes that run replicas: chief + worker.
  int num_workers() const;
  // This task's process rank (chief, worker, ps order); -1 for an evaluator.
  int rank() const;
  // The task at `rank` as {type, index}.
  std::pair<std::string, int> task_of_rank(int rank) const;
  // Roles present in the cluster, in rank order ("chief", "worker", "ps"),
  // then "evaluator" if present.
  std::vector<std::string> roles() const;
  // This task's address.
  const std::string& address() const;

  // ClusterInfo of this task (local placement left at one process per node).
  ClusterInfo info() const;
};

// Where a process sits on its host (from the launcher or set explicitly).
struct Placement {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // position among the processes on this node
  int local_size = 1;  // processes on this node
  int node = 0;        // node index (nodes numbered by their lowest rank)
  int num_nodes = 1;
};

// Groups ranks into virtual nodes of `ranks_per_node` consecutive ranks, as
// if they ran on different hosts (the last node may be smaller). 0 = keep.
Placement virtual_nodes(const Placement& real, int ranks_per_node);

// Where the cluster came from.
enum class ClusterSource { kExplicit, kTfConfig, kMpi, kSingleProcess, kSlurm };

// How a Slurm step maps onto the cluster (TensorFlow's SlurmClusterResolver
// arguments; see diststrat/slurm.h).
struct SlurmOptions {
  // Job name ("chief", "worker", "ps") -> tasks; the counts must add up to
  // the step's tasks. Tasks are given to jobs in rank order chief, worker,
  // ps (TensorFlow sorts job names instead), so SLURM_PROCID is the process
  // rank and the ps tasks are the last ones. Empty: every task a worker.
  std::map<std::string, int> jobs;
  // Task addresses are host:(port_base + local id).
  int port_base = 8888;
  // Tasks on every node, overriding SLURM_STEP_TASKS_PER_NODE (0 = Slurm's).
  int tasks_per_node = 0;
  // GPUs on each node (0..1024); -1: as many as SLURM_STEP_GPUS /
  // SLURM_JOB_GPUS list (0 when neither is set).
  int gpus_per_node = -1;
  // GPUs of each task (0..1024); -1: gpus_per_node divided by the most tasks
  // on a node (an error when that is 0 but the node has GPUs).
  int gpus_per_task = -1;
  // Set CUDA_VISIBLE_DEVICES to this task's GPUs when a SlurmClusterResolver
  // is constructed from the environment (resolve_cluster never sets it).
  bool auto_set_gpu = true;
};
const char* cluster_source_name(ClusterSource source);

struct ClusterConfig {
  // Explicit cluster; when jobs is empty, TF_CONFIG / the MPI launcher are used.
  ClusterSpec spec;
  // Read TF_CONFIG when no explicit spec is given.
  bool use_tf_config = true;
  // Read Slurm's step variables when there is neither (in_slurm_step()).
  bool use_slurm = true;
  SlurmOptions slurm;
  // Ranks per virtual node (0 = real nodes). DISTSTRAT_VIRTUAL_NODE_SIZE
  // overrides it when set (used by the tests to exercise the multi-node path
  // on one host).
  int virtual_node_size = 0;
};

struct ResolvedCluster {
  ClusterSource source = ClusterSource::kSingleProcess;
  ClusterSpec spec;     // always filled (the MPI source makes a worker job)
  ClusterInfo info;     // task type/index, rank, sizes, worker index
  Placement placement;  // node grouping (after virtual grouping)
};

// Resolves from `config`, TF_CONFIG, or the MPI launcher (initializing MPI if
// this build has it and it is not initialized yet). Blocking (the MPI path is
// collective over MPI_COMM_WORLD, every MPI call bounded by
// CommunicationOptions' default timeout). Throws InvalidArgumentError for a
// malformed TF_CONFIG or a cluster that disagrees with the launcher's
// rank/size (or DISTSTRAT_VIRTUAL_NODE_SIZE that is not an integer
// 0..1000000); under a launcher every rank throws together: the failing
// ranks their own error, the others AbortedError naming the first of them.
ResolvedCluster resolve_cluster(const ClusterConfig& config = {});

}  // namespace diststrat
