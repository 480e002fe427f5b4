// CheckpointManager: keeps the last K checkpoints of a directory, with a
// `latest` pointer, and finds the newest good one to restore.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "core/flight_recorder.h"
#include "core/file_util.h"
#include "core/user_text.h"
#include "diststrat/checkpoint_manager.h"
#include "io/checkpoint_identity.h"
#include "io/checkpoint_internal.h"

namespace diststrat {

using ckpt::broadcast_string;
using ckpt::is_multi_process;
using ckpt::is_writer;
using ckpt::kReservedPrefix;
using ckpt::on_chief_then_agree;

// ---- CheckpointManager ---------------------------------------------------------
//
// What the manager owns: "ckpt-<N>.safetensors" whose verified header carries
// kManagerStepKey == N (written by CheckpointManager::save), and the shard
// files of its parameter-server saves (ckpt::is_own_shard_file). Only those
// are pruned or counted towards max_to_keep; anything else in the directory
// (a stray file with a checkpoint's name, a renamed copy, another tool's
// file) is left alone.

namespace {
constexpr const char* kLatest = "latest";
// `latest` holds one file name: a few KiB is plenty, more is damage.
constexpr uint64_t kMaxLatestBytes = 4096;

bool parse_step_file(const std::string& name, int64_t* step) {
  static const std::string pre = "ckpt-", suf = ".safetensors";
  if (name.size() <= pre.size() + suf.size() || name.rfind(pre, 0) != 0 ||
      name.compare(name.size() - suf.size(), suf.size(), suf) != 0) {
    return false;
  }
  const std::string digits = name.substr(pre.size(), name.size() - pre.size() - suf.size());
  return digits.size() <= 18 && digits[0] != '-' &&
         ckpt::parse_int(digits, 0, std::numeric_limits<int64_t>::max(), step);
}

// The names in `dir`; none when it does not exist. Any other failure is an
// error: an unlistable directory must not look like an empty one (a silent
// fresh start).
std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) {
    if (errno == ENOENT) return out;
    fs::throw_errno(errno, "checkpoint directory '" + dir + "': cannot list it");
  }
  while (dirent* e = ::readdir(d)) out.emplace_back(e->d_name);
  ::closedir(d);
  return out;
}

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// "<base>.tmp.<pid>.<n>" (write_file_atomically) or "<base>.tmp.<pid>.probe"
// (the constructor's check) for a base this manager or its PS ranks write.
bool is_own_temp_file(const std::string& name) {
  const size_t t = name.rfind(".tmp.");
  if (t == std::string::npos) return false;
  const std::string base = name.substr(0, t), rest = name.substr(t + 5);
  const size_t dot = rest.find('.');
  if (dot == std::string::npos || !all_digits(rest.substr(0, dot))) return false;
  const std::string n = rest.substr(dot + 1);
  if (!all_digits(n) && n != "probe") return false;
  int64_t step;
  return base == kLatest || base == ckpt::kManifestFile || parse_step_file(base, &step) ||
         ckpt::parse_shard_file_name(base).has_value();
}

// The `latest` pointer as read: absent, naming a checkpoint file, or damaged.
struct Pointer {
  enum State { kAbsent, kNames, kDamaged } state = kAbsent;
  std::string name;     // kNames
  std::string problem;  // kDamaged
};

// The header CRC of a verified manager checkpoint at `path`; "" when it is
// unreadable, unverified or not a manager's.
std::string header_crc(const std::string& path) {
  try {
    const ckpt::SafetensorsHeader h = ckpt::read_safetensors_header(path);
    auto crc = h.metadata.find(ckpt::kHeaderCrcMetadataKey);
    if (!h.verified || crc == h.metadata.end() || !h.metadata.count(ckpt::kManagerStepKey))
      return "";
    return crc->second;
  } catch (const Error&) {
    return "";
  }
}

