// A directory of checkpoints: numbered saves, a `latest` pointer, pruning of
// the manager's own files only, and restore of the newest valid one
// (TensorFlow's tf.train.CheckpointManager).
//
// Rules: CheckpointManager's constructor, save and restore_latest are
// collective in a multi-process job (every process calls them at the same
// step, only the chief touches the directory) and block, bounded by the
// strategy's timeout. latest_checkpoint is local and thread-safe. A manager
// is not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "diststrat/checkpoint.h"

namespace diststrat {
namespace ckpt {
struct DirectoryIdentity;
}

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
  // TensorFlow's checkpoint_interval: save(step) writes only when `step` is
  // at least this many steps past the last checkpoint saved or restored by
  // this manager (the first save always writes); save(step, md, false)
  // (TensorFlow's check_interval=False) writes regardless. 0 = every save
  // writes. Every process uses the same value (the decision is local).
  int64_t checkpoint_interval = 0;
  // TensorFlow's keep_checkpoint_every_n_hours: a checkpoint that pruning to
  // max_to_keep would delete is kept instead when it was saved at least this
  // many hours after the last checkpoint so kept (before any: after this
  // manager was constructed). Kept checkpoints are the manager's own
  // (restore_latest may fall back to them) but never pruned, never counted
  // towards max_to_keep and not listed by checkpoints(). 0 = off. Save
  // times are recorded in the directory's manifest.
  double keep_checkpoint_every_n_hours = 0;
  // The clock of keep_checkpoint_every_n_hours, in seconds (tests inject
  // one). Empty: the wall clock (seconds since the epoch).
  std::function<double()> clock;
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
  // max_to_keep (keeping every n hours, see the options). Returns the path
  // written; "" when checkpoint_interval skipped it (only with
  // `check_interval`, TensorFlow's save(checkpoint_number, check_interval)).
  std::string save(int64_t step, const CheckpointMetadata& metadata = {},
                   bool check_interval = true);
  // TensorFlow's CheckpointManager.checkpoints: the paths of the manager's
  // checkpoints that pruning counts, oldest first (not those kept by
  // keep_checkpoint_every_n_hours). Reads the directory; not collective.
  std::vector<std::string> checkpoints() const;
  // TensorFlow's restore_or_initialize: restore_latest(options); when the
  // directory has no checkpoint, runs `init_fn` (if any) instead. Returns
  // the path restored, or nullopt when it initialized. Collective like
  // restore_latest (every process calls it; init_fn runs on every process).
  std::optional<std::string> restore_or_initialize(const std::function<void()>& init_fn = {},
                                                   const RestoreOptions& options = {});
  // The step of restored_path(); nullopt before a restore.
  std::optional<int64_t> restored_step() const { return restored_step_; }
  // latest_checkpoint(directory()). Not collective.
  std::optional<std::string> latest() const;
  // Restores the newest checkpoint (see above); nullopt (and the model
  // untouched) when the directory has none. A failed restore changes nothing.
  std::optional<CheckpointMetadata> restore_latest(const RestoreOptions& options = {});
  // The path the last successful restore_latest restored (after a fallback,
  // not what `latest` names); nullopt before one.
  const std::optional<std::string>& restored_path() const { return restored_path_; }
  const std::string& directory() const { return directory_; }
  const Checkpoint& checkpoint() const { return *checkpoint_; }

 private:
  // The directory's trusted user and manifest (see "Which files are the manager's").
  ckpt::DirectoryIdentity identity() const;
  // Warns once per file name about checkpoint-named files that are not ours.
  void report_ignored(const std::vector<std::pair<std::string, std::string>>& foreign);

  const Checkpoint* checkpoint_;
  std::string directory_;
  CheckpointManagerOptions options_;
  std::optional<std::string> restored_path_;
  std::optional<int64_t> restored_step_;
  std::set<std::string> reported_ignored_;
  // The step of the last checkpoint saved or restored (checkpoint_interval).
  std::optional<int64_t> last_step_;
  // keep_checkpoint_every_n_hours: when this manager was constructed.
  double constructed_at_ = 0;
  double now() const;
};

}  // namespace diststrat
