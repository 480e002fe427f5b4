// IDX files are read as a stream: the header first, then exactly the payload
// bytes its dims allow, so neither a gzip bomb nor a huge or sparse plain file
// is ever held in memory beyond that size (which is itself capped).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>

#include "diststrat/io.h"
#include "core/file_util.h"

namespace diststrat {

namespace {

constexpr uint64_t kMaxElements = uint64_t(1) << 34;
constexpr size_t kMaxIdxHeaderBytes = 4 + 4 * 4;

// The size of the header whose first 4 bytes these are (4 + 4 * rank).
size_t header_size(const uint8_t* b, const std::string& what) {
  DISTSTRAT_CHECK(b[0] == 0 && b[1] == 0, kDataLoss, what,
                  ": bad IDX magic (first two bytes must be zero)");
  DISTSTRAT_CHECK(b[2] == 0x08, kDataLoss, what, ": IDX element type 0x", std::hex,
                  static_cast<int>(b[2]), " is not unsigned byte (0x08)");
  const int ndims = b[3];
  DISTSTRAT_CHECK(ndims >= 1 && ndims <= 4, kDataLoss, what, ": IDX rank ", ndims,
                  " is outside [1, 4]");
  return 4 + 4 * static_cast<size_t>(ndims);
}

// The dims of a whole header; returns the payload size they imply (capped).
uint64_t parse_dims(const uint8_t* b, size_t header, std::vector<int64_t>* dims,
                    const std::string& what) {
  uint64_t total = 1;
  for (size_t p = 4; p < header; p += 4) {
    const uint32_t dim =
        (uint32_t(b[p]) << 24) | (uint32_t(b[p + 1]) << 16) | (uint32_t(b[p + 2]) << 8) | b[p + 3];
    dims->push_back(dim);
    total *= dim;
    DISTSTRAT_CHECK(total <= kMaxElements, kDataLoss, what, ": IDX dims claim ", total,
                    "+ elements");
  }
  return total;
}

// Opens a file the caller named, for reading: without blocking (a FIFO must
// not wait for a writer) and only if it is a regular file. Links are
// followed: the caller chose the path, and nothing is written.
// (fs::ReadOnlyFile does the same for whole-file reads; the gzip stream here
// reads the descriptor itself, so it opens its own and maps errno the same way.)
int open_regular_file(const std::string& path, struct stat* st) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    DISTSTRAT_CHECK(err != ENOENT, kNotFound, "IDX file '", path, "' does not exist");
    fs::throw_errno(err, "IDX file '" + path + "': open failed");
  }
  if (::fstat(fd, st) != 0 || !S_ISREG(st->st_mode)) {
    const bool fifo = S_ISFIFO(st->st_mode);
    ::close(fd);
    throw InvalidArgumentError("IDX file '" + path + "' is not a regular file" +
                               (fifo ? " (a FIFO)" : "") + "; give the data file itself");
  }
  return fd;
}

class FileCloser {
 public:
  explicit FileCloser(int fd) : fd_(fd) {}
  ~FileCloser() { ::close(fd_); }
  FileCloser(const FileCloser&) = delete;
  FileCloser& operator=(const FileCloser&) = delete;

 private:
  int fd_;
};

// Reads up to n bytes (fewer only at the end of the file).
size_t read_some(int fd, uint8_t* dst, size_t n, const std::string& path) {
  size_t have = 0;
  while (have < n) {
    const ssize_t r = ::read(fd, dst + have, n - have);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw DataLossError("'" + path + "': read failed: " + std::strerror(errno));
    if (r == 0) break;
    have += static_cast<size_t>(r);
  }
  return have;
}

// The decompressed bytes of a gzip file, as many as asked for at a time, so
// the caller decides how many it accepts. Concatenated gzip members read as
// one stream (as gzip does); anything else after the last member is an error.
class GzipReader {
 public:
  GzipReader(int fd, const std::string& path) : fd_(fd), path_(path), in_(1 << 16) {
    DISTSTRAT_CHECK(inflateInit2(&z_, 15 + 16) == Z_OK, kInternal, "'", path,
                    "': inflateInit2 failed");
  }
  ~GzipReader() { inflateEnd(&z_); }
  GzipReader(const GzipReader&) = delete;
  GzipReader& operator=(const GzipReader&) = delete;

  // Up to n bytes; fewer only at the end of the (valid, complete) stream.
  size_t read(uint8_t* dst, size_t n) {
    z_.next_out = dst;
    z_.avail_out = static_cast<uInt>(n);
    while (z_.avail_out > 0 && !ended_) {
      if (z_.avail_in == 0) {
        const size_t got = read_some(fd_, in_.data(), in_.size(), path_);
        if (got == 0) {
          DISTSTRAT_CHECK(member_done_, kDataLoss, "'", path_,
                          "' is a truncated or corrupt gzip stream (it ends inside it)");
          ended_ = true;
          break;
        }
        z_.next_in = in_.data();
        z_.avail_in = static_cast<uInt>(got);
      }
      if (member_done_) {
        DISTSTRAT_CHECK(z_.next_in[0] == 0x1f, kDataLoss, "'", path_,
                        "' has bytes after the end of its gzip stream");
        DISTSTRAT_CHECK(inflateReset(&z_) == Z_OK, kInternal, "'", path_, "': inflateReset failed");
        member_done_ = false;
      }
      const int rc = inflate(&z_, Z_NO_FLUSH);
      if (rc == Z_STREAM_END) {
        member_done_ = true;
      } else if (rc != Z_OK && !(rc == Z_BUF_ERROR && z_.avail_in == 0)) {
        throw DataLossError("'" + path_ + "' is corrupt: " +
                            (z_.msg ? z_.msg : "zlib error " + std::to_string(rc)));
      }
    }
    return n - z_.avail_out;
  }

