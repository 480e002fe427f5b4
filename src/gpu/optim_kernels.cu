// The optimizer's training-feature kernels (gradient clipping, loss scaling,
// accumulation) over lists of float32 device tensors. A list travels by value
// in the kernel parameters, kOptimChunk tensors per launch: no pointer table
// in device memory, no host round trip. Sums are deterministic: a fixed grid
// and fixed tree orders, so replicas with equal gradients compute equal
// norms and their copies stay bit-identical.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/gpu_backend.h"
#include "diststrat/error.h"
#include "gpu/cuda_check.h"
#include "gpu/optim_kernels.h"

namespace diststrat {
namespace gpu {

namespace {

constexpr int kThreads = 256;
// Blocks per tensor of the sum of squares: one partial sum each.
constexpr int kSumBlocks = static_cast<int>(GpuBackend::kSumOfSquaresScratch);
static_assert(kSumBlocks <= 65535, "grid x");

struct Chunk {
  const float* in[kOptimChunk];
  float* out[kOptimChunk];
  size_t count[kOptimChunk];
  int base;  // index of in[0] in the whole list
};

cudaStream_t as_stream(void* s) { return stream_or_legacy(s); }

void check_launch(const char* kernel) {
  check_cuda(cudaGetLastError(), kernel, __FILE__, __LINE__);
}

// The unscale factor exactly as the host computes it (1.0f / scale, IEEE).
__device__ __forceinline__ float inverse_scale(const float* loss_scale) {
  return loss_scale ? __fdiv_rn(1.0f, *loss_scale) : 1.0f;
}

// Block (b, i): the partial sum of squares of tensor i over the elements
// j = b * kThreads + t + k * kSumBlocks * kThreads, reduced in a fixed tree.
__global__ void sum_of_squares_partial(Chunk c, const float* loss_scale, double* scratch) {
  __shared__ double part[kThreads];
  const int i = blockIdx.y;
  const float inv = inverse_scale(loss_scale);
  const float* p = c.in[i];
  const size_t n = c.count[i];
  double s = 0;
  for (size_t j = size_t(blockIdx.x) * kThreads + threadIdx.x; j < n;
       j += size_t(kSumBlocks) * kThreads) {
    const float x = loss_scale ? __fmul_rn(p[j], inv) : p[j];
    s = __dadd_rn(s, __dmul_rn(double(x), double(x)));
  }
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) part[threadIdx.x] = __dadd_rn(part[threadIdx.x], part[threadIdx.x + w]);
    __syncthreads();
  }
  if (threadIdx.x == 0) scratch[size_t(c.base + i) * kSumBlocks + blockIdx.x] = part[0];
}

// sums[i] = the partials of tensor i, in block order.
__global__ void sum_of_squares_final(const double* scratch, double* sums, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  double s = 0;
  for (int b = 0; b < kSumBlocks; ++b) s = __dadd_rn(s, scratch[size_t(i) * kSumBlocks + b]);
  sums[i] = s;
}

__global__ void scale_and_clip_kernel(Chunk c, const float* loss_scale, float scale,
                                      const double* sums, float clip_norm, float clip_value) {
  const int i = blockIdx.y;
  const float inv = inverse_scale(loss_scale);
  float f = scale;
  if (clip_norm > 0) {
    const double norm = sqrt(sums[c.base + i]);
    f = isfinite(norm) ? float(double(clip_norm) / fmax(norm, double(clip_norm))) : nanf("");
  }
  const float* in = c.in[i];
  float* out = c.out[i];
  const size_t n = c.count[i];
  for (size_t j = size_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += size_t(gridDim.x) * blockDim.x) {
    float x = loss_scale ? __fmul_rn(in[j], inv) : in[j];
    if (f != 1.0f) x = __fmul_rn(x, f);
    if (clip_value > 0) x = x < -clip_value ? -clip_value : (x > clip_value ? clip_value : x);
    out[j] = x;
  }
}

__global__ void accumulate_kernel(Chunk c, bool first) {
  const int i = blockIdx.y;
  const float* in = c.in[i];
  float* acc = c.out[i];
  const size_t n = c.count[i];
  for (size_t j = size_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += size_t(gridDim.x) * blockDim.x) {
    acc[j] = first ? in[j] : __fadd_rn(acc[j], in[j]);
  }
}

__global__ void fill_kernel(float* dst, size_t count, float value) {
  for (size_t j = size_t(blockIdx.x) * blockDim.x + threadIdx.x; j < count;
       j += size_t(gridDim.x) * blockDim.x) {
    dst[j] = value;
  }
}

// Grid x for an element-wise pass over a chunk: enough blocks for its
// largest tensor, capped (the loops stride).
unsigned grid_x(const Chunk& c, int m) {
  size_t most = 0;
  for (int i = 0; i < m; ++i) most = std::max(most, c.count[i]);
  const size_t b = (most + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(b, 4096)));
}

// Calls `launch(chunk, m)` for each run of up to kOptimChunk tensors.
template <typename F>
void for_each_chunk(const float* const* in, float* const* out, const size_t* counts, int n,
                    F&& launch) {
  for (int base = 0; base < n; base += kOptimChunk) {
    Chunk c{};
    c.base = base;
    const int m = std::min(kOptimChunk, n - base);
    for (int i = 0; i < m; ++i) {
      c.in[i] = in[base + i];
      c.out[i] = out ? out[base + i] : nullptr;
      c.count[i] = counts[base + i];
    }
    launch(c, m);
  }
}

}  // namespace

void launch_sum_of_squares(const float* const* in, const size_t* counts, int n,
                           const float* loss_scale, double* sums, double* scratch, void* stream) {
  if (n <= 0) return;
  for_each_chunk(in, nullptr, counts, n, [&](const Chunk& c, int m) {
    sum_of_squares_partial<<<dim3(kSumBlocks, m), kThreads, 0, as_stream(stream)>>>(c, loss_scale,
                                                                                    scratch);
    check_launch("sum_of_squares_partial");
  });
  sum_of_squares_final<<<(n + 127) / 128, 128, 0, as_stream(stream)>>>(scratch, sums, n);
  check_launch("sum_of_squares_final");
}

void launch_scale_and_clip(const float* const* in, float* const* out, const size_t* counts, int n,
                           const float* loss_scale, float scale, const double* sums,
                           float clip_norm, float clip_value, void* stream) {
  if (n <= 0) return;
  for_each_chunk(in, out, counts, n, [&](const Chunk& c, int m) {
    scale_and_clip_kernel<<<dim3(grid_x(c, m), m), kThreads, 0, as_stream(stream)>>>(
        c, loss_scale, scale, sums, clip_norm, clip_value);
    check_launch("scale_and_clip_kernel");
  });
}

void launch_accumulate(float* const* acc, const float* const* in, const size_t* counts, int n,
                       bool first, void* stream) {
  if (n <= 0) return;
  for_each_chunk(in, acc, counts, n, [&](const Chunk& c, int m) {
    accumulate_kernel<<<dim3(grid_x(c, m), m), kThreads, 0, as_stream(stream)>>>(c, first);
    check_launch("accumulate_kernel");
  });
}

void launch_fill(float* dst, size_t count, float value, void* stream) {
  if (count == 0) return;
  const size_t b = std::min<size_t>((count + kThreads - 1) / kThreads, 4096);
  fill_kernel<<<static_cast<unsigned>(b), kThreads, 0, as_stream(stream)>>>(dst, count, value);
  check_launch("fill_kernel");
}

}  // namespace gpu
}  // namespace diststrat
