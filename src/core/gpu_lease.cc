// Leases are advisory flock(2) locks. Lifecycle of a lock file:
//   acquire: open(O_CREAT) -> flock(LOCK_EX | LOCK_NB) -> ftruncate + write the holder
//   release: ftruncate(0) -> close (drops the lock)
//   crash:   the kernel drops the lock; the stale holder text stays but a
//            reader that can take a shared lock knows the lease is free.
#include "diststrat/gpu_lease.h"

#include <dirent.h>
#include <fcntl.h>
#include <pwd.h>
#include <sys/file.h>
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

namespace diststrat {

namespace {

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

void ensure_dir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 01777) == 0) {
    ::chmod(dir.c_str(), 01777);  // shared by every user of the host, like /tmp
    return;
  }
  DISTSTRAT_CHECK(errno == EEXIST, kInternal, "GPU lease directory ", dir,
                  ": mkdir failed: ", errno_text());
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

std::string self_user() {
  // getpwuid_r: leases are taken from several threads at once (one per
  // worker in in-process jobs), and getpwuid's static buffer is shared.
  const uid_t uid = ::geteuid();
  const long hint = ::sysconf(_SC_GETPW_R_SIZE_MAX);
  std::vector<char> buf(hint > 0 ? static_cast<size_t>(hint) : 16384);
  passwd pw{};
  passwd* found = nullptr;
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) == 0 && found) return found->pw_name;
  return "uid " + std::to_string(uid);
}

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
  os << "pid=" << h.pid << "\nuser=" << h.user << "\ncommand=" << h.command
     << "\nsince=" << h.since << "\nhost=" << h.host << "\n";
  return os.str();
}

LeaseHolder parse_holder(const std::string& text) {
  LeaseHolder h;
  std::istringstream is(text);
  std::string line;
  while (std::getline(is, line)) {
    const auto eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string k = line.substr(0, eq), v = line.substr(eq + 1);
    if (k == "pid") h.pid = std::atoi(v.c_str());
    else if (k == "user") h.user = v;
    else if (k == "command") h.command = v;
    else if (k == "since") h.since = v;
    else if (k == "host") h.host = v;
  }
  return h;
}

std::string read_all(int fd) {
  std::string out;
  char buf[4096];
  off_t off = 0;
  for (;;) {
    const ssize_t n = ::pread(fd, buf, sizeof(buf), off);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    off += n;
  }
  return out;
}

// The holder of the lock file at `path` if it is locked now.
std::optional<LeaseHolder> probe(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::optional<LeaseHolder> out;
  if (::flock(fd, LOCK_SH | LOCK_NB) == 0) {
    ::flock(fd, LOCK_UN);  // free: whatever text is there is stale
  } else if (errno == EWOULDBLOCK) {
    LeaseHolder h = parse_holder(read_all(fd));
    if (h.pid == 0) h.command = "(holder record not written yet)";
    out = h;
  }
  ::close(fd);
  return out;
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
  ensure_dir(dir);
  const std::string path = lock_path(dir, gpu_id);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  DISTSTRAT_CHECK(fd >= 0, kInternal, "GPU lease ", path, ": open failed: ", errno_text());
  ::fchmod(fd, 0666);  // another user's job must be able to open it to learn the holder
  const auto deadline = std::chrono::steady_clock::now() + options.wait_timeout;
  for (;;) {
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) break;
    const int err = errno;
    if (err != EWOULDBLOCK && err != EINTR) {
      ::close(fd);
      throw InternalError("GPU lease " + path + ": flock failed: " + std::strerror(err));
    }
    if (err == EINTR) continue;
    const std::optional<LeaseHolder> holder = probe(path);
    const std::string who = holder ? holder->to_string() : "another process";
    if (!options.wait) {
      ::close(fd);
      throw ResourceExhaustedError("GPU " + gpu_id + " is leased by " + who +
                                   "; wait for it (LeaseOptions::wait), pick another GPU, or "
                                   "see diststrat-smi (lock file " + path + ")");
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      ::close(fd);
      throw DeadlineExceededError(detail::str_cat(
          "GPU ", gpu_id, " still leased by ", who, " after waiting ",
          options.wait_timeout.count(), " ms (lock file ", path, ")"));
    }
    std::this_thread::sleep_for(options.poll_interval);
  }
  LeaseHolder me;
  me.pid = static_cast<int>(::getpid());
  me.user = self_user();
  me.command = self_command();
  me.since = utc_now();
  me.host = host_name();
  const std::string record = format_holder(me);
  if (::ftruncate(fd, 0) != 0 ||
      ::pwrite(fd, record.data(), record.size(), 0) != static_cast<ssize_t>(record.size())) {
    const std::string why = errno_text();
    ::close(fd);
    throw InternalError("GPU lease " + path + ": writing the holder record failed: " + why);
  }
  GpuLease lease;
  lease.fd_ = fd;
  lease.gpu_id_ = gpu_id;
  lease.path_ = path;
  return lease;
}

GpuLease::GpuLease(GpuLease&& o) noexcept
    : fd_(o.fd_), gpu_id_(std::move(o.gpu_id_)), path_(std::move(o.path_)) {
  o.fd_ = -1;
}

GpuLease& GpuLease::operator=(GpuLease&& o) noexcept {
  if (this != &o) {
    release();
    fd_ = o.fd_;
    gpu_id_ = std::move(o.gpu_id_);
    path_ = std::move(o.path_);
    o.fd_ = -1;
  }
  return *this;
}

GpuLease::~GpuLease() { release(); }

void GpuLease::release() {
  if (fd_ < 0) return;
  if (::ftruncate(fd_, 0) != 0) {
    // The lock goes anyway; a stale record is ignored by readers.
  }
  ::close(fd_);
  fd_ = -1;
}

std::optional<LeaseHolder> query_lease(const std::string& gpu_id, const LeaseOptions& options) {
  check_id(gpu_id);
  return probe(lock_path(resolve_lease_dir(options), gpu_id));
}

std::vector<std::pair<std::string, LeaseHolder>> list_leases(const LeaseOptions& options) {
  std::vector<std::pair<std::string, LeaseHolder>> out;
  const std::string dir = resolve_lease_dir(options);
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  const std::string prefix = kPrefix, suffix = kSuffix;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0 ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    const std::string id = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
    if (auto h = probe(dir + "/" + name)) out.emplace_back(id, *h);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

}  // namespace diststrat
