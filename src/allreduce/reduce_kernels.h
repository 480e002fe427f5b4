// Reduction kernels: memory-bound, one pass, no temporaries beyond a small
// stack block. Written once as templates over the element type and the
// operator; f16 and bf16 accumulate in f32. Any count (including 0 and counts
// that are not a multiple of the vector width) is handled. Vectorised, with a
// run-time choice between baseline x86-64, AVX2 (+F16C) and AVX-512 code.
#pragma once

#include <cstddef>

#include "diststrat/collective.h"
#include "diststrat/dtype.h"

namespace diststrat {
namespace kernels {

// dst[i] = op(srcs[0][i], ..., srcs[n-1][i]) for i < count; with kMean the
// result is divided by `mean_divisor`. dst may alias any srcs[k] (exactly,
// not partially).
void reduce(void* dst, const void* const* srcs, int n, size_t count, DType dtype, ReduceOp op,
            int mean_divisor);

// dst[i] = op(dst[i], src[i]). kMean accumulates as a sum; call scale_mean
// once at the end.
void accumulate(void* dst, const void* src, size_t count, DType dtype, ReduceOp op);

// dst[i] /= divisor (integer division for integer types).
void scale_mean(void* dst, size_t count, DType dtype, int divisor);

// The same reduction with the baseline (non-dispatched) code path, for
// benchmarks and tests that compare the two.
void reduce_baseline(void* dst, const void* const* srcs, int n, size_t count, DType dtype,
                     ReduceOp op, int mean_divisor);

// memcpy with non-temporal (streaming) stores: the destination is written
// straight to memory without being read first (no write-allocate) and
// without evicting the caches' contents. For large outputs that are not
// read again soon; slower than memcpy when dst would have stayed in cache.
// Buffers must not overlap.
void copy_streaming(void* dst, const void* src, size_t bytes);

// Messages from this size on write their outputs with copy_streaming (the
// caches cannot hold them anyway). Measured with allreduce_bench (memcpy
// rows and shm at 16M/64M/256M, see docs/benchmarks.md).
constexpr size_t kStreamingBytes = 32u << 20;

// The instruction set the kernels dispatch to in this process
// (diststrat/cpu_isa.h): "avx512", "avx2" or "baseline".
const char* isa_name();

// Converts count f32 values to f16/bf16 and back (wire compression).
void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t count);

}  // namespace kernels
}  // namespace diststrat
