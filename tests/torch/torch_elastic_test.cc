// LibTorch DistributedDataParallel under elastic training (diststrat/elastic.h,
// TrainingState::track): workers as threads of this process over the Gloo
// TCP transport on 127.0.0.1 and a directory store. Worker c dies inside a
// step; a and b redo it without c; worker d joins and receives the module and
// the optimizer's momentum from a member. Every worker ends with the weights
// of the same training run sequentially over the same global batches, and
// every row is used exactly once per epoch (counted in a diststrat variable
// committed with the module).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../common/elastic_model.h"
#include "../common/temp_dir.h"
#include "diststrat/config.h"
#include "diststrat/diststrat.h"
#include "diststrat/torch.h"
#include "runtime/membership_store.h"

namespace ds = diststrat;
namespace dt = diststrat::libtorch;
namespace em = diststrat_test::elastic_model;

namespace {

constexpr int kRows = 96, kBatch = 16, kEpochs = 2;

struct Death {};  // a worker's thread "dies" by this exception

struct Outcome {
  std::vector<float> weights, counts;
  int64_t redone = 0;
  int final_workers = 0;
};

struct Plan {
  std::string dir;
  int die_at_step = -1;
  std::atomic<int>* changes_seen = nullptr;
  // Before step hold_at_step, wait while *hold (a joiner finds the group training).
  int hold_at_step = -1;
  std::atomic<bool>* hold = nullptr;
  std::atomic<int>* at_hold = nullptr;
};

Outcome train_worker(const std::string& id, const Plan& plan) {
  ds::MultiWorkerOptions o;
  o.elastic.rendezvous = "file://" + plan.dir + "/job";
  o.elastic.worker_id = id;
  o.elastic.min_workers = 2;
  o.elastic.listen_host = "127.0.0.1";
  o.elastic.settle_timeout = std::chrono::milliseconds(300);
  o.elastic.join_poll = std::chrono::milliseconds(20);
  o.elastic.join_timeout = std::chrono::seconds(60);
  o.communication.timeout = std::chrono::seconds(30);
  ds::MultiWorkerMirroredStrategy s(o);
  // The model: w (kFeatures -> 1, no bias), zero like the reference's
  // (a joiner's own values are replaced by the group's).
  auto net = std::make_shared<torch::nn::LinearImpl>(
      torch::nn::LinearOptions(em::kFeatures, 1).bias(false));
  {
    torch::NoGradGuard no_grad;
    net->weight.zero_();
  }
  dt::DistributedDataParallel ddp(s, net);  // elastic: no collective call here
  torch::optim::SGD opt(ddp.module(0)->parameters(),
                        torch::optim::SGDOptions(em::kLr).momentum(em::kMomentum));
  dt::TrainingState training(ddp, {&opt});
  // The row counter: a diststrat variable and optimizer, committed alongside.
  ds::Variable counts =
      s.create_variable("row_uses", ds::Shape{kRows}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::SGD count_opt(s, {em::kLr, 0.0f});
  ds::DistributeOptions dopts;
  dopts.shuffle = false;
  ds::DistributedDataset dist = s.distribute(em::make_data(kRows), kBatch, dopts);
  ds::ElasticState state(s, {&count_opt});
  training.track(state);
  state.on_membership_change([&](const ds::MembershipChange&) {
    if (plan.changes_seen) ++*plan.changes_seen;
  });
  state.run([&](ds::ElasticState& st) {
    ds::DataPosition& pos = st.position;
    for (; pos.epoch < kEpochs; ++pos.epoch, pos.batch = 0) {
      dist.set_epoch(pos.epoch);
      for (; pos.batch < dist.num_batches(); ++pos.batch, ++pos.step) {
        if (pos.step == plan.hold_at_step && plan.hold && plan.hold->load()) {
          ++*plan.at_hold;
          while (plan.hold->load()) std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        const ds::DistributedBatch batch = dist.batch(pos.batch);
        s.run([&](ds::ReplicaContext& ctx) {
          const ds::Tensor features = batch.features(ctx);
          const int64_t rows = features.shape()[0];
          at::Tensor x = dt::to_torch(features);
          std::vector<float> targets(static_cast<size_t>(rows));
          for (int64_t i = 0; i < rows; ++i) {
            targets[static_cast<size_t>(i)] =
                em::target(features.data<float>() + i * em::kFeatures);
          }
          const at::Tensor y = torch::from_blob(targets.data(), {rows}).clone();
          // The row counter's gradient (the weights' from em::gradients is unused).
          ds::Tensor gw(ds::Shape{em::kFeatures}, ds::DType::kFloat32);
          ds::Tensor gc(ds::Shape{kRows}, ds::DType::kFloat32);
          em::gradients(features, batch.labels(ctx),
                        ds::Tensor(ds::Shape{em::kFeatures}, ds::DType::kFloat32),
                        batch.global_size(), kRows, &gw, &gc);
          if (pos.step == plan.die_at_step) throw Death{};
          opt.zero_grad();
          const at::Tensor pred = ddp.module(ctx)->as<torch::nn::Linear>()->forward(x).squeeze(1);
          const at::Tensor loss = 0.5 * (pred - y).pow(2).mean();
          ddp.backward(ctx, loss, rows, batch.global_size());
          opt.step();
          count_opt.apply_gradients(ctx, {{gc, counts}});
        });
      }
    }
  });
  Outcome out;
  const at::Tensor w = net->weight.detach().contiguous();
  out.weights.assign(w.data_ptr<float>(), w.data_ptr<float>() + em::kFeatures);
  const ds::Tensor cv = counts.value();
  out.counts.assign(cv.data<float>(), cv.data<float>() + kRows);
  out.redone = state.steps_redone();
  out.final_workers = s.cluster().num_workers;
  return out;
}

void expect_trained(const Outcome& o, int workers) {
  const std::vector<float> ref = em::reference(kRows, kBatch, kEpochs);
  for (int f = 0; f < em::kFeatures; ++f)
    EXPECT_NEAR(o.weights[f], ref[f], 1e-5) << "w[" << f << "]";
  for (int r = 0; r < kRows; ++r) {
    EXPECT_NEAR(o.counts[r], em::kLr * kEpochs, 1e-5)
        << "row " << r << " used " << o.counts[r] / em::kLr << " times";
  }
  EXPECT_EQ(o.final_workers, workers);
}

TEST(TorchElastic, DdpSurvivesADeathAndAJoinerGetsTheModuleAndOptimizerState) {
  if (!DISTSTRAT_HAVE_GLOO) GTEST_SKIP() << "this build has no Gloo (DISTSTRAT_WITH_GLOO)";
  diststrat_test::TempDir dir("torch_elastic");
  std::atomic<int> changes{0};
  std::atomic<bool> hold{true};
  std::atomic<int> at_hold{0};
  Plan plan;
  plan.dir = dir.path();
  plan.changes_seen = &changes;
  plan.hold_at_step = 8;  // epoch 1
  plan.hold = &hold;
  plan.at_hold = &at_hold;
  Plan dying = plan;
  dying.die_at_step = 4;  // mid-epoch 0
  auto a = std::async(std::launch::async, [&] { return train_worker("a", plan); });
  auto b = std::async(std::launch::async, [&] { return train_worker("b", plan); });
  auto c = std::async(std::launch::async, [&] {
    try {
      train_worker("c", dying);
    } catch (const Death&) {
      return true;
    }
    return false;
  });
  EXPECT_TRUE(c.get());
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (changes.load() < 2 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GE(changes.load(), 2) << "the survivors did not re-form";
  auto d = std::async(std::launch::async, [&] { return train_worker("d", plan); });
  // Hold the survivors before step 8 until d waits in the store (or was
  // admitted already and holds there too).
  std::unique_ptr<ds::MembershipStore> store =
      ds::open_membership_store("file://" + dir.path() + "/job");
  while (
      at_hold.load() < 3 &&
      (at_hold.load() < 2 ||
       !store->read(std::chrono::steady_clock::now() + std::chrono::seconds(5)).is_waiting("d")) &&
      std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  hold = false;
  const Outcome oa = a.get(), ob = b.get(), od = d.get();
  for (const Outcome* o : {&oa, &ob}) {
    expect_trained(*o, 3);
    EXPECT_EQ(o->redone, 1);
  }
  expect_trained(od, 3);
}

// Without TrainingState::track the module would be neither committed nor
// sent to joiners (and nothing broadcasts it under an elastic strategy): the
// first backward refuses, instead of training diverging replicas (an outside
// trial saw different weights on every worker).
TEST(TorchElastic, DdpNotTrackedByTheElasticStateIsRefused) {
  if (!DISTSTRAT_HAVE_GLOO) GTEST_SKIP() << "this build has no Gloo (DISTSTRAT_WITH_GLOO)";
  diststrat_test::TempDir dir("torch_elastic_untracked");
  ds::MultiWorkerOptions o;
  o.elastic.rendezvous = "file://" + dir.path() + "/job";
  o.elastic.worker_id = "solo";
  o.elastic.min_workers = 1;
  o.elastic.listen_host = "127.0.0.1";
  o.elastic.settle_timeout = std::chrono::milliseconds(100);
  ds::MultiWorkerMirroredStrategy s(o);
  auto net = std::make_shared<torch::nn::LinearImpl>(
      torch::nn::LinearOptions(em::kFeatures, 1).bias(false));
  dt::DistributedDataParallel ddp(s, net);
  ds::ElasticState state(s);
  try {
    state.run([&](ds::ElasticState&) {
      s.run([&](ds::ReplicaContext& ctx) {
        const at::Tensor x = torch::ones({2, em::kFeatures});
        const at::Tensor loss = ddp.module(ctx)->as<torch::nn::Linear>()->forward(x).sum();
        ddp.backward(ctx, loss, 2, 2);
      });
    });
    ADD_FAILURE() << "an untracked DDP model trained under an elastic strategy";
  } catch (const ds::FailedPreconditionError& e) {
    EXPECT_NE(std::string(e.what()).find("TrainingState::track"), std::string::npos) << e.what();
  }
}

}  // namespace
