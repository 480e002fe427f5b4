#include "io/non_finite.h"

#include <zlib.h>

#include <algorithm>
#include <cstring>

namespace diststrat {
namespace ckpt {

namespace {

// IEEE formats: a value is not finite when its exponent bits are all ones;
// a NaN when its mantissa is non-zero too. Integers compare bits only, so
// the loop vectorizes and never traps on signalling NaNs.
template <typename Bits>
void scan_bits(const void* data, size_t count, Bits exponent, Bits mantissa, Bits sign,
               int64_t first, NonFinite* found) {
  // Bytes of a file may sit at any offset: memcpy, which compiles to plain
  // (vectorized) loads, instead of dereferencing a misaligned pointer.
  const unsigned char* p = static_cast<const unsigned char*>(data);
  // A branch-free count first: almost always 0, then nothing else is done.
  size_t bad = 0;
  for (size_t i = 0; i < count; ++i) {
    Bits b;
    std::memcpy(&b, p + i * sizeof(Bits), sizeof b);
    bad += (b & exponent) == exponent;
  }
  if (bad == 0) return;
  found->count += static_cast<int64_t>(bad);
  if (found->index >= 0) return;
  for (size_t i = 0; i < count; ++i) {
    Bits b;
    std::memcpy(&b, p + i * sizeof(Bits), sizeof b);
    if ((b & exponent) != exponent) continue;
    found->index = first + static_cast<int64_t>(i);
    found->kind = (b & mantissa) ? "NaN" : (b & sign) ? "-Inf" : "+Inf";
    return;
  }
}

}  // namespace

void scan_non_finite(const void* data, size_t count, DType dtype, int64_t first_index,
                     NonFinite* found) {
  switch (dtype) {
    case DType::kFloat32:
      scan_bits<uint32_t>(data, count, 0x7f800000u, 0x007fffffu, 0x80000000u, first_index, found);
      break;
    case DType::kFloat64:
      scan_bits<uint64_t>(data, count, 0x7ff0000000000000ull, 0x000fffffffffffffull,
                          0x8000000000000000ull, first_index, found);
      break;
    case DType::kFloat16:
      scan_bits<uint16_t>(data, count, 0x7c00u, 0x03ffu, 0x8000u, first_index, found);
      break;
    case DType::kBFloat16:
      scan_bits<uint16_t>(data, count, 0x7f80u, 0x007fu, 0x8000u, first_index, found);
      break;
    case DType::kInt32:
    case DType::kInt64:
      break;
  }
}

std::string describe_non_finite(const NonFinite& nf) {
  if (!nf) return "holds only finite values";
  if (nf.count == 1)
    return "holds a non-finite value (element " + std::to_string(nf.index) + " is " + nf.kind + ")";
  return "holds " + std::to_string(nf.count) + " non-finite values (the first, element " +
         std::to_string(nf.index) + ", is " + nf.kind + ")";
}

uint32_t crc32_and_scan(const void* data, size_t nbytes, DType dtype, bool check,
                        NonFinite* found) {
  // 64 KiB: the scan leaves the chunk in L1/L2 for the CRC right after it.
  constexpr size_t kChunk = 64 << 10;
  const size_t esize = dtype_size(dtype);
  check = check && dtype_is_floating(dtype);
  uLong crc = crc32(0L, Z_NULL, 0);
  const Bytef* p = static_cast<const Bytef*>(data);
  size_t done = 0;
  while (done < nbytes) {
    const size_t n =
        std::min(kChunk, nbytes - done);  // a multiple of esize: kChunk is, and so is nbytes
    if (check)
      scan_non_finite(p + done, n / esize, dtype, static_cast<int64_t>(done / esize), found);
    crc = crc32(crc, p + done, static_cast<uInt>(n));
    done += n;
  }
  return static_cast<uint32_t>(crc);
}

}  // namespace ckpt
}  // namespace diststrat
