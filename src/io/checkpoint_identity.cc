#include "io/checkpoint_identity.h"

#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>

#include "core/file_util.h"
#include "core/user_text.h"

namespace diststrat {
namespace ckpt {

namespace {

constexpr const char* kManifestHeader = "diststrat-checkpoint-manifest 1";
// Names and CRCs of at most max_to_keep checkpoints (plus a few of failed
// saves): a large manifest is damage.
constexpr uint64_t kMaxManifestBytes = 1 << 20;

std::string user_name(uid_t uid) {
  std::vector<char> buf(16384);
  struct passwd pw, *found = nullptr;
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) == 0 && found) return found->pw_name;
  return "uid " + std::to_string(uid);
}

std::string mode_text(mode_t m) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", static_cast<unsigned>(m & 07777));
  return buf;
}

bool is_hex8(const std::string& s) {
  if (s.size() != 8) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// The manifest of `dir` if it is a regular file owned by `uid` (else throws
// PermissionDeniedError); has_manifest = false when it is absent.
DirectoryIdentity read_manifest(const std::string& dir, uid_t uid) {
  DirectoryIdentity id;
  id.uid = uid;
  const std::string path = dir + "/" + kManifestFile;
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return id;
    fs::throw_errno(errno, "checkpoint directory '" + dir + "': manifest '" + path + "'");
  }
  if (!S_ISREG(st.st_mode) || st.st_uid != uid) {
    throw PermissionDeniedError(
        "checkpoint directory '" + dir + "': its manifest '" + path + "' is " +
        fs::file_kind(st.st_mode) + " owned by " + owner_text(st.st_uid) +
        ", not a regular file of " + owner_text(uid) +
        ": another user wrote into this directory, so its checkpoints cannot be told "
        "apart from forgeries; use a directory only you can write");
  }
  fs::ReadOptions o;
  o.follow_symlinks = false;
  o.max_bytes = kMaxManifestBytes;
  const std::string text = fs::read_text_file(path, "manifest '" + path + "'", o);
  std::istringstream in(text);
  std::string line;
  auto damaged = [&](const std::string& why) {
    return DataLossError(
        "checkpoint directory '" + dir + "': its manifest '" + path + "' is damaged (" + why +
        "). Remove it: the next save starts a new one (the checkpoints already there are then "
        "not this run's: never pruned, restored only by name)");
  };
  if (!std::getline(in, line) || line != kManifestHeader)
    throw damaged("first line '" + echo(line, 64) + "'");
  while (std::getline(in, line)) {
    // "<name> <crc>" [" <saved at>" [" kept"]] (keep_checkpoint_every_n_hours).
    std::istringstream fields(line);
    std::string name, crc, saved, kept, more;
    fields >> name >> crc >> saved >> kept >> more;
    double at = 0;
    bool at_ok = saved.empty();
    if (!saved.empty()) {
      char* end = nullptr;
      at = std::strtod(saved.c_str(), &end);
      at_ok = end && *end == '\0' && std::isfinite(at) && at >= 0;
    }
    if (name.empty() || !is_hex8(crc) || line.find('/') != std::string::npos || !at_ok ||
        !(kept.empty() || kept == "kept") || !more.empty() ||
        line != name + " " + crc + (saved.empty() ? "" : " " + saved) +
                    (kept.empty() ? "" : " " + kept)) {
      throw damaged("line '" + echo(line, 80) + "'");
    }
    if (id.listed.count(name)) throw damaged("'" + echo(name, 80) + "' listed twice");
    id.listed[name] = crc;
    if (!saved.empty()) id.saved_at[name] = at;
    if (!kept.empty()) id.kept.insert(name);
  }
  id.has_manifest = true;
  return id;
}

}  // namespace

std::string owner_text(uid_t uid) {
  return "user " + user_name(uid) + " (uid " + std::to_string(uid) + ")";
}

