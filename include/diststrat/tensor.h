// Shape and Tensor. A Tensor is a dtype, a shape, a device and a reference to
// storage. Storage is either owned (allocated by the library, zero-filled) or a
// non-owning view of user memory (Tensor::wrap), so programs with their own
// kernels can hand buffers in without a copy. Copying a Tensor copies the
// reference, not the data (like torch.Tensor); use clone() for a deep copy.
//
// Rules: no call communicates. Tensor handles may be copied and destroyed
// from any thread; writes to one tensor's data from two threads at once are
// the caller's race, as with any buffer. A copy into host memory has
// completed when it returns; a copy from host memory to a GPU has read its
// source when it returns (the source may change then) and is ordered on the
// replica's stream, as is work on GPU memory alone (each call says which).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "diststrat/device.h"
#include "diststrat/dtype.h"
#include "diststrat/error.h"

// DLPack's managed tensor (dlpack/dlpack.h declares it as
// `typedef struct DLManagedTensor {...} DLManagedTensor;`, which this
// declaration matches), so users compile against diststrat without that header.
struct DLManagedTensor;

namespace diststrat {

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(std::vector<int64_t> dims);

  size_t rank() const { return dims_.size(); }
  int64_t operator[](size_t i) const { return dims_[i]; }
  int64_t dim(size_t i) const;  // bounds-checked
  const std::vector<int64_t>& dims() const { return dims_; }
  // Product of the dims; 1 for a scalar (rank 0).
  int64_t num_elements() const;
  // "[784, 256]"
  std::string to_string() const;

  bool operator==(const Shape& o) const { return dims_ == o.dims_; }
  bool operator!=(const Shape& o) const { return dims_ != o.dims_; }

 private:
  std::vector<int64_t> dims_;
};

class Tensor {
 public:
  // An empty (null) tensor: defined() is false.
  Tensor() = default;
  // Allocates zero-filled memory on `device`. GPU memory comes from the
  // device's caching allocator and is only available on a thread that runs a
  // GPU strategy's replica (inside Strategy::run), where the zero-fill and
  // every later op go to the replica's stream; elsewhere use
  // DeviceManager::allocate. Throws FailedPreconditionError without one.
  Tensor(Shape shape, DType dtype, Device device = Device::cpu());
  // As the constructor, but GPU memory is not zero-filled (no memset is
  // enqueued): for an output that an op overwrites entirely. Host memory is
  // zero-filled as by the constructor.
  static Tensor uninitialized(Shape shape, DType dtype, Device device = Device::cpu());
  // A non-owning view of `data`; the caller keeps the memory alive for as long
  // as the tensor (and any copy of it) is used.
  static Tensor wrap(void* data, Shape shape, DType dtype, Device device = Device::cpu());
  // Takes shared ownership of memory allocated elsewhere (a device allocator):
  // `memory` must hold at least shape.num_elements() * dtype_size(dtype) bytes.
  static Tensor adopt(std::shared_ptr<void> memory, Shape shape, DType dtype, Device device);

  // ---- DLPack (zero-copy exchange with PyTorch, JAX, CuPy, TVM, ...) ----
  // Details and the mapping of devices and dtypes: docs/dlpack.md. Both throw
  // UnimplementedError in a build without the DLPack header
  // (DISTSTRAT_HAVE_DLPACK in diststrat/config.h).
  //
  // from_dlpack views `managed`'s memory without a copy and takes ownership
  // of `managed`: on success its deleter (unless null) is called exactly once,
  // when the last Tensor sharing the storage (copies, reshape, slice_rows
  // views) goes away, on whichever thread drops it; the caller must not call
  // it or touch `managed` afterwards. On failure (any exception), nothing was
  // taken: the deleter has not been called and the caller still owns
  // `managed` (as with PyTorch's at::fromDLPack). Accepted: kDLCPU and
  // kDLCUDAHost (pinned host memory) -> Device::cpu(0); kDLCUDA device_id d ->
  // the logical GPU of CUDA ordinal d, translated through the calling thread's
  // DeviceManager inside Strategy::run (the replica's own device when it is on
  // that GPU; ambiguous for a GPU split into several logical devices), else
  // Device::gpu(d). dtypes float32/64, float16, bfloat16, int32/64 with
  // lanes 1; compact row-major layout (strides NULL or equal to the compact
  // ones; size-1 dims may have any stride); data + byte_offset aligned to the
  // element size. Anything else -> InvalidArgumentError naming the field.
  // Does not block; thread-safe (touches only `managed`).
  static Tensor from_dlpack(DLManagedTensor* managed);
  // The same onto an explicit device of the matching kind (a CPU device for
  // kDLCPU/kDLCUDAHost, a GPU for kDLCUDA), e.g. a logical GPU of a split one.
  static Tensor from_dlpack(DLManagedTensor* managed, const Device& device);
  // A DLManagedTensor viewing this tensor's memory (no copy), compact
  // row-major with explicit strides, byte_offset 0. It holds a reference to
  // the storage, so the memory stays valid until the consumer calls its
  // deleter (exactly once; from any thread), even after every Tensor is gone.
  // Memory this tensor merely wraps (Tensor::wrap) stays the caller's to keep
  // alive. GPU: device_type kDLCUDA with the CUDA ordinal (the one the memory
  // was allocated on, else through the calling thread's DeviceManager when it
  // has one, else the device index); the
  // consumer orders its work after the replica's stream itself. Throws
  // FailedPreconditionError for an undefined tensor. Thread-safe.
  DLManagedTensor* to_dlpack() const;

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  const Device& device() const { return device_; }
  int64_t num_elements() const { return shape_.num_elements(); }
  size_t nbytes() const { return static_cast<size_t>(num_elements()) * dtype_size(dtype_); }
  bool owns_memory() const;

  void* data();
  const void* data() const;
  // Typed access; throws InvalidArgumentError if T does not match dtype().
  template <typename T>
  T* data() {
    check_dtype(dtype_of<T>());
    return static_cast<T*>(data());
  }
  template <typename T>
  const T* data() const {
    check_dtype(dtype_of<T>());
    return static_cast<const T*>(data());
  }

  // Deep copy into newly owned memory on the same device.
  Tensor clone() const;
  // Copies `src`'s bytes into this tensor; shapes and dtypes must match.
  // Either side may be on a GPU (same scope rules as the constructor). Device
  // to host: complete when it returns (a bounded wait). Host to device: the
  // source is staged in pinned memory (kept until the copy has run) and the
  // copy enqueued on the replica's stream, so it returns without waiting for
  // the device and the source may be reused at once. Device to device:
  // ordered on the replica's stream.
  void copy_from(const Tensor& src);
  // Sets every byte to zero (GPU: enqueued on the replica's stream).
  void zero();
  // A view with another shape of the same number of elements (shares storage).
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) along axis 0, as a view (shares storage).
  Tensor slice_rows(int64_t begin, int64_t end) const;
  // True when both tensors view the same memory.
  bool same_storage(const Tensor& o) const { return data_ptr() == o.data_ptr(); }

  std::string debug_string() const;  // "float32[784, 256] on /device:CPU:0"

 private:
  struct Storage;
  void check_dtype(DType expected) const;
  void allocate(bool zero_gpu_memory);
  // The CUDA ordinal of GPU memory this library allocated, -1 otherwise.
  int storage_cuda_ordinal() const;
  const void* data_ptr() const;

  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes into storage
  Shape shape_;
  DType dtype_ = DType::kFloat32;
  Device device_;
};

}  // namespace diststrat