Pointer read_pointer(const std::string& dir, const ckpt::DirectoryIdentity& id) {
  const std::string path = dir + "/" + kLatest;
  Pointer p;
  // `latest` itself: a regular file of the directory's user. A symlink, or
  // one another user planted, is damage: never followed, never believed.
  const std::string owner = ckpt::ownership_problem(dir, kLatest, id);
  if (!owner.empty()) {
    p.state = Pointer::kDamaged;
    p.problem = "'" + path + "' is " + owner;
    return p;
  }
  std::string text;
  try {
    fs::ReadOptions o;
    o.max_bytes = kMaxLatestBytes;  // a FIFO or a huge file is damage, not something to wait on
    o.follow_symlinks = false;
    text = fs::read_text_file(path, "'" + path + "'", o);
  } catch (const NotFoundError&) {
    return p;
  } catch (const DataLossError& e) {
    p.state = Pointer::kDamaged;
    p.problem = e.message();
    return p;
  } catch (const PermissionDeniedError& e) {
    p.state = Pointer::kDamaged;  // a symlink swapped in after the check above
    p.problem = e.message();
    return p;
  }
  std::string name = text.substr(0, text.find('\n'));
  if (!name.empty() && name.back() == '\r') name.pop_back();
  int64_t step;
  if (!parse_step_file(name, &step)) {
    p.state = Pointer::kDamaged;
    p.problem = "'" + path + "' names '" + echo(name) + "', which is not a checkpoint file";
    return p;
  }
  // What it names: not a link, not another user's file, not a checkpoint
  // the manifest does not list (damage in a listed one is for the restore
  // to report).
  std::string why = ckpt::ownership_problem(dir, name, id);
  if (why.empty()) why = ckpt::manifest_problem(dir, name, header_crc(dir + "/" + name), id);
  if (!why.empty()) {
    p.state = Pointer::kDamaged;
    p.problem =
        "'" + path + "' names '" + name + "', which is not this manager's checkpoint: " + why;
    return p;
  }
  p.state = Pointer::kNames;
  p.name = name;
  return p;
}

// The checkpoint-named files of a directory: the manager's own (by step,
// ascending) and the others with the reason they are not.
struct Scan {
  std::vector<std::pair<int64_t, std::string>> own;
  std::vector<std::pair<std::string, std::string>> foreign;  // (name, why)
};

Scan scan(const std::string& dir, const ckpt::DirectoryIdentity& id) {
  Scan sc;
  for (const std::string& n : list_dir(dir)) {
    int64_t step;
    if (!parse_step_file(n, &step)) continue;
    std::string why = ckpt::ownership_problem(dir, n, id);
    if (why.empty()) try {
        const ckpt::SafetensorsHeader h = ckpt::read_safetensors_header(dir + "/" + n);
        auto it = h.metadata.find(ckpt::kManagerStepKey);
        int64_t st = -1;
        if (!h.verified) {
          why = "no diststrat checksums";
        } else if (it == h.metadata.end()) {
          why = "not written by a CheckpointManager (no '" + std::string(ckpt::kManagerStepKey) +
                "')";
        } else if (!ckpt::parse_int(it->second, 0, std::numeric_limits<int64_t>::max(), &st) ||
                   st != step) {
          why = "its metadata says step '" + echo(it->second, 24) + "' (a renamed copy?)";
        } else {
          auto crc = h.metadata.find(ckpt::kHeaderCrcMetadataKey);
          why = ckpt::manifest_problem(dir, n, crc == h.metadata.end() ? "" : crc->second, id);
        }
      } catch (const Error& e) {
        why = e.message();
      }
    if (why.empty() && n != "ckpt-" + std::to_string(step) + ".safetensors")
      why = "not the name a save gives it";
    if (why.empty()) {
      sc.own.emplace_back(step, n);
    } else {
      sc.foreign.emplace_back(n, why);
    }
  }
  std::sort(sc.own.begin(), sc.own.end());
  std::sort(sc.foreign.begin(), sc.foreign.end());
  return sc;
}

std::string describe(const std::vector<std::pair<std::string, std::string>>& files) {
  std::string out;
  const size_t shown = std::min<size_t>(files.size(), 5);
  for (size_t i = 0; i < shown; ++i)
    out += (i ? "; " : "") + files[i].first + " (" + files[i].second + ")";
  if (files.size() > shown) out += "; and " + std::to_string(files.size() - shown) + " more";
  return out;
}

std::string damaged_pointer_message(const std::string& dir, const Pointer& p) {
  return "checkpoint directory '" + dir + "': its 'latest' pointer is damaged: " + p.problem;
}

// The manifest a directory without one starts with: the checkpoint `latest`
// names, when both are regular files of ours and it is a verified manager
// checkpoint (a directory from before manifests, or one copied whole). Other
// checkpoints already there cannot be proven ours: never pruned.
std::map<std::string, std::string> initial_manifest(const std::string& dir,
                                                    const ckpt::DirectoryIdentity& id) {
  std::map<std::string, std::string> listed;
  const Pointer p = read_pointer(dir, id);
  if (p.state != Pointer::kNames) return listed;
  const std::string crc = header_crc(dir + "/" + p.name);
  if (!crc.empty()) listed[p.name] = crc;
  return listed;
}
}  // namespace

