// Where a training example stands, as checkpoint metadata: fashion_mnist and
// torch_fashion_mnist save it with every checkpoint and resume exactly there
// (the same batch of the same epoch), refusing a checkpoint whose data order
// differs from this run's.
#pragma once

#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "diststrat/diststrat.h"
#include "train_flags.h"

namespace diststrat_examples {

// The next batch to run is batch `batch` of `epoch`; `step` steps ran before it.
using Position = diststrat::DataPosition;

// The library's data position (diststrat/data_position.h) plus the
// example's own keys: --limit and `model` (examples/predict reads
// "mlp:784,256,256,10").
inline diststrat::CheckpointMetadata position_metadata(const TrainFlags& f,
                                                       const diststrat::DistributedDataset& dist,
                                                       const Position& p,
                                                       const std::string& model) {
  diststrat::CheckpointMetadata md = diststrat::data_position_metadata(dist, p);
  md["limit"] = std::to_string(f.limit);
  md["model"] = model;
  return md;
}

// Reads the position back (diststrat::restore_data_position: a checkpoint
// whose data order differs from this run's is refused, and one whose
// position contradicts itself or `iterations` -- the optimizer's restored step
// counter, where the loop makes one update per step -- is a DataLoss error
// naming the file and keys) and refuses one written with another --limit.
inline Position resume_position(const TrainFlags& f, const diststrat::CheckpointMetadata& md,
                                const std::string& dir, const std::string& path,
                                const diststrat::DistributedDataset& dist,
                                std::optional<int64_t> iterations) {
  namespace ds = diststrat;
  auto it = md.find("limit");
  if (it == md.end()) {
    throw ds::InvalidArgumentError("checkpoint in '" + dir +
                                   "' has no 'limit' metadata: not written by this example");
  }
  if (it->second != std::to_string(f.limit)) {
    throw ds::InvalidArgumentError("checkpoint in '" + dir + "' was written with --limit " +
                                   it->second + ", this run has " + std::to_string(f.limit) +
                                   ": the data order would differ; use the same flags");
  }
  return ds::restore_data_position(dist, md, path, iterations);
}

// The chief's line after a resume from checkpoint `from` (epochs count from 1).
inline void print_resumed(const std::string& from, const Position& pos) {
  std::printf("resumed from %s: epoch %lld, batch %lld, step %lld\n", from.c_str(),
              static_cast<long long>(pos.epoch + 1), static_cast<long long>(pos.batch),
              static_cast<long long>(pos.step));
}

// After step `pos.step` (pos = the next batch to run): with checkpoints
// (--checkpoint-dir), save every --checkpoint-every steps and, with a
// `preemption` handler, on SIGTERM (collective: every process asks at every
// step, so all stop at the same one; an elastic worker has none: SIGTERM
// ends it like any death and the group goes on); then --max-steps.
// `save(Position next, const char* why)` writes the checkpoint; the position
// saved is where the next run starts. Says whether the run goes on, and if
// not, why (the exit status depends on it: `exit_status`).
enum class StepEnd { kGoOn, kPreempted, kMaxSteps };
template <typename Save>
StepEnd end_of_step(const TrainFlags& f, const Position& pos, int64_t num_batches, bool chief,
                    diststrat::PreemptionHandler* preemption, Save&& save) {
  if (!f.checkpoint_dir.empty()) {
    Position next = pos;
    if (next.batch == num_batches) next = {pos.epoch + 1, 0, pos.step};
    const bool stop = preemption != nullptr && preemption->should_stop(pos.step);
    if (stop || (f.checkpoint_every > 0 && pos.step % f.checkpoint_every == 0)) {
      save(next, stop ? "preempted" : "checkpoint");
      if (stop) return StepEnd::kPreempted;
    }
  }
  if (f.max_steps > 0 && pos.step >= f.max_steps) {
    if (chief)
      std::printf("stopping at step %lld (--max-steps)\n", static_cast<long long>(pos.step));
    return StepEnd::kMaxSteps;
  }
  return StepEnd::kGoOn;
}

// The process's exit status once training has ended: --preempted-exit-code
// after a preemption save (not 0, so that a launcher that restarts failed
// jobs -- the MPI Operator, a Kubernetes Job, a shell loop -- starts the job
// again to resume), else 0.
inline int exit_status(const TrainFlags& f, StepEnd end) {
  return end == StepEnd::kPreempted ? f.preempted_exit_code : 0;
}

}  // namespace diststrat_examples
