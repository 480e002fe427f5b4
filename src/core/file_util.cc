// Safe opening of files the library did not just create, errno -> ErrorCode, and
// the one atomic file write.
#include "core/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <new>

namespace diststrat {
namespace fs {

ErrorCode errno_code(int err) {
  switch (err) {
    case ENOENT:
      return ErrorCode::kNotFound;
    case EACCES:
    case EPERM:
    case EROFS:
      return ErrorCode::kPermissionDenied;
    case ENOTDIR:
    case EISDIR:
    case EEXIST:
    case ENOTEMPTY:
    case EBUSY:
    case ETXTBSY:
    case ELOOP:
      return ErrorCode::kFailedPrecondition;
    case ENOSPC:
    case EDQUOT:
    case EMFILE:
    case ENFILE:
    case ENOMEM:
    case EFBIG:
      return ErrorCode::kResourceExhausted;
    case EINVAL:
    case ENAMETOOLONG:
      return ErrorCode::kInvalidArgument;
    case ETIMEDOUT:
      return ErrorCode::kDeadlineExceeded;
    default:
      return ErrorCode::kUnavailable;
  }
}

void throw_errno(int err, const std::string& what) {
  throw_error(errno_code(err), what + ": " + std::strerror(err));
}

const char* file_kind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "of an unknown kind";
}

ReadOnlyFile::ReadOnlyFile(const std::string& path, const std::string& what,
                           const ReadOptions& options)
    : what_(what) {
  int flags = O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY;
  if (!options.follow_symlinks) flags |= O_NOFOLLOW;
  int fd;
  do {
    fd = ::open(path.c_str(), flags);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    if (err == ELOOP && !options.follow_symlinks) {
      throw PermissionDeniedError(what + " is a symbolic link; refusing to follow it");
    }
    if (err == ENOENT) throw NotFoundError(what + " does not exist");
    // Following symlinks, ELOOP is a loop (or a chain over 40 deep): a damaged file, like a FIFO.
    if (err == ELOOP)
      throw_error(options.bad_file_code, what + " is a symbolic link loop: " + std::strerror(err));
    throw_errno(err, what + ": open failed");
  }
  fd_.reset(fd);  // closed by fd_ on every throw below
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    throw_errno(err, what + ": fstat failed");
  }
  if (!S_ISREG(st.st_mode)) {
    throw_error(options.bad_file_code,
                what + " is " + file_kind(st.st_mode) + ", not a regular file");
  }
  size_ = static_cast<uint64_t>(st.st_size);
  if (options.max_bytes > 0 && size_ > options.max_bytes) {
    throw_error(options.bad_file_code, what + " is " + std::to_string(size_) + " bytes, over the " +
                                           std::to_string(options.max_bytes) + "-byte limit");
  }
  // A regular file never blocks; clear the flag so reads behave plainly.
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl >= 0) ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
}

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string read_prefix(int fd, size_t max_bytes) {
  std::string out(max_bytes, '\0');
  size_t have = 0;
  while (have < out.size()) {
    const ssize_t n = ::pread(fd, &out[have], out.size() - have, static_cast<off_t>(have));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    have += static_cast<size_t>(n);
  }
  out.resize(have);
  return out;
}

void ReadOnlyFile::read_at(uint64_t offset, void* buf, size_t n) const {
  DISTSTRAT_CHECK(offset <= size_ && n <= size_ - offset, kDataLoss, what_, ": truncated (", n,
                  " bytes at offset ", offset, " lie beyond its ", size_, " bytes)");
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t got = ::pread(fd_.get(), p, n, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw_errno(errno, what_ + ": read failed");
    }
    if (got == 0)
      throw DataLossError(what_ + ": truncated while being read (it shrank below " +
                          std::to_string(offset + n) + " bytes)");
    p += got;
    offset += static_cast<uint64_t>(got);
    n -= static_cast<size_t>(got);
  }
}

std::vector<uint8_t> ReadOnlyFile::read_all() const {
  std::vector<uint8_t> out;
  try {
    out.resize(static_cast<size_t>(size_));
  } catch (const std::bad_alloc&) {
    throw ResourceExhaustedError(what_ + ": its " + std::to_string(size_) +
                                 " bytes do not fit in memory");
  }
  if (size_ > 0) read_at(0, out.data(), out.size());
  return out;
}

