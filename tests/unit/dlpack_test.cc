// Tensor::from_dlpack / to_dlpack with hand-built DLManagedTensors (what a
// framework such as PyTorch hands over): zero-copy round trips of every dtype
// on CPU and of CUDA tensors on the fake GPU backend, ownership (the deleter
// runs exactly once, after the last reference; never when the import fails),
// rejection of what cannot be viewed, and imported tensors in collectives.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/device_manager_impl.h"
#include "diststrat/config.h"
#include "diststrat/diststrat.h"

#if DISTSTRAT_HAVE_DLPACK
#include <dlpack/dlpack.h>

#include "core/device_scope.h"
#include "diststrat/device_manager.h"
#if __has_include("fake_gpu_backend.h")
#include "fake_gpu_backend.h"
#define DLPACK_TEST_FAKE_GPU 1
#endif
#endif

namespace ds = diststrat;

#if !DISTSTRAT_HAVE_DLPACK

TEST(DLPack, BuiltOutThrowsUnimplemented) {
  EXPECT_THROW(ds::Tensor::from_dlpack(nullptr), ds::UnimplementedError);
  EXPECT_THROW(ds::Tensor::from_dlpack(nullptr, ds::Device::cpu()), ds::UnimplementedError);
  ds::Tensor t(ds::Shape{2}, ds::DType::kFloat32);
  EXPECT_THROW(t.to_dlpack(), ds::UnimplementedError);
}

#else

namespace {

// A producer framework's tensor: memory, shape/strides arrays and a deleter
// that counts its calls.
struct Producer {
  DLManagedTensor managed{};
  std::shared_ptr<void> memory;  // what the producer keeps alive
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  int* deletes = nullptr;
  static void deleter(DLManagedTensor* self) {
    auto* p = static_cast<Producer*>(self->manager_ctx);
    __atomic_fetch_add(p->deletes, 1, __ATOMIC_SEQ_CST);  // deleters may run on replica threads
    delete p;
  }
};

struct Spec {
  DLDevice device{kDLCPU, 0};
  DLDataType dtype{kDLFloat, 32, 1};
  std::vector<int64_t> shape;
  std::optional<std::vector<int64_t> > strides;
  uint64_t byte_offset = 0;
};

// A DLManagedTensor over `data` (kept alive by `memory`); *deletes counts the
// deleter's calls.
DLManagedTensor* make(void* data, std::shared_ptr<void> memory, const Spec& s, int* deletes) {
  auto* p = new Producer;
  p->memory = std::move(memory);
  p->shape = s.shape;
  if (s.strides) p->strides = *s.strides;
  p->deletes = deletes;
  DLTensor& t = p->managed.dl_tensor;
  t.data = data;
  t.device = s.device;
  t.ndim = static_cast<int>(s.shape.size());
  t.dtype = s.dtype;
  t.shape = p->shape.data();
  t.strides = s.strides ? p->strides.data() : nullptr;
  t.byte_offset = s.byte_offset;
  p->managed.manager_ctx = p;
  p->managed.deleter = &Producer::deleter;
  return &p->managed;
}

// Host memory of `bytes` bytes holding 0, 1, 2, ... as bytes.
std::shared_ptr<char> host_bytes(size_t bytes) {
  std::shared_ptr<char> m(static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)),
                          [](char* p) { std::free(p); });
  for (size_t i = 0; i < bytes; ++i) m.get()[i] = static_cast<char>(i * 7 + 1);
  return m;
}

DLManagedTensor* make_host(const Spec& s, int* deletes, size_t bytes = 4096) {
  auto m = host_bytes(bytes);
  return make(m.get(), m, s, deletes);
}

struct DTypeCase {
  ds::DType dtype;
  uint8_t code;
  uint8_t bits;
};
const DTypeCase kDTypes[] = {
    {ds::DType::kFloat32, kDLFloat, 32}, {ds::DType::kFloat64, kDLFloat, 64},
    {ds::DType::kFloat16, kDLFloat, 16}, {ds::DType::kBFloat16, kDLBfloat, 16},
    {ds::DType::kInt32, kDLInt, 32},     {ds::DType::kInt64, kDLInt, 64},
};

