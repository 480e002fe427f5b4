// Lease files. <dir>/gpu-<id>.lock exists while its GPU is held, and is
// created and written only by its holder:
//   acquire: openat(O_CREAT | O_EXCL | O_NOFOLLOW) -> fchmod 0644 (our new file)
//            -> OFD write lock (F_OFD_SETLK) -> the name still names our file?
//            -> write the holder record
//   release: unlink (still locked) -> close (drops the lock)
//   crash:   the kernel drops the lock; the file stays, stale. Its owner's next
//            acquire removes it, under the write lock, so that it never removes
//            a file someone holds; in the sticky directory nobody else can.
//   probe:   F_OFD_GETLK: held = a write lock is on the file. Probing takes no
//            lock, so it never disturbs an acquire; a write lock needs the file
//            open for writing, which only its owner (or root) can do, so another
//            user can neither fake "held" nor rewrite the record.
// Files found at the path (links, FIFOs, other users' files) are opened
// without following links and without blocking, only for reading, read up to
// kMaxRecordBytes, and never changed. Threat model: docs/gpu.md.
#include "diststrat/gpu_lease.h"

#include <dirent.h>
#include <fcntl.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "core/env.h"
#include "diststrat/error.h"
#include "core/file_util.h"

namespace diststrat {

namespace {

using fs::Fd;

constexpr const char* kPrefix = "gpu-";
constexpr const char* kSuffix = ".lock";

std::string errno_text() { return std::strerror(errno); }

void check_id(const std::string& id) {
  DISTSTRAT_CHECK(!id.empty() && id.size() < 200, kInvalidArgument, "GPU lease id '", id,
                  "' is empty or too long");
  for (char c : id) {
    DISTSTRAT_CHECK(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.',
                    kInvalidArgument, "GPU lease id '", id,
                    "' may hold only letters, digits, '-', '_' and '.'");
  }
}

std::string lock_path(const std::string& dir, const std::string& id) {
  return dir + "/" + kPrefix + id + kSuffix;
}

std::string self_command() {
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  while (!raw.empty() && raw.back() == '\0') raw.pop_back();
  for (char& c : raw) {
    if (c == '\0') c = ' ';
    if (c == '\n') c = ' ';
  }
  return raw.size() > 400 ? raw.substr(0, 400) + "..." : raw;
}

// getpwuid_r: leases are taken from several threads at once (one per worker
// in in-process jobs), and getpwuid's static buffer is shared.
std::string user_name(uid_t uid) {
  const long hint = ::sysconf(_SC_GETPW_R_SIZE_MAX);
  std::vector<char> buf(hint > 0 ? static_cast<size_t>(hint) : 16384);
  passwd pw{};
  passwd* found = nullptr;
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) == 0 && found) return found->pw_name;
  return "uid " + std::to_string(uid);
}

// "user alice (uid 1000)"
std::string owner_text(uid_t uid) {
  return "user " + user_name(uid) + " (uid " + std::to_string(uid) + ")";
}

std::string self_user() { return user_name(::geteuid()); }

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string host_name() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "";
  return buf;
}

// The record is "key=value" lines.
std::string format_holder(const LeaseHolder& h) {
  std::ostringstream os;
  os << "pid=" << h.pid << "\nuser=" << h.user << "\ncommand=" << h.command << "\nsince=" << h.since
     << "\nhost=" << h.host << "\n";
  return os.str();
}

// The record is read by other users' terminals (diststrat-smi, error
// messages): control characters become '?'.
LeaseHolder parse_holder(const std::string& text) {
  LeaseHolder h;
  std::istringstream is(text);
  std::string line;
  while (std::getline(is, line)) {
    const auto eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string k = line.substr(0, eq);
    std::string v = line.substr(eq + 1);
    for (char& c : v) {
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
    }
    if (k == "pid")
      h.pid = std::atoi(v.c_str());
    else if (k == "user")
      h.user = v;
    else if (k == "command")
      h.command = v;
    else if (k == "since")
      h.since = v;
    else if (k == "host")
      h.host = v;
  }
  return h;
}

// A holder record is about 600 bytes (the command line is cut at 400).
constexpr size_t kMaxRecordBytes = 4096;

