// The GPU backend's host-side logic, tested without a GPU: leases (lock files) with
// fake device ids, the caching allocator and DeviceManager over a fake
// backend, CUDA_VISIBLE_DEVICES parsing, placement logging, and the GPU code
// path of MirroredStrategy end to end on fake GPUs (host memory).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "runtime/variable_impl.h"
#include "core/caching_allocator.h"
#include "core/device_manager_impl.h"
#include "core/device_scope.h"
#include "diststrat/diststrat.h"
#include "diststrat/device_manager.h"
#include "diststrat/gpu_lease.h"
#include "fake_gpu_backend.h"
#include "gpu/call_gate.h"
#include "checkpoint_util.h"
#include "training_util.h"

namespace ds = diststrat;
using diststrat_test::FakeGpuBackend;
using diststrat_test::LeaseDir;

// ---- leases ----------------------------------------------------------------------

TEST(GpuLease, SecondAcquireFailsNamingTheHolder) {
  LeaseDir dir;
  ds::GpuLease a = ds::GpuLease::acquire("fake0", dir.options());
  EXPECT_TRUE(a.held());
  try {
    ds::GpuLease::acquire("fake0", dir.options());
    FAIL() << "second lease of a held GPU succeeded";
  } catch (const ds::ResourceExhaustedError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("GPU fake0 is leased by pid " + std::to_string(::getpid())), std::string::npos)
        << m;
    EXPECT_NE(m.find("diststrat_tests"), std::string::npos) << m;  // the holder's command
    EXPECT_NE(m.find("since 20"), std::string::npos) << m;
  }
  // Another GPU is independent.
  ds::GpuLease b = ds::GpuLease::acquire("fake1", dir.options());
  EXPECT_TRUE(b.held());
  a.release();
  EXPECT_FALSE(a.held());
  ds::GpuLease c = ds::GpuLease::acquire("fake0", dir.options());
  EXPECT_TRUE(c.held());
}

TEST(GpuLease, QueryAndListShowHolders) {
  LeaseDir dir;
  EXPECT_FALSE(ds::query_lease("fake3", dir.options()).has_value());
  {
    ds::GpuLease a = ds::GpuLease::acquire("fake3", dir.options());
    ds::GpuLease b = ds::GpuLease::acquire("fake1", dir.options());
    auto h = ds::query_lease("fake3", dir.options());
    ASSERT_TRUE(h.has_value());
    EXPECT_EQ(h->pid, ::getpid());
    EXPECT_FALSE(h->user.empty());
    auto all = ds::list_leases(dir.options());
    ASSERT_EQ(all.size(), 2u);
    EXPECT_EQ(all[0].first, "fake1");
    EXPECT_EQ(all[1].first, "fake3");
  }
  // Released: the lock files are removed, the leases are gone.
  EXPECT_FALSE(ds::query_lease("fake3", dir.options()).has_value());
  EXPECT_TRUE(ds::list_leases(dir.options()).empty());
}

TEST(GpuLease, WaitGetsTheLeaseWhenReleasedAndTimesOutOtherwise) {
  LeaseDir dir;
  ds::LeaseOptions wait = dir.options();
  wait.wait = true;
  wait.wait_timeout = std::chrono::milliseconds(100);
  ds::GpuLease a = ds::GpuLease::acquire("fake0", dir.options());
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(ds::GpuLease::acquire("fake0", wait), ds::DeadlineExceededError);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(100));

  wait.wait_timeout = std::chrono::seconds(20);
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    a.release();
  });
  ds::GpuLease b = ds::GpuLease::acquire("fake0", wait);
  releaser.join();
  EXPECT_TRUE(b.held());
}

TEST(GpuLease, ReleasedWhenTheHolderProcessDies) {
  LeaseDir dir;
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child takes the lease, says so, and is killed without releasing it.
    ::close(ready[0]);
    try {
      ds::GpuLease l = ds::GpuLease::acquire("fake7", dir.options());
      const char ok = 1;
      if (::write(ready[1], &ok, 1) != 1) ::_exit(2);
      ::pause();
    } catch (...) {
    }
    ::_exit(1);
  }
  ::close(ready[1]);
  char ok = 0;
  ASSERT_EQ(::read(ready[0], &ok, 1), 1);
  ::close(ready[0]);
  auto h = ds::query_lease("fake7", dir.options());
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(h->pid, child);
  EXPECT_THROW(ds::GpuLease::acquire("fake7", dir.options()), ds::ResourceExhaustedError);
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  ds::GpuLease mine = ds::GpuLease::acquire("fake7", dir.options());
  EXPECT_TRUE(mine.held());
  EXPECT_EQ(ds::query_lease("fake7", dir.options())->pid, ::getpid());
}

TEST(GpuLease, BadIdsAndDirectoryResolution) {
  LeaseDir dir;
  EXPECT_THROW(ds::GpuLease::acquire("../etc", dir.options()), ds::InvalidArgumentError);
  EXPECT_THROW(ds::GpuLease::acquire("", dir.options()), ds::InvalidArgumentError);
  ds::LeaseOptions o;
  o.lock_dir = "/x/y";
  EXPECT_EQ(ds::resolve_lease_dir(o), "/x/y");
  ::setenv("DISTSTRAT_GPU_LEASE_DIR", dir.path().c_str(), 1);
  EXPECT_EQ(ds::resolve_lease_dir({}), dir.path());
  ::unsetenv("DISTSTRAT_GPU_LEASE_DIR");
  EXPECT_EQ(ds::resolve_lease_dir({}), "/tmp/diststrat-gpu-leases");
}

// ---- CUDA_VISIBLE_DEVICES and lease ids ------------------------------------------------

