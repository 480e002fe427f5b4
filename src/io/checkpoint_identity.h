// Which files in a checkpoint directory are this job's (issue 23, items 15
// and 16). Anyone who can read a checkpoint can copy it, and anyone who can
// write into the directory can forge its metadata, CRCs included; what they
// cannot do is create a file owned by this job's user, or add a line to a
// file only that user can write. So a checkpoint is the manager's own when
//   - it is a regular file (never a symlink) owned by the directory's
//     trusted user (this process's effective uid for a manager that writes),
//   - its header verifies and carries "diststrat.manager_step" = its step,
//   - and the directory's manifest ("<dir>/manifest", owned by that user)
//     lists its name with its header CRC: every save adds its file there
//     before `latest` names it, and pruning drops it. Another run's genuine
//     checkpoints, copied in by the same user, are not listed (or listed
//     with another CRC); a resumed run reads the same manifest back.
// Nothing run-specific goes into the checkpoint files themselves, so a
// resumed run still writes byte-identical checkpoints.
// The directory itself must be one no other unprivileged user can change
// under us (the GPU lease directory's rules): owned by us or root, and not
// writable by others unless sticky.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "diststrat/checkpoint.h"

namespace diststrat {
namespace ckpt {

// The file in a manager's directory that lists its checkpoints.
constexpr const char* kManifestFile = "manifest";

struct DirectoryIdentity {
  uid_t uid = 0;  // the owner every file of the manager has
  // Whether a manifest was found; without one (a directory from before
  // manifests, read only) every verified manager file of `uid` is own.
  bool has_manifest = false;
  std::map<std::string, std::string> listed;  // file name -> header CRC (8 hex)
  // keep_checkpoint_every_n_hours: when each listed checkpoint was saved
  // (seconds, the manager's clock; only recorded with that option), and the
  // ones kept for good (never pruned or counted).
  std::map<std::string, double> saved_at;
  std::set<std::string> kept;

  // When the newest checkpoint kept for good was saved (none: nullopt).
  std::optional<double> newest_kept_time() const;
  // Drops the listed files that are no longer in `dir` (pruned, or gone);
  // whether any was.
  bool forget_missing(const std::string& dir);
};

// "user alice (uid 1000)".
std::string owner_text(uid_t uid);

// For a manager that writes (on the chief): the directory is owned by this
// user or root and not writable by others unless sticky, else
// PermissionDeniedError naming the owner or mode.
void check_directory_owner(const std::string& dir);

// For a manager that writes: its manifest, read back. A manifest that is not
// a regular file owned by this user is a PermissionDeniedError; a malformed
// one a DataLossError. Absent: has_manifest = false.
DirectoryIdentity writer_identity(const std::string& dir);

// Writes the manifest atomically (this user's, mode 0644) listing `listed`,
// one line "<name> <crc>" each, followed by " <saved at> [kept]" for those
// `saved_at` / `kept` name (a manifest without them reads as before).
void write_manifest(const std::string& dir, const std::map<std::string, std::string>& listed,
                    const std::map<std::string, double>& saved_at = {},
                    const std::set<std::string>& kept = {});

// For readers (a read-only manager, latest_checkpoint): the manifest's owner
// and entries when it is a regular file owned by this user or by the
// directory's owner; else the directory's owner and no manifest. Never
// writes; never throws.
DirectoryIdentity reader_identity(const std::string& dir);

// Why the file `dir/name` is not one `id`'s user may have written: a
// symlink, owned by someone else; empty when it is a regular file owned by
// id.uid, or absent, or of another kind (the reader reports that).
std::string ownership_problem(const std::string& dir, const std::string& name,
                              const DirectoryIdentity& id);

// Why the checkpoint `name` with header CRC `crc` (empty: unreadable) is not
// listed by `id`'s manifest; empty when it is, or when there is no manifest.
std::string manifest_problem(const std::string& dir, const std::string& name,
                             const std::string& crc, const DirectoryIdentity& id);

}  // namespace ckpt
}  // namespace diststrat
