#include <zlib.h>

#include <cstdio>
#include <sys/stat.h>

#include "diststrat/io.h"

namespace diststrat {

namespace {
bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Reads a whole file, inflating it if it is gzip (zlib reads plain files
// through the same calls).
std::vector<uint8_t> read_maybe_gzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  DISTSTRAT_CHECK(f != nullptr, kNotFound, "cannot open '", path, "'");
  std::vector<uint8_t> out;
  uint8_t buf[1 << 16];
  for (;;) {
    const int n = gzread(f, buf, sizeof(buf));
    if (n < 0) {
      int errnum = 0;
      const std::string msg = gzerror(f, &errnum);
      gzclose(f);
      throw DataLossError("'" + path + "' is corrupt: " + msg);
    }
    if (n == 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  // A truncated gzip stream reads as a clean EOF in gzread; gzclose reports it.
  const int rc = gzclose(f);
  DISTSTRAT_CHECK(rc == Z_OK, kDataLoss, "'", path, "' is a truncated or corrupt gzip stream (zlib ",
                  rc, ")");
  return out;
}
}  // namespace

IdxArray parse_idx(const uint8_t* bytes, size_t size, const std::string& what) {
  DISTSTRAT_CHECK(size >= 4, kDataLoss, what, ": ", size, " bytes is too short for an IDX header");
  DISTSTRAT_CHECK(bytes[0] == 0 && bytes[1] == 0, kDataLoss, what,
                  ": bad IDX magic (first two bytes must be zero)");
  DISTSTRAT_CHECK(bytes[2] == 0x08, kDataLoss, what, ": IDX element type 0x", std::hex,
                  static_cast<int>(bytes[2]), " is not unsigned byte (0x08)");
  const int ndims = bytes[3];
  DISTSTRAT_CHECK(ndims >= 1 && ndims <= 4, kDataLoss, what, ": IDX rank ", ndims,
                  " is outside [1, 4]");
  const size_t header = 4 + 4 * static_cast<size_t>(ndims);
  DISTSTRAT_CHECK(size >= header, kDataLoss, what, ": truncated IDX header");
  IdxArray a;
  uint64_t total = 1;
  for (int d = 0; d < ndims; ++d) {
    const uint8_t* p = bytes + 4 + 4 * d;
    const uint32_t dim = (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3];
    a.dims.push_back(dim);
    total *= dim;
    DISTSTRAT_CHECK(total <= (uint64_t(1) << 34), kDataLoss, what, ": IDX dims claim ", total,
                    "+ elements");
  }
  DISTSTRAT_CHECK(size - header == total, kDataLoss, what, ": IDX payload is ", size - header,
                  " bytes but the dims say ", total);
  a.data.assign(bytes + header, bytes + size);
  return a;
}

IdxArray read_idx(const std::string& path) {
  DISTSTRAT_CHECK(file_exists(path), kNotFound, "IDX file '", path, "' does not exist");
  const std::vector<uint8_t> bytes = read_maybe_gzip(path);
  return parse_idx(bytes.data(), bytes.size(), "'" + path + "'");
}

Dataset load_mnist_split(const std::string& dir, const std::string& split, int64_t limit) {
  auto find = [&](const std::string& stem) {
    for (const std::string& p : {dir + "/" + stem + ".gz", dir + "/" + stem}) {
      if (file_exists(p)) return p;
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
