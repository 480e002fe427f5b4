// CUDA kernels: the multi-buffer reduction (all dtypes, written once as a
// template over the element type), the small layer kernels around cuBLAS's
// GEMMs, softmax cross-entropy and the optimizer updates. One file, so nvcc
// runs once per architecture.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "diststrat/error.h"
#include "gpu/cuda_check.h"
#include "gpu/device_reduce.h"
#include "gpu/kernels.h"

namespace diststrat {
namespace gpu {

namespace {

constexpr int kThreads = 256;

// Null = the legacy default stream, explicitly (cuda_check.h).
cudaStream_t as_stream(void* s) { return stream_or_legacy(s); }

int blocks_for(int64_t work) {
  const int64_t b = (work + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(b, 65535 * 4)));
}

void check_launch(const char* kernel) {
  check_cuda(cudaGetLastError(), kernel, __FILE__, __LINE__);
}

// ---- reduction ----------------------------------------------------------------

// Element type -> accumulator type and conversions.
template <typename T>
struct Acc {
  using type = T;
};
template <>
struct Acc<__half> {
  using type = float;
};
template <>
struct Acc<__nv_bfloat16> {
  using type = float;
};

template <typename T>
__device__ __forceinline__ typename Acc<T>::type load_acc(T v) {
  return v;
}
template <>
__device__ __forceinline__ float load_acc<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float load_acc<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <typename T, typename A>
__device__ __forceinline__ T store_acc(A v) {
  return static_cast<T>(v);
}
template <>
__device__ __forceinline__ __half store_acc<__half, float>(float v) {
  return __float2half(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 store_acc<__nv_bfloat16, float>(float v) {
  return __float2bfloat16(v);
}

// Integer sums and products wrap modulo 2^bits (collective.h), computed in
// the unsigned type: signed overflow is undefined, on the device too.
template <typename A>
__device__ __forceinline__ A wrap_add(A a, A b) {
  if constexpr (std::is_integral<A>::value) {
    using U = typename std::make_unsigned<A>::type;
    return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}
template <typename A>
__device__ __forceinline__ A wrap_mul(A a, A b) {
  if constexpr (std::is_integral<A>::value) {
    using U = typename std::make_unsigned<A>::type;
    return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
  } else {
    return a * b;
  }
}

template <typename A>
__device__ __forceinline__ A combine(A a, A b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      return wrap_add(a, b);
    case ReduceOp::kProduct:
      return wrap_mul(a, b);
    case ReduceOp::kMin:
      return b < a ? b : a;
    case ReduceOp::kMax:
      return b > a ? b : a;
  }
  return a;
}

struct Buffers {
  const void* in[kMaxReduceBuffers];
  void* out[kMaxReduceBuffers];
  int n_in;
  int n_out;
};

// Reduces element i (of type T) over the inputs and writes every output.
template <typename T>
__device__ __forceinline__ void reduce_one(const Buffers& b, size_t i, ReduceOp op, int divisor) {
  using A = typename Acc<T>::type;
  A acc = load_acc<T>(static_cast<const T*>(b.in[0])[i]);
  for (int k = 1; k < b.n_in; ++k)
    acc = combine<A>(acc, load_acc<T>(static_cast<const T*>(b.in[k])[i]), op);
  if (op == ReduceOp::kMean) acc = acc / static_cast<A>(divisor);
  const T v = store_acc<T, A>(acc);
  for (int o = 0; o < b.n_out; ++o) static_cast<T*>(b.out[o])[i] = v;
}

// Vectorised body: each thread handles 16-byte groups (kVec elements), so
// every load and store is one 128-bit transaction; the tail is scalar.
template <typename T>
__global__ void reduce_kernel(Buffers b, size_t count, ReduceOp op, int divisor, bool vec_ok) {
  constexpr int kVec = 16 / sizeof(T) > 0 ? 16 / sizeof(T) : 1;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  size_t done = 0;
  if (vec_ok && kVec > 1) {
    using A = typename Acc<T>::type;
    struct alignas(16) Pack {
      T v[kVec];
    };
    const size_t groups = count / kVec;
    for (size_t g = tid; g < groups; g += stride) {
      A acc[kVec];
      Pack p = static_cast<const Pack*>(b.in[0])[g];
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] = load_acc<T>(p.v[j]);
      for (int k = 1; k < b.n_in; ++k) {
        Pack q = static_cast<const Pack*>(b.in[k])[g];
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[j] = combine<A>(acc[j], load_acc<T>(q.v[j]), op);
      }
      Pack r;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        A v = acc[j];
        if (op == ReduceOp::kMean) v = v / static_cast<A>(divisor);
        r.v[j] = store_acc<T, A>(v);
      }
      for (int o = 0; o < b.n_out; ++o) static_cast<Pack*>(b.out[o])[g] = r;
    }
    done = groups * kVec;
  }
  for (size_t i = done + tid; i < count; i += stride) reduce_one<T>(b, i, op, divisor);
}

template <typename T>
void launch_reduce_typed(const Buffers& b, size_t count, ReduceOp op, int divisor, void* stream) {
  bool vec_ok = true;
  for (int k = 0; k < b.n_in; ++k) vec_ok &= reinterpret_cast<uintptr_t>(b.in[k]) % 16 == 0;
  for (int o = 0; o < b.n_out; ++o) vec_ok &= reinterpret_cast<uintptr_t>(b.out[o]) % 16 == 0;
  const size_t per_thread = vec_ok ? std::max<size_t>(1, 16 / sizeof(T)) : 1;
  const int blocks = blocks_for(static_cast<int64_t>((count + per_thread - 1) / per_thread));
  reduce_kernel<T><<<blocks, kThreads, 0, as_stream(stream)>>>(b, count, op, divisor, vec_ok);
  check_launch("reduce_kernel");
}

// ---- layers -------------------------------------------------------------------

// One thread per word of the output: word w of row i comes from row
// rows[i]. Words are 4 bytes when the row size allows, else bytes.
template <typename W>
__global__ void gather_rows_kernel(W* dst, const W* src, const int64_t* rows, int64_t n,
                                   int64_t row_words) {
  const int64_t total = n * row_words;
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < total;
       k += int64_t{blockDim.x} * gridDim.x) {
    const int64_t i = k / row_words, w = k - i * row_words;
    dst[k] = src[rows[i] * row_words + w];
  }
}

__global__ void bias_add_kernel(float* y, const float* b, int64_t rows, int64_t cols) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += b[i % cols];
  }
}

