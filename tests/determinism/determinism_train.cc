// Trains a small MLP under MirroredStrategy or MultiWorkerMirroredStrategy
// and writes the final variables' bytes (in creation order) to --out, so that
// determinism_compare.sh can `cmp` runs on different replica and worker
// counts (issue 47, docs/determinism.md).
//
//   determinism_train --strategy mirrored|multi_worker --replicas N --shards V
//                     --optimizer sgd|adam --steps S --out FILE [--synthetic] [--zero]
//
// Fashion-MNIST (kFashionMnistDir) by default; --synthetic, or a machine
// without the data, uses a seeded random set of the same shape. Adam runs
// with clipping by global norm and two micro-batches per update.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <string>

#include "diststrat/diststrat.h"

namespace ds = diststrat;

namespace {

struct Flags {
  std::string strategy = "mirrored", optimizer = "sgd", out;
  int replicas = 1, shards = 12, steps = 200;
  bool synthetic = false;
  bool zero = false;  // ZeRO-1: shard_optimizer_state
};

ds::Dataset synthetic_set(int64_t rows) {
  ds::Tensor x(ds::Shape{rows, 784}, ds::DType::kFloat32);
  ds::Tensor y(ds::Shape{rows}, ds::DType::kInt32);
  std::mt19937 g(7);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int64_t i = 0; i < rows * 784; ++i) x.data<float>()[i] = u(g);
  for (int64_t i = 0; i < rows; ++i) y.data<int32_t>()[i] = static_cast<int32_t>(g() % 10);
  return ds::Dataset(x, y);
}

std::unique_ptr<ds::Strategy> make(const Flags& f) {
  ds::DeterminismOptions det;
  det.virtual_shards = f.shards;
  std::vector<ds::Device> devices;
  for (int i = 0; i < f.replicas; ++i) devices.push_back(ds::Device::cpu(i));
  if (f.strategy == "multi_worker") {
    ds::MultiWorkerOptions o;
    o.devices = devices;
    o.determinism = det;
    o.shard_optimizer_state = f.zero;
    return std::make_unique<ds::MultiWorkerMirroredStrategy>(o);
  }
  ds::MirroredOptions o;
  o.devices = devices;
  o.determinism = det;
  o.shard_optimizer_state = f.zero;
  return std::make_unique<ds::MirroredStrategy>(o);
}

int run(const Flags& f) {
  const int64_t batch = 96;
  const int64_t rows = batch * 50 + 40;  // 50 full batches and a short one per epoch
  ds::Dataset data;
  if (!f.synthetic &&
      std::ifstream(std::string(ds::kFashionMnistDir) + "/train-labels-idx1-ubyte.gz")) {
    data = ds::load_mnist_split(ds::kFashionMnistDir, "train", rows);
  } else {
    data = synthetic_set(rows);
  }
  std::unique_ptr<ds::Strategy> strategy = make(f);
  const ds::nn::Mlp mlp({784, 32, 10});
  std::vector<ds::Variable> params = mlp.create_variables(*strategy, 3);
  std::unique_ptr<ds::Optimizer> opt;
  if (f.optimizer == "adam") {
    ds::AdamOptions o;
    o.learning_rate = 0.002f;
    opt = std::make_unique<ds::Adam>(*strategy, o);
    ds::GradientClipping c;
    c.global_norm = 0.5f;
    opt->set_clipping(c);
    opt->set_accumulation_steps(2);
  } else {
    ds::SGDOptions o;
    o.learning_rate = 0.05f;
    o.momentum = 0.9f;
    opt = std::make_unique<ds::SGD>(*strategy, o);
  }
  ds::DistributeOptions dopt;
  dopt.seed = 11;
  ds::DistributedDataset dist = strategy->distribute(data, batch, dopt);
  double loss = 0;
  int step = 0;
  for (int epoch = 0; step < f.steps; ++epoch) {
    dist.set_epoch(epoch);
    for (int64_t b = 0; b < dist.num_batches() && step < f.steps; ++b, ++step) {
      const ds::DistributedBatch db = dist.batch(b);
      const float scale = 1.0f / static_cast<float>(db.global_size());
      ds::PerReplica<double> l = strategy->run([&](ds::ReplicaContext& ctx) {
        std::vector<ds::Tensor> values;
        for (const ds::Variable& v : params) values.push_back(v.read(ctx));
        ds::nn::Mlp::Step s = mlp.forward_backward(values, db.features(ctx), db.labels(ctx), scale);
        std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
        for (size_t i = 0; i < params.size(); ++i) gv.emplace_back(s.grads[i], params[i]);
        opt->apply_gradients(ctx, gv);
        return s.loss_sum;
      });
      loss = strategy->reduce(ds::ReduceOp::kSum, l) / static_cast<double>(db.global_size());
    }
  }
  if (!strategy->cluster().is_chief()) return 0;
  std::ofstream out(f.out, std::ios::binary);
  for (const ds::Variable& v : strategy->variables()) {
    const ds::Tensor t = v.value();
    out.write(static_cast<const char*>(t.data()), static_cast<std::streamsize>(t.nbytes()));
  }
  // The last step's loss as well: reductions follow the rule too.
  out.write(reinterpret_cast<const char*>(&loss), sizeof loss);
  std::printf("determinism_train: %s replicas=%d shards=%d %s steps=%d loss=%.9g\n",
              f.strategy.c_str(), strategy->num_replicas_in_sync(), f.shards, f.optimizer.c_str(),
              step, loss);
  return out ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--zero")
      f.zero = true;
    else if (a == "--strategy")
      f.strategy = next();
    else if (a == "--optimizer")
      f.optimizer = next();
    else if (a == "--out")
      f.out = next();
    else if (a == "--replicas")
      f.replicas = std::stoi(next());
    else if (a == "--shards")
      f.shards = std::stoi(next());
    else if (a == "--steps")
      f.steps = std::stoi(next());
    else if (a == "--synthetic")
      f.synthetic = true;
    else {
      std::cerr << "determinism_train: unknown flag " << a << "\n";
      return 2;
    }
  }
  try {
    return run(f);
  } catch (const std::exception& e) {
    std::cerr << "determinism_train: " << e.what() << "\n";
    return 1;
  }
}
