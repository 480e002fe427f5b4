// Checkpoints: the variables of a strategy, the optimizers' slots and step
// counters, and user metadata (epoch, step, data position) in the safetensors
// format (https://github.com/huggingface/safetensors), so Python's
// `safetensors`, PyTorch and others open our files and we open theirs.
//
//   ds::Checkpoint ckpt(strategy, {&opt});
//   ds::CheckpointManager manager(ckpt, "/ckpt", {/*max_to_keep=*/3});
//   if (auto md = manager.restore_latest())
//     epoch = ds::metadata_int(*md, "epoch", 0, 1000000, *manager.restored_path());
//   ...
//   manager.save(step, {{"epoch", std::to_string(epoch)}});
//
// Under ParameterServerStrategy every PS rank writes its own shard file and
// the chief an index, last (docs/parameter_server.md); load_checkpoint reads
// either kind whole, and restore re-splits onto the current PS ranks.
//
// Files are written atomically (temporary file in the same directory, fsync,
// rename, fsync of the directory): a crash or SIGKILL at any point leaves the
// previous checkpoint loadable. Every tensor's CRC-32 and a CRC-32 of the
// header are stored in the metadata; loading verifies them and the header's
// offsets, shapes and dtypes, and restoring checks the file against the model
// (missing, extra or mismatched tensors) BEFORE any variable is written, so a
// failed restore leaves the model untouched. Corruption is a DataLossError,
// a checkpoint of another model an InvalidArgumentError, a missing file a
// NotFoundError; every message names the file and the tensor.
#pragma once

#include <csignal>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "diststrat/strategy.h"

namespace diststrat {

class Optimizer;
namespace ckpt {
struct DirectoryIdentity;
}

// User metadata: string keys and values (safetensors' __metadata__ is a
// string-to-string map). Keys starting with "diststrat." are reserved.
using CheckpointMetadata = std::map<std::string, std::string>;

// ---- The file format ---------------------------------------------------------

// One safetensors file held in memory.
struct SafetensorsFile {
  // In file order (sorted by name when we write).
  std::vector<std::pair<std::string, Tensor>> tensors;
  // __metadata__ including our reserved "diststrat." keys.
  CheckpointMetadata metadata;
  // Whether the file carried diststrat checksums (and they all matched).
  bool verified = false;
  const Tensor* find(const std::string& name) const;
};

struct SafetensorsLoadOptions {
  // Refuse files without diststrat checksums (DataLossError). Set false to
  // read files written by other tools; checksums present are always verified.
  bool require_checksums = true;
  // Accept floating-point tensors (F32, F64, F16, BF16) holding NaN or
  // +-Inf. false (the default): such a file is a DataLossError naming the
  // file, each such tensor (up to five), the count and the first bad
  // element: a checkpoint of a diverged model is as unusable as a corrupt
  // one. The scan shares the CRC's pass over the bytes.
  bool allow_non_finite = false;
};

struct SafetensorsSaveOptions {
  // Write floating-point tensors holding NaN or +-Inf. false (the default):
  // DataLossError naming the file and each such tensor, and nothing is
  // written (the previous file at `path` is untouched).
  bool allow_non_finite = false;
};

// Writes `tensors` (host tensors, any supported dtype) and `metadata`
// atomically to `path`, adding a CRC-32 per tensor and of the header. Names
// must be unique and non-empty; keys starting with "diststrat." in `metadata`
// are rejected; non-finite floats are refused unless allowed (above).
// Blocking; thread-safe for distinct paths.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const CheckpointMetadata& metadata = {},
                      const SafetensorsSaveOptions& options = {});

// Reads and fully validates a safetensors file: header length and JSON,
// dtypes, shapes against data_offsets, offsets in bounds, contiguous and
// non-overlapping, covering the whole data region; then the checksums.
// Throws NotFoundError, DataLossError or UnimplementedError (a dtype we do
// not support, e.g. U8) naming the file and tensor. Never crashes on bad
// input. Blocking; thread-safe.
SafetensorsFile load_safetensors(const std::string& path,
                                 const SafetensorsLoadOptions& options = {});