__global__ void column_sum_kernel(const float* dy, float* db, int64_t rows, int64_t cols) {
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < cols;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int64_t r = 0; r < rows; ++r) s += dy[r * cols + c];
    db[c] = s;
  }
}

__global__ void relu_forward_kernel(const float* x, float* y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = x[i] > 0.0f ? x[i] : 0.0f;
  }
}

__global__ void relu_backward_kernel(const float* y, const float* dy, float* dx, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
  }
}

// bias_add then relu_forward, fused: the same float operations in order.
__global__ void bias_relu_kernel(float* y, const float* b, int64_t rows, int64_t cols) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = y[i] + b[i % cols];
    y[i] = v > 0.0f ? v : 0.0f;
  }
}

// relu_backward in place then column_sum, fused: each column's rows in
// order, so db is column_sum_kernel's sum of the masked values.
__global__ void drelu_column_sum_kernel(const float* y, float* dy, float* db, int64_t rows,
                                        int64_t cols) {
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < cols;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r * cols + c;
      const float v = y[i] > 0.0f ? dy[i] : 0.0f;
      dy[i] = v;
      s += v;
    }
    db[c] = s;
  }
}

// One thread per row (class counts are small); double accumulation as on CPU.
__global__ void softmax_xent_kernel(const float* z, const int32_t* labels, float* d, float* loss,
                                    int32_t* correct, int32_t* bad, int64_t n, int64_t k,
                                    float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float* zi = z + i * k;
    float* di = d + i * k;
    const int32_t y = labels[i];
    if (y < 0 || y >= k) {
      atomicCAS(bad, 0, static_cast<int32_t>(i + 1));
      loss[i] = 0.0f;
      correct[i] = 0;
      for (int64_t j = 0; j < k; ++j) di[j] = 0.0f;
      continue;
    }
    float m = zi[0];
    int64_t best = 0;
    for (int64_t j = 1; j < k; ++j) {
      if (zi[j] > m) {
        m = zi[j];
        best = j;
      }
    }
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) sum += exp(static_cast<double>(zi[j] - m));
    const double log_sum = log(sum);
    loss[i] = static_cast<float>(log_sum - static_cast<double>(zi[y] - m));
    correct[i] = best == y ? 1 : 0;
    for (int64_t j = 0; j < k; ++j) {
      const double p = exp(static_cast<double>(zi[j] - m) - log_sum);
      di[j] = static_cast<float>((p - (j == y ? 1.0 : 0.0)) * scale);
    }
  }
}