// The InvalidArgumentError message of importing `m` (which stays the caller's).
std::string rejection(DLManagedTensor* m, const ds::Device* device = nullptr) {
  try {
    if (device) {
      ds::Tensor::from_dlpack(m, *device);
    } else {
      ds::Tensor::from_dlpack(m);
    }
  } catch (const ds::InvalidArgumentError& e) {
    return e.what();
  }
  return "<accepted>";
}

}  // namespace

TEST(DLPack, EveryDTypeRoundTripsOnCpuWithoutACopy) {
  for (const DTypeCase& c : kDTypes) {
    SCOPED_TRACE(ds::dtype_name(c.dtype));
    int deletes = 0;
    auto mem = host_bytes(2 * 3 * 8);
    Spec s;
    s.dtype = {c.code, c.bits, 1};
    s.shape = {2, 3};
    {
      ds::Tensor t = ds::Tensor::from_dlpack(make(mem.get(), mem, s, &deletes));
      EXPECT_EQ(t.dtype(), c.dtype);
      EXPECT_EQ(t.shape(), (ds::Shape{2, 3}));
      EXPECT_EQ(t.device(), ds::Device::cpu(0));
      EXPECT_EQ(t.data(), mem.get());  // the producer's memory itself
      EXPECT_TRUE(t.owns_memory());

      DLManagedTensor* out = t.to_dlpack();
      const DLTensor& d = out->dl_tensor;
      EXPECT_EQ(d.data, mem.get());
      EXPECT_EQ(d.device.device_type, kDLCPU);
      EXPECT_EQ(d.device.device_id, 0);
      EXPECT_EQ(d.dtype.code, c.code);
      EXPECT_EQ(d.dtype.bits, c.bits);
      EXPECT_EQ(d.dtype.lanes, 1);
      ASSERT_EQ(d.ndim, 2);
      EXPECT_EQ(d.shape[0], 2);
      EXPECT_EQ(d.shape[1], 3);
      ASSERT_NE(d.strides, nullptr);
      EXPECT_EQ(d.strides[0], 3);
      EXPECT_EQ(d.strides[1], 1);
      EXPECT_EQ(d.byte_offset, 0u);
      // And back: same memory, same type.
      ds::Tensor back = ds::Tensor::from_dlpack(out);
      EXPECT_EQ(back.data(), mem.get());
      EXPECT_EQ(back.dtype(), c.dtype);
      EXPECT_EQ(back.shape(), t.shape());
      EXPECT_EQ(deletes, 0);
    }
    EXPECT_EQ(deletes, 1);
  }
  // Typed access reads the producer's values.
  int deletes = 0;
  auto mem = std::shared_ptr<double>(new double[4]{1.5, -2, 3, 4}, [](double* p) { delete[] p; });
  Spec s;
  s.dtype = {kDLFloat, 64, 1};
  s.shape = {4};
  ds::Tensor t = ds::Tensor::from_dlpack(make(mem.get(), mem, s, &deletes));
  EXPECT_EQ(t.data<double>()[0], 1.5);
  EXPECT_EQ(t.data<double>()[1], -2.0);
  t.data<double>()[3] = 9;  // writes go to the producer's memory
  EXPECT_EQ(mem.get()[3], 9.0);
}

TEST(DLPack, ScalarsAndEmptyTensors) {
  int deletes = 0;
  {
    Spec s;  // ndim 0: one element
    ds::Tensor t = ds::Tensor::from_dlpack(make_host(s, &deletes));
    EXPECT_EQ(t.shape().rank(), 0u);
    EXPECT_EQ(t.num_elements(), 1);
    DLManagedTensor* out = t.to_dlpack();
    EXPECT_EQ(out->dl_tensor.ndim, 0);
    out->deleter(out);
  }
  {
    Spec s;  // no elements: data may be NULL, strides do not matter
    s.shape = {0, 5};
    s.strides = std::vector<int64_t>{7, 3};
    ds::Tensor t = ds::Tensor::from_dlpack(make(nullptr, nullptr, s, &deletes));
    EXPECT_EQ(t.num_elements(), 0);
    EXPECT_EQ(t.nbytes(), 0u);
  }
  EXPECT_EQ(deletes, 2);
}