// The same from bytes in memory; `what` names the source in errors.
SafetensorsFile parse_safetensors(const uint8_t* bytes, size_t size, const std::string& what,
                                  const SafetensorsLoadOptions& options = {});

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

// Writes `bytes` to `path` atomically: a temporary file beside it
// ("<path>.tmp.<pid>.<n>"), fsync, rename over `path`, fsync of the directory.
// On failure the temporary file is removed and `path` is unchanged. A `path`
// that exists and is neither a regular file nor a symlink (a device such as
// /dev/full, a FIFO, a socket, a directory) is never replaced:
// FailedPreconditionError naming it.
void write_file_atomically(const std::string& path, const void* bytes, size_t size);

// The integer value of user metadata `key` (decimal: an optional '-' and
// digits, nothing else) checked to lie in [min, max]; `source` names the
// checkpoint in errors (CheckpointManager::restored_path(), or the path given
// to Checkpoint::restore). Throws InvalidArgumentError when `key` is absent
// (a checkpoint of another program) and DataLossError naming `source` and
// `key` when the value is no integer in range ("abc", "1e20", " 5"). Use it
// for every number a program reads back from checkpoint metadata. Thread-safe.
int64_t metadata_int(const CheckpointMetadata& md, const std::string& key, int64_t min, int64_t max,
                     const std::string& source);

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
};

// Checks `file` (read from `path`) against the model state `expected` (names,
// dtypes, shapes): every expected tensor present with the same dtype and
// shape, no extra tensor. Names in `optional` may be missing. Throws
// InvalidArgumentError naming the file and every offending tensor (up to a
// few). Participants use it so that validation is written once.
CheckpointContents match_checkpoint(const SafetensorsFile& file, const std::string& path,
                                    const std::vector<std::pair<std::string, Tensor>>& expected,
                                    const std::vector<std::string>& optional = {});

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

// Names a strategy's state for checkpoints: every variable under its own name
// (optimizer step counters are variables: "optimizer/iterations"), and every
// slot of `optimizers` for every trainable variable as "<var>/<slot>".
class Checkpoint {
 public:
  // The strategy and optimizers must outlive the Checkpoint. Variables created
  // after construction are included too (names are resolved at save/restore).
  explicit Checkpoint(Strategy& strategy, std::vector<const Optimizer*> optimizers = {});

  // Writes the current state and `metadata` to `path` (see
  // CheckpointParticipant::write_checkpoint). Refuses a state holding NaN or
  // +-Inf (see SaveOptions). Cross-replica context, every process of the job
  // calls it at the same step. Blocking.
  void save(const std::string& path, const CheckpointMetadata& metadata = {},
            const SaveOptions& options = {}) const;
  // Validates `path` against the model completely, then writes every variable
  // and slot. Throws (and changes nothing) on any mismatch. Returns the user
  // metadata. Cross-replica context, collective like save(). Blocking.
  CheckpointMetadata restore(const std::string& path, const RestoreOptions& options = {}) const;

  // The state as host tensors, in checkpoint names, sorted by name.
  std::vector<std::pair<std::string, Tensor>> state() const;
  Strategy& strategy() const { return *strategy_; }

 private:
  struct Entry {
    std::string name;
    Variable var;
    std::string slot;  // empty for the variable itself
    bool optimizer_state = false;
  };
  friend class CheckpointManager;
  // save() without the check for reserved metadata keys.
  void write(const std::string& path, const CheckpointMetadata& metadata,
             const SaveOptions& options) const;
  std::vector<Entry> entries() const;
  CheckpointParticipant& participant() const;

  Strategy* strategy_;
  std::vector<const Optimizer*> optimizers_;
  // Used when the strategy is not itself a CheckpointParticipant (stateless).
  mutable CheckpointParticipant default_participant_;
};

