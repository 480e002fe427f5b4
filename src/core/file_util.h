// Files opened by a path the library did not just create (checkpoints, their
// `latest` pointer, index and shard files, lease records, dataset files): the
// one place that opens them safely, and the one errno -> ErrorCode mapping.
//
// Safe opening means: O_NONBLOCK (a FIFO or device node must not block the
// open; it is then refused), optionally O_NOFOLLOW (where a symlink planted
// by someone else is a risk), fstat to require a regular file, and a size cap
// on what is read, so that nothing read from outside can hang the caller or
// make it allocate without bound.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "diststrat/error.h"

namespace diststrat {
namespace fs {

// absl's canonical mapping, restricted to our codes: ENOENT -> kNotFound;
// EACCES, EPERM, EROFS -> kPermissionDenied; ENOTDIR, EISDIR, EEXIST,
// ENOTEMPTY, EBUSY, ETXTBSY, ELOOP -> kFailedPrecondition; ENOSPC, EDQUOT,
// EMFILE, ENFILE, ENOMEM, EFBIG -> kResourceExhausted; EINVAL, ENAMETOOLONG ->
// kInvalidArgument; ETIMEDOUT -> kDeadlineExceeded; anything else (EIO,
// EAGAIN, EINTR, ...) -> kUnavailable (an I/O error: retry).
ErrorCode errno_code(int err);
// Throws the error of errno_code(err): "<what>: <strerror(err)>".
[[noreturn]] void throw_errno(int err, const std::string& what);

// "a regular file", "a directory", "a FIFO", "a character device", ... for
// messages.
const char* file_kind(mode_t mode);

struct ReadOptions {
  // Refuse a path whose last component is a symlink (kPermissionDenied).
  bool follow_symlinks = true;
  // Files larger than this are refused (0 = no cap beyond the file's size).
  uint64_t max_bytes = 0;
  // The code for a path that is not a regular file or exceeds max_bytes:
  // kDataLoss (the file is damaged) by default.
  ErrorCode bad_file_code = ErrorCode::kDataLoss;
};

// A file descriptor this object owns (closed on destruction), for code that
// opens with openat() relative to a checked directory or takes OFD locks,
// which ReadOnlyFile does not offer.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { reset(-1); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // Gives the descriptor up (the caller closes it).
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // Closes the descriptor held, then holds `fd`.
  void reset(int fd);

 private:
  int fd_;
};

// At most `max_bytes` from the start of the open file `fd`, however long the
// file is (fewer at its end or at a read error): a record of capped size read
// from a file someone else may have grown.
std::string read_prefix(int fd, size_t max_bytes);

// A read-only regular file, opened safely; closes on destruction.
class ReadOnlyFile {
 public:
  // Opens `path` (named `what` in errors, e.g. "checkpoint '/c/ckpt-5.safetensors'").
  // Never blocks on a FIFO or device. Throws NotFoundError, PermissionDeniedError,
  // options.bad_file_code ("is a FIFO, not a regular file" / "is N bytes, over
  // the M-byte limit" / "is a symbolic link loop") or the errno_code of a failing open/fstat.
  ReadOnlyFile(const std::string& path, const std::string& what, const ReadOptions& options = {});
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;

  // The size fstat reported at open; reads never go beyond it.
  uint64_t size() const { return size_; }
  // Reads exactly `n` bytes at `offset`; a file that shrank meanwhile is
  // kDataLoss ("truncated"), a read error its errno_code.
  void read_at(uint64_t offset, void* buf, size_t n) const;
  // The whole file (size() bytes).
  std::vector<uint8_t> read_all() const;

 private:
  Fd fd_;
  uint64_t size_ = 0;
  std::string what_;
};

// The whole regular file at `path`, read safely (see ReadOnlyFile).
std::vector<uint8_t> read_file(const std::string& path, const std::string& what,
                               const ReadOptions& options = {});
std::string read_text_file(const std::string& path, const std::string& what,
                           const ReadOptions& options = {});

// Creates `dir` and its missing parents (mode 0755), then checks that it is a
// directory (a symlink to one is fine) in which this process can create and
// remove a file (probe "<dir>/<probe_name>", O_CREAT | O_EXCL | O_NOFOLLOW).
// Throws FailedPreconditionError when a component is not a directory,
// PermissionDeniedError when it cannot be created or written, else the
// errno_code; every message names `what` and the path.
void ensure_writable_directory(const std::string& dir, const std::string& probe_name,
                               const std::string& what);

// The directory of `path`: "." without a slash, "/" for a file in the root.
std::string directory_of(const std::string& path);
// The last component of `path` (all of it without a slash).
std::string file_name_of(const std::string& path);

}  // namespace fs

// Writes `bytes` to `path` atomically (temporary file, fsync, rename, fsync
// of the directory); the public declaration and its contract are in
// diststrat/safetensors.h. Here so that the core's own files (the timeline)
// write durably without including the checkpoint room.
void write_file_atomically(const std::string& path, const void* bytes, size_t size);

}  // namespace diststrat
