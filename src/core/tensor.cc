#include "diststrat/tensor.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>

#include "core/device_manager_impl.h"
#include "core/device_scope.h"
#include "core/step_capture.h"

namespace diststrat {

// ---- Shape -----------------------------------------------------------------

Shape::Shape(std::initializer_list<int64_t> dims) : Shape(std::vector<int64_t>(dims)) {}

Shape::Shape(std::vector<int64_t> dims) : dims_(std::move(dims)) {
  int64_t n = 1;
  for (size_t i = 0; i < dims_.size(); ++i) {
    DISTSTRAT_CHECK(dims_[i] >= 0, kInvalidArgument, "shape ", to_string(), ": dim ", i,
                    " is negative");
    // The element count must be an int64 (num_elements() multiplies freely).
    DISTSTRAT_CHECK(n == 0 || dims_[i] <= std::numeric_limits<int64_t>::max() / n, kInvalidArgument,
                    "shape ", to_string(), ": the element count overflows int64");
    n *= dims_[i];
  }
}

int64_t Shape::dim(size_t i) const {
  DISTSTRAT_CHECK_LT(i, dims_.size(), "Shape::dim on ", to_string());
  return dims_[i];
}

int64_t Shape::num_elements() const {
  int64_t n = 1;
  for (int64_t d : dims_) n *= d;
  return n;
}

std::string Shape::to_string() const {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < dims_.size(); ++i) os << (i ? ", " : "") << dims_[i];
  os << "]";
  return os.str();
}

// ---- Tensor ----------------------------------------------------------------

struct Tensor::Storage {
  void* ptr = nullptr;
  size_t bytes = 0;
  std::shared_ptr<void> owner;  // null for wrapped user memory
  // The CUDA ordinal of GPU memory allocated here (its device's index is a
  // logical GPU's, which on a split GPU is not an ordinal); -1 otherwise.
  int cuda_ordinal = -1;
};

namespace {
constexpr size_t kAlignment = 64;  // cache line; also AVX-512 friendly

std::shared_ptr<void> allocate_host(size_t bytes) {
  const size_t rounded = ((bytes + kAlignment - 1) / kAlignment) * kAlignment;
  void* p = rounded ? std::aligned_alloc(kAlignment, rounded) : nullptr;
  if (rounded && !p) {
    throw ResourceExhaustedError("host allocation of " + std::to_string(bytes) + " bytes failed");
  }
  if (p) std::memset(p, 0, rounded);
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}
}  // namespace

namespace {
// A shape whose bytes in `dtype` fit int64 (and so size_t, with room to round).
void check_byte_size(const Shape& shape, DType dtype) {
  const int64_t elems = shape.num_elements();
  const int64_t size = static_cast<int64_t>(dtype_size(dtype));
  DISTSTRAT_CHECK(size == 0 || elems <= (std::numeric_limits<int64_t>::max() / 2) / size,
                  kInvalidArgument, "tensor of shape ", shape.to_string(), " in ",
                  dtype_name(dtype), ": its byte size overflows");
}
}  // namespace

Tensor::Tensor(Shape shape, DType dtype, Device device)
    : shape_(std::move(shape)), dtype_(dtype), device_(device) {
  allocate(/*zero_gpu_memory=*/true);
}

Tensor Tensor::uninitialized(Shape shape, DType dtype, Device device) {
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.allocate(/*zero_gpu_memory=*/false);
  return t;
}

void Tensor::allocate(bool zero_gpu_memory) {
  check_byte_size(shape_, dtype_);
  storage_ = std::make_shared<Storage>();
  storage_->bytes = nbytes();
  // GPU memory comes from the calling thread's scope (a replica of a GPU
  // strategy) and its device's caching allocator.
  storage_->owner = device_.is_cpu()
                        ? allocate_host(storage_->bytes)
                        : allocate_device_memory(device_, storage_->bytes, zero_gpu_memory);
  storage_->ptr = storage_->owner.get();
  if (device_.is_gpu())
    storage_->cuda_ordinal =
        DeviceManagerAccess::impl(*current_exec_scope()->devices).ordinal_of(device_);
}

int Tensor::storage_cuda_ordinal() const { return storage_ ? storage_->cuda_ordinal : -1; }

Tensor Tensor::wrap(void* data, Shape shape, DType dtype, Device device) {
  check_byte_size(shape, dtype);
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  DISTSTRAT_CHECK(data != nullptr || t.nbytes() == 0, kInvalidArgument,
                  "Tensor::wrap of a null pointer with shape ", t.shape_.to_string());
  t.storage_ = std::make_shared<Storage>();
  t.storage_->ptr = data;
  t.storage_->bytes = t.nbytes();
  return t;
}

Tensor Tensor::adopt(std::shared_ptr<void> memory, Shape shape, DType dtype, Device device) {
  Tensor t = wrap(memory.get(), std::move(shape), dtype, device);
  t.storage_->owner = std::move(memory);
  return t;
}