std::vector<uint8_t> read_file(const std::string& path, const std::string& what,
                               const ReadOptions& options) {
  return ReadOnlyFile(path, what, options).read_all();
}

std::string read_text_file(const std::string& path, const std::string& what,
                           const ReadOptions& options) {
  const std::vector<uint8_t> b = read_file(path, what, options);
  return std::string(b.begin(), b.end());
}

void ensure_writable_directory(const std::string& dir, const std::string& probe_name,
                               const std::string& what) {
  DISTSTRAT_CHECK(!dir.empty(), kInvalidArgument, what, ": empty directory name");
  // mkdir -p: every prefix that ends a component, then the whole path.
  for (size_t i = 1; i <= dir.size(); ++i) {
    if (i < dir.size() && dir[i] != '/') continue;
    const std::string partial = dir.substr(0, i);
    if (partial.empty() || partial.back() == '/') continue;
    if (::mkdir(partial.c_str(), 0755) == 0 || errno == EEXIST) continue;
    const int err = errno;
    struct stat st;
    if (::stat(partial.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
      continue;  // raced, or EACCES on an existing one
    if (err == ENOTDIR) {
      throw FailedPreconditionError(what + ": cannot create directory '" + dir +
                                    "': a component of '" + partial + "' is not a directory");
    }
    throw_errno(err, what + ": cannot create directory '" + partial + "'");
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) throw_errno(errno, what + ": '" + dir + "'");
  if (!S_ISDIR(st.st_mode)) {
    throw FailedPreconditionError(what + ": '" + dir + "' is " + file_kind(st.st_mode) +
                                  ", not a directory");
  }
  const std::string probe = dir + "/" + probe_name;
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int err = errno;
    throw_errno(err, what + ": directory '" + dir + "' is not writable (creating '" + probe_name +
                         "' failed)");
  }
  ::close(fd);
  if (::unlink(probe.c_str()) != 0) {
    throw_errno(errno, what + ": directory '" + dir + "': cannot remove the probe file '" +
                           probe_name + "'");
  }
}

std::string directory_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}
std::string file_name_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

}  // namespace fs

// Declared in diststrat/safetensors.h (public) and core/file_util.h.
void write_file_atomically(const std::string& path, const void* bytes, size_t size) {
  static std::atomic<uint64_t> counter{0};  // distinct temp names for threads of one process
  // A device node, socket or directory under that name is not ours to
  // replace (as root, /dev/full would become a regular file and the data look
  // written). A FIFO or symlink is: the rename replaces the entry only, which
  // is how a damaged `latest` (a FIFO planted there) is repaired.
  struct stat lst {};
  if (::lstat(path.c_str(), &lst) == 0 && !S_ISREG(lst.st_mode) && !S_ISLNK(lst.st_mode) &&
      !S_ISFIFO(lst.st_mode)) {
    throw FailedPreconditionError("writing '" + path + "': it exists and is " +
                                  fs::file_kind(lst.st_mode) +
                                  ", not a regular file; refusing to replace it");
  }
  const std::string tmp =
      path + ".tmp." + std::to_string(getpid()) + "." + std::to_string(counter.fetch_add(1));
  auto fail = [&](const std::string& what, int err) {
    ::unlink(tmp.c_str());
    // ENOENT: kNotFound, EACCES/EPERM/EROFS: kPermissionDenied, ENOTDIR:
    // kFailedPrecondition, ENOSPC/EDQUOT: kResourceExhausted, EIO...: kUnavailable.
    fs::throw_errno(err, "writing '" + path + "': " + what);
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) fail("open of temporary file '" + tmp + "'", errno);
  const char* p = static_cast<const char*>(bytes);
  size_t left = size;
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      fail("write", err);
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    fail("fsync", err);
  }
  if (::close(fd) != 0) fail("close", errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename", errno);
  // The rename is durable only once the directory entry is.
  const std::string dir = fs::directory_of(path);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace diststrat
