// DLPack import and export (Tensor::from_dlpack / Tensor::to_dlpack).
//
// Import views the producer's memory: the Tensor's storage owns a small
// Imported record whose destructor calls the producer's deleter, and the data
// pointer aliases that record's shared_ptr, so every view of the storage keeps
// it alive and the last one releases it. The record is armed only after the
// Tensor exists, so an import that throws (validation, bad_alloc) never calls
// the deleter: the caller keeps ownership, as with PyTorch's at::fromDLPack.
//
// Export hands out an Exported record (the DLManagedTensor, a Tensor copy that
// holds the storage, and the shape/strides arrays it points to); its deleter
// deletes the record. A Tensor that came from from_dlpack exports its
// original pointer, so import -> export -> import is zero-copy and the chain
// releases the first producer's memory when the last holder lets go.
#include "diststrat/config.h"
#include "diststrat/tensor.h"

#if DISTSTRAT_HAVE_DLPACK
#include <dlpack/dlpack.h>
#endif

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "core/device_manager_impl.h"
#include "core/device_scope.h"

namespace diststrat {

#if DISTSTRAT_HAVE_DLPACK

namespace {

// More dims than any framework makes (PyTorch: 64); a larger ndim is garbage.
constexpr int kMaxDims = 64;

const char* device_type_name(int type) {
  switch (type) {
    case kDLCPU:
      return "kDLCPU";
    case kDLCUDA:
      return "kDLCUDA";
    case kDLCUDAHost:
      return "kDLCUDAHost";
    case kDLOpenCL:
      return "kDLOpenCL";
    case kDLVulkan:
      return "kDLVulkan";
    case kDLMetal:
      return "kDLMetal";
    case kDLVPI:
      return "kDLVPI";
    case kDLROCM:
      return "kDLROCM";
    case kDLROCMHost:
      return "kDLROCMHost";
    case kDLExtDev:
      return "kDLExtDev";
    case kDLCUDAManaged:
      return "kDLCUDAManaged";
    case 14:
      return "kDLOneAPI";  // DLPack >= 0.7
    case 15:
      return "kDLWebGPU";
    case 16:
      return "kDLHexagon";
    default:
      return "unknown";
  }
}

// "float32", "uint8", "complex64", "float32x4" (lanes), "code 9 bits 8".
std::string describe(const DLDataType& t) {
  const char* name = nullptr;
  switch (t.code) {
    case kDLInt:
      name = "int";
      break;
    case kDLUInt:
      name = "uint";
      break;
    case kDLFloat:
      name = "float";
      break;
    case kDLOpaqueHandle:
      name = "opaque";
      break;
    case kDLBfloat:
      name = "bfloat";
      break;
    case kDLComplex:
      name = "complex";
      break;
    case 6:
      name = "bool";
      break;  // kDLBool, DLPack >= 0.8
    default:
      break;
  }
  std::ostringstream os;
  if (name) {
    os << name << static_cast<int>(t.bits);
  } else {
    os << "code " << static_cast<int>(t.code) << " bits " << static_cast<int>(t.bits);
  }
  if (t.lanes != 1) os << "x" << t.lanes;
  return os.str();
}

DType dtype_from_dl(const DLDataType& t) {
  DISTSTRAT_CHECK(t.lanes == 1, kInvalidArgument, "Tensor::from_dlpack: dtype ", describe(t),
                  " has ", t.lanes, " lanes; only scalar elements (lanes == 1) are supported");
  if (t.code == kDLFloat && t.bits == 32) return DType::kFloat32;
  if (t.code == kDLFloat && t.bits == 64) return DType::kFloat64;
  if (t.code == kDLFloat && t.bits == 16) return DType::kFloat16;
  if (t.code == kDLBfloat && t.bits == 16) return DType::kBFloat16;
  if (t.code == kDLInt && t.bits == 32) return DType::kInt32;
  if (t.code == kDLInt && t.bits == 64) return DType::kInt64;
  throw InvalidArgumentError("Tensor::from_dlpack: unsupported dtype " + describe(t) + " (code " +
                             std::to_string(t.code) + ", bits " + std::to_string(t.bits) +
                             "); supported: float32, float64, float16, bfloat16, int32, int64");
}

DLDataType dtype_to_dl(DType d) {
  DLDataType t;
  t.lanes = 1;
  t.bits = static_cast<uint8_t>(dtype_size(d) * 8);
  switch (d) {
    case DType::kFloat32:
    case DType::kFloat64:
    case DType::kFloat16:
      t.code = kDLFloat;
      break;
    case DType::kBFloat16:
      t.code = kDLBfloat;
      break;
    case DType::kInt32:
    case DType::kInt64:
      t.code = kDLInt;
      break;
  }
  return t;
}

std::string join(const int64_t* v, int n) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < n; ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

// The logical GPU of CUDA ordinal `ordinal` as the calling thread sees it.
Device gpu_of_ordinal(int ordinal) {
  const ExecScope* s = current_exec_scope();
  if (!s || !s->devices) return Device::gpu(ordinal);
  DeviceManager::Impl& dm = DeviceManagerAccess::impl(*s->devices);
  if (s->device.is_gpu() && dm.ordinal_of(s->device) == ordinal) return s->device;
  std::vector<Device> matches;
  std::ostringstream all;
  for (const LogicalDeviceInfo& l : dm.logical_devices()) {
    if (l.physical_ordinal == ordinal) matches.push_back(l.device);
    all << (all.tellp() > 0 ? ", " : "") << l.device.to_string() << " = CUDA "
        << l.physical_ordinal;
  }
  DISTSTRAT_CHECK(!matches.empty(), kInvalidArgument, "Tensor::from_dlpack: kDLCUDA device_id ",
                  ordinal, " is not a GPU of this thread's DeviceManager (",
                  all.str().empty() ? "none" : all.str(), ")");
  if (matches.size() > 1) {
    throw InvalidArgumentError("Tensor::from_dlpack: kDLCUDA device_id " + std::to_string(ordinal) +
                               " is split into several logical GPUs (" + all.str() +
                               "); name the one to use with Tensor::from_dlpack(managed, device)");
  }
  return matches[0];
}

Device device_from_dl(const DLDevice& dev, const Device* wanted) {
  // Read as the integer it travels as: a producer's unknown type code is no
  // valid DLDeviceType, and loading it as the enum is undefined behaviour.
  std::underlying_type_t<DLDeviceType> raw;
  static_assert(sizeof raw == sizeof dev.device_type, "DLDeviceType's size");
  std::memcpy(&raw, &dev.device_type, sizeof raw);
  const int type = static_cast<int>(raw);
  if (type == kDLCPU || type == kDLCUDAHost) {  // pinned host memory is host memory
    DISTSTRAT_CHECK(!wanted || wanted->is_cpu(), kInvalidArgument,
                    "Tensor::from_dlpack: ", device_type_name(type), " memory onto ",
                    wanted->to_string(), " (host memory needs a CPU device)");
    return wanted ? *wanted : Device::cpu(0);
  }
  if (type == kDLCUDA) {
    DISTSTRAT_CHECK(dev.device_id >= 0, kInvalidArgument, "Tensor::from_dlpack: kDLCUDA device_id ",
                    dev.device_id, " is negative");
    if (!wanted) return gpu_of_ordinal(dev.device_id);
    DISTSTRAT_CHECK(wanted->is_gpu(), kInvalidArgument, "Tensor::from_dlpack: kDLCUDA memory (",
                    "device_id ", dev.device_id, ") onto ", wanted->to_string(),
                    " (device memory needs a GPU device)");
    const ExecScope* s = current_exec_scope();
    if (s && s->devices) {
      const int ordinal = DeviceManagerAccess::impl(*s->devices).ordinal_of(*wanted);
      DISTSTRAT_CHECK(ordinal == dev.device_id, kInvalidArgument,
                      "Tensor::from_dlpack: ", wanted->to_string(), " is CUDA ordinal ", ordinal,
                      ", the memory is on kDLCUDA device_id ", dev.device_id);
    }
    return *wanted;
  }
  throw InvalidArgumentError(std::string("Tensor::from_dlpack: unsupported device type ") +
                             device_type_name(type) + " (" + std::to_string(type) +
                             "); supported: kDLCPU, kDLCUDAHost, kDLCUDA");
}

// Owns an imported DLManagedTensor once armed (see the file comment).
struct Imported {
  DLManagedTensor* managed = nullptr;
  bool armed = false;
  ~Imported() {
    if (armed) managed->deleter(managed);
  }
};

struct Exported {
  DLManagedTensor managed{};
  Tensor tensor;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  static void deleter(DLManagedTensor* self) { delete static_cast<Exported*>(self->manager_ctx); }
};

Tensor import(DLManagedTensor* managed, const Device* wanted) {
  DISTSTRAT_CHECK(managed != nullptr, kInvalidArgument,
                  "Tensor::from_dlpack: null DLManagedTensor");
  const DLTensor& t = managed->dl_tensor;
  DISTSTRAT_CHECK(t.ndim >= 0 && t.ndim <= kMaxDims, kInvalidArgument, "Tensor::from_dlpack: ndim ",
                  t.ndim, " is outside [0, ", kMaxDims, "]");
  DISTSTRAT_CHECK(t.ndim == 0 || t.shape != nullptr, kInvalidArgument,
                  "Tensor::from_dlpack: shape is NULL with ndim ", t.ndim);
  const DType dtype = dtype_from_dl(t.dtype);
  const int64_t elem = static_cast<int64_t>(dtype_size(dtype));
  const Device device = device_from_dl(t.device, wanted);

  std::vector<int64_t> dims(t.shape, t.shape + t.ndim);
  int64_t count = 1;
  for (int i = 0; i < t.ndim; ++i) {
    DISTSTRAT_CHECK(dims[i] >= 0, kInvalidArgument, "Tensor::from_dlpack: shape ",
                    join(t.shape, t.ndim), ": dim ", i, " is negative");
  }
  bool overflow = false;
  for (int i = 0; i < t.ndim && !overflow; ++i) {
    overflow = __builtin_mul_overflow(count, dims[i], &count);
  }
  int64_t nbytes = 0;
  overflow = overflow || __builtin_mul_overflow(count, elem, &nbytes);
  DISTSTRAT_CHECK(!overflow, kInvalidArgument, "Tensor::from_dlpack: shape ", join(t.shape, t.ndim),
                  " of ", dtype_name(dtype), " has more bytes than an int64 holds");

  // Compact row-major: stride[i] = prod(shape[i+1:]); a size-1 dim's stride
  // never moves the pointer and an empty tensor has no layout.
  if (t.strides && count > 0) {
    int64_t expected = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      DISTSTRAT_CHECK(dims[i] == 1 || t.strides[i] == expected, kInvalidArgument,
                      "Tensor::from_dlpack: not contiguous: dim ", i, " has stride ", t.strides[i],
                      " where compact row-major needs ", expected, " (shape ",
                      join(t.shape, t.ndim), ", strides ", join(t.strides, t.ndim),
                      "); make it contiguous first (torch: .contiguous())");
      expected *= dims[i];
    }
  }

