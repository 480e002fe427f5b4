// DistributedDataParallel's .grad semantics in one process (MirroredStrategy
// x2): find_unused_parameters leaves a parameter that no replica used
// without a gradient (as torch DDP does), a .grad from before the
// accumulation window is kept; gradients accumulated outside ddp.backward
// (a plain loss.backward()) fail every replica instead of letting the
// replicas drift apart; a module changed after construction fails the step.
#include <chrono>
#include <mutex>

#include "torch_test_util.h"

namespace diststrat::testing {
namespace {

constexpr int kBranchFrom = 10;  // NetImpl's `extra` layer joins the forward pass here

std::unique_ptr<torch::optim::Optimizer> make_adam(torch::nn::Module& m) {
  return std::make_unique<torch::optim::Adam>(m.parameters(), torch::optim::AdamOptions(0.01));
}

at::Tensor grad_of(torch::nn::Module& m, const std::string& name) {
  return m.named_parameters()[name].grad();
}

// Single-process LibTorch with Adam: the `extra` branch unused before
// kBranchFrom (its .grad stays undefined, so Adam creates no state for it).
void train_reference_adam(NetImpl& net, const Dataset& data) {
  auto opt = make_adam(net);
  at::Tensor x = dt::to_torch(data.features()), y = dt::to_torch(data.labels());
  for (int s = 0; s < kSteps; ++s) {
    net.use_extra_ = s >= kBranchFrom;
    const int64_t begin = s * kGlobalBatch, end = std::min(data.size(), begin + kGlobalBatch);
    opt->zero_grad();
    torch::nn::functional::cross_entropy(net.forward(x.slice(0, begin, end)),
                                         y.slice(0, begin, end))
        .backward();
    opt->step();
  }
}

// The same under DDP; `check(step)` runs after each step's run().
void train_ddp_adam(Strategy& strategy, dt::DistributedDataParallel& ddp, const Dataset& data,
                    const std::function<void(int)>& check) {
  std::vector<std::unique_ptr<torch::optim::Optimizer>> opts;
  for (int i = 0; i < ddp.num_local_replicas(); ++i) opts.push_back(make_adam(*ddp.module(i)));
  DistributeOptions o;
  o.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, kGlobalBatch, o);
  for (int s = 0; s < kSteps; ++s) {
    for (int i = 0; i < ddp.num_local_replicas(); ++i)
      ddp.module(i)->as<NetImpl>()->use_extra_ = s >= kBranchFrom;
    DistributedBatch batch = dist.batch(s);
    strategy.run([&](ReplicaContext& ctx) {
      auto& model = ddp.module(ctx);
      at::Tensor x = dt::to_torch(batch.features(ctx)), y = dt::to_torch(batch.labels(ctx));
      auto& opt = *opts[ctx.local_replica_id()];
      opt.zero_grad();
      at::Tensor loss;
      if (x.size(0) > 0)
        loss = torch::nn::functional::cross_entropy(model->as<NetImpl>()->forward(x), y);
      ddp.backward(ctx, loss, x.size(0), batch.global_size());
      opt.step();
    });
    check(s);
    for (int i = 1; i < ddp.num_local_replicas(); ++i)
      ASSERT_TRUE(bit_identical(*ddp.module(0), *ddp.module(i))) << "step " << s;
  }
}

// ---- find_unused_parameters -------------------------------------------------

// The case: Adam over a branch that is unused for the first steps.
// A zero .grad there would make Adam create state and count steps for it,
// so its bias correction would be off once the branch is used.
TEST(TorchDdpUnused, AdamWithABranchUnusedAtFirstMatchesSingleProcess) {
  const Dataset data = equivalence_data();
  auto ref = make_net(7, /*extra=*/true, /*use_extra=*/false);
  train_reference_adam(*ref, data);
  ASSERT_GT(max_abs_diff(*ref, *make_net(7, true, false)), 1e-3) << "the reference did not train";
  MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
  DdpOptions o;
  o.find_unused_parameters = true;
  dt::DistributedDataParallel ddp(strategy, make_net(7, true, false), o);
  train_ddp_adam(strategy, ddp, data, [&](int s) {
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(grad_of(*ddp.module(i), "extra.weight").defined(), s >= kBranchFrom)
          << "step " << s << ", replica " << i;
    }
  });
  const double diff = max_abs_diff(*ref, *ddp.module(0));
  EXPECT_LE(diff, 1e-5);
}