struct CheckpointManagerOptions {
  // Checkpoints of this manager kept; older ones are deleted after a newer
  // one is complete. Files it did not write are neither kept nor counted.
  int max_to_keep = 3;
  // A restore-only reader (an evaluator, a directory it may not write): the
  // constructor neither creates nor probes the directory nor removes stale
  // temporary files, and save() throws FailedPreconditionError. latest() and
  // restore_latest() work as usual (restore_latest never writes).
  bool read_only = false;
  // save() writes a state holding NaN or +-Inf (SaveOptions::allow_non_finite).
  // false (the default): such a save throws DataLossError naming the tensor
  // on every process, and neither `latest` nor the kept checkpoints change
  // (a diverged run never prunes good checkpoints).
  bool allow_non_finite = false;
};

// TensorFlow's tf.train.latest_checkpoint for a CheckpointManager directory:
// the checkpoint `latest` names; without a `latest` file, the newest
// checkpoint a CheckpointManager wrote there (see below), or nullopt when
// there is none. Throws DataLossError naming the file when `latest` is
// damaged (not a regular file, e.g. a FIFO; a symlink loop; over 4 KiB;
// naming no checkpoint file). Never blocks on a FIFO. Reads headers only. Blocking; thread-safe.
std::optional<std::string> latest_checkpoint(const std::string& directory);

// A directory of checkpoints "ckpt-<step>.safetensors" and a `latest` file
// naming the newest. The checkpoint is written (atomically) first and
// `latest` (atomically) after it, so `latest` always names a complete file.
// A parameter-server checkpoint is the index "ckpt-<step>.safetensors" plus
// its shard files "ckpt-<step>.ps-<i>-of-<n>.<save id>.safetensors" (written
// before the index).
//
// Which files are the manager's own (docs/checkpoints.md): a regular file
// (never a symlink) owned by this process's user, whose verified header
// carries the reserved "diststrat.manager_step" = <step> (in the index for a
// sharded one), and which the directory's manifest ("<dir>/manifest", owned
// by that user) lists with its header CRC: every save adds its file there
// before `latest` names it. A shard file is the manager's when its header's
// save id, PS and PS count match its name and it is owned by this user.
// Pruning deletes only the manager's files: beyond max_to_keep of its
// checkpoints (the index first), then its shard files that no checkpoint in
// the directory names. Anything else with a checkpoint's name (another run's
// genuine checkpoints copied in, another user's forgeries, symlinks, strays,
// renamed copies, other tools' files) is never deleted, counted or restored
// by restore_latest, and a warning names each once with why;
// Checkpoint::restore(path) restores one on purpose. A `latest` naming such
// a file, or itself a symlink or another user's file, is a damaged pointer.
//
// restore_latest:
//  - `latest` names a checkpoint: that one. If it is corrupt or incomplete
//    (kDataLoss / kNotFound), with RestoreOptions::fall_back_to_valid (the
//    default) the manager's next newest that restores is taken, with a
//    warning naming the skipped file and why; without it, the error. Files
//    with checkpoint names passed over on the way (not the manager's, e.g.
//    a damaged header) are named in a warning too, with why; never pruned.
//  - `latest` is missing: the newest checkpoint of the manager (a warning
//    names the missing pointer), falling back as above. If there are files
//    with checkpoint names but none is the manager's: FailedPreconditionError
//    naming them (never a silent fresh start over existing checkpoints).
//  - `latest` is damaged (a FIFO, a symlink loop, a huge file, a bad name): as missing, with
//    the fallback; without it, DataLossError.
//  - no checkpoint file at all: nullopt, a fresh start.
// When every candidate fails, the error (the newest one's code) names each,
// and every file passed over. A checkpoint is validated from its header
// before its data is read: a huge junk file (zeros, a bad header, trailing
// bytes) is kDataLoss at once, skipped like other damage.
// Collective in a multi-process job: every process constructs the manager
// and calls save/restore at the same step; only the chief touches the
// directory, and every process learns its outcome. Not thread-safe.
class CheckpointManager {
 public:
  // Checks the directory at once (on the chief): creates it and missing
  // parents if absent, requires a directory in which a file can be created
  // and removed. Throws FailedPreconditionError (a component is a regular
  // file), PermissionDeniedError (EACCES/EPERM/EROFS) naming the directory.
  // Refuses (PermissionDeniedError) a directory owned by another user than
  // this one or root, or writable by others without the sticky bit, and a
  // manifest that is not this user's. Starts the manifest when there is none
  // (with the checkpoint `latest` names, carried forward). Removes temporary
  // files that a crash left behind: its own names, owned by this user only.
  // With options.read_only (a restore-only evaluator): none of this; the
  // directory is only read, and save() throws FailedPreconditionError.
  CheckpointManager(const Checkpoint& checkpoint, std::string directory,
                    CheckpointManagerOptions options = {});