std::optional<std::string> latest_checkpoint(const std::string& directory) {
  const ckpt::DirectoryIdentity id = ckpt::reader_identity(directory);
  const Pointer p = read_pointer(directory, id);
  if (p.state == Pointer::kNames) return directory + "/" + p.name;
  if (p.state == Pointer::kDamaged) throw DataLossError(damaged_pointer_message(directory, p));
  const Scan sc = scan(directory, id);
  if (sc.own.empty()) return std::nullopt;
  return directory + "/" + sc.own.back().second;
}

CheckpointManager::CheckpointManager(const Checkpoint& checkpoint, std::string directory,
                                     CheckpointManagerOptions options)
    : checkpoint_(&checkpoint), directory_(std::move(directory)), options_(options) {
  DISTSTRAT_CHECK(options_.max_to_keep >= 1, kInvalidArgument, "CheckpointManager: max_to_keep ",
                  options_.max_to_keep, " must be at least 1");
  DISTSTRAT_CHECK(!directory_.empty(), kInvalidArgument, "CheckpointManager: empty directory");
  DISTSTRAT_CHECK(options_.checkpoint_interval >= 0, kInvalidArgument,
                  "CheckpointManager: checkpoint_interval ", options_.checkpoint_interval,
                  " must not be negative");
  DISTSTRAT_CHECK(std::isfinite(options_.keep_checkpoint_every_n_hours) &&
                      options_.keep_checkpoint_every_n_hours >= 0,
                  kInvalidArgument, "CheckpointManager: keep_checkpoint_every_n_hours ",
                  options_.keep_checkpoint_every_n_hours, " must be a finite number >= 0");
  constructed_at_ = now();
  checkpoint.participant().check_checkpoint_supported(checkpoint.strategy(),
                                                      "CheckpointManager('" + directory_ + "')");
  // A restore-only reader touches nothing in the directory.
  if (options_.read_only) return;
  // The directory is usable now, not 50 steps later: created if absent, a
  // directory, writable. Every process learns the chief's outcome.
  on_chief_then_agree(
      checkpoint.strategy(), "to prepare checkpoint directory '" + directory_ + "'", [&] {
        // The probe is named by process and thread: two managers made at once
        // on one directory (threads of one process) must not collide.
        fs::ensure_writable_directory(
            directory_,
            std::string(kLatest) + ".tmp." + std::to_string(::getpid()) + "." +
                std::to_string(std::hash<std::thread::id>()(std::this_thread::get_id())) + ".probe",
            "CheckpointManager");
        // Owned by us or root, not writable by others unless sticky; its
        // manifest read, or started now (with what `latest` names, carried
        // forward from a directory without one).
        ckpt::check_directory_owner(directory_);
        ckpt::DirectoryIdentity id = ckpt::writer_identity(directory_);
        if (!id.has_manifest) {
          ckpt::write_manifest(directory_, initial_manifest(directory_, id));
          id = ckpt::writer_identity(directory_);
        }
        // Temporary files of saves that a crash interrupted: our names, and
        // files we own (never another user's, whatever its name).
        for (const std::string& n : list_dir(directory_)) {
          if (!is_own_temp_file(n)) continue;
          struct stat st {};
          const std::string p = directory_ + "/" + n;
          if (::lstat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == id.uid)
            ::unlink(p.c_str());
        }
        report_ignored(scan(directory_, id).foreign);
      });
  // A hang's flight records go next to the checkpoints (unless
  // DISTSTRAT_FLIGHT_RECORDER_DIR says otherwise).
  flight::set_checkpoint_directory(directory_ + "/flight-records");
}

ckpt::DirectoryIdentity CheckpointManager::identity() const {
  return options_.read_only ? ckpt::reader_identity(directory_) : ckpt::writer_identity(directory_);
}

void CheckpointManager::report_ignored(
    const std::vector<std::pair<std::string, std::string>>& foreign) {
  std::vector<std::pair<std::string, std::string>> fresh;
  for (const auto& f : foreign) {
    if (reported_ignored_.insert(f.first).second) fresh.push_back(f);
  }
  if (fresh.empty()) return;
  checkpoint_->strategy().logger().warning(
      "checkpoint directory '", directory_, "': ignoring ", fresh.size(),
      " file(s) with checkpoint names that are not this run's checkpoints (never counted towards "
      "max_to_keep, ",
      "pruned, or restored by restore_latest; Checkpoint::restore(path) restores one on purpose): ",
      describe(fresh));
}