// ---- optimizers ----------------------------------------------------------------

// One element of each rule: the single-tensor and the list kernels share
// them, so both give every element the same bits.
__device__ __forceinline__ void sgd_element(float* var, const float* g, float* v, size_t i,
                                            float lr, float mu, bool nesterov) {
  if (v == nullptr) {
    var[i] -= lr * g[i];
  } else {
    v[i] = mu * v[i] - lr * g[i];
    var[i] += nesterov ? mu * v[i] - lr * g[i] : v[i];
  }
}

__device__ __forceinline__ void adam_element(float* var, const float* g, float* m, float* v,
                                             size_t i, float b1, float b2, float eps, float alpha) {
  m[i] = b1 * m[i] + (1 - b1) * g[i];
  v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
  var[i] -= alpha * m[i] / (sqrtf(v[i]) + eps);
}

__global__ void sgd_kernel(float* var, const float* g, float* v, size_t n, float lr, float mu,
                           bool nesterov) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    sgd_element(var, g, v, i, lr, mu, nesterov);
  }
}

__global__ void adam_kernel(float* var, const float* g, float* m, float* v, size_t n, float b1,
                            float b2, float eps, float alpha) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    adam_element(var, g, m, v, i, b1, b2, eps, alpha);
  }
}

// A list of tensors by value in the kernel's parameters (no pointer table
// in device memory); blockIdx.y picks the tensor.
struct UpdateChunk {
  float* var[kUpdateChunk];
  const float* grad[kUpdateChunk];
  float* m[kUpdateChunk];  // momentum / Adam's m; null: SGD without momentum
  float* v[kUpdateChunk];  // Adam's v
  size_t count[kUpdateChunk];
};

__global__ void sgd_list_kernel(UpdateChunk c, float lr, float mu, bool nesterov) {
  const int t = blockIdx.y;
  const size_t n = c.count[t];
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    sgd_element(c.var[t], c.grad[t], c.m[t], i, lr, mu, nesterov);
  }
}

__global__ void adam_list_kernel(UpdateChunk c, float b1, float b2, float eps, float alpha) {
  const int t = blockIdx.y;
  const size_t n = c.count[t];
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    adam_element(c.var[t], c.grad[t], c.m[t], c.v[t], i, b1, b2, eps, alpha);
  }
}

// The list kernels with the step's rate read from device memory (a
// captured step's update: the rate is patched per replay, not baked in).
__global__ void sgd_list_at_kernel(UpdateChunk c, const float* rate, float mu, bool nesterov) {
  const int t = blockIdx.y;
  const size_t n = c.count[t];
  const float lr = *rate;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    sgd_element(c.var[t], c.grad[t], c.m[t], i, lr, mu, nesterov);
  }
}

__global__ void adam_list_at_kernel(UpdateChunk c, float b1, float b2, float eps,
                                    const float* rate) {
  const int t = blockIdx.y;
  const size_t n = c.count[t];
  const float alpha = *rate;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    adam_element(c.var[t], c.grad[t], c.m[t], c.v[t], i, b1, b2, eps, alpha);
  }
}

// Adam's bias-corrected step size, as the host rule computes it.
float adam_alpha(const UpdateRule& rule, int64_t step) {
  const double t = static_cast<double>(step);
  return static_cast<float>(rule.learning_rate * std::sqrt(1.0 - std::pow(rule.beta2, t)) /
                            (1.0 - std::pow(rule.beta1, t)));
}

}  // namespace