TEST(VisibleDevices, ParsedLikeCuda) {
  EXPECT_FALSE(ds::parse_visible_devices(nullptr).has_value());
  EXPECT_TRUE(ds::parse_visible_devices("")->empty());
  EXPECT_EQ(*ds::parse_visible_devices("0,2"), (std::vector<std::string>{"0", "2"}));
  EXPECT_EQ(*ds::parse_visible_devices(" 3 , 1"), (std::vector<std::string>{"3", "1"}));
  // CUDA stops at the first invalid entry.
  EXPECT_EQ(*ds::parse_visible_devices("1,x,2"), (std::vector<std::string>{"1"}));
  EXPECT_TRUE(ds::parse_visible_devices("-1")->empty());
  EXPECT_EQ(*ds::parse_visible_devices("GPU-abc,0"), (std::vector<std::string>{"GPU-abc", "0"}));
}

TEST(VisibleDevices, LeaseIdsNameTheHostGpu) {
  EXPECT_EQ(ds::gpu_lease_id(0, "GPU-1234", std::nullopt), "GPU-1234");
  EXPECT_EQ(ds::gpu_lease_id(1, "", std::nullopt), "gpu1");
  // Process ordinal 0 is host GPU 3 under CUDA_VISIBLE_DEVICES=3,1.
  EXPECT_EQ(ds::gpu_lease_id(0, "", std::vector<std::string>{"3", "1"}), "gpu3");
  EXPECT_EQ(ds::gpu_lease_id(1, "", std::vector<std::string>{"3", "MIG-x"}), "MIG-x");
}

// ---- caching allocator ------------------------------------------------------------------

TEST(CachingAllocator, ReusesFreedBlocksWithoutNewBackendAllocations) {
  auto fake = std::make_shared<FakeGpuBackend>(1);
  ds::CachingAllocator a(fake, 0, 0, /*growth=*/true, "gpu0");
  void* p = a.allocate(1000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % ds::CachingAllocator::kAlignment, 0u);
  EXPECT_EQ(a.stats().num_backend_allocs, 1u);
  EXPECT_EQ(a.stats().reserved_bytes, ds::CachingAllocator::kMinChunk);
  a.deallocate(p);
  for (int i = 0; i < 100; ++i) a.deallocate(a.allocate(512 + i * 7));
  EXPECT_EQ(a.stats().num_backend_allocs, 1u);
  EXPECT_EQ(a.stats().in_use_bytes, 0u);
  EXPECT_EQ(a.allocate(0), nullptr);
}

TEST(CachingAllocator, FreeNeighboursCoalesceIntoOneBlock) {
  auto fake = std::make_shared<FakeGpuBackend>(1);
  ds::CachingAllocator a(fake, 0, 0, true, "gpu0");
  const size_t third = ds::CachingAllocator::kMinChunk / 4;
  void* x = a.allocate(third);
  void* y = a.allocate(third);
  void* z = a.allocate(third);
  EXPECT_EQ(a.stats().num_backend_allocs, 1u);
  a.deallocate(x);
  a.deallocate(z);
  a.deallocate(y);  // merges with both neighbours
  void* whole = a.allocate(ds::CachingAllocator::kMinChunk);
  EXPECT_EQ(whole, x);
  EXPECT_EQ(a.stats().num_backend_allocs, 1u);
  a.deallocate(whole);
}

TEST(CachingAllocator, MemoryLimitIsEnforcedWithAClearError) {
  auto fake = std::make_shared<FakeGpuBackend>(1);
  const size_t limit = 3 * ds::CachingAllocator::kMinChunk;
  ds::CachingAllocator a(fake, 0, limit, true, "/device:GPU:0 (physical GPU 0)");
  void* p = a.allocate(2 * ds::CachingAllocator::kMinChunk);
  void* q = a.allocate(ds::CachingAllocator::kMinChunk / 2);
  try {
    a.allocate(ds::CachingAllocator::kMinChunk);
    FAIL() << "allocation past the limit succeeded";
  } catch (const ds::ResourceExhaustedError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("/device:GPU:0"), std::string::npos) << m;
    EXPECT_NE(m.find("limit " + std::to_string(limit)), std::string::npos) << m;
  }
  EXPECT_LE(a.stats().reserved_bytes, limit);
  a.deallocate(p);
  a.deallocate(q);
  // After freeing, the same request fits again.
  a.deallocate(a.allocate(ds::CachingAllocator::kMinChunk));
  EXPECT_LE(fake->used(0), limit);
}

TEST(CachingAllocator, NoGrowthReservesUpFrontAndNeverGrows) {
  auto fake = std::make_shared<FakeGpuBackend>(1, 64u << 20);
  {
    ds::CachingAllocator a(fake, 0, 8u << 20, /*growth=*/false, "gpu0");
    EXPECT_EQ(fake->mallocs.load(), 1);
    EXPECT_EQ(fake->used(0), 8u << 20);
    EXPECT_EQ(a.stats().reserved_bytes, 8u << 20);
    void* p = a.allocate(6u << 20);
    EXPECT_THROW(a.allocate(4u << 20), ds::ResourceExhaustedError);
    a.empty_cache();  // keeps the reservation
    EXPECT_EQ(fake->used(0), 8u << 20);
    a.deallocate(p);
  }
  EXPECT_EQ(fake->used(0), 0u);
  // Without a limit: 90% of the free memory.
  ds::CachingAllocator b(fake, 0, 0, false, "gpu0");
  EXPECT_EQ(b.stats().reserved_bytes, (64u << 20) / 10 * 9 / ds::CachingAllocator::kMinChunk *
                                          ds::CachingAllocator::kMinChunk);
}

TEST(CachingAllocator, GrowthReturnsCachedChunksWhenTheDeviceIsFull) {
  auto fake = std::make_shared<FakeGpuBackend>(1, 8u << 20);
  ds::CachingAllocator a(fake, 0, 0, true, "gpu0");
  void* p = a.allocate(3u << 20);
  void* q = a.allocate(3u << 20);
  a.deallocate(p);
  a.deallocate(q);
  // 6 MiB cached in 4 MiB chunks; a 6 MiB request needs them returned first.
  void* r = a.allocate(6u << 20);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(a.stats().reserved_bytes, 6u << 20);
  a.deallocate(r);
  a.empty_cache();
  EXPECT_EQ(fake->used(0), 0u);
}

