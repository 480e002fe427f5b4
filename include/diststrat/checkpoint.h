// Checkpoints: the variables of a strategy, the optimizers' slots and step
// counters, and user metadata (epoch, step, data position) in the safetensors
// format (https://github.com/huggingface/safetensors), so Python's
// `safetensors`, PyTorch and others open our files and we open theirs.
//
//   ```cpp fragment=loop
//   ds::Checkpoint ckpt(strategy, {&opt});
//   ds::CheckpointManager manager(ckpt, "ckpt", {/*max_to_keep=*/3});
//   if (auto md = manager.restore_latest())
//     epoch = ds::metadata_int(*md, "epoch", 0, 1000000, *manager.restored_path());
//   // ... train ...
//   manager.save(step, {{"epoch", std::to_string(epoch)}});
//   ```
//
// Under ParameterServerStrategy every PS rank writes its own shard file and
// the chief an index, last (docs/parameter_server.md); load_checkpoint reads
// either kind whole, and restore re-splits onto the current PS ranks.
//
// The file format and the atomic write are in diststrat/safetensors.h; the
// manager of a directory of checkpoints in diststrat/checkpoint_manager.h;
// stopping at a preemption signal in diststrat/preemption.h. This header
// includes all three, so programs written against it alone compile unchanged.
//
// Restoring checks the file against the model (missing, extra or mismatched
// tensors) BEFORE any variable is written, so a failed restore leaves the
// model untouched; a checkpoint of another model is an InvalidArgumentError
// naming the file and the tensor.
//
// Rules: Checkpoint::save and restore are collective (every process of the
// strategy calls them, in the same order) and block until every process is
// done, bounded by the strategy's timeout; they run in cross-replica context
// (not inside Strategy::run). A Checkpoint is not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "diststrat/safetensors.h"
#include "diststrat/strategy.h"

