// Finding NaN and infinities in tensor bytes, for checkpoints: a save refuses
// a model that diverged (so it never replaces good checkpoints) and a restore
// refuses one that did (issue 23, item 3). The scan runs chunk by chunk next
// to the CRC of the same bytes, so the data is read from memory once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "diststrat/dtype.h"

namespace diststrat {
namespace ckpt {

// Where a tensor first holds a value that is not finite.
struct NonFinite {
  int64_t index = -1;     // element index; -1: every element is finite
  const char* kind = "";  // "NaN", "+Inf" or "-Inf"
  int64_t count = 0;      // how many elements are not finite
  explicit operator bool() const { return index >= 0; }
};

// Scans `count` elements of `dtype` at `data` (F32, F64, F16, BF16; integer
// dtypes are always finite). `first_index` is added to the reported index
// (for scans chunk by chunk); `found` accumulates across calls.
void scan_non_finite(const void* data, size_t count, DType dtype, int64_t first_index,
                     NonFinite* found);

// "holds 3 non-finite values (the first, element 17, is NaN)".
std::string describe_non_finite(const NonFinite& nf);

// CRC-32 of `nbytes` at `data` and, when `check`, the non-finite scan of the
// same bytes as `dtype`, in cache-sized chunks (one pass over memory).
uint32_t crc32_and_scan(const void* data, size_t nbytes, DType dtype, bool check, NonFinite* found);

}  // namespace ckpt
}  // namespace diststrat