// ---- DeviceManager ------------------------------------------------------------------------

namespace {
ds::GpuOptions fake_options(const LeaseDir& dir) {
  ds::GpuOptions o;
  o.lease = dir.options();
  return o;
}
}  // namespace

TEST(DeviceManager, LogicalDevicesSplitAPhysicalGpuWithTheirOwnLimits) {
  LeaseDir dir;
  auto dm_owner =
      ds::DeviceManagerAccess::with_backend(fake_options(dir), std::make_unique<FakeGpuBackend>(2));
  ds::DeviceManager& dm = *dm_owner;
  EXPECT_EQ(dm.list_physical_devices().size(), 2u);
  EXPECT_EQ(dm.list_physical_devices()[1].lease_id, "GPU-fake-1");
  dm.set_logical_device_configuration(0, {{4u << 20}, {6u << 20}});
  auto logical = dm.list_logical_devices();
  ASSERT_EQ(logical.size(), 3u);
  EXPECT_EQ(logical[0].physical_ordinal, 0);
  EXPECT_EQ(logical[1].physical_ordinal, 0);
  EXPECT_EQ(logical[1].memory_limit_bytes, 6u << 20);
  EXPECT_EQ(logical[2].device, ds::Device::gpu(2));
  EXPECT_EQ(logical[2].physical_ordinal, 1);
  // Each logical device has its own limit.
  ds::Tensor a = dm.allocate(ds::Shape{1 << 20}, ds::DType::kFloat32, ds::Device::gpu(0));
  EXPECT_THROW(dm.allocate(ds::Shape{1 << 20}, ds::DType::kFloat32, ds::Device::gpu(0)),
               ds::ResourceExhaustedError);
  ds::Tensor b = dm.allocate(ds::Shape{1 << 20}, ds::DType::kFloat32, ds::Device::gpu(1));
  EXPECT_EQ(b.device(), ds::Device::gpu(1));
  {
    ds::Tensor host(b.shape(), b.dtype());  // device memory is read through a copy
    ds::ExecScope sc;
    sc.device = ds::Device::gpu(1);
    sc.devices = &dm;
    ds::ScopedExec scoped(sc);
    host.copy_from(b);
    EXPECT_EQ(host.data<float>()[12345], 0.0f);  // zero-filled
  }
  EXPECT_EQ(dm.memory_stats(ds::Device::gpu(1)).in_use_bytes, 4u << 20);
  EXPECT_THROW(dm.allocate(ds::Shape{1}, ds::DType::kFloat32, ds::Device::gpu(3)),
               ds::NotFoundError);
  // Configuration is frozen once initialized.
  EXPECT_THROW(dm.set_memory_growth(false), ds::FailedPreconditionError);
  EXPECT_THROW(dm.set_visible_devices({0}), ds::FailedPreconditionError);
}

TEST(DeviceManager, VisibleDevicesAndValidation) {
  LeaseDir dir;
  {
    auto dm_owner = ds::DeviceManagerAccess::with_backend(fake_options(dir),
                                                          std::make_unique<FakeGpuBackend>(3));
    ds::DeviceManager& dm = *dm_owner;
    dm.set_visible_devices({2, 0});
    auto phys = dm.list_physical_devices();
    ASSERT_EQ(phys.size(), 2u);
    EXPECT_EQ(phys[0].ordinal, 2);
    auto logical = dm.list_logical_devices();
    EXPECT_EQ(logical[0].physical_ordinal, 2);
    EXPECT_EQ(logical[1].physical_ordinal, 0);
    EXPECT_THROW(dm.set_visible_devices({0, 0}), ds::FailedPreconditionError);
  }
  {
    auto dm_owner = ds::DeviceManagerAccess::with_backend(fake_options(dir),
                                                          std::make_unique<FakeGpuBackend>(1));
    ds::DeviceManager& dm = *dm_owner;
    EXPECT_THROW(dm.set_visible_devices({1, 1}), ds::InvalidArgumentError);
    dm.set_visible_devices({5});
    EXPECT_THROW(dm.list_logical_devices(), ds::NotFoundError);
  }
  {
    auto dm_owner = ds::DeviceManagerAccess::with_backend(fake_options(dir),
                                                          std::make_unique<FakeGpuBackend>(1));
    ds::DeviceManager& dm = *dm_owner;
    dm.set_logical_device_configuration(0, {{}, {}});  // a split needs limits
    EXPECT_THROW(dm.list_logical_devices(), ds::InvalidArgumentError);
  }
  {
    auto dm_owner = ds::DeviceManagerAccess::with_backend(fake_options(dir),
                                                          std::make_unique<FakeGpuBackend>(1));
    ds::DeviceManager& dm = *dm_owner;
    dm.set_visible_devices({});
    EXPECT_TRUE(dm.list_logical_devices().empty());
  }
}

TEST(DeviceManager, TakesTheLeasesOfItsGpusAndASecondJobIsRefused) {
  LeaseDir dir;
  auto first =
      ds::DeviceManagerAccess::with_backend(fake_options(dir), std::make_unique<FakeGpuBackend>(2));
  first->list_logical_devices();
  EXPECT_EQ(ds::list_leases(dir.options()).size(), 2u);
  auto second_owner =
      ds::DeviceManagerAccess::with_backend(fake_options(dir), std::make_unique<FakeGpuBackend>(2));
  ds::DeviceManager& second = *second_owner;
  try {
    second.list_logical_devices();
    FAIL() << "a second manager got leased GPUs";
  } catch (const ds::ResourceExhaustedError& e) {
    EXPECT_NE(std::string(e.what()).find("pid " + std::to_string(::getpid())), std::string::npos);
  }
  EXPECT_FALSE(second.initialized());
  first.reset();
  EXPECT_EQ(second.list_logical_devices().size(), 2u);
  // Leases off: no lock taken.
  ds::GpuOptions off = fake_options(dir);
  off.take_leases = false;
  auto third_owner =
      ds::DeviceManagerAccess::with_backend(off, std::make_unique<FakeGpuBackend>(2));
  ds::DeviceManager& third = *third_owner;
  EXPECT_EQ(third.list_logical_devices().size(), 2u);
}

