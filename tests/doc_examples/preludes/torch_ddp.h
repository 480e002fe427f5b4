// Prelude "torch_ddp": a DistributedDataParallel `ddp` of `Net` (see
// "torch_net") over a two-CPU MirroredStrategy `strategy`, one SGD per
// replica in `opt` (`opt0`, `opt1` name them), `dist` (512 Fashion-MNIST
// rows, global batch 128), `epochs` (2), `dir` ("ckpts"), `steps` (4),
// `every` (2), `step` (0) and train_step(batch), one real step.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

// @extends: torch_net
// @body
ds::MirroredStrategy strategy({ds::Device::cpu(0), ds::Device::cpu(1)});
auto net = std::make_shared<Net>();
dt::DistributedDataParallel ddp(strategy, net);
std::vector<std::unique_ptr<torch::optim::SGD>> opt;
for (int i = 0; i < ddp.num_local_replicas(); ++i)
  opt.push_back(std::make_unique<torch::optim::SGD>(ddp.module(i)->parameters(),
                                                    torch::optim::SGDOptions(0.05).momentum(0.9)));
[[maybe_unused]] std::unique_ptr<torch::optim::SGD>&opt0 = opt[0], &opt1 = opt[1];
[[maybe_unused]] const std::string dir = "ckpts";
[[maybe_unused]] const int64_t steps = 4, every = 2;
[[maybe_unused]] int64_t step = 0;
[[maybe_unused]] const int64_t epochs = 2;
ds::DistributedDataset dist = strategy.distribute(data, /*global_batch=*/128);
[[maybe_unused]] auto train_step = [&](const ds::DistributedBatch& batch) {
  strategy.run([&](ds::ReplicaContext& ctx) {
    at::Tensor x = dt::to_torch(batch.features(ctx));
    at::Tensor y = dt::to_torch(batch.labels(ctx)).to(torch::kLong);
    auto& o = *opt[ctx.local_replica_id()];
    o.zero_grad();
    at::Tensor loss = torch::nll_loss(ddp.module(ctx)->as<Net>()->forward(x), y);
    ddp.backward(ctx, loss, x.size(0), batch.global_size());
    o.step();
  });
};
