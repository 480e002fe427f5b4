// Prelude "loop": a MirroredStrategy training loop's parts, for fragments
// about checkpoints and the data position. Two CPU replicas, an MLP on 512
// Fashion-MNIST rows (global batch 128: 4 batches an epoch), `opt` (SGD with
// momentum), `dist` (the distributed dataset), `epochs` (2), `epoch` and
// `step` (0), and train_step(batch) that runs one real step. The fragment
// runs in an empty working directory of its own.
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
