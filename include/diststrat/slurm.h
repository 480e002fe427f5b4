// Slurm as the job engine: who this process is in a job that `srun` started
// (TensorFlow's SlurmClusterResolver), read from the step's SLURM_*
// variables and checked before anything trusts them.
//
// resolve_cluster() (cluster.h) uses it on its own inside an srun step, so a
// program launched with `srun --mpi=pmix` needs no code for it; construct a
// SlurmClusterResolver yourself to name roles (SlurmOptions::jobs), to read
// the hosts and GPUs of the step, or to set this task's visible GPUs at the
// start of main.
//
// What is read (step variables first, then the job's): SLURM_PROCID (the
// process rank), SLURM_STEP_NUM_TASKS / SLURM_NTASKS (the size),
// SLURM_STEP_NODELIST / SLURM_JOB_NODELIST (the hosts, in Slurm's hostlist
// form "h[1-3,5],gpu[001-004]"), SLURM_STEP_TASKS_PER_NODE /
// SLURM_TASKS_PER_NODE ("2(x3),1"), SLURM_NODEID, SLURM_LOCALID,
// SLURM_CPUS_PER_TASK, and for GPUs SLURM_STEP_GPUS / SLURM_JOB_GPUS (or
// CUDA_VISIBLE_DEVICES when SlurmOptions::gpus_per_node is given). Tasks must
// be laid out in blocks across the nodes (Slurm's default: consecutive ranks
// on one node); other distributions are refused by name (SLURM_DISTRIBUTION).
//
// Rules: plain values; no call blocks or communicates. Every malformed or
// inconsistent value throws InvalidArgumentError naming the variable and
// its value. set_visible_gpus() calls setenv: call it before any thread or
// GPU work starts.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "diststrat/cluster.h"

namespace diststrat {

// Expands a Slurm hostlist: "h[1-3,5]" -> h1 h2 h3 h5, "h[001-004]" (the
// lower bound's width is kept) -> h001 .. h004, "a,b[1-2]" -> a b1 b2,
// "r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2. Throws InvalidArgumentError for a
// malformed list: an empty entry or bracket ("h[]"), an unclosed or nested
// bracket ("h[1-"), a descending range ("h[3-1]"), a non-digit in a range,
// a duplicate host, a name over 255 characters, or more than 100000 hosts.
std::vector<std::string> expand_slurm_hostlist(const std::string& list);

// Expands Slurm's tasks per node: "2(x3),1" -> 2 2 2 1. Each count is at
// least 1. Throws InvalidArgumentError for a malformed list.
std::vector<int> expand_slurm_tasks_per_node(const std::string& list);

// Whether this process is a task of an srun step: SLURM_STEP_ID and
// SLURM_PROCID are set, and it was not started by an MPI launcher inside the
// allocation (mpirun's OMPI_COMM_WORLD_SIZE, Hydra's MPI_LOCALNRANKS): there
// the launcher's ranks are the truth, and the SLURM_* variables describe the
// launcher's own daemons.
bool in_slurm_step();

class SlurmClusterResolver {
 public:
  // From this process's environment. Throws FailedPreconditionError outside
  // an srun step (in_slurm_step()), InvalidArgumentError for bad values. With
  // options.auto_set_gpu and GPUs in the step, also sets this task's GPUs
  // (set_visible_gpus()).
  explicit SlurmClusterResolver(SlurmOptions options = {});
  // From the given variables (recorded environments, tests): the step
  // markers (SLURM_STEP_ID, an MPI launcher's) are not looked for; never sets
  // any variable.
  SlurmClusterResolver(SlurmOptions options, const std::map<std::string, std::string>& env);

  // The cluster: jobs of "host:port" addresses (port = port_base + the
  // task's local id), tasks given to jobs in rank order chief, worker, ps;
  // task_type/task_index of this process.
  const ClusterSpec& cluster_spec() const { return spec_; }
  // Where this process sits: rank, size, node index and local rank from
  // Slurm.
  const Placement& placement() const { return placement_; }
  // The step's hosts, in Slurm's order, and the tasks on each.
  const std::vector<std::string>& hosts() const { return hosts_; }
  const std::vector<int>& tasks_per_node() const { return tasks_per_node_; }
  // SLURM_CPUS_PER_TASK; 0 when Slurm does not say.
  int cpus_per_task() const { return cpus_per_task_; }
  // GPUs of this task as CUDA_VISIBLE_DEVICES entries (empty: no GPUs), and
  // the GPUs each task gets.
  const std::vector<std::string>& task_gpus() const { return task_gpus_; }
  int gpus_per_task() const { return gpus_per_task_; }
  // Sets CUDA_VISIBLE_DEVICES to task_gpus() (nothing when there are none).
  void set_visible_gpus() const;

 private:
  ClusterSpec spec_;
  Placement placement_;
  std::vector<std::string> hosts_;
  std::vector<int> tasks_per_node_;
  int cpus_per_task_ = 0;
  int gpus_per_task_ = 0;
  std::vector<std::string> task_gpus_;
};

}  // namespace diststrat