TEST(DLPack, DeleterRunsOnceAfterTheLastReference) {
  int deletes = 0;
  Spec s;
  s.shape = {4, 2};
  ds::Tensor a = ds::Tensor::from_dlpack(make_host(s, &deletes));
  auto b = std::make_unique<ds::Tensor>(a);
  auto view = std::make_unique<ds::Tensor>(a.reshape(ds::Shape{8}));
  auto rows = std::make_unique<ds::Tensor>(a.slice_rows(1, 3));
  EXPECT_EQ(rows->data(), static_cast<char*>(a.data()) + 2 * 4);
  a = ds::Tensor();
  b.reset();
  view.reset();
  EXPECT_EQ(deletes, 0);
  rows.reset();
  EXPECT_EQ(deletes, 1);
}

TEST(DLPack, ExportKeepsTheStorageAliveUntilTheConsumerDeletes) {
  DLManagedTensor* out = nullptr;
  {
    ds::Tensor t(ds::Shape{3}, ds::DType::kInt64);
    for (int i = 0; i < 3; ++i) t.data<int64_t>()[i] = 10 + i;
    out = t.to_dlpack();
  }  // the library's last Tensor is gone; the consumer still holds the memory
  const auto* v = static_cast<const int64_t*>(out->dl_tensor.data);
  EXPECT_EQ(v[0], 10);
  EXPECT_EQ(v[2], 12);
  out->deleter(out);

  // producer -> import A -> export E -> import B: one buffer throughout, and
  // the producer's deleter runs once, when the last of A and B is gone.
  int deletes = 0;
  Spec s;
  s.shape = {16};
  auto mem = host_bytes(64);
  auto a = std::make_unique<ds::Tensor>(ds::Tensor::from_dlpack(make(mem.get(), mem, s, &deletes)));
  auto b = std::make_unique<ds::Tensor>(ds::Tensor::from_dlpack(a->to_dlpack()));
  EXPECT_EQ(b->data(), mem.get());
  EXPECT_TRUE(b->same_storage(*a));
  a.reset();
  EXPECT_EQ(deletes, 0);
  b.reset();
  EXPECT_EQ(deletes, 1);

  // A consumer may release the export after the tensor and from another thread.
  ds::Tensor c(ds::Shape{2}, ds::DType::kFloat32);
  DLManagedTensor* e = c.to_dlpack();
  c = ds::Tensor();
  std::thread([e] { e->deleter(e); }).join();

  ds::Tensor undefined;
  EXPECT_THROW(undefined.to_dlpack(), ds::FailedPreconditionError);
}

TEST(DLPack, NullDeleterIsANonOwningView) {
  float values[3] = {1, 2, 3};
  DLManagedTensor m{};
  int64_t shape[1] = {3};
  m.dl_tensor.data = values;
  m.dl_tensor.device = {kDLCPU, 0};
  m.dl_tensor.ndim = 1;
  m.dl_tensor.dtype = {kDLFloat, 32, 1};
  m.dl_tensor.shape = shape;
  ds::Tensor t = ds::Tensor::from_dlpack(&m);
  EXPECT_FALSE(t.owns_memory());
  EXPECT_EQ(t.data<float>()[2], 3.0f);
}

TEST(DLPack, FailedImportLeavesOwnershipWithTheCaller) {
  int deletes = 0;
  Spec s;
  s.shape = {2, 3};
  s.strides = std::vector<int64_t>{1, 2};  // column-major
  DLManagedTensor* m = make_host(s, &deletes);
  EXPECT_THROW(ds::Tensor::from_dlpack(m), ds::InvalidArgumentError);
  EXPECT_EQ(deletes, 0);  // not taken: still ours to release
  m->deleter(m);
  EXPECT_EQ(deletes, 1);
}

TEST(DLPack, StridesMustBeCompactRowMajor) {
  int deletes = 0;
  auto accept = [&](std::vector<int64_t> shape, std::vector<int64_t> strides) {
    Spec s;
    s.shape = std::move(shape);
    s.strides = std::move(strides);
    EXPECT_NO_THROW(ds::Tensor::from_dlpack(make_host(s, &deletes)));
  };
  accept({2, 3, 4}, {12, 4, 1});   // explicit compact strides
  accept({3, 1, 4}, {4, 999, 1});  // a size-1 dim's stride is never used
  accept({1, 5}, {-3, 1});
  accept({5}, {1});
  EXPECT_EQ(deletes, 4);

  auto reject = [&](std::vector<int64_t> shape, std::vector<int64_t> strides) {
    Spec s;
    s.shape = std::move(shape);
    s.strides = std::move(strides);
    DLManagedTensor* m = make_host(s, &deletes);
    const std::string why = rejection(m);
    m->deleter(m);
    return why;
  };
  std::string why = reject({2, 3}, {1, 2});  // a transpose
  EXPECT_NE(why.find("not contiguous: dim 1 has stride 2 where compact row-major needs 1"),
            std::string::npos)
      << why;
  EXPECT_NE(why.find("strides [1, 2]"), std::string::npos) << why;
  why = reject({4, 2}, {4, 1});  // every other row
  EXPECT_NE(why.find("dim 0 has stride 4 where compact row-major needs 2"), std::string::npos)
      << why;
  why = reject({3}, {0});  // broadcast
  EXPECT_NE(why.find("dim 0 has stride 0"), std::string::npos) << why;
}