// One synchronizing step on batch `b`: replica r's forward uses the branch
// when use(r); `prepare(r)` runs on the replica's thread before forward.
void one_step(Strategy& strategy, dt::DistributedDataParallel& ddp, DistributedDataset& dist,
              int64_t b, const std::function<bool(int)>& use,
              const std::function<void(int)>& prepare = {}) {
  DistributedBatch batch = dist.batch(b);
  strategy.run([&](ReplicaContext& ctx) {
    const int r = ctx.local_replica_id();
    auto net = ddp.module(ctx)->as<NetImpl>();
    net->use_extra_ = use(r);
    if (prepare) prepare(r);
    at::Tensor x = dt::to_torch(batch.features(ctx)), y = dt::to_torch(batch.labels(ctx));
    at::Tensor loss;
    if (x.size(0) > 0) loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    ddp.backward(ctx, loss, x.size(0), batch.global_size());
  });
}

TEST(TorchDdpUnused, GradIsUndefinedOnlyWhenNoReplicaUsedTheParameter) {
  const Dataset data = make_data(64);
  MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
  DdpOptions o;
  o.find_unused_parameters = true;
  dt::DistributedDataParallel ddp(strategy, make_net(7, true, false), o);
  DistributeOptions d;
  d.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, 8, d);
  auto grads = [&](int r) { return grad_of(*ddp.module(r), "extra.weight"); };
  auto none = [](int) { return false; };
  auto clear = [&](int r) {
    for (auto& p : ddp.module(r)->parameters()) p.mutable_grad() = at::Tensor();
  };

  // Unused by every replica: no gradient (torch DDP leaves .grad untouched).
  one_step(strategy, ddp, dist, 0, none);
  for (int r = 0; r < 2; ++r) EXPECT_FALSE(grads(r).defined()) << "replica " << r;
  EXPECT_TRUE(grad_of(*ddp.module(0), "fc1.weight").defined());

  // Used by replica 0 only: replica 1 counts as zero; defined and equal.
  one_step(
      strategy, ddp, dist, 1, [](int r) { return r == 0; }, clear);
  ASSERT_TRUE(grads(0).defined() && grads(1).defined());
  EXPECT_TRUE(torch::equal(grads(0), grads(1)));
  EXPECT_GT(grads(0).abs().sum().item<double>(), 0);

  // A .grad from before the window (not zeroed) and unused by every
  // replica: kept as it was, bit for bit.
  const at::Tensor before = grads(0).clone();
  one_step(strategy, ddp, dist, 2, none);
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(torch::equal(grads(r), before)) << "replica " << r;
  // zero_grad() (LibTorch 1.13 zeroes, it does not reset): stays zeros.
  one_step(strategy, ddp, dist, 3, none, [&](int r) {
    for (auto& p : ddp.module(r)->parameters()) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(grads(r).defined());
    EXPECT_EQ(grads(r).abs().sum().item<double>(), 0.0);
  }

  // A .grad from before the window and used: old + the window's global mean
  // (torch DDP averages identical old values to themselves), not n x old.
  one_step(
      strategy, ddp, dist, 4, [](int) { return true; }, clear);
  const at::Tensor fresh = grads(0).clone();
  const at::Tensor fresh_fc1 = grad_of(*ddp.module(0), "fc1.weight").clone();
  one_step(strategy, ddp, dist, 4, [](int) { return true; });  // no zero_grad
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(torch::allclose(grads(r), fresh + fresh, 1e-6, 1e-7)) << "replica " << r;
    EXPECT_TRUE(
        torch::allclose(grad_of(*ddp.module(r), "fc1.weight"), fresh_fc1 + fresh_fc1, 1e-6, 1e-7))
        << "replica " << r;
  }

  // no_sync: used on replica 0 in an earlier micro-batch of the window only
  // counts as used.
  strategy.run([&](ReplicaContext& ctx) {
    const int r = ctx.local_replica_id();
    clear(r);
    auto net = ddp.module(ctx)->as<NetImpl>();
    auto micro = [&](int64_t b) {
      DistributedBatch batch = dist.batch(b);
      at::Tensor x = dt::to_torch(batch.features(ctx)), y = dt::to_torch(batch.labels(ctx));
      ddp.backward(ctx, torch::nn::functional::cross_entropy(net->forward(x), y), x.size(0),
                   batch.global_size());
    };
    {
      auto guard = ddp.no_sync(ctx);
      net->use_extra_ = r == 0;
      micro(5);
    }
    net->use_extra_ = false;
    micro(6);
  });
  ASSERT_TRUE(grads(0).defined() && grads(1).defined());
  EXPECT_TRUE(torch::equal(grads(0), grads(1)));
  EXPECT_GT(grads(0).abs().sum().item<double>(), 0);

  // A replica without rows is neutral: the other did not use the branch, so
  // nobody did (single-process LibTorch gives no gradient either).
  const Dataset nine = make_data(9);
  DistributedDataset short_last = strategy.distribute(nine, 8, d);  // batch 1: 1 row
  std::vector<int64_t> rows(2, -1);
  one_step(strategy, ddp, short_last, 1, none, clear);
  strategy.run([&](ReplicaContext& ctx) {
    rows[ctx.local_replica_id()] = short_last.batch(1).features(ctx).shape()[0];
  });
  EXPECT_EQ(rows[0] + rows[1], 1);
  for (int r = 0; r < 2; ++r) EXPECT_FALSE(grads(r).defined()) << "replica " << r;
  EXPECT_TRUE(grad_of(*ddp.module(1), "fc1.weight").defined());
}

