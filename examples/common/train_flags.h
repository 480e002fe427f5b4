// The command-line flags that fashion_mnist and torch_fashion_mnist share
// (one definition, so both accept the same flags with the same defaults,
// checks and help). Each example derives its Flags from TrainFlags for what
// is its own (--split-gpus, --threads) and adds those options itself:
//
//   Flags f;                              // struct Flags : TrainFlags {...}
//   CLI::App app{"..."};
//   add_strategy_flags(app, f, "where replicas compute: cpu or gpu");
//   ...its own options...
//   add_training_flags(app, f);
//   CLI11_PARSE(app, argc, argv);
//   f.replicas_given = app.count("--replicas") > 0;
#pragma once

#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdint>
#include <string>

#include "diststrat/diststrat.h"
#include "timeout_flag.h"

namespace diststrat_examples {

struct TrainFlags {
  std::string strategy = "mirrored";
  std::string device = "cpu";
  int replicas = 2;
  bool replicas_given = false;  // set after parsing: --replicas was on the command line
  int ps = 1;
  int max_staleness = -1;
  int epochs = 3;
  int64_t batch = 128;
  float lr = 0.05f;
  float momentum = 0.9f;
  uint64_t seed = 1;
  std::string data = diststrat::kFashionMnistDir;
  int64_t limit = 0;
  int64_t test_limit = 0;
  std::string timeline;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  int max_to_keep = 3;
  int64_t max_steps = 0;
  std::string timeout;                     // seconds; empty = CommunicationOptions' default
  std::string algorithm = "auto";          // multi_worker: the all-reduce algorithm
  std::string preemption_signal = "TERM";  // the signal that means "save and exit"
  int preempted_exit_code = 143;           // the exit status after a preemption save
  // Elastic training (multi_worker, diststrat/elastic.h).
  bool elastic = false;
  std::string rendezvous;
  int min_workers = 1;
  int max_workers = 0;
  std::string worker_id;
  std::string listen_host;
  // Determinism across world sizes (diststrat/determinism.h): V virtual
  // shards per global batch; 0 = off.
  int virtual_shards = 0;
};

// --strategy, --ps, --max-staleness, --device (`device_help`: what --device
// does in this example).
inline void add_strategy_flags(CLI::App& app, TrainFlags& f, const std::string& device_help) {
  app.add_option("--strategy", f.strategy,
                 "mirrored | central_storage | multi_worker (mpirun, or TF_CONFIG by hand) | "
                 "parameter_server")
      ->capture_default_str();
  app.add_option("--ps", f.ps, "parameter_server: PS ranks (the last ranks of the job)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--max-staleness", f.max_staleness,
                 "parameter_server: steps a worker may run ahead of the slowest (-1 = async)")
      ->capture_default_str();
  app.add_option("--device", f.device, device_help)
      ->check(CLI::IsMember({"cpu", "gpu"}))
      ->capture_default_str();
}

// --replicas, the training loop's flags (--epochs ... --limit, --test-limit), --timeline,
// the checkpoint flags (--checkpoint-dir, --checkpoint-every, --max-to-keep,
// --max-steps) and --timeout.
inline void add_training_flags(CLI::App& app, TrainFlags& f) {
  app.add_option("--replicas", f.replicas,
                 "replicas (devices) per process (multi_worker, parameter_server default: 1)")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--epochs", f.epochs, "passes over the training set")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--batch", f.batch, "global batch size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--lr", f.lr, "learning rate (SGD)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--momentum", f.momentum, "SGD momentum")
      ->check(CLI::Range(0.0, 0.999))
      ->capture_default_str();
  app.add_option("--seed", f.seed, "initialization and shuffling seed")->capture_default_str();
  app.add_option("--data", f.data, "directory with the IDX files")->capture_default_str();
  app.add_option("--limit", f.limit, "use only the first N training rows (0 = all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--test-limit", f.test_limit,
                 "measure the test accuracy on only the first N test rows (0 = all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--timeline", f.timeline,
                 "write a Chrome trace (Perfetto) of the communication to FILE (multi_worker)");
  app.add_option("--checkpoint-dir", f.checkpoint_dir,
                 "save checkpoints here and resume from the latest one on start");
  app.add_option("--checkpoint-every", f.checkpoint_every,
                 "steps between checkpoints (0 = only at the end and on SIGTERM)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--max-to-keep", f.max_to_keep, "checkpoints kept")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_option("--max-steps", f.max_steps,
                 "stop (without saving) once this run's global step reaches N: simulates an "
                 "interruption (0 = no limit)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--preemption-signal", f.preemption_signal,
                 "the signal that means save and exit (Slurm: sbatch --signal=USR1@60 with USR1)")
      ->check(CLI::IsMember({"TERM", "USR1", "USR2", "INT"}))
      ->capture_default_str();
  app.add_option("--preempted-exit-code", f.preempted_exit_code,
                 "the exit status after a preemption save: not 0, so that a launcher that "
                 "restarts failed jobs (MPI Operator, Kubernetes Job) restarts this one "
                 "(143 = 128 + SIGTERM, as TensorFlow's PreemptionCheckpointHandler on GCE; "
                 "0 = report success)")
      ->check(CLI::Range(0, 255))
      ->capture_default_str();
  add_timeout_flag(app, f.timeout);
  app.add_option("--algorithm", f.algorithm,
                 "multi_worker: the all-reduce algorithm (auto, ring, halving_doubling, tree, "
                 "reduce_to_one, hierarchical; CommunicationOptions::algorithm)")
      ->check(CLI::IsMember(
          {"auto", "ring", "halving_doubling", "tree", "reduce_to_one", "hierarchical"}))
      ->capture_default_str();
  app.add_flag("--elastic", f.elastic,
               "multi_worker: elastic training (workers may die and join; started by a shell "
               "loop or srun, not mpirun; docs/elastic.md)");
  app.add_option("--rendezvous", f.rendezvous,
                 "--elastic: where workers meet, redis://host:port/job or file:///dir/job");
  app.add_option("--min-workers", f.min_workers, "--elastic: train only with at least N workers")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--max-workers", f.max_workers, "--elastic: admit at most N workers (0 = any)")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  app.add_option("--worker-id", f.worker_id,
                 "--elastic: this worker's id (default: DISTSTRAT_WORKER_ID, else host-pid)");
  app.add_option("--listen-host", f.listen_host,
                 "--elastic: the address peers reach this worker at (default: the host name)");
}

// --deterministic-across-workers V (mirrored, central_storage, multi_worker):
// the same bits on any number of replicas and workers (docs/determinism.md).
inline void add_determinism_flag(CLI::App& app, TrainFlags& f) {
  app.add_option("--deterministic-across-workers", f.virtual_shards,
                 "cut each global batch into V fixed shards and sum their gradients exactly, so "
                 "that 1, 2 or 4 replicas or workers end with the same bits (mirrored, "
                 "central_storage, multi_worker; 0 = off; docs/determinism.md)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
}

// The PreemptionHandler's options for --preemption-signal.
inline diststrat::PreemptionOptions preemption_options(const TrainFlags& f) {
  diststrat::PreemptionOptions o;
  const std::string& s = f.preemption_signal;
  o.signals = {s == "USR1" ? SIGUSR1 : s == "USR2" ? SIGUSR2 : s == "INT" ? SIGINT : SIGTERM};
  return o;
}

}  // namespace diststrat_examples