namespace diststrat {

class Optimizer;

// Reads a checkpoint written by Checkpoint::save under any strategy, whole:
// a single safetensors file as load_safetensors does, or a parameter-server
// checkpoint (an index whose "diststrat.ps_index" metadata names one shard
// file per PS rank) reassembled from its shard files into the same names a
// single file has ("<var>", "<var>/<slot>"). Every file is verified, and the
// index and shard files against each other (same save, every shard present
// once, rows covering each variable exactly); a missing shard file is a
// NotFoundError, any disagreement a DataLossError naming the file and tensor.
// `metadata` is the index's. Blocking; thread-safe.
SafetensorsFile load_checkpoint(const std::string& path,
                                const SafetensorsLoadOptions& options = {});

// ---- A model's checkpoint ------------------------------------------------------

struct RestoreOptions {
  // Accept files without diststrat checksums (written by Python/PyTorch).
  bool require_checksums = true;
  // CheckpointManager::restore_latest only: when the checkpoint `latest`
  // names is corrupt or incomplete (kDataLoss, kNotFound: a flipped byte, a
  // missing shard file, a FIFO in its place) or `latest` itself is damaged,
  // restore the newest checkpoint of the manager that does restore, with a
  // warning naming each skipped file and why. false: such a checkpoint is
  // an error, as Checkpoint::restore's is. Checkpoint::restore ignores it.
  bool fall_back_to_valid = true;
  // Allow the file to lack optimizer slots and step counters (a model-only
  // file, e.g. exported from PyTorch): those keep their current values.
  bool allow_missing_optimizer_state = false;
  // TensorFlow's expect_partial(): restore a subset. Names the checkpoint
  // saves that the file lacks keep their current values, and tensors of the
  // file that the checkpoint does not save are left unread. false (the
  // default): either kind of unmatched name is an InvalidArgumentError
  // naming each (and nothing changes). With it, the unmatched names are
  // reported, not silenced: Checkpoint::last_restore() lists them and an
  // info-level log line names them (TensorFlow's expect_partial silences its
  // warnings instead). A dtype or shape mismatch is an error either way.
  // Not under ParameterServerStrategy (UnimplementedError).
  bool expect_partial = false;
  // Restore a checkpoint whose floating-point tensors (variables, slots,
  // ZeRO slots, sync-on-read values, parameter-server shards) hold NaN or
  // +-Inf. false (the default): such a checkpoint is a DataLossError naming
  // the file and the tensors, and restore_latest (with fall_back_to_valid)
  // skips it with a warning for the newest checkpoint that is finite.
  bool allow_non_finite = false;
};

// Checkpoint::save's options.
struct SaveOptions {
  // Write the state even when a floating-point tensor (a variable, an
  // optimizer slot, a ZeRO-sharded slot, a sync-on-read value) holds NaN or
  // +-Inf. false (the default): the save is refused, on every process alike,
  // with a DataLossError naming the file and each such tensor, and nothing
  // is written. Under ParameterServerStrategy the PS ranks' shard files are
  // always checked (the option does not reach them yet).
  bool allow_non_finite = false;
};

// A checkpoint's contents matched against a model.
struct CheckpointContents {
  // Tensors to write into the model, in checkpoint names (a subset of the
  // expected names: all of them unless optimizer state may be missing).
  std::vector<std::pair<std::string, Tensor>> tensors;
  // The user metadata (reserved "diststrat." keys removed).
  CheckpointMetadata metadata;
  // Tensors of the file that no expected name matched, sorted (only when
  // match_checkpoint was allowed to leave them: RestoreOptions::expect_partial).
  std::vector<std::string> unused;
};

// Checks `file` (read from `path`) against the model state `expected` (names,
// dtypes, shapes): every expected tensor present with the same dtype and
// shape, no extra tensor. Names in `optional` may be missing. Throws
// InvalidArgumentError naming the file and every offending tensor (up to a
// few). Participants use it so that validation is written once.
// `allow_unused`: tensors of the file that are not expected are no error;
// they are listed in CheckpointContents::unused.
CheckpointContents match_checkpoint(const SafetensorsFile& file, const std::string& path,
                                    const std::vector<std::pair<std::string, Tensor>>& expected,
                                    const std::vector<std::string>& optional = {},
                                    bool allow_unused = false);

// One shard of a variable as a parameter-server rank holds it: what its
// shard file stores (ParameterServerStrategy::local_shards).
struct ShardSnapshot {
  std::string variable;  // variable name
  int64_t shard_index = 0;
  int64_t num_shards = 1;
  int64_t row_offset = 0;               // first row of the variable this shard holds
  Shape full_shape;                     // the whole variable's shape
  Tensor value;                         // the shard's rows (a copy)
  std::map<std::string, Tensor> slots;  // optimizer slots (copies)
  int64_t step = 0;                     // updates applied to this shard (Adam's t)
};

// How a strategy takes part in saving and restoring. Strategies in which every
// process holds the whole state (mirrored, multi-worker, central storage) need
// not implement it: the default below covers them (variables through
// Variable::value/assign, slots copied on the replicas' threads, so device
// copies work too). A strategy that shards its variables (parameter server)
// inherits this interface as well as Strategy and overrides what it needs;
// Checkpoint finds it with dynamic_cast.
class CheckpointParticipant {
 public:
  virtual ~CheckpointParticipant() = default;

  // Throws (UnimplementedError naming the rank and `what`) when this strategy
  // cannot be checkpointed correctly, so that nothing silently wrong is ever
  // written or restored. Checkpoint::save/restore and the CheckpointManager
  // constructor call it on every process before any collective. Default:
  // supported.
  virtual void check_checkpoint_supported(Strategy& strategy, const std::string& what);

  // Whether write_checkpoint needs the full state (Checkpoint::state()). A
  // strategy whose servers write their own shards returns false and gets an
  // empty `state`. Default: true.
  virtual bool needs_state_to_write() const;

  // PreemptionHandler::should_stop's agreement: returns true on every process
  // at the same `step` once any process was `signalled`. Called by every
  // process at every checked step. Default: a max-reduction over every
  // replica in sync (Strategy::reduce). The parameter server's workers do not
  // reduce across workers; they agree through PS 0 without waiting for each
  // other (docs/parameter_server.md).
  virtual bool agree_to_stop(Strategy& strategy, int64_t step, bool signalled);