// ---- gradients accumulated outside ddp.backward -------------------------------

MirroredStrategy short_deadline_strategy() {
  MirroredOptions mo;
  mo.devices = {Device::cpu(0), Device::cpu(1)};
  mo.communication.timeout = std::chrono::seconds(5);
  return MirroredStrategy(mo);
}

// The case: every replica calls loss.backward() (not ddp.backward):
// nothing synchronizes, each replica steps on its own half of the batch.
// Every replica fails by the second step instead of drifting on silently.
TEST(TorchDdpOutside, PlainBackwardFailsEveryReplicaInsteadOfDrifting) {
  const Dataset data = make_data(64);
  MirroredStrategy strategy = short_deadline_strategy();
  dt::DistributedDataParallel ddp(strategy, make_net(7));
  auto opts = make_sgds(ddp);
  DistributeOptions d;
  d.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, 16, d);
  std::vector<std::string> errors(2);
  std::vector<int> failed_at(2, -1);
  const auto start = std::chrono::steady_clock::now();
  for (int s = 0; s < 3; ++s) {
    DistributedBatch batch = dist.batch(s);
    try {
      strategy.run([&](ReplicaContext& ctx) {
        const int r = ctx.local_replica_id();
        at::Tensor x = dt::to_torch(batch.features(ctx)), y = dt::to_torch(batch.labels(ctx));
        opts[r]->zero_grad();
        try {
          torch::nn::functional::cross_entropy(ddp.module(ctx)->as<NetImpl>()->forward(x), y)
              .backward();
        } catch (const std::exception& e) {
          if (failed_at[r] < 0) {
            failed_at[r] = s;
            errors[r] = e.what();
          }
          throw;
        }
        opts[r]->step();
      });
    } catch (const std::exception&) {
    }
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
  for (int r = 0; r < 2; ++r) {
    EXPECT_GE(failed_at[r], 0) << "replica " << r << " was never told (replicas equal: "
                               << bit_identical(*ddp.module(0), *ddp.module(1)) << ")";
    EXPECT_LE(failed_at[r], 1) << "replica " << r;
    EXPECT_NE(errors[r].find("outside ddp.backward"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("ddp.backward(ctx, loss, rows, global_rows)"), std::string::npos)
        << errors[r];
  }
}

// ddp.backward plus an extra loss.backward() on one replica only (e.g. an
// auxiliary loss): that replica's gradients hold something the others'
// do not. The next ddp.backward fails on every replica, naming it, within
// the deadline; the step after that works again.
TEST(TorchDdpOutside, ExtraBackwardOnOneReplicaFailsTheNextStepOnEveryReplica) {
  const Dataset data = make_data(64);
  MirroredStrategy strategy = short_deadline_strategy();
  dt::DistributedDataParallel ddp(strategy, make_net(7));
  auto opts = make_sgds(ddp);
  DistributeOptions d;
  d.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, 16, d);
  for (int s = 0; s < 3; ++s) {
    std::vector<std::string> errors(2);
    DistributedBatch batch = dist.batch(s);
    const auto start = std::chrono::steady_clock::now();
    try {
      strategy.run([&](ReplicaContext& ctx) {
        const int r = ctx.local_replica_id();
        auto net = ddp.module(ctx)->as<NetImpl>();
        at::Tensor x = dt::to_torch(batch.features(ctx)), y = dt::to_torch(batch.labels(ctx));
        opts[r]->zero_grad();
        try {
          ddp.backward(ctx, torch::nn::functional::cross_entropy(net->forward(x), y), x.size(0),
                       batch.global_size());
        } catch (const Error& e) {
          errors[r] = e.what();
          throw;
        }
        if (s == 0 && r == 1) net->forward(x).pow(2).mean().backward();  // the stray pass
        opts[r]->step();
      });
    } catch (const Error&) {
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4)) << "step " << s;
    for (int r = 0; r < 2; ++r) {
      if (s == 1) {
        EXPECT_NE(errors[r].find("outside ddp.backward"), std::string::npos)
            << "replica " << r << ": " << errors[r];
        EXPECT_NE(errors[r].find("on replica 1"), std::string::npos) << errors[r];
        EXPECT_NE(errors[r].find("ddp.backward(ctx, loss, rows, global_rows)"), std::string::npos)
            << errors[r];
      } else {
        EXPECT_EQ(errors[r], "") << "step " << s << ", replica " << r;
      }
    }
  }
}

