// diststrat::torch on CUDA (label gpu): DistributedDataParallel with CUDA
// modules under MirroredStrategy (two logical GPUs of GPU 0, so one GPU is
// enough) and MultiWorkerMirroredStrategy (one GPU), no_sync, and
// TrainingState checkpoints written from GPU replicas and restored on CPU.
// Each test skips, with the reason, where LibTorch has no CUDA (Debian's).
#include <unistd.h>

#include <memory>
#include <string>

#include "../common/temp_dir.h"
#include "torch_test_util.h"

namespace diststrat::testing {
namespace {

#define SKIP_WITHOUT_CUDA()                                                                \
  do {                                                                                     \
    if (!torch::cuda::is_available())                                                      \
      GTEST_SKIP() << "this LibTorch (" << compat::version()                               \
                   << ") has no CUDA or sees no CUDA device (torch::cuda::is_available() " \
                      "is false)";                                                         \
  } while (0)

constexpr int64_t kGlobalBatch = 16;
constexpr int kSteps = 20;

// GPU 0 split into `n` logical GPUs of 1 GiB each.
std::shared_ptr<DeviceManager> split_gpu0(int n) {
  auto dm = std::make_shared<DeviceManager>();
  dm->set_logical_device_configuration(
      0, std::vector<LogicalDeviceConfiguration>(static_cast<size_t>(n), {size_t{1} << 30}));
  return dm;
}

// Single-GPU LibTorch: train_reference with the net and the data on cuda:0.
void train_reference_cuda(NetImpl& net, const Dataset& data, int steps) {
  net.to(torch::Device(torch::kCUDA, 0));
  auto opt = make_sgd(net);
  const torch::Device gpu(torch::kCUDA, 0);
  at::Tensor x = dt::to_torch(data.features()).to(gpu), y = dt::to_torch(data.labels()).to(gpu);
  for (int s = 0; s < steps; ++s) {
    const int64_t begin = s * kGlobalBatch, end = std::min(data.size(), begin + kGlobalBatch);
    opt->zero_grad();
    torch::nn::functional::cross_entropy(net.forward(x.slice(0, begin, end)),
                                         y.slice(0, begin, end))
        .backward();
    opt->step();
  }
}

TEST(TorchGpu, MirroredTwoLogicalGpusMatchesSingleGpuLibTorch) {
  SKIP_WITHOUT_CUDA();
  const Dataset data = make_data(kGlobalBatch * kSteps);
  auto ref = make_net(7);
  train_reference_cuda(*ref, data, kSteps);
  MirroredOptions o;
  o.devices = {Device::gpu(0), Device::gpu(1)};
  o.device_manager = split_gpu0(2);
  MirroredStrategy strategy(o);
  dt::DistributedDataParallel ddp(strategy, make_net(7));
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(ddp.module(r)->parameters()[0].is_cuda()) << "replica " << r;
    EXPECT_EQ(ddp.module(r)->parameters()[0].device().index(), 0) << "replica " << r;
  }
  train_ddp(strategy, ddp, data, kGlobalBatch, kSteps);
  EXPECT_LE(max_abs_diff(*ref, *ddp.module(0)), 1e-5);
  EXPECT_LE(max_abs_diff(*ref, *ddp.module(1)), 1e-5);
}

TEST(TorchGpu, MultiWorkerOneGpuMatchesSingleGpuLibTorch) {
  SKIP_WITHOUT_CUDA();
  const Dataset data = make_data(kGlobalBatch * kSteps);
  auto ref = make_net(7);
  train_reference_cuda(*ref, data, kSteps);
  InProcessGroup group(1);  // one worker, no MPI (the GPU machine has none)
  MultiWorkerOptions o;
  o.communicator = &group.at(0);
  o.devices = {Device::gpu(0)};
  MultiWorkerMirroredStrategy strategy(o);
  dt::DistributedDataParallel ddp(strategy, make_net(7));
  train_ddp(strategy, ddp, data, kGlobalBatch, kSteps);
  EXPECT_LE(max_abs_diff(*ref, *ddp.module(0)), 1e-5);
}

// Micro-batches under no_sync, then a synchronizing one: the gradients of
// one larger batch, on both GPU replicas.
TEST(TorchGpu, NoSyncAccumulationEqualsOneLargerBatch) {
  SKIP_WITHOUT_CUDA();
  constexpr int kMicro = 3;
  constexpr int64_t kMicroBatch = 8;
  const Dataset data = make_data(kMicro * kMicroBatch);
  auto ref = make_net(7);
  {
    const torch::Device gpu(torch::kCUDA, 0);
    ref->to(gpu);
    at::Tensor x = dt::to_torch(data.features()).to(gpu), y = dt::to_torch(data.labels()).to(gpu);
    torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
  }
  MirroredOptions mo;
  mo.devices = {Device::gpu(0), Device::gpu(1)};
  mo.device_manager = split_gpu0(2);
  MirroredStrategy strategy(mo);
  dt::DistributedDataParallel ddp(strategy, make_net(7));
  DistributeOptions o;
  o.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, kMicroBatch, o);
  strategy.run([&](ReplicaContext& ctx) {
    auto& model = ddp.module(ctx);
    auto step = [&](int64_t i) {
      DistributedBatch b = dist.batch(i);
      at::Tensor x = dt::to_torch(b.features(ctx)), y = dt::to_torch(b.labels(ctx));
      at::Tensor loss = torch::nn::functional::cross_entropy(model->as<NetImpl>()->forward(x), y);
      ddp.backward(ctx, loss, x.size(0), b.global_size());
    };
    {
      auto guard = ddp.no_sync(ctx);
      for (int i = 0; i + 1 < kMicro; ++i) step(i);
    }
    step(kMicro - 1);
  });
  EXPECT_EQ(ddp.stats().sync_steps, 1);
  for (int r = 0; r < 2; ++r) {
    auto pr = ref->parameters(), pd = ddp.module(r)->parameters();
    for (size_t i = 0; i < pr.size(); ++i) {
      EXPECT_LE((pr[i].grad() - pd[i].grad()).abs().max().item<double>(), 1e-6)
          << "replica " << r << " parameter " << i;
    }
  }
}