TEST(DeviceManager, WithoutABackendThereAreNoGpus) {
  LeaseDir dir;
  auto dm_owner = ds::DeviceManagerAccess::with_backend(fake_options(dir), nullptr);
  ds::DeviceManager& dm = *dm_owner;
  EXPECT_TRUE(dm.list_physical_devices().empty());
  EXPECT_TRUE(dm.list_logical_devices().empty());
  EXPECT_THROW(dm.allocate(ds::Shape{1}, ds::DType::kFloat32, ds::Device::gpu(0)),
               ds::NotFoundError);
}

// ---- placement logging ------------------------------------------------------------------

namespace {
std::vector<std::string> train_two_steps_logged(ds::MirroredOptions o) {
  o.log_device_placement = true;
  ds::MirroredStrategy s(o);
  std::vector<std::string> lines;
  std::mutex mu;
  s.placement_log().set_sink([&](const std::string& l) {
    std::lock_guard<std::mutex> lock(mu);
    lines.push_back(l);
  });
  ds::nn::Mlp mlp({784, 8, 10});
  auto vars = mlp.create_variables(s, 1);
  ds::SGD opt(s, {0.1f, 0.9f});
  ds::Tensor x(ds::Shape{8, 784}, ds::DType::kFloat32), y(ds::Shape{8}, ds::DType::kInt32);
  ds::init::RandomNormal{0, 1, 3}(x);
  for (int i = 0; i < 8; ++i) y.data<int32_t>()[i] = i % 10;
  auto dist = s.distribute(ds::Dataset(x, y), 8);
  for (const auto& batch : dist) {
    s.run([&](ds::ReplicaContext& ctx) {
      std::vector<ds::Tensor> p;
      for (auto& v : vars) p.push_back(v.read(ctx));
      auto st = mlp.forward_backward(p, batch.features(ctx), batch.labels(ctx), 1.0f / 8);
      std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
      for (size_t i = 0; i < vars.size(); ++i) gv.emplace_back(st.grads[i], vars[i]);
      opt.apply_gradients(ctx, gv);
    });
  }
  return lines;
}
size_t count_with(const std::vector<std::string>& lines, const std::string& a,
                  const std::string& b = "") {
  size_t n = 0;
  for (const auto& l : lines) n += l.find(a) != std::string::npos && l.find(b) != std::string::npos;
  return n;
}
}  // namespace

TEST(PlacementLog, VariablesCollectivesAndOpsReportTheirDevice) {
  ds::MirroredOptions o;
  o.devices = {ds::Device::cpu(0), ds::Device::cpu(1)};
  const auto lines = train_two_steps_logged(o);
  EXPECT_EQ(count_with(lines, "variable dense0/kernel on /device:CPU:0"), 1u);
  EXPECT_EQ(count_with(lines, "variable dense0/kernel on /device:CPU:1"), 1u);
  EXPECT_EQ(count_with(lines, "collective all_reduce dense1/bias/grad on /device:CPU:1"), 1u);
  EXPECT_GE(count_with(lines, "op dense_forward on /device:CPU:0"), 2u);
  EXPECT_GE(count_with(lines, "op optimizer_update on /device:CPU:1"), 4u);
}

TEST(PlacementLog, EnvironmentTurnsItOn) {
  ::setenv("DISTSTRAT_LOG_DEVICE_PLACEMENT", "1", 1);
  ds::PlacementLog on(false);
  ::setenv("DISTSTRAT_LOG_DEVICE_PLACEMENT", "0", 1);
  ds::PlacementLog off(true);
  ::unsetenv("DISTSTRAT_LOG_DEVICE_PLACEMENT");
  EXPECT_TRUE(on.enabled());
  EXPECT_FALSE(off.enabled());
  std::vector<std::string> got;
  on.set_sink([&](const std::string& l) { got.push_back(l); });
  on.record("op", "matmul", ds::Device::gpu(1));
  off.record("op", "matmul", ds::Device::gpu(1));
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0], "op matmul on /device:GPU:1");
}

// ---- MirroredStrategy's GPU path on fake GPUs ----------------------------------------------

namespace {
// Trains the same MLP under `o` and returns the final weights (host).
std::vector<ds::Tensor> train_mlp(ds::MirroredOptions o, int steps) {
  ds::MirroredStrategy s(o);
  ds::nn::Mlp mlp({784, 16, 10});
  auto vars = mlp.create_variables(s, 7);
  ds::SGD opt(s, {0.05f, 0.9f});
  ds::Tensor x(ds::Shape{64, 784}, ds::DType::kFloat32), y(ds::Shape{64}, ds::DType::kInt32);
  ds::init::RandomNormal{0, 1, 11}(x);
  for (int i = 0; i < 64; ++i) y.data<int32_t>()[i] = (i * 7) % 10;
  auto dist = s.distribute(ds::Dataset(x, y), 16);
  int done = 0;
  for (int epoch = 0; done < steps; ++epoch) {
    dist.set_epoch(epoch);
    for (const auto& batch : dist) {
      if (done++ == steps) break;
      auto loss = s.run([&](ds::ReplicaContext& ctx) {
        std::vector<ds::Tensor> p;
        for (auto& v : vars) p.push_back(v.read(ctx));
        if (ctx.device().is_gpu()) {
          EXPECT_TRUE(p[0].device() == ctx.device());
          EXPECT_TRUE(batch.features(ctx).device() == ctx.device());
          EXPECT_TRUE(batch.labels(ctx).device() == ctx.device());
        }
        auto st = mlp.forward_backward(p, batch.features(ctx), batch.labels(ctx),
                                       1.0f / batch.global_size());
        std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
        for (size_t i = 0; i < vars.size(); ++i) gv.emplace_back(st.grads[i], vars[i]);
        opt.apply_gradients(ctx, gv);
        return st.loss_sum / batch.global_size();
      });
      EXPECT_TRUE(std::isfinite(s.reduce(ds::ReduceOp::kSum, loss)));
    }
  }
  std::vector<ds::Tensor> out;
  for (auto& v : vars) out.push_back(v.value());
  return out;
}

void expect_near(const std::vector<ds::Tensor>& a, const std::vector<ds::Tensor>& b) {
  EXPECT_LE(ds::testing::max_abs_diff(a, b), 1e-5);
}
}  // namespace

