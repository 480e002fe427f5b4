// DistributedDataParallel over two CPU replicas of a MirroredStrategy: one
// backward, then both replicas hold the same (averaged) gradient.
#include <cstdio>

#include <diststrat/diststrat.h>
#include <diststrat/torch.h>

int main() {
  namespace ds = diststrat;
  namespace dt = diststrat::libtorch;
  ds::MirroredStrategy strategy({ds::Device::cpu(0), ds::Device::cpu(1)});
  torch::manual_seed(0);
  dt::DistributedDataParallel ddp(strategy, torch::nn::Linear(3, 1).ptr());
  strategy.run([&](ds::ReplicaContext& ctx) {
    auto model = ddp.module(ctx)->as<torch::nn::LinearImpl>();
    at::Tensor x = torch::full({2, 3}, static_cast<float>(ctx.replica_id() + 1));
    ddp.backward(ctx, model->forward(x).mean(), 2, 4);
  });
  at::Tensor g0 = ddp.module(0)->as<torch::nn::LinearImpl>()->weight.grad();
  at::Tensor g1 = ddp.module(1)->as<torch::nn::LinearImpl>()->weight.grad();
  // d mean(w.x + b)/dw over rows of 1s and 2s = 1.5 per input.
  const bool ok = torch::equal(g0, g1) && std::abs(g0[0][0].item<float>() - 1.5f) < 1e-6f;
  std::printf("torch_consumer: grad %g %s\n", g0[0][0].item<float>(), ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