TEST(DLPack, ByteOffsetsAreHonouredWhenAligned) {
  int deletes = 0;
  auto mem = host_bytes(256);
  {
    Spec s;
    s.shape = {4};
    s.byte_offset = 8;
    ds::Tensor t = ds::Tensor::from_dlpack(make(mem.get(), mem, s, &deletes));
    EXPECT_EQ(t.data(), mem.get() + 8);
    Spec h;
    h.dtype = {kDLFloat, 16, 1};
    h.shape = {4};
    h.byte_offset = 2;
    EXPECT_EQ(ds::Tensor::from_dlpack(make(mem.get(), mem, h, &deletes)).data(), mem.get() + 2);
  }
  EXPECT_EQ(deletes, 2);
  auto reject = [&](DLDataType dtype, void* data, uint64_t offset) {
    Spec s;
    s.dtype = dtype;
    s.shape = {4};
    s.byte_offset = offset;
    DLManagedTensor* m = make(data, mem, s, &deletes);
    const std::string why = rejection(m);
    m->deleter(m);
    return why;
  };
  std::string why = reject({kDLFloat, 32, 1}, mem.get(), 2);
  EXPECT_NE(why.find("byte_offset 2 is not aligned to the 4-byte elements of float32"),
            std::string::npos)
      << why;
  why = reject({kDLFloat, 64, 1}, mem.get(), 4);
  EXPECT_NE(why.find("not aligned to the 8-byte elements of float64"), std::string::npos) << why;
  why = reject({kDLInt, 32, 1}, mem.get() + 1, 0);  // a misaligned data pointer
  EXPECT_NE(why.find("not aligned"), std::string::npos) << why;
  why = reject({kDLFloat, 32, 1}, mem.get(), ~uint64_t{0} - 4);
  EXPECT_NE(why.find("overflows the address space"), std::string::npos) << why;
}

TEST(DLPack, UnsupportedDTypesAreNamed) {
  int deletes = 0;
  auto reject = [&](DLDataType dtype) {
    Spec s;
    s.dtype = dtype;
    s.shape = {4};
    DLManagedTensor* m = make_host(s, &deletes);
    const std::string why = rejection(m);
    m->deleter(m);
    return why;
  };
  EXPECT_NE(reject({kDLFloat, 32, 4}).find("float32x4 has 4 lanes"), std::string::npos);
  EXPECT_NE(reject({kDLUInt, 8, 1}).find("unsupported dtype uint8"), std::string::npos);
  EXPECT_NE(reject({kDLInt, 8, 1}).find("unsupported dtype int8"), std::string::npos);
  EXPECT_NE(reject({kDLInt, 16, 1}).find("unsupported dtype int16"), std::string::npos);
  EXPECT_NE(reject({6, 8, 1}).find("unsupported dtype bool8"), std::string::npos);  // kDLBool
  EXPECT_NE(reject({kDLComplex, 64, 1}).find("unsupported dtype complex64"), std::string::npos);
  EXPECT_NE(reject({kDLBfloat, 32, 1}).find("unsupported dtype bfloat32"), std::string::npos);
  EXPECT_NE(reject({kDLOpaqueHandle, 64, 1}).find("opaque64"), std::string::npos);
  EXPECT_NE(reject({99, 32, 1}).find("code 99 bits 32"), std::string::npos);
  EXPECT_EQ(deletes, 9);
}