TEST(MirroredOnFakeGpus, DistinctGpusUseTheNcclPathAndMatchCpuTraining) {
  LeaseDir dir;
  ds::MirroredOptions cpu;
  cpu.devices = {ds::Device::cpu(0), ds::Device::cpu(1)};
  const auto want = train_mlp(cpu, 6);

  auto backend = std::make_unique<FakeGpuBackend>(2);
  FakeGpuBackend* fake = backend.get();
  ds::MirroredOptions gpu;
  gpu.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};
  gpu.device_manager =
      ds::DeviceManagerAccess::shared_with_backend(fake_options(dir), std::move(backend));
  const auto got = train_mlp(gpu, 6);
  expect_near(got, want);
  EXPECT_EQ(fake->nccl_groups.load(), 1);
  EXPECT_EQ(fake->shared_groups.load(), 0);
  EXPECT_EQ(fake->updates.load(), 6 * 4 * 2);  // steps x params x replicas, on the device
  EXPECT_GE(fake->syncs.load(), 12);           // every step drains every replica's stream
  // Steady state: the allocator serves the steps from its cache.
  const auto stats = gpu.device_manager->memory_stats(ds::Device::gpu(0));
  EXPECT_GT(stats.num_allocs, 10 * stats.num_backend_allocs);
}

TEST(MirroredOnFakeGpus, LogicalGpusOfOnePhysicalGpuUseTheSharedDeviceReduction) {
  LeaseDir dir;
  ds::MirroredOptions cpu;
  cpu.devices = {ds::Device::cpu(0), ds::Device::cpu(1), ds::Device::cpu(2)};
  const auto want = train_mlp(cpu, 4);

  auto backend = std::make_unique<FakeGpuBackend>(1);
  FakeGpuBackend* fake = backend.get();
  auto dm = ds::DeviceManagerAccess::shared_with_backend(fake_options(dir), std::move(backend));
  dm->set_logical_device_configuration(0, {{8u << 20}, {8u << 20}, {8u << 20}});
  ds::MirroredOptions gpu;
  gpu.device_manager = dm;  // devices {} = every logical GPU
  const auto got = train_mlp(gpu, 4);
  expect_near(got, want);
  EXPECT_EQ(fake->shared_groups.load(), 1);
  EXPECT_EQ(fake->nccl_groups.load(), 0);
}

TEST(MirroredOnFakeGpus, PlacementLogNamesTheGpus) {
  LeaseDir dir;
  ds::MirroredOptions o;
  o.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};
  o.device_manager = ds::DeviceManagerAccess::shared_with_backend(
      fake_options(dir), std::make_unique<FakeGpuBackend>(2));
  const auto lines = train_two_steps_logged(o);
  EXPECT_EQ(count_with(lines, "variable dense0/kernel on /device:GPU:1"), 1u);
  // The step counter lives in host memory.
  EXPECT_EQ(count_with(lines, "variable optimizer/iterations on /device:CPU:1"), 1u);
  EXPECT_EQ(count_with(lines, "collective all_reduce dense0/kernel/grad on /device:GPU:0"), 1u);
  EXPECT_GE(count_with(lines, "op dense_backward on /device:GPU:1"), 2u);
  EXPECT_GE(count_with(lines, "op optimizer_update on /device:GPU:0"), 4u);
}

TEST(MirroredOnFakeGpus, MixedCpuAndGpuDevicesAndMissingGpusAreRejected) {
  LeaseDir dir;
  ds::MirroredOptions o;
  o.devices = {ds::Device::cpu(0), ds::Device::gpu(0)};
  o.device_manager = ds::DeviceManagerAccess::shared_with_backend(
      fake_options(dir), std::make_unique<FakeGpuBackend>(1));
  EXPECT_THROW(ds::MirroredStrategy{o}, ds::InvalidArgumentError);
  o.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};  // only one fake GPU
  EXPECT_THROW(ds::MirroredStrategy{o}, ds::NotFoundError);
}

TEST(MirroredOnFakeGpus, GpuTensorsOutsideAReplicaNeedAScope) {
  LeaseDir dir;
  ds::MirroredOptions o;
  o.devices = {ds::Device::gpu(0)};
  o.device_manager = ds::DeviceManagerAccess::shared_with_backend(
      fake_options(dir), std::make_unique<FakeGpuBackend>(1));
  ds::MirroredStrategy s(o);
  ds::Variable v = s.create_variable("v", ds::Shape{3}, ds::DType::kFloat32, ds::init::Constant{2});
  ds::Tensor host = v.value();
  EXPECT_TRUE(host.device().is_cpu());
  EXPECT_EQ(host.data<float>()[2], 2.0f);
  ds::Tensor three(ds::Shape{3}, ds::DType::kFloat32);
  for (int i = 0; i < 3; ++i) three.data<float>()[i] = 3.0f;
  v.assign(three);
  EXPECT_EQ(v.value().data<float>()[1], 3.0f);
  // Inside run(): GPU tensors are allocated on the replica's device.
  s.run([&](ds::ReplicaContext& ctx) {
    ds::Tensor t(ds::Shape{4}, ds::DType::kFloat32, ctx.device());
    EXPECT_EQ(t.device(), ds::Device::gpu(0));
    ds::Tensor r = ctx.all_reduce(ds::ReduceOp::kSum, v.read(ctx), "v");
    EXPECT_EQ(r.device(), ds::Device::gpu(0));
  });
  // Outside: a clear error, not a crash.
  EXPECT_THROW(ds::Tensor(ds::Shape{1}, ds::DType::kFloat32, ds::Device::gpu(0)),
               ds::FailedPreconditionError);
}