  // One optimizer slot: Variable::Impl::slot(name) of `var`.
  struct SlotRef {
    Variable::Impl* var;
    std::string slot;
  };
  // Host copies of `slots` (cross-replica values). Default: inside one
  // Strategy::run, local replica 0 copies its copy of each slot to the host,
  // so device-resident copies are read on their replica's thread and stream;
  // mirrored copies are equal, so one is the value. Every process calls it.
  virtual std::vector<Tensor> read_slots(Strategy& strategy, const std::vector<SlotRef>& slots);
  // Writes host `values` into every local copy of `slots`. Default: inside
  // one Strategy::run, replica i writes copy i (a single host copy, as in
  // central storage, is written by replica 0).
  virtual void assign_slots(Strategy& strategy, const std::vector<SlotRef>& slots,
                            const std::vector<Tensor>& values);
  // Writes the checkpoint file(s) for `path`. `state` is the full state in
  // checkpoint names (variables, "<var>/<slot>", iterations). `metadata` may
  // carry reserved "diststrat." keys (CheckpointManager marks its files with
  // one); write them unchanged, into the file that `path` names. Default: the
  // chief (or the only process) writes one file, then every process learns
  // the chief's success or error through Strategy::broadcast (a collective:
  // all processes call it). A sharded strategy writes its shards plus an
  // index (the parameter server: every PS rank writes its shard file, then
  // the chief writes the index, last).
  virtual void write_checkpoint(Strategy& strategy, const std::string& path,
                                const std::vector<std::pair<std::string, Tensor>>& state,
                                const CheckpointMetadata& metadata);
  // Reads and validates the checkpoint at `path` against `expected` (see
  // match_checkpoint; `optional` names may be missing). Default: the chief
  // reads and validates (load_checkpoint: either format), then broadcasts a
  // status, the tensors and the metadata, so only the chief needs to see the
  // file and every process fails together. A participant that writes the
  // state into the model itself once everything is validated (the parameter
  // server: shards re-split onto the current PS ranks, slots and per-shard
  // step counters included) returns no tensors, only the metadata.
  virtual CheckpointContents read_checkpoint(
      Strategy& strategy, const std::string& path,
      const std::vector<std::pair<std::string, Tensor>>& expected,
      const std::vector<std::string>& optional, const RestoreOptions& options);
};

struct DataPosition;
class DistributedDataset;

// One named object of a Checkpoint, as in TensorFlow's
// tf.train.Checkpoint(model=..., optimizer=...): what it saves, each tensor
// under "<object name>/...". Converts implicitly from what it saves.
class CheckpointObject {
 public:
  // Variables (a model's, a libtorch::TrainingState's variables()):
  // "<object>/<variable name>" each.
  CheckpointObject(std::vector<Variable> variables);  // NOLINT(google-explicit-constructor)
  CheckpointObject(const Variable& variable);         // NOLINT(google-explicit-constructor)
  // An optimizer's state: its step counter "<object>/iterations" and its
  // slots of every trainable float32 variable of its strategy,
  // "<object>/<variable>/<slot>". Must outlive the Checkpoint.
  CheckpointObject(const Optimizer& optimizer);  // NOLINT(google-explicit-constructor)
  // A data position (diststrat/data_position.h): int64 [1] tensors
  // "<object>/epoch", "<object>/batch", "<object>/step", written from and
  // restored into `position` (which must outlive the Checkpoint).
  CheckpointObject(DataPosition& position);  // NOLINT(google-explicit-constructor)
  // The same plus what fixes the order of `data`'s rows ("<object>/
  // global_batch", "seed", "rows", "shuffle", "drop_remainder"), checked on
  // restore as restore_data_position does: a checkpoint of another batch
  // size, seed or row count is an InvalidArgumentError naming the key, a
  // position that contradicts itself a DataLossError; nothing changes then.
  CheckpointObject(DataPosition& position, const DistributedDataset& data);

 private:
  friend class Checkpoint;
  enum class Kind { kVariables, kOptimizer, kPosition };
  Kind kind_;
  std::vector<Variable> variables_;
  const Optimizer* optimizer_ = nullptr;
  DataPosition* position_ = nullptr;
  const DistributedDataset* data_ = nullptr;
};

// A Checkpoint's named objects, e.g.
// {{"model", vars}, {"optimizer", opt}, {"position", {pos, dist}}}.
using CheckpointObjects = std::vector<std::pair<std::string, CheckpointObject>>;

// What the last Checkpoint::restore left unmatched (RestoreOptions::expect_partial).
struct RestoreReport {
  std::string path;                  // the file restored
  std::vector<std::string> missing;  // saved by the Checkpoint, absent from the file: unchanged
  std::vector<std::string> unused;   // in the file, not saved by the Checkpoint: not read
};

// Names a strategy's state for checkpoints. Two forms:
//  - Checkpoint(strategy, optimizers): every variable of the strategy under
//    its own name (optimizer step counters are variables:
//    "optimizer/iterations"), and every slot of `optimizers` for every
//    trainable variable as "<var>/<slot>";
//  - Checkpoint(objects), TensorFlow's tf.train.Checkpoint(**objects): only
//    the objects chosen, each under its name (CheckpointObject above):
//      ```cpp fragment=loop
//      ds::Checkpoint named({{"model", params}, {"optimizer", opt}});
//      ```
class Checkpoint {
 public:
  // The strategy and optimizers must outlive the Checkpoint. Variables created
  // after construction are included too (names are resolved at save/restore).
  explicit Checkpoint(Strategy& strategy, std::vector<const Optimizer*> optimizers = {});
  // The named objects (at least one variable or optimizer: the strategy is
  // theirs, one for all, else InvalidArgumentError). Names must be non-empty,
  // unique, and contain no '/'. Under ParameterServerStrategy:
  // UnimplementedError (its shards are saved by variable name).
  explicit Checkpoint(CheckpointObjects objects);