TEST(DLPack, DevicesAreMappedOrNamed) {
  int deletes = 0;
  {
    Spec s;
    s.device = {kDLCUDAHost, 0};  // pinned host memory: a CPU tensor
    s.shape = {2};
    EXPECT_EQ(ds::Tensor::from_dlpack(make_host(s, &deletes)).device(), ds::Device::cpu(0));
    s.device = {kDLCPU, 0};
    EXPECT_EQ(ds::Tensor::from_dlpack(make_host(s, &deletes), ds::Device::cpu(1)).device(),
              ds::Device::cpu(1));
  }
  auto reject = [&](DLDevice device, const ds::Device* onto = nullptr) {
    Spec s;
    s.device = device;
    s.shape = {2};
    DLManagedTensor* m = make_host(s, &deletes);
    const std::string why = rejection(m, onto);
    m->deleter(m);
    return why;
  };
  EXPECT_NE(reject({kDLOpenCL, 0}).find("unsupported device type kDLOpenCL (4)"),
            std::string::npos);
  EXPECT_NE(reject({kDLROCM, 0}).find("kDLROCM (10)"), std::string::npos);
  EXPECT_NE(reject({kDLCUDAManaged, 0}).find("kDLCUDAManaged (13)"), std::string::npos);
  EXPECT_NE(reject({static_cast<DLDeviceType>(77), 0}).find("unknown (77)"), std::string::npos);
  EXPECT_NE(reject({kDLCUDA, -1}).find("device_id -1 is negative"), std::string::npos);
  const ds::Device gpu = ds::Device::gpu(0), cpu = ds::Device::cpu(0);
  EXPECT_NE(reject({kDLCPU, 0}, &gpu).find("host memory needs a CPU device"), std::string::npos);
  EXPECT_NE(reject({kDLCUDA, 0}, &cpu).find("device memory needs a GPU device"), std::string::npos);
  EXPECT_EQ(deletes, 9);
}

TEST(DLPack, AbsurdShapesAreRejected) {
  int deletes = 0;
  EXPECT_NE(rejection(nullptr).find("null DLManagedTensor"), std::string::npos);
  auto reject = [&](auto edit) {
    Spec s;
    s.shape = {2, 2};
    DLManagedTensor* m = make_host(s, &deletes);
    edit(m->dl_tensor);
    const std::string why = rejection(m);
    auto* p = static_cast<Producer*>(m->manager_ctx);
    m->dl_tensor.shape = p->shape.data();
    m->deleter(m);
    return why;
  };
  EXPECT_NE(reject([](DLTensor& t) { t.ndim = -1; }).find("ndim -1 is outside [0, 64]"),
            std::string::npos);
  EXPECT_NE(reject([](DLTensor& t) { t.ndim = 1 << 30; }).find("is outside [0, 64]"),
            std::string::npos);
  EXPECT_NE(reject([](DLTensor& t) { t.shape = nullptr; }).find("shape is NULL with ndim 2"),
            std::string::npos);
  EXPECT_NE(reject([](DLTensor& t) { t.shape[1] = -3; }).find("dim 1 is negative"),
            std::string::npos);
  EXPECT_NE(reject([](DLTensor& t) {
              t.shape[0] = t.shape[1] = int64_t{1} << 40;
            }).find("more bytes than an int64 holds"),
            std::string::npos);
  // 2^31 * 2^31 elements fit an int64, their bytes (x4) do not.
  EXPECT_NE(reject([](DLTensor& t) {
              t.shape[0] = t.shape[1] = int64_t{1} << 31;
            }).find("more bytes than an int64 holds"),
            std::string::npos);
  EXPECT_NE(reject([](DLTensor& t) { t.data = nullptr; }).find("data is NULL for 4 elements"),
            std::string::npos);
  EXPECT_EQ(deletes, 7);
}