std::optional<std::string> CheckpointManager::latest() const {
  return latest_checkpoint(directory_);
}

double CheckpointManager::now() const {
  if (!options_.clock) {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  // An injected clock's value goes into the manifest: checked first (a NaN
  // there would make the manifest unreadable).
  const double t = options_.clock();
  DISTSTRAT_CHECK(std::isfinite(t) && t >= 0, kInvalidArgument, "CheckpointManager '", directory_,
                  "': options.clock returned ", t, "; it must give finite seconds >= 0");
  return t;
}

std::vector<std::string> CheckpointManager::checkpoints() const {
  const ckpt::DirectoryIdentity id = identity();
  std::vector<std::string> out;
  for (const auto& [step, name] : scan(directory_, id).own) {
    if (!id.kept.count(name)) out.push_back(directory_ + "/" + name);
  }
  return out;
}

std::optional<std::string> CheckpointManager::restore_or_initialize(
    const std::function<void()>& init_fn, const RestoreOptions& options) {
  if (restore_latest(options)) return restored_path_;
  if (init_fn) init_fn();
  return std::nullopt;
}

std::string CheckpointManager::save(int64_t step, const CheckpointMetadata& metadata,
                                    bool check_interval) {
  DISTSTRAT_CHECK(!options_.read_only, kFailedPrecondition, "CheckpointManager::save(", step,
                  ") into '", directory_, "': the manager was made with read_only = true");
  DISTSTRAT_CHECK(step >= 0, kInvalidArgument, "CheckpointManager::save: negative step ", step);
  // TensorFlow's checkpoint_interval: too soon after the last one, no save
  // (every process decides alike: same steps, same options).
  if (check_interval && options_.checkpoint_interval > 0 && last_step_ &&
      step - *last_step_ < options_.checkpoint_interval) {
    return "";
  }
  // Read before anything is written: a bad injected clock fails the save
  // with nothing left behind.
  const double saved_at = options_.keep_checkpoint_every_n_hours > 0 ? now() : 0.0;
  const std::string name = "ckpt-" + std::to_string(step) + ".safetensors";
  const std::string path = directory_ + "/" + name;
  CheckpointMetadata md = metadata;
  for (const auto& [k, v] : md) {
    DISTSTRAT_CHECK(k.rfind(kReservedPrefix, 0) != 0, kInvalidArgument, "CheckpointManager::save '",
                    path, "': metadata key '", k, "' uses the reserved prefix 'diststrat.'");
  }
  md[ckpt::kManagerStepKey] = std::to_string(step);  // what marks the file as this manager's
  SaveOptions so;
  so.allow_non_finite = options_.allow_non_finite;
  Strategy& s = checkpoint_->strategy();
  // A file under that name that is not one of this run's saves (another
  // run's checkpoint copied in, or a save of ours interrupted before the
  // manifest listed it) is kept under another name, never overwritten.
  on_chief_then_agree(s, "to make room for '" + path + "'", [&] {
    struct stat st {};
    // (Only a regular file: anything else there makes the write fail, naming it.)
    if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
    const ckpt::DirectoryIdentity id = identity();
    if (!id.has_manifest) return;
    const auto listed = id.listed.find(name);
    if (listed != id.listed.end() && header_crc(path) == listed->second) return;  // ours
    const std::string aside = path + ".replaced-" + std::to_string(::time(nullptr));
    if (::rename(path.c_str(), aside.c_str()) != 0) {
      fs::throw_errno(errno, "CheckpointManager::save: cannot move '" + path +
                                 "' (not one of this run's saves) aside to '" + aside + "'");
    }
    s.logger().warning("CheckpointManager: '", path,
                       "' was not one of this run's saves (not in its manifest); kept as '", aside,
                       "' and not overwritten by the checkpoint of step ", step);
  });
  checkpoint_->write(path, md, so);
  // The checkpoint is complete on disk; only now does `latest` point at it.
  on_chief_then_agree(s, "to update '" + directory_ + "/latest'", [&] {
    // The manifest lists it before `latest` names it: `latest` never names a
    // checkpoint this run would not recognize as its own.
    ckpt::DirectoryIdentity id = identity();
    const std::string crc = header_crc(path);
    DISTSTRAT_CHECK(!crc.empty(), kDataLoss, "CheckpointManager::save: checkpoint '", path,
                    "' just written has no verifiable header");
    id.listed[name] = crc;
    id.has_manifest = true;
    const double hours = options_.keep_checkpoint_every_n_hours;
    if (hours > 0) id.saved_at[name] = saved_at;
    ckpt::write_manifest(directory_, id.listed, id.saved_at, id.kept);
    const std::string text = name + "\n";
    write_file_atomically(directory_ + "/" + kLatest, text.data(), text.size());
    Scan sc = scan(directory_, id);
    report_ignored(sc.foreign);
    if (std::find(sc.own.begin(), sc.own.end(), std::make_pair(step, name)) == sc.own.end()) {
      sc.own.emplace_back(step,
                          name);  // just written: ours even if its header cannot be re-read now
      std::sort(sc.own.begin(), sc.own.end());
    }
    const size_t keep = static_cast<size_t>(options_.max_to_keep);
    // Checkpoints kept every n hours are neither counted nor pruned.
    size_t managed = 0;
    for (const auto& o : sc.own) managed += id.kept.count(o.second) ? 0 : 1;
    // The last one kept for good (before any: when this manager started).
    double last_kept = id.newest_kept_time().value_or(constructed_at_);
    bool newly_kept = false;
    std::set<std::string> kept_shards;  // shard files a kept (sharded) checkpoint names
    for (size_t i = 0, m = 0; i < sc.own.size(); ++i) {
      const std::string p = directory_ + "/" + sc.own[i].second;
      const bool counted = !id.kept.count(sc.own[i].second);
      bool prune = counted && m + keep < managed && sc.own[i].second != name;
      m += counted ? 1 : 0;
      auto at = id.saved_at.find(sc.own[i].second);
      if (prune && hours > 0 && at != id.saved_at.end() &&
          at->second >= last_kept + hours * 3600.0) {
        // TensorFlow's keep_checkpoint_every_n_hours: kept for good instead.
        id.kept.insert(sc.own[i].second);
        last_kept = at->second;
        newly_kept = true;
        prune = false;
      }
      if (prune) {
        // The index first: a crash in between leaves orphans, never an index without shards.
        ::unlink(p.c_str());
      } else {
        for (const std::string& f : ckpt::shard_files_of(p))
          kept_shards.insert(fs::file_name_of(f));
      }
    }
    // Files that are not ours keep whatever shard files they name.
    for (const auto& f : sc.foreign) {
      for (const std::string& sf : ckpt::shard_files_of(directory_ + "/" + f.first)) {
        kept_shards.insert(fs::file_name_of(sf));
      }
    }
    // Our shard files of pruned checkpoints and of saves that never got their index.
    for (const std::string& n : list_dir(directory_)) {
      if (kept_shards.count(n) || !ckpt::parse_shard_file_name(n)) continue;
      // Another user's file is never ours, whatever its header says.
      if (!ckpt::ownership_problem(directory_, n, id).empty()) continue;
      if (ckpt::is_own_shard_file(directory_ + "/" + n)) ::unlink((directory_ + "/" + n).c_str());
    }
    // Pruned (or vanished) checkpoints leave the manifest.
    const bool changed = id.forget_missing(directory_) || newly_kept;
    if (changed) ckpt::write_manifest(directory_, id.listed, id.saved_at, id.kept);
  });
  last_step_ = step;
  return path;
}

std::optional<CheckpointMetadata> CheckpointManager::restore_latest(const RestoreOptions& options) {
  Strategy& s = checkpoint_->strategy();
  const bool writer = is_writer(s);
  // The chief decides what to try, newest first; every process tries the same.
  std::string plan;
  on_chief_then_agree(s, "to find the latest checkpoint in '" + directory_ + "'", [&] {
    const ckpt::DirectoryIdentity id = identity();
    const Pointer p = read_pointer(directory_, id);
    if (p.state == Pointer::kDamaged && !options.fall_back_to_valid) {
      throw DataLossError(damaged_pointer_message(directory_, p));
    }
    const Scan sc = scan(directory_, id);
    report_ignored(sc.foreign);
    std::vector<std::string> names;
    if (p.state == Pointer::kNames) {
      names.push_back(p.name);
    } else if (sc.own.empty()) {
      if (p.state == Pointer::kDamaged) {
        throw DataLossError(
            damaged_pointer_message(directory_, p) +
            "; and no checkpoint of this manager to fall back to" +
            (sc.foreign.empty() ? std::string() : " (found: " + describe(sc.foreign) + ")"));
      }
      if (sc.foreign.empty()) return;  // an empty directory: a fresh start
      // Never a silent fresh start over files that look like checkpoints.
      throw FailedPreconditionError(
          "checkpoint directory '" + directory_ +
          "' has no usable 'latest' pointer, and none of its checkpoint " +
          "files is this manager's (written by its CheckpointManager runs, owned by this user): " +
          describe(sc.foreign) +
          ". Restore one explicitly (Checkpoint::restore) or move them away to start from scratch");
    } else {
      s.logger().warning("checkpoint directory '", directory_, "': ",
                         p.state == Pointer::kAbsent
                             ? "'" + directory_ + "/latest' is missing"
                             : "its 'latest' pointer is damaged (" + p.problem + ")",
                         "; restoring the newest checkpoint this manager wrote, '", directory_, "/",
                         sc.own.back().second, "'");
    }
    // The fallback order, newest first: the manager's own checkpoints to try,
    // and, older than the first candidate, the other checkpoint-named files
    // (damaged headers, strays), which are passed over but named as they are
    // ("?<name>\t<why>" in the plan). They are not verifiably ours: never tried, never pruned.
    std::vector<std::pair<int64_t, std::string>> order;
    for (auto it = sc.own.rbegin(); it != sc.own.rend(); ++it) {
      if (names.empty() || it->second != names.front()) order.emplace_back(it->first, it->second);
    }
    // The first candidate: what `latest` names, else the newest of our own (order is not empty then).
    const std::string first = names.empty() ? order.front().second : names.front();
    int64_t first_step = 0;
    if (parse_step_file(first, &first_step)) {
      for (const auto& [n, why] : sc.foreign) {
        int64_t st;
        if (n != first && parse_step_file(n, &st) && st < first_step) {
          order.emplace_back(st, "?" + n + "\t" + echo(why, 1000));
        }
      }
    }
    std::stable_sort(order.begin(), order.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    for (const auto& o : order) names.push_back(o.second);
    if (!options.fall_back_to_valid) names.resize(1);
    for (const std::string& n : names) plan += (plan.empty() ? "" : "\n") + n;
  });
  if (is_multi_process(s)) plan = broadcast_string(s, plan, "checkpoint restore plan");
  if (plan.empty()) return std::nullopt;
  std::vector<std::string> candidates, skip_why;  // skip_why non-empty: passed over, not tried
  for (size_t i = 0; i <= plan.size();) {
    const size_t nl = std::min(plan.find('\n', i), plan.size());
    std::string line = plan.substr(i, nl - i), why;
    if (!line.empty() && line[0] == '?') {
      const size_t tab = line.find('\t');
      why = tab == std::string::npos ? "unreadable" : line.substr(tab + 1);
      line = line.substr(1, tab == std::string::npos ? std::string::npos : tab - 1);
    }
    candidates.push_back(directory_ + "/" + line);
    skip_why.push_back(why);
    i = nl + 1;
  }
  std::string failures;
  ErrorCode first_code = ErrorCode::kDataLoss;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (!skip_why[i].empty()) {
      const std::string msg =
          "checkpoint '" + candidates[i] + "' is skipped (" + skip_why[i] +
          "): it cannot be verified as this manager's, so it is neither tried nor pruned";
      failures += (failures.empty() ? "" : "; ") + msg;
      if (writer && i + 1 < candidates.size()) {
        s.logger().warning(msg, "; falling back to '", candidates[i + 1], "'");
      }
      continue;
    }
    try {
      CheckpointMetadata md = checkpoint_->restore(candidates[i], options);
      restored_path_ = candidates[i];
      int64_t step = 0;
      if (parse_step_file(fs::file_name_of(candidates[i]), &step)) {
        restored_step_ = step;
        last_step_ = step;
      }
      return md;
    } catch (const Error& e) {
      // Only a checkpoint that is damaged or incomplete is skipped; a model
      // mismatch, a permission or I/O problem is the caller's to see.
      const bool unusable = e.code() == ErrorCode::kDataLoss || e.code() == ErrorCode::kNotFound;
      if (!options.fall_back_to_valid || !unusable) throw;
      if (i == 0) first_code = e.code();
      failures += (failures.empty() ? "" : "; ") + e.message();
      if (writer && i + 1 < candidates.size()) {
        s.logger().warning("checkpoint '", candidates[i], "' cannot be restored (", e.message(),
                           "); falling back to '", candidates[i + 1], "'");
      }
    }
  }
  throw_error(first_code, "checkpoint directory '" + directory_ +
                              "': no checkpoint could be restored: " + failures);
}

}  // namespace diststrat