std::string mode_text(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

bool same_file(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

// Whether `name` in the directory still names the file open as `fd`.
bool names_file(int dir_fd, const std::string& name, int fd) {
  struct stat by_name {
  }, by_fd{};
  return ::fstatat(dir_fd, name.c_str(), &by_name, AT_SYMLINK_NOFOLLOW) == 0 &&
         ::fstat(fd, &by_fd) == 0 && same_file(by_name, by_fd);
}

// Takes the write lock on the whole file without waiting; false when another
// open file description has a lock on it. OFD locks: per open file, not per
// process, so two leases of one process exclude each other.
bool try_write_lock(int fd, const std::string& path) {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  if (::fcntl(fd, F_OFD_SETLK, &fl) == 0) return true;
  if (errno == EAGAIN || errno == EACCES) return false;
  throw InternalError("GPU lease " + path + ": fcntl(F_OFD_SETLK) failed: " + errno_text());
}

// Whether someone holds the write lock: a lease holder, since only the file's
// owner (or root) can open it for writing. Read locks that any reader can take
// on a 0644 file do not count.
bool write_locked(int fd) {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  if (::fcntl(fd, F_OFD_GETLK, &fl) != 0) return false;
  return fl.l_type == F_WRLCK;
}

// The holder of the open lock file, if it is held. The user is the file's
// owner (who alone can write the record), not what the record says.
std::optional<LeaseHolder> holder_of(int fd, const struct stat& st) {
  if (!write_locked(fd)) return std::nullopt;
  LeaseHolder h = parse_holder(fs::read_prefix(fd, kMaxRecordBytes));
  h.user = user_name(st.st_uid);
  if (h.pid == 0) h.command = "(holder record not written yet)";
  return h;
}

// A directory that no other unprivileged user can change under us: owned by
// root or by us, and not writable by others unless sticky (then others cannot
// remove or rename what is ours). `what` names it in errors.
void check_directory(const struct stat& st, const std::string& what) {
  const uid_t me = ::geteuid();
  if (st.st_uid != 0 && st.st_uid != me) {
    throw PermissionDeniedError(
        "GPU lease directory " + what + " is owned by " + owner_text(st.st_uid) +
        ", who could remove or replace the lock files of other users' leases; use a directory "
        "owned by root (e.g. `install -d -m 1777 -o root -g root DIR`) or by you "
        "(LeaseOptions::lock_dir, DISTSTRAT_GPU_LEASE_DIR)");
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0) {
    throw PermissionDeniedError("GPU lease directory " + what + " (mode " + mode_text(st.st_mode) +
                                ") is writable by other users but not sticky, so they could "
                                "remove or replace lock files; chmod +t it (mode 1777, like /tmp)");
  }
}

// Opens the lease directory, creating it (mode 1777) when `create`, and
// checks it and every directory above it. -1 when it is absent and !create.
int open_lease_dir(const std::string& dir, bool create) {
  bool created = false;
  if (create) {
    if (::mkdir(dir.c_str(), 0700) == 0) {
      created = true;
    } else if (errno != EEXIST) {
      const int err = errno;
      fs::throw_errno(err, "GPU lease directory " + dir + ": mkdir failed");
    }
  }
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ENOENT && !create) return -1;
    struct stat lst {};
    if ((err == ELOOP || err == ENOTDIR) && ::lstat(dir.c_str(), &lst) == 0) {
      throw PermissionDeniedError("GPU lease directory " + dir + " is " +
                                  fs::file_kind(lst.st_mode) + " (owned by " +
                                  owner_text(lst.st_uid) +
                                  "), not a directory; lease directories are not followed "
                                  "through links");
    }
    fs::throw_errno(err, "GPU lease directory " + dir + ": open failed");
  }
  struct stat st {};
  DISTSTRAT_CHECK(::fstat(fd.get(), &st) == 0, kInternal, "GPU lease directory ", dir,
                  ": fstat failed: ", errno_text());
  if (created && st.st_uid == ::geteuid()) {
    // Ours, just made: shared by every user of the host, like /tmp.
    DISTSTRAT_CHECK(::fchmod(fd.get(), 01777) == 0 && ::fstat(fd.get(), &st) == 0, kInternal,
                    "GPU lease directory ", dir, ": fchmod 1777 failed: ", errno_text());
  }
  check_directory(st, dir);
  // Above it: a directory others could rename entries in would let them swap
  // the lease directory itself. Walk up through "..", which needs no names.
  std::string above = dir;
  Fd cur(::dup(fd.get()));
  for (int depth = 0; depth < 256 && cur.get() >= 0; ++depth) {
    Fd up(::openat(cur.get(), "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    struct stat cst {
    }, ust{};
    if (up.get() < 0 || ::fstat(cur.get(), &cst) != 0 || ::fstat(up.get(), &ust) != 0) break;
    if (same_file(cst, ust)) break;  // "/"
    above += "/..";
    check_directory(ust, above + " (above " + dir + ")");
    cur.reset(up.release());
  }
  return fd.release();
}

// The holder of the lock file `name` in the directory, if it is held. Never
// blocks, never follows a link; a file that is not a regular file is not held.
std::optional<LeaseHolder> probe(int dir_fd, const std::string& name) {
  Fd fd(::openat(dir_fd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) return std::nullopt;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  return holder_of(fd.get(), st);
}

// One attempt at taking the lease.
struct Attempt {
  enum Outcome {
    kTaken,     // fd holds the lease
    kRetry,     // the file came or went meanwhile (or we removed our stale one): again at once
    kHeld,      // holder holds it
    kUnlocked,  // a lock file nobody holds that we may not remove (yet): owner
  } outcome = kRetry;
  int fd = -1;
  LeaseHolder holder;
  uid_t owner = 0;
};

Attempt try_take(int dir_fd, const std::string& name, const std::string& path) {
  Attempt a;
  Fd fresh(::openat(dir_fd, name.c_str(),
                    O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644));
  if (fresh.get() >= 0) {
    // Ours: readable by every user whatever the umask, writable by us alone.
    DISTSTRAT_CHECK(::fchmod(fresh.get(), 0644) == 0, kInternal, "GPU lease ", path,
                    ": fchmod failed: ", errno_text());
    if (try_write_lock(fresh.get(), path)) {
      // A job of ours cleaning up "stale" files may have removed it before we
      // locked it; then the lock guards nothing.
      if (names_file(dir_fd, name, fresh.get())) {
        a.outcome = Attempt::kTaken;
        a.fd = fresh.release();
      }
      return a;
    }
    // A reader's read lock came first. The file stays, stale; we remove it on
    // a later attempt (under the write lock, as for any stale file of ours).
    a.outcome = Attempt::kUnlocked;
    a.owner = ::geteuid();
    return a;
  }
  const int create_err = errno;
  if (create_err == EACCES || create_err == EPERM) {
    throw PermissionDeniedError("GPU lease " + path +
                                ": cannot create it: " + std::strerror(create_err));
  }
  if (create_err != EEXIST) fs::throw_errno(create_err, "GPU lease " + path + ": open failed");

  // A file is there: read it, never follow, never block, never change it.
  Fd fd(::openat(dir_fd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    struct stat lst {};
    if (err == ENOENT || ::fstatat(dir_fd, name.c_str(), &lst, AT_SYMLINK_NOFOLLOW) != 0) return a;
    if (err == ELOOP) {
      throw PermissionDeniedError("GPU lease " + path + " is a symbolic link (owned by " +
                                  owner_text(lst.st_uid) +
                                  "), not a lock file; lock files are never followed through "
                                  "links. Its owner or root must remove it");
    }
    if (err == EACCES) {
      throw PermissionDeniedError("GPU lease " + path + " (owned by " + owner_text(lst.st_uid) +
                                  ", mode " + mode_text(lst.st_mode) +
                                  ") cannot be read, so it is no lock file a holder made (they "
                                  "are 0644); its owner or root must remove it");
    }
    fs::throw_errno(err, "GPU lease " + path + ": open failed");
  }
  struct stat st {};
  DISTSTRAT_CHECK(::fstat(fd.get(), &st) == 0, kInternal, "GPU lease ", path,
                  ": fstat failed: ", errno_text());
  if (!S_ISREG(st.st_mode)) {
    throw PermissionDeniedError("GPU lease " + path + " is not a regular file (" +
                                fs::file_kind(st.st_mode) + ", owned by " + owner_text(st.st_uid) +
                                "); its owner or root must remove it");
  }
  if (auto h = holder_of(fd.get(), st)) {
    a.outcome = Attempt::kHeld;
    a.holder = *h;
    return a;
  }
  if (!names_file(dir_fd, name, fd.get())) return a;  // released meanwhile
  a.owner = st.st_uid;
  if (st.st_uid != ::geteuid()) {
    // Someone else's: being set up by its creator, or stale. Not ours to remove.
    a.outcome = Attempt::kUnlocked;
    return a;
  }
  if (st.st_nlink != 1) {
    throw PermissionDeniedError("GPU lease " + path + " has " + std::to_string(st.st_nlink) +
                                " hard links, so it is no lock file a holder made; remove it");
  }
  // A stale file of ours (a job of ours died holding it, or is just creating
  // it): remove it under the write lock, which no holder of it can then have.
  Fd w(::openat(dir_fd, name.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (w.get() < 0 && errno != ENOENT) {
    throw PermissionDeniedError("GPU lease " + path + " (yours, mode " + mode_text(st.st_mode) +
                                ", no one holds it) cannot be opened for writing: " + errno_text() +
                                "; remove it");
  }
  struct stat wst {};
  if (w.get() < 0 || ::fstat(w.get(), &wst) != 0 || !same_file(st, wst)) return a;
  if (!try_write_lock(w.get(), path)) {
    a.outcome = Attempt::kUnlocked;  // a reader's read lock, or another job of ours cleaning it
    return a;
  }
  if (names_file(dir_fd, name, w.get())) ::unlinkat(dir_fd, name.c_str(), 0);
  return a;
}

}  // namespace

std::string LeaseHolder::to_string() const {
  std::ostringstream os;
  os << "pid " << pid << " (user " << (user.empty() ? "?" : user) << ", command '" << command
     << "', since " << (since.empty() ? "?" : since);
  if (!host.empty()) os << ", host " << host;
  os << ")";
  return os.str();
}

std::string resolve_lease_dir(const LeaseOptions& options) {
  if (!options.lock_dir.empty()) return options.lock_dir;
  if (auto env = env::text("DISTSTRAT_GPU_LEASE_DIR")) return *env;
  return "/tmp/diststrat-gpu-leases";
}

GpuLease GpuLease::acquire(const std::string& gpu_id, const LeaseOptions& options) {
  check_id(gpu_id);
  const std::string dir = resolve_lease_dir(options);
  Fd dir_fd(open_lease_dir(dir, /*create=*/true));
  const std::string name = kPrefix + gpu_id + kSuffix;
  const std::string path = lock_path(dir, gpu_id);
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + options.wait_timeout;
  // A file nobody holds is normal for a moment (its creator has not locked it
  // yet; a reader's read lock is in the way); past this grace it is stale.
  const auto grace = std::chrono::milliseconds(200);
  std::optional<std::chrono::steady_clock::time_point> unlocked_since;
  int retries = 0;  // in a row
  for (;;) {
    Attempt a = try_take(dir_fd.get(), name, path);
    const auto now = std::chrono::steady_clock::now();
    if (a.outcome == Attempt::kTaken) {
      Fd fd(a.fd);
      LeaseHolder me;
      me.pid = static_cast<int>(::getpid());
      me.user = self_user();
      me.command = self_command();
      me.since = utc_now();
      me.host = host_name();
      const std::string record = format_holder(me);
      if (::pwrite(fd.get(), record.data(), record.size(), 0) !=
          static_cast<ssize_t>(record.size())) {
        const std::string why = errno_text();
        ::unlinkat(dir_fd.get(), name.c_str(), 0);
        throw InternalError("GPU lease " + path + ": writing the holder record failed: " + why);
      }
      GpuLease lease;
      lease.fd_ = fd.release();
      lease.dir_fd_ = dir_fd.release();
      lease.gpu_id_ = gpu_id;
      lease.path_ = path;
      return lease;
    }
    if (a.outcome == Attempt::kRetry) {
      unlocked_since.reset();
      // Files coming and going as fast as we look: someone is racing us on
      // purpose, or a bug; never spin without bound.
      DISTSTRAT_CHECK(++retries < 10000, kUnavailable, "GPU lease ", path,
                      ": the lock file keeps changing; try again");
      if (retries > 10) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    retries = 0;
    if (a.outcome == Attempt::kUnlocked) {
      if (!unlocked_since) unlocked_since = now;
      if (now - *unlocked_since >= grace && a.owner != ::geteuid()) {
        throw PermissionDeniedError(
            "GPU " + gpu_id + ": lock file " + path + " belongs to " + owner_text(a.owner) +
            " and no one holds it (stale: its job ended without releasing it, or the file was "
            "planted); only its owner or root can remove it from the lease directory");
      }
      if (now - *unlocked_since >= grace && !options.wait) {
        throw UnavailableError("GPU " + gpu_id + ": lock file " + path +
                               " is locked by a process that does not hold the lease (a reader); "
                               "try again");
      }
    } else {  // kHeld
      unlocked_since.reset();
      if (!options.wait) {
        throw ResourceExhaustedError("GPU " + gpu_id + " is leased by " + a.holder.to_string() +
                                     "; wait for it (LeaseOptions::wait), pick another GPU, or "
                                     "see diststrat-smi (lock file " +
                                     path + ")");
      }
    }
    if (options.wait && now >= deadline) {
      const std::string who =
          a.outcome == Attempt::kHeld ? a.holder.to_string() : "a process that is not a holder";
      throw DeadlineExceededError(detail::str_cat("GPU ", gpu_id, " still leased by ", who,
                                                  " after waiting ", options.wait_timeout.count(),
                                                  " ms (lock file ", path, ")"));
    }
    std::this_thread::sleep_for(a.outcome == Attempt::kHeld
                                    ? options.poll_interval
                                    : std::min<std::chrono::milliseconds>(
                                          options.poll_interval, std::chrono::milliseconds(5)));
  }
}

GpuLease::GpuLease(GpuLease&& o) noexcept
    : fd_(o.fd_), dir_fd_(o.dir_fd_), gpu_id_(std::move(o.gpu_id_)), path_(std::move(o.path_)) {
  o.fd_ = -1;
  o.dir_fd_ = -1;
}

GpuLease& GpuLease::operator=(GpuLease&& o) noexcept {
  if (this != &o) {
    release();
    fd_ = o.fd_;
    dir_fd_ = o.dir_fd_;
    gpu_id_ = std::move(o.gpu_id_);
    path_ = std::move(o.path_);
    o.fd_ = -1;
    o.dir_fd_ = -1;
  }
  return *this;
}

GpuLease::~GpuLease() { release(); }

void GpuLease::release() {
  if (fd_ < 0) return;
  // Unlinked while still locked: no one can take a lease on this file after
  // us, and the next holder creates a new one. (Only root could have replaced
  // the name meanwhile; then it is not ours to remove.)
  const std::string name = kPrefix + gpu_id_ + kSuffix;
  if (dir_fd_ >= 0 && names_file(dir_fd_, name, fd_)) ::unlinkat(dir_fd_, name.c_str(), 0);
  ::close(fd_);
  fd_ = -1;
  if (dir_fd_ >= 0) ::close(dir_fd_);
  dir_fd_ = -1;
}

std::optional<LeaseHolder> query_lease(const std::string& gpu_id, const LeaseOptions& options) {
  check_id(gpu_id);
  Fd dir_fd(open_lease_dir(resolve_lease_dir(options), /*create=*/false));
  if (dir_fd.get() < 0) return std::nullopt;
  return probe(dir_fd.get(), kPrefix + gpu_id + kSuffix);
}

std::vector<std::pair<std::string, LeaseHolder>> list_leases(const LeaseOptions& options) {
  std::vector<std::pair<std::string, LeaseHolder>> out;
  Fd dir_fd(open_lease_dir(resolve_lease_dir(options), /*create=*/false));
  if (dir_fd.get() < 0) return out;
  const int list_fd = ::dup(dir_fd.get());
  DIR* d = list_fd >= 0 ? ::fdopendir(list_fd) : nullptr;
  if (!d) {
    if (list_fd >= 0) ::close(list_fd);
    return out;
  }
  const std::string prefix = kPrefix, suffix = kSuffix;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0 ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    const std::string id = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
    try {
      check_id(id);  // no lease has another name; nor will a terminal escape be printed
    } catch (const InvalidArgumentError&) {
      continue;
    }
    if (auto h = probe(dir_fd.get(), name)) out.emplace_back(id, *h);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

}  // namespace diststrat
