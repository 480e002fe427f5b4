// Checkpoints of a MirroredStrategy on (fake) GPUs: variables and optimizer
// slots live in device memory; save reads them to the host and restore writes
// every replica's copy, so training continues bit-identically. Uses the fake
// GPU backend of the GPU room's tests (host memory as "device memory"); this
// file compiles to nothing in a tree without it.
#if __has_include("fake_gpu_backend.h")

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <memory>

#include "core/device_manager_impl.h"
#include "runtime/variable_impl.h"
#include "checkpoint_util.h"
#include "diststrat/device_manager.h"
#include "diststrat/diststrat.h"
#include "fake_gpu_backend.h"
#include "../common/temp_dir.h"
#include "../common/compare.h"

namespace ds = diststrat;

namespace {

using diststrat_test::same_bytes;
// Each strategy leases its fake GPUs exclusively: one lock directory each.
struct FakeGpuMirrored {
  explicit FakeGpuMirrored(uint64_t seed) : lock_dir("diststrat-ckpt-lease-"), mlp({784, 16, 10}) {
    ds::GpuOptions g;
    g.lease.lock_dir = lock_dir.path();
    ds::MirroredOptions o;
    o.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};
    o.device_manager = ds::DeviceManagerAccess::shared_with_backend(
        g, std::make_unique<diststrat_test::FakeGpuBackend>(2));
    strategy = std::make_unique<ds::MirroredStrategy>(o);
    vars = mlp.create_variables(*strategy, seed);
    opt = std::make_unique<ds::SGD>(*strategy, ds::SGDOptions{0.05f, 0.9f});
    ckpt =
        std::make_unique<ds::Checkpoint>(*strategy, std::vector<const ds::Optimizer*>{opt.get()});
  }
  ~FakeGpuMirrored() {
    ckpt.reset();
    opt.reset();
    vars.clear();
    strategy.reset();  // releases the leases before lock_dir goes
  }
  void train(int steps, const ds::Dataset& data) {
    ds::DistributedDataset dist = strategy->distribute(data, 16, {false, 0, false});
    for (int i = 0; i < steps; ++i) {
      ds::testing::mlp_step(*strategy, mlp, vars, *opt, dist.batch(i % dist.num_batches()));
    }
  }
  const diststrat_test::TempDir lock_dir;  // first member: destroyed last
  ds::nn::Mlp mlp;
  std::unique_ptr<ds::MirroredStrategy> strategy;
  std::vector<ds::Variable> vars;
  std::unique_ptr<ds::SGD> opt;
  std::unique_ptr<ds::Checkpoint> ckpt;
};

}  // namespace

TEST(CheckpointOnFakeGpus, RoundTripOfDeviceVariablesAndSlotsContinuesIdentically) {
  const diststrat_test::TempDir dir("diststrat-ckpt-gpu-");
  const std::string path = dir / "c.safetensors";
  ds::Tensor x(ds::Shape{64, 784}, ds::DType::kFloat32), y(ds::Shape{64}, ds::DType::kInt32);
  ds::init::RandomNormal{0, 1, 11}(x);
  for (int i = 0; i < 64; ++i) y.data<int32_t>()[i] = (i * 7) % 10;
  const ds::Dataset data(x, y);

  FakeGpuMirrored a(7), b(8);
  ASSERT_TRUE(a.vars[0].impl().copies[0].device().is_gpu());
  a.train(3, data);
  a.ckpt->save(path, {{"step", "3"}});
  EXPECT_EQ(b.ckpt->restore(path).at("step"), "3");
  const auto sa = a.ckpt->state(), sb = b.ckpt->state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i)
    EXPECT_TRUE(same_bytes(sa[i].second, sb[i].second)) << sa[i].first;
  a.train(2, data);
  b.train(2, data);
  for (size_t i = 0; i < a.vars.size(); ++i) {
    EXPECT_TRUE(same_bytes(a.vars[i].value(), b.vars[i].value())) << a.vars[i].name();
  }
}

#endif  // __has_include("fake_gpu_backend.h")