  DISTSTRAT_CHECK(t.data != nullptr || count == 0, kInvalidArgument,
                  "Tensor::from_dlpack: data is NULL for ", count, " elements");
  void* ptr = nullptr;
  if (t.data) {
    // Address arithmetic only: device pointers are never dereferenced here.
    const uintptr_t base = reinterpret_cast<uintptr_t>(t.data);
    const uintptr_t max = std::numeric_limits<uintptr_t>::max();
    DISTSTRAT_CHECK(t.byte_offset <= max - base &&
                        static_cast<uint64_t>(nbytes) <= max - (base + t.byte_offset),
                    kInvalidArgument, "Tensor::from_dlpack: byte_offset ", t.byte_offset, " + ",
                    nbytes, " bytes overflows the address space");
    const uintptr_t addr = base + static_cast<uintptr_t>(t.byte_offset);
    DISTSTRAT_CHECK(addr % static_cast<uintptr_t>(elem) == 0, kInvalidArgument,
                    "Tensor::from_dlpack: data ", t.data, " + byte_offset ", t.byte_offset,
                    " is not aligned to the ", elem, "-byte elements of ", dtype_name(dtype));
    ptr = reinterpret_cast<void*>(addr);
  }

  Shape shape(std::move(dims));
  // A null deleter: the producer keeps the memory alive some other way; a view.
  if (!managed->deleter) return Tensor::wrap(ptr, std::move(shape), dtype, device);
  auto owner = std::make_shared<Imported>();
  owner->managed = managed;
  Tensor out = Tensor::adopt(std::shared_ptr<void>(owner, ptr), std::move(shape), dtype, device);
  owner->armed = true;  // nothing below throws: from here on the deleter is ours to call
  return out;
}

}  // namespace