void launch_reduce(void* const* outs, int n_out, const void* const* ins, int n_in, size_t count,
                   DType dtype, ReduceOp op, int mean_divisor, void* stream) {
  DISTSTRAT_CHECK(
      n_in >= 1 && n_in <= kMaxReduceBuffers && n_out >= 1 && n_out <= kMaxReduceBuffers,
      kInvalidArgument, "GPU reduce of ", n_in, " inputs into ", n_out,
      " outputs: each must be in [1, ", kMaxReduceBuffers, "]");
  // The kernel's switch would reduce an unknown op as nothing at all.
  check_device_reduce(dtype, op, "GPU reduce");
  if (count == 0) return;
  Buffers b{};
  b.n_in = n_in;
  b.n_out = n_out;
  for (int k = 0; k < n_in; ++k) b.in[k] = ins[k];
  for (int o = 0; o < n_out; ++o) b.out[o] = outs[o];
  const int divisor = mean_divisor > 0 ? mean_divisor : 1;
  switch (dtype) {
    case DType::kFloat32:
      return launch_reduce_typed<float>(b, count, op, divisor, stream);
    case DType::kFloat64:
      return launch_reduce_typed<double>(b, count, op, divisor, stream);
    case DType::kFloat16:
      return launch_reduce_typed<__half>(b, count, op, divisor, stream);
    case DType::kBFloat16:
      return launch_reduce_typed<__nv_bfloat16>(b, count, op, divisor, stream);
    case DType::kInt32:
      return launch_reduce_typed<int32_t>(b, count, op, divisor, stream);
    case DType::kInt64:
      return launch_reduce_typed<int64_t>(b, count, op, divisor, stream);
  }
  throw InvalidArgumentError(std::string("GPU reduce: unsupported dtype ") + dtype_name(dtype));
}

void launch_gather_rows(void* dst, const void* src, const int64_t* rows, int64_t n,
                        size_t row_bytes, void* stream) {
  if (n == 0 || row_bytes == 0) return;
  // cudaMalloc'd tensors are 256-byte aligned and row views keep rows of
  // 4-byte multiples aligned: words then.
  const bool words = row_bytes % 4 == 0 && reinterpret_cast<uintptr_t>(dst) % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(src) % 4 == 0;
  const int64_t per = static_cast<int64_t>(words ? row_bytes / 4 : row_bytes);
  if (words) {
    gather_rows_kernel<<<blocks_for(n * per), kThreads, 0, as_stream(stream)>>>(
        static_cast<uint32_t*>(dst), static_cast<const uint32_t*>(src), rows, n, per);
  } else {
    gather_rows_kernel<<<blocks_for(n * per), kThreads, 0, as_stream(stream)>>>(
        static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), rows, n, per);
  }
  check_launch("gather_rows_kernel");
}

void launch_bias_add(float* y, const float* b, int64_t rows, int64_t cols, void* stream) {
  if (rows * cols == 0) return;
  bias_add_kernel<<<blocks_for(rows * cols), kThreads, 0, as_stream(stream)>>>(y, b, rows, cols);
  check_launch("bias_add_kernel");
}

void launch_column_sum(const float* dy, float* db, int64_t rows, int64_t cols, void* stream) {
  if (cols == 0) return;
  column_sum_kernel<<<blocks_for(cols), kThreads, 0, as_stream(stream)>>>(dy, db, rows, cols);
  check_launch("column_sum_kernel");
}

void launch_relu_forward(const float* x, float* y, int64_t count, void* stream) {
  if (count == 0) return;
  relu_forward_kernel<<<blocks_for(count), kThreads, 0, as_stream(stream)>>>(x, y, count);
  check_launch("relu_forward_kernel");
}

void launch_relu_backward(const float* y, const float* dy, float* dx, int64_t count, void* stream) {
  if (count == 0) return;
  relu_backward_kernel<<<blocks_for(count), kThreads, 0, as_stream(stream)>>>(y, dy, dx, count);
  check_launch("relu_backward_kernel");
}

void launch_bias_relu(float* y, const float* b, int64_t rows, int64_t cols, void* stream) {
  if (rows * cols == 0) return;
  bias_relu_kernel<<<blocks_for(rows * cols), kThreads, 0, as_stream(stream)>>>(y, b, rows, cols);
  check_launch("bias_relu_kernel");
}

void launch_drelu_column_sum(const float* y, float* dy, float* db, int64_t rows, int64_t cols,
                             void* stream) {
  if (cols == 0) return;
  drelu_column_sum_kernel<<<blocks_for(cols), kThreads, 0, as_stream(stream)>>>(y, dy, db, rows,
                                                                                cols);
  check_launch("drelu_column_sum_kernel");
}

void launch_softmax_xent(const float* logits, const int32_t* labels, float* dlogits, float* loss,
                         int32_t* correct, int32_t* bad, int64_t n, int64_t k, float scale,
                         void* stream) {
  check_cuda(cudaMemsetAsync(bad, 0, sizeof(int32_t), as_stream(stream)), "cudaMemsetAsync(bad)",
             __FILE__, __LINE__);
  if (n == 0) return;
  softmax_xent_kernel<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(
      logits, labels, dlogits, loss, correct, bad, n, k, scale);
  check_launch("softmax_xent_kernel");
}