  // Saves as "ckpt-<step>.safetensors", updates `latest`, prunes to
  // max_to_keep. Returns the path written.
  std::string save(int64_t step, const CheckpointMetadata& metadata = {});
  // latest_checkpoint(directory()). Not collective.
  std::optional<std::string> latest() const;
  // Restores the newest checkpoint (see above); nullopt (and the model
  // untouched) when the directory has none. A failed restore changes nothing.
  std::optional<CheckpointMetadata> restore_latest(const RestoreOptions& options = {});
  // The path the last successful restore_latest restored (after a fallback,
  // not what `latest` names); nullopt before one.
  const std::optional<std::string>& restored_path() const { return restored_path_; }
  const std::string& directory() const { return directory_; }

 private:
  // The directory's trusted user and manifest (see "Which files are the manager's").
  ckpt::DirectoryIdentity identity() const;
  // Warns once per file name about checkpoint-named files that are not ours.
  void report_ignored(const std::vector<std::pair<std::string, std::string>>& foreign);

  const Checkpoint* checkpoint_;
  std::string directory_;
  CheckpointManagerOptions options_;
  std::optional<std::string> restored_path_;
  std::set<std::string> reported_ignored_;
};

// ---- Preemption ----------------------------------------------------------------

struct PreemptionOptions {
  // Signals that mean "save and exit" (the cluster's grace-period signal).
  std::vector<int> signals = {SIGTERM};
  // Steps between cross-process agreements; every process must use the same
  // value. 1 = check at every step boundary.
  int check_every = 1;
};

// TensorFlow's PreemptionCheckpointHandler: catches the preemption signal and
// lets the training loop stop at a step boundary that every process agrees on.
//
//   ds::PreemptionHandler preemption(strategy);
//   for (...) { step(); if (preemption.should_stop(step)) { manager.save(step, md); return 0; } }
//
// The signal handler only sets a flag (async-signal-safe); the flag is per
// process (signals are), shared by every PreemptionHandler alive. The
// previous handlers are restored on destruction.
class PreemptionHandler {
 public:
  explicit PreemptionHandler(Strategy& strategy, PreemptionOptions options = {});
  ~PreemptionHandler();
  PreemptionHandler(const PreemptionHandler&) = delete;
  PreemptionHandler& operator=(const PreemptionHandler&) = delete;

  // Whether this process received a preemption signal.
  bool signalled() const;
  // Collective at step boundaries: every process calls it after every step
  // with the same `step`; on steps that are multiples of check_every the
  // processes agree (CheckpointParticipant::agree_to_stop: a max-reduction
  // over every replica in sync; the parameter server's workers ask PS 0,
  // which fixes one stop step for all without holding anyone back), and it
  // returns true on every process at that same step. Cross-replica context.
  // Blocking (bounded by the strategy's timeout).
  bool should_stop(int64_t step);
  // Simulates the signal in this process (tests, or a scheduler's API hook).
  static void raise_for_testing();

 private:
  Strategy* strategy_;
  PreemptionOptions options_;
  struct SavedHandlers;
  std::unique_ptr<SavedHandlers> saved_;
};

}  // namespace diststrat