 private:
  int fd_;
  std::string path_;
  std::vector<uint8_t> in_;
  z_stream z_{};
  bool member_done_ = false;
  bool ended_ = false;
};

// Header, then exactly the payload the dims allow, from `read(dst, n)` (which
// returns fewer than n bytes only at the end). `known_size`: the whole
// stream's size when known (plain files), checked before anything is read.
template <typename Read>
IdxArray read_stream(Read&& read, const std::string& what, std::optional<uint64_t> known_size) {
  uint8_t head[kMaxIdxHeaderBytes];
  size_t have = read(head, 4);
  DISTSTRAT_CHECK(have == 4, kDataLoss, what, ": ", have, " bytes is too short for an IDX header");
  const size_t header = header_size(head, what);
  have += read(head + 4, header - 4);
  DISTSTRAT_CHECK(have == header, kDataLoss, what, ": truncated IDX header");
  IdxArray a;
  const uint64_t total = parse_dims(head, header, &a.dims, what);
  if (known_size) {
    DISTSTRAT_CHECK(*known_size >= header && *known_size - header == total, kDataLoss, what,
                    ": IDX payload is ", *known_size - header, " bytes but the dims say ", total);
  }
  // Grown as the bytes arrive (chunks from 64 KiB, doubling up to 16 MiB): the
  // claim alone allocates next to nothing.
  uint64_t chunk = uint64_t(64) << 10;
  uint64_t got = 0;
  while (got < total) {
    const uint64_t want = std::min(chunk, total - got);
    chunk = std::min(chunk * 2, uint64_t(16) << 20);
    a.data.resize(static_cast<size_t>(got + want));
    const size_t n = read(a.data.data() + got, static_cast<size_t>(want));
    got += n;
    if (n < want) break;
  }
  a.data.resize(static_cast<size_t>(got));
  DISTSTRAT_CHECK(got == total, kDataLoss, what, ": IDX payload is ", got,
                  " bytes but the dims say ", total);
  uint8_t extra;
  DISTSTRAT_CHECK(read(&extra, 1) == 0, kDataLoss, what, ": IDX payload holds more than the ",
                  total, " bytes its dims allow");
  return a;
}

}  // namespace

IdxArray parse_idx(const uint8_t* bytes, size_t size, const std::string& what) {
  size_t pos = 0;
  auto read = [&](uint8_t* dst, size_t n) {
    const size_t k = std::min(n, size - pos);
    if (k > 0) std::memcpy(dst, bytes + pos, k);  // memcpy of 0 bytes still wants non-null pointers
    pos += k;
    return k;
  };
  return read_stream(read, what, static_cast<uint64_t>(size));
}

IdxArray read_idx(const std::string& path) {
  struct stat st {};
  const int fd = open_regular_file(path, &st);
  FileCloser closer(fd);
  const std::string what = "'" + path + "'";
  uint8_t magic[2] = {0, 0};
  const bool gzip = ::pread(fd, magic, 2, 0) == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
  if (gzip) {
    GzipReader gz(fd, path);
    return read_stream([&](uint8_t* dst, size_t n) { return gz.read(dst, n); }, what, std::nullopt);
  }
  return read_stream([&](uint8_t* dst, size_t n) { return read_some(fd, dst, n, path); }, what,
                     static_cast<uint64_t>(st.st_size));
}

Dataset load_mnist_split(const std::string& dir, const std::string& split, int64_t limit) {
  DISTSTRAT_CHECK(limit >= 0, kInvalidArgument, "load_mnist_split: limit ", limit,
                  " must be >= 0 (0 = every row)");
  auto find = [&](const std::string& stem) {
    for (const std::string& p : {dir + "/" + stem + ".gz", dir + "/" + stem}) {
      struct stat st;
      if (::stat(p.c_str(), &st) == 0) return p;  // read_idx refuses what is not a file
    }
    throw NotFoundError("no '" + stem + "[.gz]' in '" + dir +
                        "' (install Debian's dataset-fashion-mnist, or pass --data DIR)");
  };
  const IdxArray images = read_idx(find(split + "-images-idx3-ubyte"));
  const IdxArray labels = read_idx(find(split + "-labels-idx1-ubyte"));
  DISTSTRAT_CHECK(images.dims.size() == 3, kDataLoss, split, " images: expected rank 3, got ",
                  images.dims.size());
  DISTSTRAT_CHECK(labels.dims.size() == 1, kDataLoss, split, " labels: expected rank 1, got ",
                  labels.dims.size());
  DISTSTRAT_CHECK(images.dims[0] == labels.dims[0], kDataLoss, split, ": ", images.dims[0],
                  " images but ", labels.dims[0], " labels");
  int64_t n = images.dims[0];
  if (limit > 0 && limit < n) n = limit;
  const int64_t pixels = images.dims[1] * images.dims[2];
  Tensor x(Shape{n, pixels}, DType::kFloat32);
  Tensor y(Shape{n}, DType::kInt32);
  float* xp = x.data<float>();
  int32_t* yp = y.data<int32_t>();
  for (int64_t i = 0; i < n * pixels; ++i) xp[i] = images.data[i] / 255.0f;
  for (int64_t i = 0; i < n; ++i) yp[i] = labels.data[i];
  return Dataset(x, y);
}

}  // namespace diststrat
