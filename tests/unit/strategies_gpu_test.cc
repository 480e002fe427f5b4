// The strategies other than MirroredStrategy with GPU compute replicas, on
// the fake GPU backend (host memory posing as device memory): training must
// match the same strategy on CPU replicas within 1e-5. Compiles to nothing in
// a tree without the fake backend.
#if __has_include("fake_gpu_backend.h")

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <functional>
#include <memory>
#include <thread>

#include "core/device_manager_impl.h"
#include "runtime/variable_impl.h"
#include "checkpoint_util.h"
#include "diststrat/device_manager.h"
#include "diststrat/diststrat.h"
#include "fake_gpu_backend.h"
#include "training_util.h"

namespace ds = diststrat;
using diststrat_test::FakeGpuBackend;
using diststrat_test::LeaseDir;

namespace {

// Trains the test MLP for `steps` steps of 16 samples with SGD + momentum
// (a slot per variable) and returns the final weights (host).
std::vector<ds::Tensor> train(ds::Strategy& s, int steps,
                              const std::function<void()>& before_read = nullptr) {
  ds::nn::Mlp mlp({784, 16, 10});
  auto vars = mlp.create_variables(s, 7);
  ds::SGD opt(s, {0.05f, 0.9f});
  ds::DistributedDataset dist = s.distribute(ds::testing::synthetic(64, 11), 16, {false, 0, false});
  for (int i = 0; i < steps; ++i) {
    ds::testing::mlp_step(s, mlp, vars, opt, dist.batch(i % dist.num_batches()));
  }
  if (before_read) before_read();
  std::vector<ds::Tensor> out;
  for (auto& v : vars) out.push_back(v.value());
  return out;
}

}  // namespace

TEST(CentralStorageOnFakeGpus, HostVariablesGpuComputeMatchesCpuTraining) {
  ds::CentralStorageStrategy cpu({ds::Device::cpu(0), ds::Device::cpu(1)});
  const auto want = train(cpu, 6);

  LeaseDir dir;
  auto backend = std::make_unique<FakeGpuBackend>(2);
  FakeGpuBackend* fake = backend.get();
  ds::CentralStorageOptions o;
  o.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};
  o.device_manager =
      ds::DeviceManagerAccess::shared_with_backend(dir.gpu_options(), std::move(backend));
  ds::CentralStorageStrategy gpu(o);
  const auto got = train(gpu, 6);
  EXPECT_LE(ds::testing::max_abs_diff(got, want), 1e-5);
  // One host copy per variable (and its slot); the update ran on the host.
  for (const ds::Variable& v : gpu.variables()) {
    ASSERT_EQ(v.impl().copies.size(), 1u) << v.name();
    EXPECT_TRUE(v.impl().copies[0].device().is_cpu()) << v.name();
    for (const auto& [name, slot] : v.impl().slots) {
      ASSERT_EQ(slot.size(), 1u);
      EXPECT_TRUE(slot[0].device().is_cpu()) << v.name() << "/" << name;
    }
  }
  EXPECT_EQ(fake->updates.load(), 0);    // no device update kernel
  EXPECT_GE(fake->syncs.load(), 2 * 6);  // every step drains both replicas' streams
  EXPECT_EQ(gpu.device_manager(), o.device_manager);
}

TEST(CentralStorageOnFakeGpus, ReadsAreDeviceCopiesAndResultsComeBackToTheHost) {
  LeaseDir dir;
  ds::CentralStorageOptions o;
  o.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};
  o.device_manager = ds::DeviceManagerAccess::shared_with_backend(
      dir.gpu_options(), std::make_unique<FakeGpuBackend>(2));
  ds::CentralStorageStrategy s(o);
  ds::Variable v = s.create_variable("v", ds::Shape{3}, ds::DType::kFloat32, ds::init::Constant{2});
  ds::Variable n = s.create_variable("n", ds::Shape{1}, ds::DType::kInt64, ds::init::Zeros{});
  auto out = s.run([&](ds::ReplicaContext& ctx) {
    ds::Tensor t = v.read(ctx);
    EXPECT_EQ(t.device(), ctx.device());
    EXPECT_FALSE(t.same_storage(v.impl().copies[0]));
    EXPECT_TRUE(n.read(ctx).device().is_cpu());  // integers stay on the host
    ds::Tensor h(ds::Shape{3}, ds::DType::kFloat32);
    h.copy_from(t);
    EXPECT_EQ(h.data<float>()[1], 2.0f);
    return t;
  });
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(out[1].device() == ds::Device::gpu(1));
  ds::Tensor sum = s.reduce(ds::ReduceOp::kSum, out);
  EXPECT_TRUE(sum.device().is_cpu());
  EXPECT_EQ(sum.data<float>()[2], 4.0f);
  ds::Tensor all = s.gather(out);
  EXPECT_EQ(all.shape(), ds::Shape({6}));
  EXPECT_EQ(all.data<float>()[5], 2.0f);
  // assign writes the single host copy, which the next read sees.
  ds::Tensor three(ds::Shape{3}, ds::DType::kFloat32);
  for (int i = 0; i < 3; ++i) three.data<float>()[i] = 3.0f;
  v.assign(three);
  s.run([&](ds::ReplicaContext& ctx) {
    ds::Tensor h(ds::Shape{3}, ds::DType::kFloat32);
    h.copy_from(v.read(ctx));
    EXPECT_EQ(h.data<float>()[0], 3.0f);
  });
}

