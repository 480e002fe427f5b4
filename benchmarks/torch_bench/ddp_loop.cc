// The c10d loop of c10d_loop.cc with diststrat::libtorch::DistributedDataParallel:
// the hand-written per-gradient all-reduces and the division by the world
// size are gone; ddp.backward() runs the backward pass and (overlap on) hands
// each bucket of gradients to the fusion engine from the autograd hooks.
#include "ddp_loop.h"

#include <chrono>
#include <memory>

#include <diststrat/diststrat.h>
#include <diststrat/torch.h>

#include "cnn.h"

namespace ds = diststrat;
namespace dt = diststrat::libtorch;

namespace torch_bench {

Result run_diststrat_ddp(const Config& config, const Data& data, const DdpMode& mode, int* rank,
                         int* world) {
  ds::MultiWorkerOptions options;
  options.devices = {ds::Device::cpu(0)};
  options.communication.timeout =
      std::chrono::milliseconds(static_cast<int64_t>(config.timeout_s * 1000));
  ds::MultiWorkerMirroredStrategy strategy(options);
  *rank = strategy.cluster().worker_index;
  *world = strategy.cluster().num_workers;

  torch::manual_seed(
      static_cast<uint64_t>(config.seed));  // as the c10d loop (DDP broadcasts anyway)
  auto net = std::make_shared<torch_fashion_mnist::CnnImpl>();
  dt::DdpOptions ddp_options;
  ddp_options.overlap = mode.overlap;
  if (mode.bytes_per_bucket >= 0)
    ddp_options.bytes_per_bucket = static_cast<size_t>(mode.bytes_per_bucket);
  dt::DistributedDataParallel ddp(strategy, net, ddp_options);
  torch::optim::SGD optimizer(ddp.module(0)->parameters(),
                              torch::optim::SGDOptions(config.lr).momentum(config.momentum));

  double loss_sum = 0;
  std::chrono::steady_clock::time_point t0;
  const int64_t global_rows = config.batch * *world;
  for (int step = 0; step < config.warmup + config.steps; ++step) {
    if (step == config.warmup) {
      strategy.barrier("torch_bench timing start");
      t0 = std::chrono::steady_clock::now();
    }
    ds::PerReplica<double> loss = strategy.run([&](ds::ReplicaContext& ctx) {
      torch_fashion_mnist::use_intra_op_threads(config.threads);
      auto* model = ddp.module(ctx)->as<torch_fashion_mnist::CnnImpl>();
      optimizer.zero_grad();
      torch::Tensor l = torch_fashion_mnist::mean_cross_entropy(
          model->forward(data.batch_x(config, step, *rank, *world)),
          data.batch_y(config, step, *rank, *world));
      ddp.backward(ctx, l, config.batch, global_rows);  // grads = mean over every process's rows
      optimizer.step();
      return l.item<double>();
    });
    if (step >= config.warmup) loss_sum += loss[0];
  }
  strategy.barrier("torch_bench timing end");
  Result r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // The mean over every process's batches (outside the timed steps).
  ds::PerReplica<double> mine = strategy.run([&](ds::ReplicaContext&) { return loss_sum; });
  r.mean_loss =
      strategy.reduce(ds::ReduceOp::kSum, mine) / (static_cast<double>(config.steps) * *world);
  return r;
}

}  // namespace torch_bench
