// Which torch::Device a diststrat device is (dt::torch_device): logical GPUs
// of a DeviceManager, several of which may share one physical GPU, map to
// their physical CUDA ordinal, and DistributedDataParallel clones a GPU
// replica's module onto that ordinal. Runs on the fake GPU backend (no GPU,
// no CUDA LibTorch needed).
#include <memory>
#include <string>

#include "core/device_manager_impl.h"
#include "torch_test_util.h"
#include "unit/fake_gpu_backend.h"

namespace diststrat::testing {
namespace {

using diststrat_test::FakeGpuBackend;
using diststrat_test::LeaseDir;

std::shared_ptr<DeviceManager> split_first_gpu(const LeaseDir& dir) {
  GpuOptions o;
  o.lease = dir.options();
  auto dm = DeviceManagerAccess::shared_with_backend(o, std::make_unique<FakeGpuBackend>(2));
  // GPU:0 and GPU:1 on CUDA 0, GPU:2 = CUDA 1.
  dm->set_logical_device_configuration(0, {{8u << 20}, {8u << 20}});
  return dm;
}

TEST(TorchDevice, LogicalGpusMapToTheirPhysicalCudaOrdinal) {
  LeaseDir dir;
  auto dm = split_first_gpu(dir);
  EXPECT_EQ(dt::torch_device(Device::cpu(3), dm.get()), torch::Device(torch::kCPU));
  EXPECT_EQ(dt::torch_device(Device::gpu(0), dm.get()), torch::Device(torch::kCUDA, 0));
  EXPECT_EQ(dt::torch_device(Device::gpu(1), dm.get()), torch::Device(torch::kCUDA, 0));
  EXPECT_EQ(dt::torch_device(Device::gpu(2), dm.get()), torch::Device(torch::kCUDA, 1));
  // Without a manager the logical index is the ordinal (one logical GPU each).
  EXPECT_EQ(dt::torch_device(Device::gpu(1), nullptr), torch::Device(torch::kCUDA, 1));
  try {
    dt::torch_device(Device::gpu(3), dm.get());
    FAIL() << "GPU:3 does not exist";
  } catch (const NotFoundError& e) {
    EXPECT_NE(std::string(e.what()).find("GPU:1 = CUDA 0"), std::string::npos) << e.what();
  }
}

TEST(TorchDevice, StrategiesHandTheirDeviceManager) {
  LeaseDir dir;
  auto dm = split_first_gpu(dir);
  MirroredOptions o;
  o.devices = {Device::gpu(0), Device::gpu(1)};
  o.device_manager = dm;
  MirroredStrategy gpu(o);
  EXPECT_EQ(dt::device_manager_of(gpu), dm.get());
  MirroredStrategy cpu({Device::cpu(0), Device::cpu(1)});
  EXPECT_EQ(dt::device_manager_of(cpu), nullptr);
}

// DDP over two logical GPUs of one split GPU clones replica 1's module onto
// cuda:0 (it asked for cuda:1, a GPU that may not exist). Debian's LibTorch
// has no CUDA, so the clone itself fails here: the error names the device.
TEST(TorchDevice, DdpClonesOntoThePhysicalOrdinalOfASplitGpu) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a CUDA LibTorch clones for real";
  LeaseDir dir;
  auto dm = split_first_gpu(dir);
  MirroredOptions o;
  o.devices = {Device::gpu(0), Device::gpu(1)};
  o.device_manager = dm;
  MirroredStrategy strategy(o);
  try {
    dt::DistributedDataParallel ddp(strategy, make_net(1));
    FAIL() << "a CPU-only LibTorch made a CUDA module";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cuda:0 (/device:GPU:1)"), std::string::npos) << what;
    EXPECT_EQ(what.find("cuda:1"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace diststrat::testing
