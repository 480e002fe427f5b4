// Where a training example stands, as checkpoint metadata: fashion_mnist and
// torch_fashion_mnist save it with every checkpoint and resume exactly there
// (the same batch of the same epoch), refusing a checkpoint whose data order
// differs from this run's.
#pragma once

#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <utility>

#include "diststrat/diststrat.h"
#include "train_flags.h"

namespace diststrat_examples {

// The next batch to run is batch `batch` of `epoch`; `step` steps ran before it.
struct Position {
  int64_t epoch = 0, batch = 0, step = 0;
};

// `model` names the model (examples/predict reads "mlp:784,256,256,10").
inline diststrat::CheckpointMetadata position_metadata(const TrainFlags& f, const Position& p,
                                                       const std::string& model) {
  return {{"epoch", std::to_string(p.epoch)},
          {"batch", std::to_string(p.batch)},
          {"step", std::to_string(p.step)},
          {"global_batch", std::to_string(f.batch)},
          {"seed", std::to_string(f.seed)},
          {"limit", std::to_string(f.limit)},
          {"model", model}};
}

// Reads the position back and refuses a checkpoint whose data order differs
// from this run's (another batch size, seed or subset would not resume exactly).
// Every number is range-checked (diststrat::metadata_int): "step=abc" is a
// DataLoss error naming the file and key, not an exception that ends the process.
inline Position resume_position(const TrainFlags& f, const diststrat::CheckpointMetadata& md,
                                const std::string& dir, const std::string& path,
                                int64_t num_batches) {
  namespace ds = diststrat;
  auto get = [&](const char* key) -> std::string {
    auto it = md.find(key);
    if (it == md.end()) {
      throw ds::InvalidArgumentError("checkpoint in '" + dir + "' has no '" + key +
                                     "' metadata: not written by this example");
    }
    return it->second;
  };
  for (const auto& [key, mine] : {std::pair<const char*, std::string>{"global_batch", std::to_string(f.batch)},
                                  {"seed", std::to_string(f.seed)},
                                  {"limit", std::to_string(f.limit)}}) {
    if (get(key) != mine) {
      throw ds::InvalidArgumentError("checkpoint in '" + dir + "' was written with --" +
                                     (std::string(key) == "global_batch" ? "batch" : key) + " " +
                                     get(key) + ", this run has " + mine +
                                     ": the data order would differ; use the same flags");
    }
  }
  return {ds::metadata_int(md, "epoch", 0, std::numeric_limits<int>::max(), path),
          ds::metadata_int(md, "batch", 0, num_batches, path),
          ds::metadata_int(md, "step", 0, std::numeric_limits<int64_t>::max(), path)};
}

// The chief's line after a resume from checkpoint `from` (epochs count from 1).
inline void print_resumed(const std::string& from, const Position& pos) {
  std::printf("resumed from %s: epoch %lld, batch %lld, step %lld\n", from.c_str(),
              static_cast<long long>(pos.epoch + 1), static_cast<long long>(pos.batch),
              static_cast<long long>(pos.step));
}

// After step `pos.step` (pos = the next batch to run): with checkpoints
// (`preemption` non-null), save every --checkpoint-every steps and on SIGTERM
// (collective: every process asks at every step, so all stop at the same
// one); then --max-steps. `save(Position next, const char* why)` writes the
// checkpoint; the position saved is where the next run starts. Returns true
// when the run must end now.
template <typename Save>
bool end_of_step(const TrainFlags& f, const Position& pos, int64_t num_batches, bool chief,
                 diststrat::PreemptionHandler* preemption, Save&& save) {
  if (preemption) {
    Position next = pos;
    if (next.batch == num_batches) next = {pos.epoch + 1, 0, pos.step};
    const bool stop = preemption->should_stop(pos.step);
    if (stop || (f.checkpoint_every > 0 && pos.step % f.checkpoint_every == 0)) {
      save(next, stop ? "preempted" : "checkpoint");
      if (stop) return true;
    }
  }
  if (f.max_steps > 0 && pos.step >= f.max_steps) {
    if (chief) std::printf("stopping at step %lld (--max-steps)\n", static_cast<long long>(pos.step));
    return true;
  }
  return false;
}

}  // namespace diststrat_examples