TEST(MirroredOnFakeGpus, AFailingReplicaAbortsTheOthersDeviceCollectivesAndTheGroupRecovers) {
  LeaseDir dir;
  ds::MirroredOptions o;
  o.devices = {ds::Device::gpu(0), ds::Device::gpu(1), ds::Device::gpu(2)};
  o.communication.timeout = std::chrono::seconds(30);
  o.device_manager = ds::DeviceManagerAccess::shared_with_backend(
      fake_options(dir), std::make_unique<FakeGpuBackend>(3));
  ds::MirroredStrategy s(o);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    s.run([&](ds::ReplicaContext& ctx) {
      if (ctx.replica_id() == 1) throw ds::InvalidArgumentError("replica 1 broke");
      ds::Tensor t(ds::Shape{8}, ds::DType::kFloat32, ctx.device());
      std::vector<ds::Tensor> v{t};
      ctx.all_reduce(ds::ReduceOp::kSum, v, {"g"});
    });
    FAIL() << "run() succeeded";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("replica 1 broke"), std::string::npos);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));  // no deadline wait
  // The device group works again.
  s.run([&](ds::ReplicaContext& ctx) {
    ds::Tensor h(ds::Shape{4}, ds::DType::kFloat32);
    for (int i = 0; i < 4; ++i) h.data<float>()[i] = static_cast<float>(ctx.replica_id());
    ds::Tensor t(h.shape(), h.dtype(), ctx.device());
    t.copy_from(h);
    std::vector<ds::Tensor> v{t};
    ctx.all_reduce(ds::ReduceOp::kSum, v, {"g"});
    h.copy_from(v[0]);
    EXPECT_EQ(h.data<float>()[3], 3.0f);
  });
}

TEST(MirroredOnFakeGpus, AStrategyHoldsItsGpusLeasesUntilItsManagerGoes) {
  LeaseDir dir;
  {
    ds::MirroredOptions o;
    o.devices = {ds::Device::gpu(1)};
    o.device_manager = ds::DeviceManagerAccess::shared_with_backend(
        fake_options(dir), std::make_unique<FakeGpuBackend>(2));
    ds::MirroredStrategy s(o);
    auto leases = ds::list_leases(dir.options());
    ASSERT_EQ(leases.size(), 2u);  // the manager's visible GPUs
    EXPECT_EQ(leases[0].second.pid, ::getpid());
    // A second job on the same GPUs is refused, naming this process.
    ds::MirroredOptions other = o;
    other.device_manager = ds::DeviceManagerAccess::shared_with_backend(
        fake_options(dir), std::make_unique<FakeGpuBackend>(2));
    EXPECT_THROW(ds::MirroredStrategy{other}, ds::ResourceExhaustedError);
  }
  EXPECT_TRUE(ds::list_leases(dir.options()).empty());
  // DISTSTRAT_GPU_LEASE=0 turns leases off.
  ::setenv("DISTSTRAT_GPU_LEASE", "0", 1);
  {
    auto dm_owner = ds::DeviceManagerAccess::with_backend(fake_options(dir),
                                                          std::make_unique<FakeGpuBackend>(1));
    ds::DeviceManager& dm = *dm_owner;
    EXPECT_EQ(dm.list_logical_devices().size(), 1u);
    EXPECT_TRUE(ds::list_leases(dir.options()).empty());
  }
  ::unsetenv("DISTSTRAT_GPU_LEASE");
}

TEST(MirroredOnFakeGpus, TensorCopiesCloneZeroAndAllGatherOnGpuReplicas) {
  LeaseDir dir;
  auto backend = std::make_unique<FakeGpuBackend>(2);
  FakeGpuBackend* fake = backend.get();
  ds::MirroredOptions o;
  o.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};
  o.device_manager =
      ds::DeviceManagerAccess::shared_with_backend(fake_options(dir), std::move(backend));
  ds::MirroredStrategy s(o);
  auto out = s.run([&](ds::ReplicaContext& ctx) {
    ds::Tensor h(ds::Shape{2, 3}, ds::DType::kFloat32);
    for (int i = 0; i < 6; ++i) h.data<float>()[i] = static_cast<float>(10 * ctx.replica_id() + i);
    ds::Tensor g(h.shape(), h.dtype(), ctx.device());
    g.copy_from(h);            // host -> device
    ds::Tensor c = g.clone();  // device -> device
    EXPECT_TRUE(c.device() == ctx.device());
    EXPECT_FALSE(c.same_storage(g));
    g.zero();
    ds::Tensor back(h.shape(), h.dtype());
    back.copy_from(g);  // device -> host
    EXPECT_EQ(back.data<float>()[4], 0.0f);
    back.copy_from(c);
    EXPECT_EQ(back.data<float>()[4], static_cast<float>(10 * ctx.replica_id() + 4));
    ds::Tensor gathered = ctx.all_gather(c, "c");
    EXPECT_TRUE(gathered.device() == ctx.device());
    EXPECT_EQ(gathered.shape(), ds::Shape({4, 3}));
    return c;
  });
  // Cross-replica reduce and gather of GPU tensors come back to the host.
  ds::Tensor sum = s.reduce(ds::ReduceOp::kSum, out);
  EXPECT_TRUE(sum.device().is_cpu());
  EXPECT_EQ(sum.data<float>()[5], 5.0f + 15.0f);
  ds::Tensor all = s.gather(out);
  EXPECT_EQ(all.shape(), ds::Shape({4, 3}));
  EXPECT_EQ(all.data<float>()[6], 10.0f);
  // Memory goes back to the cache, not to the device.
  const int frees_before = fake->frees.load();
  out = {};
  EXPECT_EQ(fake->frees.load(), frees_before);
  EXPECT_GT(o.device_manager->memory_stats(ds::Device::gpu(1)).reserved_bytes, 0u);
  o.device_manager->empty_cache(ds::Device::gpu(1));
  EXPECT_EQ(o.device_manager->memory_stats(ds::Device::gpu(1)).in_use_bytes, 0u);
}