TEST(CentralStorageOnFakeGpus, MissingGpusAndGpuParameterDeviceAreRejected) {
  LeaseDir dir;
  ds::CentralStorageOptions o;
  o.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};  // only one fake GPU
  o.device_manager = ds::DeviceManagerAccess::shared_with_backend(
      dir.gpu_options(), std::make_unique<FakeGpuBackend>(1));
  EXPECT_THROW(ds::CentralStorageStrategy{o}, ds::NotFoundError);
  o.devices = {ds::Device::gpu(0)};
  o.parameter_device = ds::Device::gpu(0);
  EXPECT_THROW(ds::CentralStorageStrategy{o}, ds::UnimplementedError);
  o.parameter_device = ds::Device::cpu(0);
  o.devices = {ds::Device::cpu(0), ds::Device::gpu(0)};
  EXPECT_THROW(ds::CentralStorageStrategy{o}, ds::InvalidArgumentError);
}

namespace {
// Trains under MultiWorkerMirroredStrategy with 2 workers (threads over one
// InProcessGroup), 2 local replicas each, on CPUs or on 2 fake GPUs per
// worker; returns worker 0's final weights.
std::vector<ds::Tensor> train_multi_worker(bool gpus, int steps, std::atomic<int>* device_updates) {
  const int workers = 2;
  ds::CommunicationOptions comm;
  comm.timeout = std::chrono::seconds(60);
  ds::InProcessGroup flat(workers, comm);
  std::vector<std::vector<ds::Tensor>> out(workers);
  std::vector<std::exception_ptr> errors(workers);
  std::vector<std::unique_ptr<LeaseDir>> dirs;
  for (int w = 0; w < workers; ++w) dirs.push_back(std::make_unique<LeaseDir>());
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      try {
        ds::MultiWorkerOptions o;
        o.communication = comm;
        o.communicator = &flat.at(w);
        if (gpus) {
          o.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};
          auto backend = std::make_unique<FakeGpuBackend>(2);
          FakeGpuBackend* fake = backend.get();
          o.device_manager = ds::DeviceManagerAccess::shared_with_backend(dirs[w]->gpu_options(),
                                                                          std::move(backend));
          ds::MultiWorkerMirroredStrategy s(o);
          out[w] = train(s, steps);
          *device_updates += fake->updates.load();
        } else {
          o.devices = {ds::Device::cpu(0), ds::Device::cpu(1)};
          ds::MultiWorkerMirroredStrategy s(o);
          out[w] = train(s, steps);
        }
      } catch (...) {
        errors[w] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  EXPECT_LE(ds::testing::max_abs_diff(out[1], out[0]), 1e-5);  // the workers' copies agree
  return out[0];
}
}  // namespace

TEST(MultiWorkerOnFakeGpus, DeviceReplicasWithHostStagedReductionMatchCpuTraining) {
  std::atomic<int> cpu_updates{0}, gpu_updates{0};
  const auto want = train_multi_worker(false, 6, &cpu_updates);
  const auto got = train_multi_worker(true, 6, &gpu_updates);
  EXPECT_LE(ds::testing::max_abs_diff(got, want), 1e-5);
  EXPECT_EQ(gpu_updates.load(), 2 * 2 * 6 * 4);  // workers x replicas x steps x params, on device
}