void check_directory_owner(const std::string& dir) {
  const uid_t me = ::geteuid();
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) fs::throw_errno(errno, "checkpoint directory '" + dir + "'");
  if (st.st_uid != 0 && st.st_uid != me) {
    throw PermissionDeniedError("checkpoint directory '" + dir + "' is owned by " +
                                owner_text(st.st_uid) + ", not by " + owner_text(me) +
                                " or root: its owner could replace or remove "
                                "this job's checkpoints; use a directory you own");
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0) {
    throw PermissionDeniedError(
        "checkpoint directory '" + dir + "' (mode " + mode_text(st.st_mode) +
        ") is writable by other users but not sticky, so they could remove or replace "
        "this job's checkpoints; chmod +t it (like /tmp) or use a directory only you can write");
  }
}

DirectoryIdentity writer_identity(const std::string& dir) {
  return read_manifest(dir, ::geteuid());
}

void write_manifest(const std::string& dir, const std::map<std::string, std::string>& listed,
                    const std::map<std::string, double>& saved_at,
                    const std::set<std::string>& kept) {
  std::string text = std::string(kManifestHeader) + "\n";
  for (const auto& [name, crc] : listed) {
    text += name + " " + crc;
    auto at = saved_at.find(name);
    if (at != saved_at.end()) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.3f", at->second);
      text += std::string(" ") + buf;
      if (kept.count(name)) text += " kept";
    }
    text += "\n";
  }
  write_file_atomically(dir + "/" + kManifestFile, text.data(), text.size());
}

DirectoryIdentity reader_identity(const std::string& dir) {
  DirectoryIdentity id;
  id.uid = ::geteuid();
  struct stat dst {};
  if (::stat(dir.c_str(), &dst) != 0) return id;
  struct stat st {};
  const std::string path = dir + "/" + kManifestFile;
  if (::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
      (st.st_uid == id.uid || st.st_uid == dst.st_uid)) {
    try {
      return read_manifest(dir, st.st_uid);
    } catch (const Error&) {
      // Damaged: as if absent.
    }
  }
  // No usable manifest: the directory's owner's files, when the directory
  // is not ours (an evaluator reading a trainer's directory).
  if (dst.st_uid != id.uid && dst.st_uid != 0) id.uid = dst.st_uid;
  return id;
}

std::string ownership_problem(const std::string& dir, const std::string& name,
                              const DirectoryIdentity& id) {
  const std::string path = dir + "/" + name;
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return "";
  if (S_ISLNK(st.st_mode)) {
    char target[4096];
    const ssize_t n = ::readlink(path.c_str(), target, sizeof target - 1);
    const std::string to = n > 0 ? std::string(target, static_cast<size_t>(n)) : std::string("?");
    return "a symbolic link (to '" + echo(to, 200) +
           "'); checkpoints are not followed through links";
  }
  if (S_ISREG(st.st_mode) && st.st_uid != id.uid) {
    return "owned by " + owner_text(st.st_uid) + ", not by " + owner_text(id.uid) +
           " (who writes this directory's checkpoints)";
  }
  return "";
}

std::string manifest_problem(const std::string& dir, const std::string& name,
                             const std::string& crc, const DirectoryIdentity& id) {
  if (!id.has_manifest) return "";
  auto it = id.listed.find(name);
  if (it == id.listed.end()) {
    return "not among this run's saves (not listed in '" + dir + "/" + kManifestFile +
           "'): a save that was interrupted before the manifest listed it, or another run's "
           "checkpoint copied in?";
  }
  if (!crc.empty() && it->second != crc) {
    return "not the file this run saved under that name (header CRC " + crc +
           ", the manifest lists " + it->second + "): another run's checkpoint, copied over it?";
  }
  return "";
}

std::optional<double> DirectoryIdentity::newest_kept_time() const {
  std::optional<double> newest;
  for (const std::string& k : kept) {
    auto at = saved_at.find(k);
    if (at != saved_at.end()) newest = std::max(newest.value_or(at->second), at->second);
  }
  return newest;
}

bool DirectoryIdentity::forget_missing(const std::string& dir) {
  bool any = false;
  for (auto it = listed.begin(); it != listed.end();) {
    struct stat st {};
    if (::lstat((dir + "/" + it->first).c_str(), &st) == 0) {
      ++it;
      continue;
    }
    saved_at.erase(it->first);
    kept.erase(it->first);
    it = listed.erase(it);
    any = true;
  }
  return any;
}

}  // namespace ckpt
}  // namespace diststrat
