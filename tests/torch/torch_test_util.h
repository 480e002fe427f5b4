// Shared by the LibTorch tests (in-process and under mpirun): a small
// Cloneable model, a deterministic data set, the single-process LibTorch
// reference loop and the same loop under a strategy with
// DistributedDataParallel.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "diststrat/diststrat.h"
#include "diststrat/torch.h"
#include "torch/torch_compat.h"  // src/: LibTorch 1.x/2.x differences

namespace diststrat::testing {

namespace dt = diststrat::libtorch;
namespace compat = diststrat::libtorch::compat;
using dt::DdpOptions;
using dt::DdpStats;

// 8 -> 16 -> 4 MLP with a buffer; `extra` adds a layer (a different module),
// `use_extra` = false leaves it out of the forward pass (an unused parameter).
struct NetImpl : torch::nn::Cloneable<NetImpl> {
  explicit NetImpl(bool extra = false, bool use_extra = true)
      : extra_(extra), use_extra_(use_extra) {
    reset();
  }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
    scale = register_buffer("scale", torch::ones({4}));
    if (extra_) extra = register_module("extra", torch::nn::Linear(4, 4));
  }
  at::Tensor forward(at::Tensor x) {
    x = fc2->forward(torch::tanh(fc1->forward(x))) * scale;
    if (extra && use_extra_) x = extra->forward(x);
    return x;
  }
  bool extra_, use_extra_;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, extra{nullptr};
  at::Tensor scale;
};

// LibTorch's default generator is one per process: seeding it and drawing
// from it are two steps, so two threads building nets at once would take
// each other's numbers (a worker thread's net seeded 7 drew from seed 99).
// Every seeded draw in these helpers holds this lock.
inline std::mutex& default_generator_mutex() {
  static std::mutex m;
  return m;
}

// The same weights for the same seed, from any thread.
inline std::shared_ptr<NetImpl> make_net(uint64_t seed, bool extra = false, bool use_extra = true) {
  std::lock_guard<std::mutex> lock(default_generator_mutex());
  torch::manual_seed(seed);
  return std::make_shared<NetImpl>(extra, use_extra);
}

// Rows of features [n, 8] and labels [n] in 0..3, the same in every process.
inline Dataset make_data(int64_t n) {
  std::lock_guard<std::mutex> lock(default_generator_mutex());
  torch::manual_seed(1234);
  at::Tensor x = torch::randn({n, 8});
  at::Tensor y = torch::randint(0, 4, {n}, torch::kLong);
  Tensor f(Shape{n, 8}, DType::kFloat32), l(Shape{n}, DType::kInt64);
  std::memcpy(f.data(), x.data_ptr(), f.nbytes());
  std::memcpy(l.data(), y.data_ptr(), l.nbytes());
  return Dataset(f, l);
}

// The equivalence tests' run: kSteps steps of kGlobalBatch rows (the last
// one short: 3 rows).
constexpr int64_t kGlobalBatch = 16;
constexpr int kSteps = 20;
inline Dataset equivalence_data() { return make_data(kGlobalBatch * (kSteps - 1) + 3); }

constexpr double kLr = 0.1, kMomentum = 0.9;

inline std::unique_ptr<torch::optim::SGD> make_sgd(torch::nn::Module& m) {
  return std::make_unique<torch::optim::SGD>(m.parameters(),
                                             torch::optim::SGDOptions(kLr).momentum(kMomentum));
}

// Single-process LibTorch: SGD on the mean loss of each global batch of
// `data` in order (the last one short), `steps` steps.
inline void train_reference(NetImpl& net, const Dataset& data, int64_t global_batch, int steps) {
  auto opt = make_sgd(net);
  at::Tensor x = dt::to_torch(data.features()), y = dt::to_torch(data.labels());
  for (int s = 0; s < steps; ++s) {
    const int64_t begin = s * global_batch, end = std::min(data.size(), begin + global_batch);
    ASSERT_LT(begin, end);
    opt->zero_grad();
    at::Tensor loss = torch::nn::functional::cross_entropy(net.forward(x.slice(0, begin, end)),
                                                           y.slice(0, begin, end));
    loss.backward();
    opt->step();
  }
}

inline double max_abs_diff(torch::nn::Module& a, torch::nn::Module& b) {
  double d = 0;
  auto pa = a.parameters(), pb = b.parameters();
  EXPECT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size() && i < pb.size(); ++i) {
    d = std::max(d, (pa[i] - pb[i]).abs().max().item<double>());
  }
  return d;
}

inline bool bit_identical(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters(), pb = b.parameters();
  if (pa.size() != pb.size()) return false;
  for (size_t i = 0; i < pa.size(); ++i) {
    if (!torch::equal(pa[i], pb[i])) return false;
  }
  return true;
}

// The same loop under `strategy`: one optimizer per local replica, the
// epoch's batches in order (no shuffle). After every step all local replicas
// must be bit-identical (checked here). `steps` <= the batches of one epoch.
// Steps [first, last) with the given optimizers (one per local replica).
inline void train_ddp_steps(Strategy& strategy, dt::DistributedDataParallel& ddp,
                            std::vector<std::unique_ptr<torch::optim::SGD>>& opts,
                            const Dataset& data, int64_t global_batch, int first, int last) {
  DistributeOptions o;
  o.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, global_batch, o);
  ASSERT_GE(dist.num_batches(), last);
  for (int s = first; s < last; ++s) {
    DistributedBatch batch = dist.batch(s);
    strategy.run([&](ReplicaContext& ctx) {
      auto& model = ddp.module(ctx);
      // Several replicas in one process: one intra-op thread each.
      if (ddp.num_local_replicas() > 1) EXPECT_EQ(at::get_num_threads(), 1);
      at::Tensor x = dt::to_torch(batch.features(ctx)), y = dt::to_torch(batch.labels(ctx));
      torch::optim::SGD& opt = *opts[ctx.local_replica_id()];
      opt.zero_grad();
      at::Tensor loss;
      if (x.size(0) > 0) {
        loss = torch::nn::functional::cross_entropy(model->as<NetImpl>()->forward(x), y);
      }
      ddp.backward(ctx, loss, x.size(0), batch.global_size());
      opt.step();
    });
    for (int i = 1; i < ddp.num_local_replicas(); ++i) {
      ASSERT_TRUE(bit_identical(*ddp.module(0), *ddp.module(i)))
          << "step " << s << ": local replica " << i << " differs from replica 0";
    }
  }
}

inline std::vector<std::unique_ptr<torch::optim::SGD>> make_sgds(dt::DistributedDataParallel& ddp) {
  std::vector<std::unique_ptr<torch::optim::SGD>> opts;
  for (int i = 0; i < ddp.num_local_replicas(); ++i) opts.push_back(make_sgd(*ddp.module(i)));
  return opts;
}

inline void train_ddp(Strategy& strategy, dt::DistributedDataParallel& ddp, const Dataset& data,
                      int64_t global_batch, int steps) {
  auto opts = make_sgds(ddp);
  train_ddp_steps(strategy, ddp, opts, data, global_batch, 0, steps);
}

}  // namespace diststrat::testing