// Imported tensors are ordinary tensors: a MirroredStrategy all-reduces two
// replicas' DLPack buffers in place, and the sums land in the producers' memory.
TEST(DLPack, ImportedTensorsAllReduceInPlaceUnderMirroredStrategy) {
  ds::MirroredStrategy strategy({ds::Device::cpu(0), ds::Device::cpu(1)});
  std::vector<std::vector<float> > grads = {{1, 2, 3, 4, 5, 6}, {10, 20, 30, 40, 50, 60}};
  std::vector<std::vector<int64_t> > counts = {{1, 2}, {100, 200}};
  int deletes = 0;
  std::vector<DLManagedTensor*> managed;
  for (int r = 0; r < 2; ++r) {
    Spec f;
    f.shape = {2, 3};
    managed.push_back(make(grads[r].data(), nullptr, f, &deletes));
    Spec i;
    i.dtype = {kDLInt, 64, 1};
    i.shape = {2};
    i.strides = std::vector<int64_t>{1};
    managed.push_back(make(counts[r].data(), nullptr, i, &deletes));
  }
  strategy.run([&](ds::ReplicaContext& ctx) {
    const size_t r = static_cast<size_t>(ctx.local_replica_id());
    std::vector<ds::Tensor> tensors = {ds::Tensor::from_dlpack(managed[2 * r], ctx.device()),
                                       ds::Tensor::from_dlpack(managed[2 * r + 1], ctx.device())};
    ctx.all_reduce(ds::ReduceOp::kSum, tensors, {"grad", "count"});
  });
  EXPECT_EQ(deletes, 4);  // the replicas' tensors are gone
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(grads[r], (std::vector<float>{11, 22, 33, 44, 55, 66}));
    EXPECT_EQ(counts[r], (std::vector<int64_t>{101, 202}));
  }
}

// A kDLCUDA tensor is a GPU tensor whatever this build or machine has: a
// CPU replica's collective rejects it (naming it and both devices) instead
// of reducing device memory on the host.
TEST(DLPack, CudaTensorsAreRejectedByCpuReplicaCollectives) {
  ds::MirroredStrategy strategy({ds::Device::cpu(0), ds::Device::cpu(1)});
  std::vector<std::vector<float> > bufs = {{1, 2}, {3, 4}};
  int deletes = 0;
  std::vector<ds::Tensor> imported;
  for (int r = 0; r < 2; ++r) {
    Spec s;
    s.device = {kDLCUDA, 0};
    s.shape = {2};
    imported.push_back(ds::Tensor::from_dlpack(make(bufs[r].data(), nullptr, s, &deletes)));
    ASSERT_EQ(imported.back().device(), ds::Device::gpu(0));
  }
  strategy.run([&](ds::ReplicaContext& ctx) {
    std::vector<ds::Tensor> t{imported[static_cast<size_t>(ctx.local_replica_id())]};
    try {
      ctx.all_reduce(ds::ReduceOp::kSum, t, {"imported"});
      ADD_FAILURE() << "a kDLCUDA tensor was all-reduced on " << ctx.device().to_string();
    } catch (const ds::InvalidArgumentError& e) {
      const std::string m = e.message();
      EXPECT_NE(m.find("'imported'"), std::string::npos) << m;
      EXPECT_NE(m.find("/device:GPU:0"), std::string::npos) << m;
      EXPECT_NE(m.find(ctx.device().to_string()), std::string::npos) << m;
    }
  });
  EXPECT_EQ(bufs[0], (std::vector<float>{1, 2}));
  imported.clear();
  EXPECT_EQ(deletes, 2);
}

