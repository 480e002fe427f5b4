// to_diststrat / to_torch: zero-copy views between at::Tensor and
// diststrat::Tensor. Each side keeps the other's storage alive through the
// deleter it is given. CUDA tensors cross through DLPack, so that the CUDA
// ordinal is translated to the logical GPU the way Tensor::from_dlpack
// documents (docs/dlpack.md); CPU tensors take the direct route (no DLPack
// header needed).
#include <ATen/DLConvertor.h>

#include <sstream>

#include "diststrat/central_storage.h"
#include "diststrat/config.h"
#include "diststrat/mirrored.h"
#include "diststrat/torch.h"

namespace diststrat::libtorch {

namespace {

bool to_dtype(c10::ScalarType s, DType* out) {
  switch (s) {
    case c10::ScalarType::Float:
      *out = DType::kFloat32;
      return true;
    case c10::ScalarType::Double:
      *out = DType::kFloat64;
      return true;
    case c10::ScalarType::Half:
      *out = DType::kFloat16;
      return true;
    case c10::ScalarType::BFloat16:
      *out = DType::kBFloat16;
      return true;
    case c10::ScalarType::Int:
      *out = DType::kInt32;
      return true;
    case c10::ScalarType::Long:
      *out = DType::kInt64;
      return true;
    default:
      return false;
  }
}

c10::ScalarType to_scalar_type(DType d) {
  switch (d) {
    case DType::kFloat32:
      return c10::ScalarType::Float;
    case DType::kFloat64:
      return c10::ScalarType::Double;
    case DType::kFloat16:
      return c10::ScalarType::Half;
    case DType::kBFloat16:
      return c10::ScalarType::BFloat16;
    case DType::kInt32:
      return c10::ScalarType::Int;
    case DType::kInt64:
      return c10::ScalarType::Long;
  }
  throw_error(ErrorCode::kInternal, "to_torch: unknown dtype");
}

std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << t.scalar_type() << t.sizes() << " on " << t.device();
  return os.str();
}

}  // namespace

Tensor to_diststrat(const at::Tensor& t) {
  if (!t.defined()) return Tensor();
  DISTSTRAT_CHECK(t.layout() == c10::kStrided, kInvalidArgument, "to_diststrat: tensor ",
                  describe(t), " has layout ", t.layout(),
                  "; only dense (strided) tensors convert");
  DISTSTRAT_CHECK(!t.is_quantized(), kInvalidArgument, "to_diststrat: tensor ", describe(t),
                  " is quantized; only float32/64, float16, bfloat16, int32/64 convert");
  // Lazy views whose bytes are not their values: a negative view holds -x,
  // a conjugate view conj(x), a ZeroTensor no memory at all.
  DISTSTRAT_CHECK(!t.is_neg() && !t.is_conj(), kInvalidArgument, "to_diststrat: tensor ",
                  describe(t), " is a lazily ", t.is_neg() ? "negated" : "conjugated",
                  " view (its memory holds the other sign): call .resolve_neg() / "
                  ".resolve_conj() first");
  DISTSTRAT_CHECK(!t._is_zerotensor(), kInvalidArgument, "to_diststrat: tensor ", describe(t),
                  " is a ZeroTensor (no memory behind it): call .clone() first");
  DType dtype;
  DISTSTRAT_CHECK(to_dtype(t.scalar_type(), &dtype), kInvalidArgument, "to_diststrat: tensor ",
                  describe(t), " has dtype ", t.scalar_type(),
                  "; supported: float32, float64, float16, bfloat16, int32, int64");
  DISTSTRAT_CHECK(t.is_contiguous(), kInvalidArgument, "to_diststrat: tensor ", describe(t),
                  " is not contiguous (strides ", t.strides(),
                  "); a view shares memory only in compact row-major layout: call .contiguous()");
  DISTSTRAT_CHECK(t.is_cpu() || t.is_cuda(), kInvalidArgument, "to_diststrat: tensor ", describe(t),
                  " is on ", t.device(), "; only CPU and CUDA tensors convert");
  std::vector<int64_t> dims(t.sizes().begin(), t.sizes().end());
  if (t.is_cuda()) {
#if DISTSTRAT_HAVE_DLPACK
    DLManagedTensor* managed = at::toDLPack(t);
    try {
      return Tensor::from_dlpack(managed);
    } catch (...) {
      managed->deleter(managed);  // not taken on failure (tensor.h)
      throw;
    }
#else
    const at::Tensor keep = t;
    return Tensor::adopt(std::shared_ptr<void>(t.data_ptr(), [keep](void*) {}), Shape(dims), dtype,
                         Device::gpu(t.device().index()));
#endif
  }
  // The deleter's copy of `t` keeps its storage alive.
  const at::Tensor keep = t;
  return Tensor::adopt(std::shared_ptr<void>(t.data_ptr(), [keep](void*) {}), Shape(dims), dtype,
                       Device::cpu(0));
}

torch::Device torch_device(const Device& device, DeviceManager* manager) {
  if (device.is_cpu()) return torch::Device(torch::kCPU);
  DISTSTRAT_CHECK(device.is_gpu(), kInvalidArgument, "torch_device: ", device.to_string(),
                  " is neither a CPU nor a GPU");
  DISTSTRAT_CHECK(device.index >= 0, kInvalidArgument, "torch_device: ", device.to_string(),
                  " has a negative index");
  if (manager == nullptr) return torch::Device(torch::kCUDA, static_cast<int16_t>(device.index));
  std::ostringstream all;
  for (const LogicalDeviceInfo& l : manager->list_logical_devices()) {
    if (l.device == device)
      return torch::Device(torch::kCUDA, static_cast<int16_t>(l.physical_ordinal));
    all << (all.tellp() > 0 ? ", " : "") << l.device.to_string() << " = CUDA "
        << l.physical_ordinal;
  }
  throw_error(ErrorCode::kNotFound, "torch_device: " + device.to_string() +
                                        " is not a logical GPU of the DeviceManager (it has " +
                                        (all.tellp() > 0 ? all.str() : std::string("none")) + ")");
}

DeviceManager* device_manager_of(Strategy& strategy) {
  // The strategies that own a DeviceManager; no virtual in Strategy for it.
  if (auto* m = dynamic_cast<MirroredStrategy*>(&strategy)) return m->device_manager().get();
  if (auto* m = dynamic_cast<MultiWorkerMirroredStrategy*>(&strategy))
    return m->device_manager().get();
  if (auto* m = dynamic_cast<CentralStorageStrategy*>(&strategy)) return m->device_manager().get();
  return nullptr;
}

at::Tensor to_torch(const Tensor& t) {
  if (!t.defined()) return at::Tensor();
  if (t.device().is_gpu()) {
#if DISTSTRAT_HAVE_DLPACK
    return at::fromDLPack(t.to_dlpack());
#else
    throw_error(ErrorCode::kUnimplemented,
                "to_torch: a GPU tensor needs a build with DLPack (DISTSTRAT_HAVE_DLPACK): " +
                    t.debug_string());
#endif
  }
  std::vector<int64_t> dims = t.shape().dims();
  // torch has no read-only tensors: the view is writable, as documented.
  void* data = const_cast<void*>(t.num_elements() ? t.data() : nullptr);
  const Tensor keep = t;
  return torch::from_blob(
      data, dims, [keep](void*) {}, torch::TensorOptions().dtype(to_scalar_type(t.dtype())));
}

}  // namespace diststrat::libtorch
