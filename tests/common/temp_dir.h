// Temporary directories for tests: private (mode 0700, mkdtemp) directories
// under $TMPDIR (default /tmp), removed with everything in them.
//
// Two forms:
//  - TempDir: an RAII object, removed at the end of its scope. Use it where
//    the directory lives in one scope.
//  - temp_dir(prefix): a path removed when the process that created it ends
//    normally (return from main / exit(), not _exit or a signal). Use it where
//    the path is passed around by value, and under mpirun where one rank makes
//    the job's directory (it outlives every test; main's final collective
//    keeps the other ranks from still using it).
// Both remove only directories the calling process created: a forked child
// that exits, or destroys a copy of a parent's object, leaves the parent's
// directories alone. Creating is thread-safe; failure throws
// std::runtime_error naming the template and the errno text (gtest reports a
// throw in a test body as a failure of that test).
#pragma once

#include <ftw.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace diststrat_test {

// $TMPDIR without trailing slashes, or /tmp when unset or empty.
inline std::string temp_root() {
  const char* env = std::getenv("TMPDIR");
  std::string root = env != nullptr && *env != '\0' ? env : "/tmp";
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  return root;
}

// Creates $TMPDIR/<prefix>XXXXXX and returns its path; nobody removes it.
// Throws std::runtime_error when the prefix holds a '/' or mkdtemp fails.
inline std::string make_temp_dir(const std::string& prefix) {
  if (prefix.find('/') != std::string::npos) {
    throw std::runtime_error("temporary directory prefix '" + prefix + "' holds a '/'");
  }
  const std::string tmpl = temp_root() + "/" + prefix + "XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) {
    const int err = errno;
    throw std::runtime_error("cannot create a temporary directory " + tmpl + ": " +
                             std::strerror(err));
  }
  return std::string(buf.data());
}

// Removes `path` and everything under it (symbolic links themselves, never
// what they point to); errors are ignored (best effort at teardown). POSIX
// nftw, not std::filesystem: PyTorch's 2.x libtorch.so exports a copy of
// std::filesystem that crashes a program linked with it when called
// (pytorch/pytorch#133437), and the LibTorch tests include this header.
inline void remove_tree(const std::string& path) {
  ::nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int type, struct FTW*) {
        if (type == FTW_DP || type == FTW_DNR) {
          ::rmdir(p);
        } else {
          ::unlink(p);
        }
        return 0;  // go on past what cannot be removed
      },
      16, FTW_DEPTH | FTW_PHYS);
}
inline void remove_temp_dir(const std::string& path) { remove_tree(path); }

// A temporary directory removed at the end of the scope, by the process that
// created it only. Not copyable (two owners would remove it twice).
class TempDir {
 public:
  explicit TempDir(const std::string& prefix) : path_(make_temp_dir(prefix)), owner_(::getpid()) {}
  ~TempDir() {
    if (::getpid() == owner_) remove_temp_dir(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  // path() + "/" + name.
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
  pid_t owner_;
};

namespace detail {

// The directories temp_dir() made, each with the pid that made it; removed
// when static objects are destroyed at normal process exit. (A test-only
// registry: the library itself keeps no such state.)
class TempDirRegistry {
 public:
  void add(std::string path) {
    std::lock_guard<std::mutex> lock(mu_);
    dirs_.emplace_back(::getpid(), std::move(path));
  }
  ~TempDirRegistry() {
    const pid_t self = ::getpid();
    for (const auto& d : dirs_) {
      if (d.first == self) remove_temp_dir(d.second);
    }
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<pid_t, std::string>> dirs_;
};

inline TempDirRegistry& temp_dir_registry() {
  static TempDirRegistry registry;
  return registry;
}

}  // namespace detail

// Creates $TMPDIR/<prefix>XXXXXX, removed when this process exits normally.
// Throws like make_temp_dir.
inline std::string temp_dir(const std::string& prefix) {
  detail::TempDirRegistry& registry = detail::temp_dir_registry();  // constructed first
  std::string path = make_temp_dir(prefix);
  registry.add(path);
  return path;
}

}  // namespace diststrat_test