// TrainingState captured from GPU replicas (parameters and SGD momentum on
// the device), saved, and restored into a CPU job: bit-equal.
TEST(TorchGpu, CheckpointSavedFromGpuRestoresOnCpuBitEqual) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = diststrat_test::make_temp_dir("diststrat_torch_gpu_");
  const Dataset data = make_data(kGlobalBatch * 4);
  std::vector<at::Tensor> params, momentum;
  {
    MirroredOptions o;
    o.devices = {Device::gpu(0), Device::gpu(1)};
    o.device_manager = split_gpu0(2);
    MirroredStrategy strategy(o);
    dt::DistributedDataParallel ddp(strategy, make_net(7));
    auto opts = make_sgds(ddp);
    dt::TrainingState state(ddp, {opts[0].get(), opts[1].get()});
    Checkpoint ckpt(strategy);
    CheckpointManager manager(ckpt, dir);
    train_ddp_steps(strategy, ddp, opts, data, kGlobalBatch, 0, 3);
    state.capture(3);
    manager.save(3);
    for (const at::Tensor& p : ddp.module(0)->parameters()) {
      params.push_back(p.detach().cpu());
      momentum.push_back(static_cast<torch::optim::SGDParamState&>(
                             *opts[0]->state().at(compat::optimizer_state_key(p)))
                             .momentum_buffer()
                             .cpu());
    }
  }
  MirroredStrategy cpu({Device::cpu(0), Device::cpu(1)});
  dt::DistributedDataParallel ddp(cpu, make_net(99));
  auto opts = make_sgds(ddp);
  dt::TrainingState state(ddp, {opts[0].get(), opts[1].get()});
  Checkpoint ckpt(cpu);
  CheckpointManager manager(ckpt, dir);
  ASSERT_TRUE(manager.restore_latest().has_value());
  EXPECT_EQ(state.apply(), 3);
  for (int r = 0; r < 2; ++r) {
    auto got = ddp.module(r)->parameters();
    ASSERT_EQ(got.size(), params.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(torch::equal(got[i], params[i])) << "replica " << r << " parameter " << i;
      auto& st = static_cast<torch::optim::SGDParamState&>(
          *opts[r]->state().at(compat::optimizer_state_key(got[i])));
      EXPECT_TRUE(torch::equal(st.momentum_buffer(), momentum[i]))
          << "replica " << r << " momentum " << i;
    }
  }
  diststrat_test::remove_tree(dir);
}

// DLPack conversions of CUDA tensors inside a replica of a split GPU: the
// CUDA ordinal (0 for both replicas) maps to the replica's logical GPU, no
// copy either way.
TEST(TorchGpu, ConvertCudaTensorsToTheReplicasLogicalGpu) {
  SKIP_WITHOUT_CUDA();
  MirroredOptions o;
  o.devices = {Device::gpu(0), Device::gpu(1)};
  o.device_manager = split_gpu0(2);
  MirroredStrategy strategy(o);
  strategy.run([&](ReplicaContext& ctx) {
    const at::Tensor t = torch::arange(
        6, torch::TensorOptions().dtype(torch::kFloat32).device(torch::Device(torch::kCUDA, 0)));
    const Tensor d = dt::to_diststrat(t);
    EXPECT_EQ(d.device(), ctx.device());
    const at::Tensor back = dt::to_torch(d);
    EXPECT_TRUE(back.is_cuda());
    EXPECT_EQ(back.device().index(), 0);
    EXPECT_EQ(back.data_ptr(), t.data_ptr());
    EXPECT_TRUE(torch::equal(back, t));
  });
}

}  // namespace
}  // namespace diststrat::testing