// ---- what the fake backend models (issue 18 item 9) and the regressions it catches ----------

namespace {
ds::DeadlineClock::time_point in_seconds(int s) {
  return ds::DeadlineClock::now() + std::chrono::seconds(s);
}
}  // namespace

// Item 1: a CUDA error that was thrown (and caught) must not make the next,
// unrelated kernel launch fail: throwing clears the thread's last error.
TEST(FakeGpuBackend, AReportedErrorDoesNotPoisonTheNextLaunch) {
  FakeGpuBackend b(1);
  void* p = b.raw_malloc(0, 64 * sizeof(float));
  EXPECT_THROW(b.memset_async(9999, p, 0, 16, nullptr), ds::InternalError);  // no such device
  EXPECT_TRUE(FakeGpuBackend::thread_state().last_error.empty())
      << FakeGpuBackend::thread_state().last_error;
  b.memset_async(0, p, 0, 64 * sizeof(float), nullptr);
  EXPECT_NO_THROW(b.relu_forward(0, nullptr, static_cast<float*>(p), static_cast<float*>(p), 64));
  EXPECT_EQ(b.read<float>(0, p, 64)[63], 0.0f);
  b.raw_free(0, p);
}

TEST(FakeGpuBackend, InvalidOrdinalsAndForeignStreamsAreRejected) {
  FakeGpuBackend b(2);
  EXPECT_THROW(b.raw_malloc(2, 16), ds::InternalError);
  EXPECT_THROW(b.raw_malloc(-1, 16), ds::InternalError);
  EXPECT_THROW(b.create_stream(7), ds::InternalError);
  EXPECT_THROW(b.info(2), ds::NotFoundError);
  void* s1 = b.create_stream(1);
  void* p = b.raw_malloc(0, 16);
  EXPECT_THROW(b.memset_async(0, p, 0, 16, s1), ds::InternalError);  // s1 is GPU 1's
  b.destroy_stream(1, s1);
  EXPECT_THROW(b.memset_async(1, p, 0, 16, s1), ds::InternalError);  // destroyed
  b.raw_free(0, p);
}

// Work runs when it is waited for, not when it is called; device pointers
// are not host pointers; fresh device memory is not zero.
TEST(FakeGpuBackend, WorkIsAsynchronousAndDeviceMemoryIsNotHostMemory) {
  FakeGpuBackend b(1);
  float* d = static_cast<float*>(b.raw_malloc(0, 4 * sizeof(float)));
  EXPECT_TRUE(FakeGpuBackend::is_device(d));
  EXPECT_TRUE(std::isnan(b.read<float>(0, d, 4)[0]));
  const float src[4] = {1, 2, 3, 4};
  float dst[4] = {0, 0, 0, 0};
  // Held so that it has not run (the executor would run it at any time):
  // a missing wait reads stale memory.
  b.hold(0, nullptr);
  b.memcpy_async(0, d, src, sizeof(src), nullptr);
  b.memcpy_async(0, dst, d, sizeof(dst), nullptr);
  EXPECT_EQ(dst[3], 0.0f);
  b.release(0, nullptr);
  b.synchronize(0, nullptr, in_seconds(5), "test");
  EXPECT_EQ(dst[3], 4.0f);
  // A held stream's work does not run; waiting for it hits the deadline.
  void* s = b.create_stream(0);
  b.hold(0, s);
  b.memset_async(0, d, 0, sizeof(src), s);
  EXPECT_THROW(
      b.synchronize(0, s, ds::DeadlineClock::now() + std::chrono::milliseconds(20), "held"),
      ds::DeadlineExceededError);
  b.release(0, s);
  EXPECT_EQ(b.read<float>(0, d, 4)[3], 0.0f);
  b.destroy_stream(0, s);
  b.raw_free(0, d);
}

// Item 7: a block freed while its stream's work still uses it goes to
// another stream only after that work, whatever the default-stream mode.
TEST(CachingAllocator, AnotherStreamReusesAFreedBlockOnlyAfterTheFreeingStreamsWork) {
  FakeGpuBackend::Options independent;
  independent.default_stream_orders_with_streams = false;  // per-thread default streams
  for (bool second_is_default : {false, true}) {
    auto fake = std::make_shared<FakeGpuBackend>(1, 64u << 20, independent);
    ds::CachingAllocator a(fake, 0, 0, true, "gpu0");
    void* s1 = fake->create_stream(0);
    void* s2 = second_is_default ? nullptr : fake->create_stream(0);
    const size_t bytes = 4096;
    void* x = a.allocate(bytes, s1);
    fake->hold(0, s1);
    fake->memset_async(0, x, 2, bytes, s1);  // still queued when x is freed
    a.deallocate(x);
    void* y = a.allocate(bytes, s2);
    fake->memset_async(0, y, 1, bytes, s2);
    fake->synchronize(0, s2, in_seconds(5), "s2");
    fake->release(0, s1);
    const std::vector<char> got = fake->read<char>(0, y, bytes);
    EXPECT_EQ(got[0], 1) << "stream 1's queued write landed in stream 2's block"
                         << (second_is_default ? " (default stream)" : "");
    EXPECT_EQ(got[bytes - 1], 1);
    // The freeing stream itself reuses the block at once (stream order).
    void* z = a.allocate(bytes, s1);
    a.deallocate(z);
    a.deallocate(y);
    fake->synchronize_device(0, in_seconds(5), "end");
    fake->destroy_stream(0, s1);
    if (s2) fake->destroy_stream(0, s2);
  }
}