// What may run outside ddp.backward: torch::autograd::grad (it accumulates
// into no .grad) and forward passes without backward (evaluation).
TEST(TorchDdpOutside, AutogradGradAndEvaluationAreFine) {
  const Dataset data = make_data(64);
  MirroredStrategy strategy = short_deadline_strategy();
  dt::DistributedDataParallel ddp(strategy, make_net(7));
  auto opts = make_sgds(ddp);
  DistributeOptions d;
  d.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, 16, d);
  for (int s = 0; s < 3; ++s) {
    DistributedBatch batch = dist.batch(s);
    strategy.run([&](ReplicaContext& ctx) {
      const int r = ctx.local_replica_id();
      auto net = ddp.module(ctx)->as<NetImpl>();
      at::Tensor x = dt::to_torch(batch.features(ctx)), y = dt::to_torch(batch.labels(ctx));
      opts[r]->zero_grad();
      // A gradient norm over the parameters, by autograd::grad.
      auto params = net->parameters();
      auto g = torch::autograd::grad({net->forward(x).pow(2).mean()}, params);
      EXPECT_EQ(g.size(), params.size());
      {
        torch::NoGradGuard no_grad;
        net->forward(x);  // evaluation
      }
      net->forward(x);  // a forward whose graph is dropped
      ddp.backward(ctx, torch::nn::functional::cross_entropy(net->forward(x), y), x.size(0),
                   batch.global_size());
      opts[r]->step();
    });
    ASSERT_TRUE(bit_identical(*ddp.module(0), *ddp.module(1))) << "step " << s;
  }
}

// ---- a module changed after construction --------------------------------------