TEST(MultiWorkerOnFakeGpus, VariablesLiveOnTheDevicesAndComeBackToTheHost) {
  LeaseDir dir;
  ds::InProcessGroup flat(1, {});
  ds::MultiWorkerOptions o;
  o.communicator = &flat.at(0);
  o.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};
  o.device_manager = ds::DeviceManagerAccess::shared_with_backend(
      dir.gpu_options(), std::make_unique<FakeGpuBackend>(2));
  ds::MultiWorkerMirroredStrategy s(o);
  ds::Variable v = s.create_variable("v", ds::Shape{4}, ds::DType::kFloat32, ds::init::Constant{2});
  ASSERT_EQ(v.impl().copies.size(), 2u);
  EXPECT_EQ(v.impl().copies[1].device(), ds::Device::gpu(1));
  ds::Tensor five(ds::Shape{4}, ds::DType::kFloat32);
  for (int i = 0; i < 4; ++i) five.data<float>()[i] = 5.0f;
  v.assign(five);
  EXPECT_EQ(v.value().data<float>()[3], 5.0f);
  auto out = s.run([&](ds::ReplicaContext& ctx) {
    ds::Tensor t = ctx.all_reduce(ds::ReduceOp::kSum, v.read(ctx), "v");
    EXPECT_EQ(t.device(), ctx.device());
    ds::Tensor g = ctx.all_gather(v.read(ctx), "v");
    EXPECT_EQ(g.device(), ctx.device());
    EXPECT_EQ(g.shape(), ds::Shape({8}));
    return t;
  });
  ds::Tensor sum = s.reduce(ds::ReduceOp::kSum, out);
  EXPECT_TRUE(sum.device().is_cpu());
  EXPECT_EQ(sum.data<float>()[0], 20.0f);  // 2 replicas x (5 + 5)
}

namespace {
std::vector<ds::Tensor> train_ps(std::vector<ds::Device> devices,
                                 std::shared_ptr<ds::DeviceManager> dm, int steps) {
  ds::ParameterServerOptions o;
  o.num_ps = 1;
  o.devices = std::move(devices);
  o.device_manager = std::move(dm);
  o.max_staleness = 0;
  ds::ParameterServerStrategy s(o);
  return train(s, steps, [&] { s.flush(); });
}
}  // namespace

TEST(ParameterServerOnFakeGpus, GpuWorkerReplicasMatchCpuWorkerTraining) {
  const auto want = train_ps({ds::Device::cpu(0), ds::Device::cpu(1)}, nullptr, 6);
  LeaseDir dir;
  auto backend = std::make_unique<FakeGpuBackend>(2);
  FakeGpuBackend* fake = backend.get();
  auto dm = ds::DeviceManagerAccess::shared_with_backend(dir.gpu_options(), std::move(backend));
  const auto got = train_ps({ds::Device::gpu(0), ds::Device::gpu(1)}, dm, 6);
  EXPECT_LE(ds::testing::max_abs_diff(got, want), 1e-5);
  EXPECT_EQ(fake->nccl_groups.load(), 1);  // the worker's replicas all-reduce on the GPUs
  EXPECT_EQ(fake->updates.load(), 0);      // the PS applies the updates
  EXPECT_GE(fake->syncs.load(), 2 * 6);
}

TEST(ParameterServerOnFakeGpus, OneGpuReplicaReadsADeviceCopyOfTheCache) {
  LeaseDir dir;
  ds::ParameterServerOptions o;
  o.num_ps = 1;
  o.devices = {ds::Device::gpu(0)};
  o.device_manager = ds::DeviceManagerAccess::shared_with_backend(
      dir.gpu_options(), std::make_unique<FakeGpuBackend>(1));
  ds::ParameterServerStrategy s(o);
  ds::Variable w =
      s.create_variable("w", ds::Shape{4}, ds::DType::kFloat32, ds::init::Constant{1.0});
  ds::SGD sgd(s, {0.5f, 0.0f});
  for (int step = 0; step < 3; ++step) {
    s.run([&](ds::ReplicaContext& ctx) {
      ds::Tensor r = w.read(ctx);
      EXPECT_EQ(r.device(), ds::Device::gpu(0));
      sgd.apply_gradients(ctx, {{r.clone(), w}});  // grad = w: w *= 0.5
    });
  }
  s.flush();
  EXPECT_FLOAT_EQ(w.value().data<float>()[2], 0.125f);
}

#endif  // __has_include("fake_gpu_backend.h")