// Item 6: cached chunks go back (cudaFree waits for the whole device) only
// after the device drained within the deadline; past it they stay cached.
TEST(CachingAllocator, ChunksAreFreedOnlyAfterTheDeviceDrained) {
  auto fake = std::make_shared<FakeGpuBackend>(1);
  ds::CachingAllocator a(fake, 0, 0, true, "gpu0", std::chrono::milliseconds(50));
  void* s = fake->create_stream(0);
  void* x = a.allocate(4096, s);
  fake->hold(0, s);
  fake->memset_async(0, x, 0, 4096, s);
  a.deallocate(x);
  EXPECT_THROW(a.empty_cache(), ds::DeadlineExceededError);
  EXPECT_EQ(a.stats().reserved_bytes, ds::CachingAllocator::kMinChunk);  // kept
  EXPECT_EQ(fake->frees.load(), 0);
  fake->release(0, s);
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes, 0u);
  EXPECT_EQ(fake->frees.load(), 1);
  EXPECT_EQ(fake->frees_with_pending_work.load(), 0);
  fake->destroy_stream(0, s);
}

// Item 5: a failing replica's abort must not run while another replica is
// inside a (fake) NCCL call on the same communicator.
TEST(MirroredOnFakeGpus, AnAbortWaitsForTheCollectiveCallsInFlight) {
  LeaseDir dir;
  auto backend = std::make_unique<FakeGpuBackend>(3);
  FakeGpuBackend* fake = backend.get();
  std::atomic<int> inside{0};
  fake->inside_collective = [&](int) {
    ++inside;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  };
  ds::MirroredOptions o;
  o.devices = {ds::Device::gpu(0), ds::Device::gpu(1), ds::Device::gpu(2)};
  o.communication.timeout = std::chrono::seconds(30);
  o.device_manager =
      ds::DeviceManagerAccess::shared_with_backend(fake_options(dir), std::move(backend));
  ds::MirroredStrategy s(o);
  EXPECT_THROW(s.run([&](ds::ReplicaContext& ctx) {
    if (ctx.replica_id() == 1) {
      // Fail once the two others are inside their NCCL call.
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (inside.load() < 2 && std::chrono::steady_clock::now() < until)
        std::this_thread::yield();
      throw ds::InvalidArgumentError("replica 1 broke");
    }
    ds::Tensor t(ds::Shape{8}, ds::DType::kFloat32, ctx.device());
    std::vector<ds::Tensor> v{t};
    ctx.all_reduce(ds::ReduceOp::kSum, v, {"g"});
  }),
               ds::InvalidArgumentError);
  EXPECT_EQ(inside.load(), 2);
  EXPECT_EQ(fake->aborts_during_calls.load(), 0);
  fake->inside_collective = nullptr;
}

// Adam runs on the device path (slots in device memory) and trains like the CPU.
TEST(MirroredOnFakeGpus, AdamOnTheDevicePathMatchesCpuTraining) {
  auto train_adam = [](ds::MirroredOptions o) {
    ds::MirroredStrategy s(o);
    ds::nn::Mlp mlp({784, 16, 10});
    auto vars = mlp.create_variables(s, 7);
    ds::Adam opt(s, ds::AdamOptions{0.01f});
    ds::DistributedDataset dist =
        s.distribute(ds::testing::synthetic(64, 11), 16, {false, 0, false});
    for (int i = 0; i < 5; ++i)
      ds::testing::mlp_step(s, mlp, vars, opt, dist.batch(i % dist.num_batches()));
    std::vector<ds::Tensor> out;
    for (auto& v : vars) out.push_back(v.value());
    return out;
  };
  ds::MirroredOptions cpu;
  cpu.devices = {ds::Device::cpu(0), ds::Device::cpu(1)};
  const auto want = train_adam(cpu);
  LeaseDir dir;
  auto backend = std::make_unique<FakeGpuBackend>(2);
  FakeGpuBackend* fake = backend.get();
  ds::MirroredOptions gpu;
  gpu.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};
  gpu.device_manager =
      ds::DeviceManagerAccess::shared_with_backend(fake_options(dir), std::move(backend));
  const auto got = train_adam(gpu);
  EXPECT_LE(ds::testing::max_abs_diff(got, want), 1e-5);
  EXPECT_EQ(fake->adam_updates.load(), 5 * 4 * 2);  // steps x params x replicas
  EXPECT_GT(fake->copies_to_host.load(), 0);
}

// The gate NcclCommunicator puts around its NCCL calls (item 5): an abort
// runs only once the call inside has left, later calls see the abort, reset
// opens the gate again.
TEST(CallGate, AnAbortWaitsForTheCallInsideAndLaterCallsSeeIt) {
  ds::gpu::CallGate gate;
  std::atomic<bool> inside{false}, left{false};
  std::thread caller([&] {
    gate.enter("call", [&] {
      inside = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      left = true;
    });
  });
  while (!inside) std::this_thread::yield();
  bool left_when_aborted = false;
  EXPECT_TRUE(gate.abort("replica 1 failed", [&] { left_when_aborted = left.load(); }));
  caller.join();
  EXPECT_TRUE(left_when_aborted);
  EXPECT_FALSE(gate.abort("again", [] { ADD_FAILURE() << "aborted twice"; }));
  try {
    gate.enter("all_reduce 'g'", [] { ADD_FAILURE() << "entered an aborted gate"; });
    FAIL() << "no AbortedError";
  } catch (const ds::AbortedError& e) {
    EXPECT_NE(std::string(e.what()).find("all_reduce 'g': replica 1 failed"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(gate.reset([] { throw ds::InternalError("recreate failed"); }), ds::InternalError);
  EXPECT_TRUE(gate.aborted());
  gate.reset([] {});
  EXPECT_FALSE(gate.aborted());
  EXPECT_EQ(gate.enter("call", [] { return 7; }), 7);
}