// A replaced layer's parameters have no hooks: their gradients would never
// be synchronized (silently, under find_unused_parameters). Every replica
// fails the step naming the parameter instead.
TEST(TorchDdpModuleChanged, ReplacedLayerFailsTheStepOnEveryReplica) {
  const Dataset data = make_data(64);
  MirroredStrategy strategy = short_deadline_strategy();
  DdpOptions o;
  o.find_unused_parameters = true;
  dt::DistributedDataParallel ddp(strategy, make_net(7), o);
  auto opts = make_sgds(ddp);
  DistributeOptions d;
  d.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, 16, d);
  for (int r = 0; r < 2; ++r) {
    auto net = ddp.module(r)->as<NetImpl>();
    torch::manual_seed(100 + r);
    net->fc1 = net->replace_module("fc1", torch::nn::Linear(8, 16));
  }
  std::vector<std::string> errors(2);
  DistributedBatch batch = dist.batch(0);
  try {
    strategy.run([&](ReplicaContext& ctx) {
      const int r = ctx.local_replica_id();
      auto net = ddp.module(ctx)->as<NetImpl>();
      at::Tensor x = dt::to_torch(batch.features(ctx)), y = dt::to_torch(batch.labels(ctx));
      try {
        ddp.backward(ctx, torch::nn::functional::cross_entropy(net->forward(x), y), x.size(0),
                     batch.global_size());
      } catch (const Error& e) {
        errors[r] = e.what();
        throw;
      }
      opts[r]->step();
    });
  } catch (const Error&) {
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("'fc1.weight'"), std::string::npos)
        << "replica " << r << ": " << errors[r]
        << " (replicas equal: " << bit_identical(*ddp.module(0), *ddp.module(1)) << ")";
    EXPECT_NE(errors[r].find("changed after"), std::string::npos) << errors[r];
  }
}

// Module::clone() makes every parameter trainable again; the replicas keep
// the original's frozen ones frozen, and training equals single-process.
TEST(TorchDdpModuleChanged, FrozenParameterStaysFrozenInEveryReplica) {
  const Dataset data = equivalence_data();
  auto ref = make_net(7);
  ref->fc1->weight.set_requires_grad(false);
  train_reference(*ref, data, kGlobalBatch, kSteps);
  MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
  auto net = make_net(7);
  net->fc1->weight.set_requires_grad(false);
  dt::DistributedDataParallel ddp(strategy, net);
  EXPECT_FALSE(ddp.module(1)->as<NetImpl>()->fc1->weight.requires_grad());
  train_ddp(strategy, ddp, data, kGlobalBatch, kSteps);
  EXPECT_LE(max_abs_diff(*ref, *ddp.module(0)), 1e-5);
  EXPECT_TRUE(torch::equal(ddp.module(1)->as<NetImpl>()->fc1->weight, make_net(7)->fc1->weight));
}

// A parameter frozen at construction (requires_grad false: no hook) and
// unfrozen later would train on each replica's own gradient.
TEST(TorchDdpModuleChanged, ParameterUnfrozenAfterConstructionFailsTheStep) {
  const Dataset data = make_data(64);
  MirroredStrategy strategy = short_deadline_strategy();
  auto net = make_net(7);
  net->fc1->bias.set_requires_grad(false);
  dt::DistributedDataParallel ddp(strategy, net);
  auto opts = make_sgds(ddp);
  for (int r = 0; r < 2; ++r) ddp.module(r)->as<NetImpl>()->fc1->bias.set_requires_grad(true);
  DistributeOptions d;
  d.shuffle = false;
  DistributedDataset dist = strategy.distribute(data, 16, d);
  std::vector<std::string> errors(2);
  DistributedBatch batch = dist.batch(0);
  try {
    strategy.run([&](ReplicaContext& ctx) {
      const int r = ctx.local_replica_id();
      auto net = ddp.module(ctx)->as<NetImpl>();
      at::Tensor x = dt::to_torch(batch.features(ctx)), y = dt::to_torch(batch.labels(ctx));
      try {
        ddp.backward(ctx, torch::nn::functional::cross_entropy(net->forward(x), y), x.size(0),
                     batch.global_size());
      } catch (const Error& e) {
        errors[r] = e.what();
        throw;
      }
      opts[r]->step();
    });
  } catch (const Error&) {
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("'fc1.bias' requires grad now"), std::string::npos)
        << "replica " << r << ": " << errors[r];
  }
}

}  // namespace
}  // namespace diststrat::testing