  // Writes the current state and `metadata` to `path` (see
  // CheckpointParticipant::write_checkpoint). Refuses a state holding NaN or
  // +-Inf (see SaveOptions). Cross-replica context, every process of the job
  // calls it at the same step. Blocking: first Strategy::synchronize() (the
  // device errors of the steps before it are thrown, naming their step).
  void save(const std::string& path, const CheckpointMetadata& metadata = {},
            const SaveOptions& options = {}) const;
  // Validates `path` against the model completely, then writes every variable
  // and slot. Throws (and changes nothing) on any mismatch. Returns the user
  // metadata. Cross-replica context, collective like save(). Blocking.
  CheckpointMetadata restore(const std::string& path, const RestoreOptions& options = {}) const;

  // The state as host tensors, in checkpoint names, sorted by name.
  // Collective when an optimizer shards its slots (ZeRO-1 gathers them).
  std::vector<std::pair<std::string, Tensor>> state() const;
  // Writes `state` (state()'s form) into the model: checked against the model
  // first (every name present with its dtype and shape, no extra; else
  // InvalidArgumentError naming `what` and the tensors, and nothing changes),
  // then every variable and slot (ZeRO-1 slots: each replica keeps its block).
  // Cross-replica context; collective like restore().
  void assign(const std::vector<std::pair<std::string, Tensor>>& state,
              const std::string& what) const;
  Strategy& strategy() const { return *strategy_; }
  // The names, dtypes and shapes this Checkpoint saves (values not read), sorted.
  std::vector<std::pair<std::string, Tensor>> expected_state() const;
  // What the last successful restore (or restore_latest) left unmatched:
  // empty lists unless RestoreOptions::expect_partial was set.
  const RestoreReport& last_restore() const { return last_restore_; }

 private:
  struct Entry {
    std::string name;
    Variable var;
    std::string slot;  // empty for the variable itself
    bool optimizer_state = false;
    // A data position's field ("epoch", ...): `var` is empty then.
    int position_object = -1;
    std::string field;
  };
  friend class CheckpointManager;
  // save() without the check for reserved metadata keys.
  void write(const std::string& path, const CheckpointMetadata& metadata,
             const SaveOptions& options) const;
  std::vector<Entry> entries() const;
  // An entry's name, dtype and shape (an unfilled tensor).
  static std::pair<std::string, Tensor> expected_of(const Entry& e);
  // Writes matched `tensors` (of checkpoint `path`) into the variables,
  // slots and data positions of `es`.
  void write_into_model(const std::vector<Entry>& es,
                        const std::vector<std::pair<std::string, Tensor>>& tensors,
                        const std::string& path) const;
  CheckpointParticipant& participant() const;
  // Named objects: the data positions' fields among `tensors`, checked and
  // decoded (all before any write): object index -> position.
  std::map<int, DataPosition> read_positions(
      const std::vector<std::pair<std::string, Tensor>>& tensors, const std::string& path) const;

  Strategy* strategy_;
  std::vector<const Optimizer*> optimizers_;
  CheckpointObjects objects_;  // the named form; empty for the other
  mutable RestoreReport last_restore_;
  // Used when the strategy is not itself a CheckpointParticipant (stateless).
  mutable CheckpointParticipant default_participant_;
};

}  // namespace diststrat

// The rest of the checkpoint family (see above).
#include "diststrat/checkpoint_manager.h"  // IWYU pragma: export
#include "diststrat/preemption.h"          // IWYU pragma: export