bool Tensor::owns_memory() const { return storage_ && storage_->owner != nullptr; }

const void* Tensor::data_ptr() const {
  return storage_ ? static_cast<const char*>(storage_->ptr) + offset_ : nullptr;
}
void* Tensor::data() {
  DISTSTRAT_CHECK(defined(), kFailedPrecondition, "data() of an undefined tensor");
  return const_cast<void*>(data_ptr());
}
const void* Tensor::data() const {
  DISTSTRAT_CHECK(defined(), kFailedPrecondition, "data() of an undefined tensor");
  return data_ptr();
}

void Tensor::check_dtype(DType expected) const {
  DISTSTRAT_CHECK(dtype_ == expected, kInvalidArgument, "tensor ", debug_string(), " accessed as ",
                  dtype_name(expected));
}

Tensor Tensor::clone() const {
  Tensor t(shape_, dtype_, device_);
  t.copy_from(*this);
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  DISTSTRAT_CHECK(src.shape_ == shape_ && src.dtype_ == dtype_, kInvalidArgument,
                  "copy_from: ", src.debug_string(), " into ", debug_string());
  if (!nbytes() || data() == src.data()) return;
  if (device_.is_cpu() && src.device_.is_cpu()) {
    std::memmove(data(), src.data(), nbytes());
    return;
  }
  // Any copy that touches a GPU is enqueued on the GPU side's stream. Device
  // -> host completes before returning; host -> device returns once the
  // source is read.
  const Device& gpu = device_.is_gpu() ? device_ : src.device_;
  const GpuExec e = gpu_exec(gpu, "copy_from");
  if (device_.is_cpu() || src.device_.is_cpu()) {
    refuse_in_capture("copy_from: a copy of " + src.debug_string() + " into " + debug_string());
  }
  if (device_.is_cpu()) {  // device -> host: bounded wait, staged when pageable
    e.backend->copy_to_host(e.ordinal, data(), src.data(), nbytes(), e.stream, e.deadline(),
                            "copy of " + src.debug_string() + " into " + debug_string());
    return;
  }
  if (src.device_.is_cpu()) {
    // Host -> device on a replica's stream (inside a step): staged through
    // pinned memory that outlives the copy, so the host goes on at once and
    // the step's later work on that stream is ordered after it; pageable
    // when none is to be had. On the default stream (outside a step) the
    // copy completes before returning: the replicas' streams are not
    // ordered after the default stream, and a copy left in flight there
    // raced the next step's reads (DLPack.CudaTensorsAllReduce... under load).
    if (e.stream) {
      DeviceManager::Impl& dm = DeviceManagerAccess::impl(*current_exec_scope()->devices);
      if (dm.copy_to_device_staged(e.ordinal, data(), src.data(), nbytes(), e.stream)) return;
    }
    e.backend->memcpy_async(e.ordinal, data(), src.data(), nbytes(), e.stream);
    e.synchronize("copy of " + src.debug_string() + " into " + debug_string());
    return;
  }
  e.backend->memcpy_async(e.ordinal, data(), src.data(), nbytes(), e.stream);
}

void Tensor::zero() {
  if (!nbytes()) return;
  if (device_.is_cpu()) {
    std::memset(data(), 0, nbytes());
    return;
  }
  const GpuExec e = gpu_exec(device_, "zero");
  e.backend->memset_async(e.ordinal, data(), 0, nbytes(), e.stream);
}

Tensor Tensor::reshape(Shape shape) const {
  DISTSTRAT_CHECK_EQ(shape.num_elements(), num_elements(),
                     "reshape of " + debug_string() + " to " + shape.to_string());
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  DISTSTRAT_CHECK(shape_.rank() >= 1, kInvalidArgument, "slice_rows of scalar ", debug_string());
  DISTSTRAT_CHECK(0 <= begin && begin <= end && end <= shape_[0], kInvalidArgument, "slice_rows [",
                  begin, ", ", end, ") of ", debug_string());
  std::vector<int64_t> dims = shape_.dims();
  const int64_t row_elems = dims[0] ? num_elements() / dims[0] : 0;
  int64_t row_bytes = row_elems * static_cast<int64_t>(dtype_size(dtype_));
  if (dims[0] == 0) {
    int64_t r = 1;
    for (size_t i = 1; i < dims.size(); ++i) r *= dims[i];
    row_bytes = r * static_cast<int64_t>(dtype_size(dtype_));
  }
  dims[0] = end - begin;
  Tensor t = *this;
  t.shape_ = Shape(dims);
  t.offset_ = offset_ + static_cast<size_t>(begin * row_bytes);
  return t;
}

std::string Tensor::debug_string() const {
  if (!defined()) return "<undefined tensor>";
  return std::string(dtype_name(dtype_)) + shape_.to_string() + " on " + device_.to_string();
}

}  // namespace diststrat
