// Dataset readers.
//
// Rules: every reader validates the file before trusting it (sizes, magic
// numbers, counts) and throws DataLossError or NotFoundError naming the file;
// the readers block on the file system only, communicate with no peer and are
// thread-safe for distinct files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "diststrat/data.h"

namespace diststrat {

// An IDX file (the MNIST format): dims and raw unsigned-byte data. Reads gzip
// or plain files. Throws NotFoundError for a missing file and DataLossError
// for a bad magic number, an unsupported element type, or a payload shorter
// or longer than the dims say.
struct IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;
};
IdxArray read_idx(const std::string& path);
// Same, from bytes in memory (decompressed); `what` names the source in errors.
IdxArray parse_idx(const uint8_t* bytes, size_t size, const std::string& what);

// Loads "train" or "t10k" images and labels of an MNIST-layout directory
// (`<split>-images-idx3-ubyte[.gz]`, `<split>-labels-idx1-ubyte[.gz]`):
// features float32 [N, rows*cols] scaled to [0, 1], labels int32 [N].
// `limit` > 0 keeps the first `limit` rows.
Dataset load_mnist_split(const std::string& dir, const std::string& split, int64_t limit = 0);

// Where Debian's dataset-fashion-mnist package installs the data.
constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

}  // namespace diststrat
