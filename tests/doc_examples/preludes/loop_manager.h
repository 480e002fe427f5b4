// Prelude "loop_manager": the prelude "loop" (a MirroredStrategy training
// loop's parts: `strategy`, `opt`, `dist`, `epochs`, `epoch`, `step`,
// train_step(batch)) and a CheckpointManager `manager` (directory ckpt) of
// a Checkpoint of the variables and `opt`.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <diststrat/diststrat.h>
namespace ds = diststrat;
// @body
ds::MirroredStrategy strategy({ds::Device::cpu(0), ds::Device::cpu(1)});
ds::Dataset train = ds::load_mnist_split(ds::kFashionMnistDir, "train", 512);
ds::nn::Mlp mlp({784, 32, 10});
std::vector<ds::Variable> params = mlp.create_variables(strategy, /*seed=*/1);
ds::SGD opt(strategy, {/*learning_rate=*/0.05f, /*momentum=*/0.9f});
ds::DistributedDataset dist = strategy.distribute(train, /*global_batch=*/128);
const int64_t epochs = 2;
[[maybe_unused]] int64_t epoch = 0, step = 0;
[[maybe_unused]] auto train_step = [&](const ds::DistributedBatch& batch) {
  const float scale = 1.0f / batch.global_size();
  strategy.run([&](ds::ReplicaContext& ctx) {
    std::vector<ds::Tensor> w;
    for (auto& v : params) w.push_back(v.read(ctx));
    auto s = mlp.forward_backward(w, batch.features(ctx), batch.labels(ctx), scale);
    std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
    for (size_t i = 0; i < params.size(); ++i) gv.emplace_back(s.grads[i], params[i]);
    opt.apply_gradients(ctx, gv);
  });
};
ds::Checkpoint checkpoint(strategy, {&opt});
ds::CheckpointManager manager(checkpoint, "ckpt", {/*max_to_keep=*/2});