Tensor Tensor::from_dlpack(DLManagedTensor* managed) { return import(managed, nullptr); }

Tensor Tensor::from_dlpack(DLManagedTensor* managed, const Device& device) {
  return import(managed, &device);
}

DLManagedTensor* Tensor::to_dlpack() const {
  DISTSTRAT_CHECK(defined(), kFailedPrecondition, "Tensor::to_dlpack of an undefined tensor");
  auto e = std::make_unique<Exported>();
  e->tensor = *this;
  e->shape = shape_.dims();
  e->strides.resize(e->shape.size());
  int64_t stride = 1;
  for (size_t i = e->shape.size(); i-- > 0;) {
    e->strides[i] = stride;
    stride *= e->shape[i];
  }
  DLTensor& t = e->managed.dl_tensor;
  t.data = const_cast<void*>(data_ptr());
  if (device_.is_cpu()) {
    t.device = DLDevice{kDLCPU, 0};
  } else {
    // Memory allocated here knows its ordinal: outside a replica the device's
    // index is a logical GPU's, not a CUDA ordinal, on a split GPU.
    const ExecScope* s = current_exec_scope();
    int ordinal = storage_cuda_ordinal();
    if (ordinal < 0)
      ordinal = s && s->devices ? DeviceManagerAccess::impl(*s->devices).ordinal_of(device_)
                                : device_.index;
    t.device = DLDevice{kDLCUDA, ordinal};
  }
  t.ndim = static_cast<int>(e->shape.size());
  t.dtype = dtype_to_dl(dtype_);
  t.shape = e->shape.data();
  t.strides = e->strides.data();
  t.byte_offset = 0;
  e->managed.manager_ctx = e.get();
  e->managed.deleter = &Exported::deleter;
  return &e.release()->managed;
}

#else  // !DISTSTRAT_HAVE_DLPACK

namespace {
[[noreturn]] void no_dlpack(const char* op) {
  throw UnimplementedError(std::string(op) +
                           ": this build of diststrat has no DLPack support (configured without "
                           "dlpack/dlpack.h: install libdlpack-dev, or set DLPACK_ROOT, and "
                           "reconfigure with DISTSTRAT_WITH_DLPACK=AUTO or ON)");
}
}  // namespace

Tensor Tensor::from_dlpack(DLManagedTensor*) { no_dlpack("Tensor::from_dlpack"); }
Tensor Tensor::from_dlpack(DLManagedTensor*, const Device&) { no_dlpack("Tensor::from_dlpack"); }
DLManagedTensor* Tensor::to_dlpack() const { no_dlpack("Tensor::to_dlpack"); }

#endif  // DISTSTRAT_HAVE_DLPACK

}  // namespace diststrat