// The same through a bare in-process communicator (no strategy).
TEST(DLPack, ImportedTensorsAllReduceOverAnInProcessCommunicator) {
  ds::InProcessGroup group(2);
  std::vector<std::vector<double> > buf = {{1, 2, 3}, {4, 5, 6}};
  int deletes[2] = {0, 0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      Spec s;
      s.dtype = {kDLFloat, 64, 1};
      s.shape = {3};
      ds::Tensor t = ds::Tensor::from_dlpack(make(buf[r].data(), nullptr, s, &deletes[r]));
      group.at(r).all_reduce(t.data(), t.data(), static_cast<size_t>(t.num_elements()), t.dtype(),
                             ds::ReduceOp::kMean, "dlpack");
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(deletes[0] + deletes[1], 2);
  EXPECT_EQ(buf[0], (std::vector<double>{2.5, 3.5, 4.5}));
  EXPECT_EQ(buf[1], buf[0]);
}

#if DLPACK_TEST_FAKE_GPU

namespace {
using diststrat_test::FakeGpuBackend;
using diststrat_test::LeaseDir;

// A kDLCUDA DLManagedTensor over fresh device memory of `dm`'s `device`
// holding `values` (the producer keeps the device tensor alive; so does
// *keep when given).
DLManagedTensor* make_cuda(ds::DeviceManager& dm, const ds::Device& device, int ordinal,
                           const std::vector<float>& values, int* deletes,
                           std::shared_ptr<ds::Tensor>* keep = nullptr) {
  auto dev = std::make_shared<ds::Tensor>(
      dm.allocate(ds::Shape{static_cast<int64_t>(values.size())}, ds::DType::kFloat32, device));
  {
    ds::ExecScope sc;
    sc.device = device;
    sc.devices = &dm;
    ds::ScopedExec scoped(sc);
    dev->copy_from(
        ds::Tensor::wrap(const_cast<float*>(values.data()), dev->shape(), ds::DType::kFloat32));
  }
  if (keep) *keep = dev;
  Spec s;
  s.device = {kDLCUDA, ordinal};
  s.shape = {static_cast<int64_t>(values.size())};
  return make(dev->data(), dev, s, deletes);
}
}  // namespace

TEST(DLPack, CudaTensorsRoundTripOnTheFakeGpu) {
  LeaseDir dir;
  auto backend = std::make_unique<FakeGpuBackend>(2);
  FakeGpuBackend* fake = backend.get();
  auto dm_owner = ds::DeviceManagerAccess::with_backend(dir.gpu_options(), std::move(backend));
  ds::DeviceManager& dm = *dm_owner;
  int deletes = 0;
  const std::vector<float> values = {1, 2, 3, 4};
  DLManagedTensor* m = make_cuda(dm, ds::Device::gpu(1), 1, values, &deletes);
  void* const dev_ptr = m->dl_tensor.data;
  ASSERT_TRUE(FakeGpuBackend::is_device(dev_ptr));
  {
    // Outside a scope, CUDA ordinal d is Device::gpu(d).
    ds::Tensor t = ds::Tensor::from_dlpack(m);
    EXPECT_EQ(t.device(), ds::Device::gpu(1));
    EXPECT_EQ(t.data(), dev_ptr);  // no copy, no host access
    EXPECT_EQ(fake->read<float>(1, t.data(), 4), values);
    ds::ExecScope sc;
    sc.device = ds::Device::gpu(1);
    sc.devices = &dm;
    ds::ScopedExec scoped(sc);
    DLManagedTensor* out = t.to_dlpack();
    EXPECT_EQ(out->dl_tensor.device.device_type, kDLCUDA);
    EXPECT_EQ(out->dl_tensor.device.device_id, 1);
    EXPECT_EQ(out->dl_tensor.data, dev_ptr);
    ds::Tensor back = ds::Tensor::from_dlpack(out);
    EXPECT_EQ(back.device(), ds::Device::gpu(1));
    EXPECT_EQ(back.data(), dev_ptr);
    ds::Tensor host(back.shape(), back.dtype());
    host.copy_from(back);
    EXPECT_EQ(host.data<float>()[3], 4.0f);
    EXPECT_EQ(deletes, 0);
  }
  EXPECT_EQ(deletes, 1);
}

TEST(DLPack, CudaOrdinalsAreTranslatedThroughTheThreadsDeviceManager) {
  LeaseDir dir;
  auto dm_owner =
      ds::DeviceManagerAccess::with_backend(dir.gpu_options(), std::make_unique<FakeGpuBackend>(2));
  ds::DeviceManager& dm = *dm_owner;
  dm.set_logical_device_configuration(0, {{8u << 20}, {8u << 20}});  // GPU:0, GPU:1 on CUDA 0
  int deletes = 0;
  DLManagedTensor* on0 = make_cuda(dm, ds::Device::gpu(1), 0, {1, 2}, &deletes);
  DLManagedTensor* on1 = make_cuda(dm, ds::Device::gpu(2), 1, {3, 4}, &deletes);
  ds::ExecScope sc;
  sc.devices = &dm;
  {
    sc.device = ds::Device::gpu(1);  // a replica on the second half of CUDA 0
    ds::ScopedExec scoped(sc);
    ds::Tensor a = ds::Tensor::from_dlpack(on0);
    EXPECT_EQ(a.device(), ds::Device::gpu(1));
    ds::Tensor b = ds::Tensor::from_dlpack(on1);
    EXPECT_EQ(b.device(), ds::Device::gpu(2));  // CUDA 1 is logical GPU:2
    DLManagedTensor* eb = b.to_dlpack();
    EXPECT_EQ(eb->dl_tensor.device.device_id, 1);
    DLManagedTensor* ea = a.to_dlpack();
    EXPECT_EQ(ea->dl_tensor.device.device_id, 0);
    ea->deleter(ea);
    eb->deleter(eb);
  }
  EXPECT_EQ(deletes, 2);
  DLManagedTensor* again = make_cuda(dm, ds::Device::gpu(0), 0, {5, 6}, &deletes);
  {
    sc.device = ds::Device::gpu(2);  // CUDA 0 seen from CUDA 1: which half?
    ds::ScopedExec scoped(sc);
    const std::string why = rejection(again);
    EXPECT_NE(why.find("split into several logical GPUs"), std::string::npos) << why;
    const ds::Device wrong = ds::Device::gpu(2);
    EXPECT_NE(rejection(again, &wrong).find("/device:GPU:2 is CUDA ordinal 1"), std::string::npos);
    EXPECT_EQ(ds::Tensor::from_dlpack(again, ds::Device::gpu(0)).device(), ds::Device::gpu(0));
  }
  EXPECT_EQ(deletes, 3);
}

// A tensor made inside a replica on the second half of a split GPU keeps its
// CUDA ordinal when exported outside any scope (its logical index, 1, is not
// a CUDA device of this process).
TEST(DLPack, ExportOutsideAReplicaNamesTheCudaOrdinalNotTheLogicalIndex) {
  LeaseDir dir;
  auto dm_owner =
      ds::DeviceManagerAccess::with_backend(dir.gpu_options(), std::make_unique<FakeGpuBackend>(1));
  ds::DeviceManager& dm = *dm_owner;
  dm.set_logical_device_configuration(0, {{8u << 20}, {8u << 20}});  // GPU:0, GPU:1 on CUDA 0
  ds::Tensor t;
  {
    ds::ExecScope sc;
    sc.devices = &dm;
    sc.device = ds::Device::gpu(1);
    ds::ScopedExec scoped(sc);
    t = ds::Tensor(ds::Shape{4}, ds::DType::kFloat32, ds::Device::gpu(1));
  }
  DLManagedTensor* e = t.to_dlpack();
  EXPECT_EQ(e->dl_tensor.device.device_type, kDLCUDA);
  EXPECT_EQ(e->dl_tensor.device.device_id, 0);
  e->deleter(e);
  t = ds::Tensor();
}

// A CUDA producer's buffers all-reduced by a MirroredStrategy on fake GPUs.
TEST(DLPack, CudaTensorsAllReduceUnderMirroredStrategyOnFakeGpus) {
  LeaseDir dir;
  auto backend = std::make_unique<FakeGpuBackend>(2);
  FakeGpuBackend* fake = backend.get();
  ds::MirroredOptions o;
  o.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};
  o.device_manager =
      ds::DeviceManagerAccess::shared_with_backend(dir.gpu_options(), std::move(backend));
  ds::MirroredStrategy strategy(o);
  int deletes = 0;
  std::vector<std::shared_ptr<ds::Tensor> > keep(2);  // read after the import released them
  std::vector<DLManagedTensor*> managed = {
      make_cuda(*o.device_manager, ds::Device::gpu(0), 0, {1, 2, 3}, &deletes, &keep[0]),
      make_cuda(*o.device_manager, ds::Device::gpu(1), 1, {10, 20, 30}, &deletes, &keep[1])};
  std::vector<void*> ptrs = {managed[0]->dl_tensor.data, managed[1]->dl_tensor.data};
  strategy.run([&](ds::ReplicaContext& ctx) {
    const size_t r = static_cast<size_t>(ctx.local_replica_id());
    std::vector<ds::Tensor> t = {ds::Tensor::from_dlpack(managed[r])};
    EXPECT_EQ(t[0].device(), ctx.device());
    ctx.all_reduce(ds::ReduceOp::kSum, t, {"grad"});
  });
  EXPECT_EQ(deletes, 2);
  // run() returns with the replicas' work enqueued (issue 44): the buffers'
  // consumer orders its reads after it, here by waiting for every replica
  // (docs/dlpack.md).
  strategy.synchronize();
  EXPECT_EQ(fake->read<float>(0, ptrs[0], 3), (std::vector<float>{11, 22, 33}));
  EXPECT_EQ(fake->read<float>(1, ptrs[1], 3), (std::vector<float>{11, 22, 33}));
}

#endif  // DLPACK_TEST_FAKE_GPU

#endif  // DISTSTRAT_HAVE_DLPACK
