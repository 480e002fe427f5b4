// Launchers of the optimizer's training-feature kernels (optim_kernels.cu):
// sums of squares for clipping and the non-finite check of loss scaling, the
// unscale / clip pass and gradient accumulation, over lists of float32
// device tensors. Host functions: they enqueue on `stream` (a cudaStream_t,
// null = the legacy default stream) and check the launch; nothing blocks.
// Semantics: GpuBackend's training-feature block (core/gpu_backend.h).
#pragma once

#include <cstddef>
#include <cstdint>

namespace diststrat {
namespace gpu {

// Tensors one launch covers (they travel by value in the kernel's
// parameters); longer lists take one launch per chunk, in order.
constexpr int kOptimChunk = 48;

void launch_sum_of_squares(const float* const* in, const size_t* counts, int n,
                           const float* loss_scale, double* sums, double* scratch, void* stream);
void launch_scale_and_clip(const float* const* in, float* const* out, const size_t* counts, int n,
                           const float* loss_scale, float scale, const double* sums,
                           float clip_norm, float clip_value, void* stream);
void launch_accumulate(float* const* acc, const float* const* in, const size_t* counts, int n,
                       bool first, void* stream);
void launch_fill(float* dst, size_t count, float value, void* stream);

}  // namespace gpu
}  // namespace diststrat
