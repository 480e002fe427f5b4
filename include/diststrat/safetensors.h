// The safetensors file format (https://github.com/huggingface/safetensors) as
// diststrat reads and writes it, so Python's `safetensors`, PyTorch and others
// open our files and we open theirs; and the atomic file write every
// checkpoint goes through.
//
// Files are written atomically (temporary file in the same directory, fsync,
// rename, fsync of the directory): a crash or SIGKILL at any point leaves the
// previous file in place. Every tensor's CRC-32 and a CRC-32 of the header are
// stored in the metadata; loading verifies them and the header's offsets,
// shapes and dtypes. Corruption is a DataLossError, a missing file a
// NotFoundError; every message names the file and the tensor.
//
// Rules: every call blocks until its file is written or read; none is
// collective; all are thread-safe for distinct paths.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "diststrat/tensor.h"

namespace diststrat {

// User metadata: string keys and values (safetensors' __metadata__ is a
// string-to-string map). Keys starting with "diststrat." are reserved.
using CheckpointMetadata = std::map<std::string, std::string>;

// ---- The file format ---------------------------------------------------------

// One safetensors file held in memory.
struct SafetensorsFile {
  // In file order (sorted by name when we write).
  std::vector<std::pair<std::string, Tensor>> tensors;
  // __metadata__ including our reserved "diststrat." keys.
  CheckpointMetadata metadata;
  // Whether the file carried diststrat checksums (and they all matched).
  bool verified = false;
  const Tensor* find(const std::string& name) const;
};

struct SafetensorsLoadOptions {
  // Refuse files without diststrat checksums (DataLossError). Set false to
  // read files written by other tools; checksums present are always verified.
  bool require_checksums = true;
  // Accept floating-point tensors (F32, F64, F16, BF16) holding NaN or
  // +-Inf. false (the default): such a file is a DataLossError naming the
  // file, each such tensor (up to five), the count and the first bad
  // element: a checkpoint of a diverged model is as unusable as a corrupt
  // one. The scan shares the CRC's pass over the bytes.
  bool allow_non_finite = false;
};

struct SafetensorsSaveOptions {
  // Write floating-point tensors holding NaN or +-Inf. false (the default):
  // DataLossError naming the file and each such tensor, and nothing is
  // written (the previous file at `path` is untouched).
  bool allow_non_finite = false;
};

// Writes `tensors` (host tensors, any supported dtype) and `metadata`
// atomically to `path`, adding a CRC-32 per tensor and of the header. Names
// must be unique and non-empty; keys starting with "diststrat." in `metadata`
// are rejected; non-finite floats are refused unless allowed (above).
// Blocking; thread-safe for distinct paths.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const CheckpointMetadata& metadata = {},
                      const SafetensorsSaveOptions& options = {});

// Reads and fully validates a safetensors file: header length and JSON,
// dtypes, shapes against data_offsets, offsets in bounds, contiguous and
// non-overlapping, covering the whole data region; then the checksums.
// Throws NotFoundError, DataLossError or UnimplementedError (a dtype we do
// not support, e.g. U8) naming the file and tensor. Never crashes on bad
// input. Blocking; thread-safe.
SafetensorsFile load_safetensors(const std::string& path,
                                 const SafetensorsLoadOptions& options = {});
// The same from bytes in memory; `what` names the source in errors.
SafetensorsFile parse_safetensors(const uint8_t* bytes, size_t size, const std::string& what,
                                  const SafetensorsLoadOptions& options = {});

// Writes `bytes` to `path` atomically: a temporary file beside it
// ("<path>.tmp.<pid>.<n>"), fsync, rename over `path`, fsync of the directory.
// On failure the temporary file is removed and `path` is unchanged. A `path`
// that exists and is neither a regular file nor a symlink (a device such as
// /dev/full, a FIFO, a socket, a directory) is never replaced:
// FailedPreconditionError naming it.
void write_file_atomically(const std::string& path, const void* bytes, size_t size);

// The integer value of user metadata `key` (decimal: an optional '-' and
// digits, nothing else) checked to lie in [min, max]; `source` names the
// checkpoint in errors (CheckpointManager::restored_path(), or the path given
// to Checkpoint::restore). Throws InvalidArgumentError when `key` is absent
// (a checkpoint of another program) and DataLossError naming `source` and
// `key` when the value is no integer in range ("abc", "1e20", " 5"). Use it
// for every number a program reads back from checkpoint metadata. Thread-safe.
int64_t metadata_int(const CheckpointMetadata& md, const std::string& key, int64_t min, int64_t max,
                     const std::string& source);

}  // namespace diststrat