void launch_update(const UpdateRule& rule, float* var, const float* grad, float* const* slots,
                   size_t count, int64_t step, void* stream) {
  if (count == 0) return;
  const int blocks = blocks_for(static_cast<int64_t>(count));
  switch (rule.kind) {
    case UpdateRule::Kind::kSgd:
      sgd_kernel<<<blocks, kThreads, 0, as_stream(stream)>>>(
          var, grad, rule.momentum == 0.0f ? nullptr : slots[0], count, rule.learning_rate,
          rule.momentum, rule.nesterov);
      check_launch("sgd_kernel");
      return;
    case UpdateRule::Kind::kAdam: {
      // Same bias-corrected step size as the host rule (Optimizer::update).
      const float alpha = adam_alpha(rule, step);
      adam_kernel<<<blocks, kThreads, 0, as_stream(stream)>>>(
          var, grad, slots[0], slots[1], count, rule.beta1, rule.beta2, rule.epsilon, alpha);
      check_launch("adam_kernel");
      return;
    }
    case UpdateRule::Kind::kNone:
      break;
  }
  throw UnimplementedError("GPU update: the optimizer has no device rule");
}

namespace {
// The list in chunks of kUpdateChunk tensors, each one launch of
// `launch(chunk, grid)` (a chunk whose tensors are all empty launches nothing).
template <typename Launch>
void for_each_update_chunk(const UpdateRule& rule, float* const* vars, const float* const* grads,
                           float* const* slots, const size_t* counts, int n, Launch launch) {
  if (rule.kind == UpdateRule::Kind::kNone) {
    throw UnimplementedError("GPU update: the optimizer has no device rule");
  }
  const bool adam = rule.kind == UpdateRule::Kind::kAdam;
  const bool momentum = !adam && rule.momentum != 0.0f;
  for (int base = 0; base < n; base += kUpdateChunk) {
    UpdateChunk c{};
    const int m = std::min(kUpdateChunk, n - base);
    size_t most = 0;
    for (int k = 0; k < m; ++k) {
      const int i = base + k;
      c.var[k] = vars[i];
      c.grad[k] = grads[i];
      c.m[k] = adam || momentum ? slots[i] : nullptr;
      c.v[k] = adam ? slots[n + i] : nullptr;
      c.count[k] = counts[i];
      most = std::max(most, counts[i]);
    }
    if (most == 0) continue;
    launch(c, dim3(static_cast<unsigned>(blocks_for(static_cast<int64_t>(most))),
                   static_cast<unsigned>(m)));
  }
}
}  // namespace

void launch_update_list(const UpdateRule& rule, float* const* vars, const float* const* grads,
                        float* const* slots, const size_t* counts, int n, int64_t step,
                        void* stream) {
  const bool adam = rule.kind == UpdateRule::Kind::kAdam;
  const float alpha = adam ? adam_alpha(rule, step) : 0.0f;
  for_each_update_chunk(rule, vars, grads, slots, counts, n, [&](const UpdateChunk& c, dim3 grid) {
    if (adam) {
      adam_list_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(c, rule.beta1, rule.beta2,
                                                                 rule.epsilon, alpha);
      check_launch("adam_list_kernel");
    } else {
      sgd_list_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(c, rule.learning_rate,
                                                                rule.momentum, rule.nesterov);
      check_launch("sgd_list_kernel");
    }
  });
}

// The same with the rate read from device memory (a captured step's update).
void launch_update_list_at(const UpdateRule& rule, float* const* vars, const float* const* grads,
                           float* const* slots, const size_t* counts, int n, const float* rate,
                           void* stream) {
  const bool adam = rule.kind == UpdateRule::Kind::kAdam;
  for_each_update_chunk(rule, vars, grads, slots, counts, n, [&](const UpdateChunk& c, dim3 grid) {
    if (adam) {
      adam_list_at_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(c, rule.beta1, rule.beta2,
                                                                    rule.epsilon, rate);
      check_launch("adam_list_at_kernel");
    } else {
      sgd_list_at_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(c, rate, rule.momentum,
                                                                   rule.nesterov);
      check_launch("sgd_list_at_kernel");
    }
  });
}

}  // namespace gpu
}  // namespace diststrat
