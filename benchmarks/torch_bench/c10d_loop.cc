// c10d ProcessGroupGloo training loop, written as pytorch/examples'
// cpp/distributed/dist-mnist.cpp writes its loop (there with
// ProcessGroupMPI): forward, backward, then for every parameter one
// allreduce of its gradient (all issued, then all waited for), each gradient
// divided by the number of processes, optimizer step. No bucketing, no
// overlap with backward: what a LibTorch C++ user writes today, since the
// C++ API has no DistributedDataParallel.
#include "c10d_loop.h"

#include <chrono>
#include <vector>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "cnn.h"

namespace torch_bench {

namespace {
int64_t block(const Config& c, const Data& d, int step, int rank, int world) {
  const int64_t blocks = d.x.size(0) / c.batch;
  return ((static_cast<int64_t>(step) * world + rank) % blocks) * c.batch;
}
}  // namespace

torch::Tensor Data::batch_x(const Config& c, int step, int rank, int world) const {
  return x.narrow(0, block(c, *this, step, rank, world), c.batch);
}
torch::Tensor Data::batch_y(const Config& c, int step, int rank, int world) const {
  return y.narrow(0, block(c, *this, step, rank, world), c.batch);
}

Result run_c10d_gloo(const Config& config, const Data& data, int rank, int world,
                     const std::string& store_path) {
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(config.timeout_s * 1000));
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, world);
  store->setTimeout(timeout);
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);

  torch_fashion_mnist::use_intra_op_threads(config.threads);
  // Every process seeds alike, so the replicas start equal (as dist-mnist's do).
  torch::manual_seed(static_cast<uint64_t>(config.seed));
  torch_fashion_mnist::Cnn model;
  torch::optim::SGD optimizer(model->parameters(),
                              torch::optim::SGDOptions(config.lr).momentum(config.momentum));

  double loss_sum = 0;
  std::chrono::steady_clock::time_point t0;
  for (int step = 0; step < config.warmup + config.steps; ++step) {
    if (step == config.warmup) {
      pg->barrier()->wait();
      t0 = std::chrono::steady_clock::now();
    }
    optimizer.zero_grad();
    torch::Tensor loss = torch_fashion_mnist::mean_cross_entropy(
        model->forward(data.batch_x(config, step, rank, world)),
        data.batch_y(config, step, rank, world));
    loss.backward();
    // Averaging the gradients of the parameters over the processes, as
    // dist-mnist does.
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (torch::Tensor& p : model->parameters()) {
      std::vector<torch::Tensor> one = {p.grad()};
      works.push_back(pg->allreduce(one));
    }
    for (auto& w : works) w->wait(timeout);
    for (torch::Tensor& p : model->parameters()) p.grad().div_(world);
    optimizer.step();
    if (step >= config.warmup) loss_sum += loss.item<double>();
  }
  pg->barrier()->wait();
  Result r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // The mean over every process's batches (outside the timed steps).
  std::vector<torch::Tensor> total = {torch::tensor({loss_sum}, torch::kFloat64)};
  pg->allreduce(total)->wait(timeout);
  r.mean_loss = total[0].item<double>() / (static_cast<double>(config.steps) * world);
  return r;
}

}  // namespace torch_bench
