// LibTorch DistributedDataParallel under elastic training (diststrat/elastic.h,
// TrainingState::track): workers as threads of this process over the Gloo
// TCP transport on 127.0.0.1 and a directory store. Worker c dies inside a
// step; a and b redo it without c; worker d joins and receives the module and
// the optimizer's momentum from a member. Every worker ends with the weights
// of the same training run sequentially over the same global batches, and
// every row is used exactly once per epoch (counted in a diststrat variable
// committed with the module).
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "../common/elastic_model.h"
#include "../common/elastic_scenario.h"
#include "../common/temp_dir.h"
#include "diststrat/config.h"
#include "diststrat/diststrat.h"
#include "diststrat/torch.h"

namespace ds = diststrat;
namespace dt = diststrat::libtorch;
namespace em = diststrat_test::elastic_model;
namespace es = diststrat_test::elastic_scenario;

namespace {

constexpr int kRows = 96, kBatch = 16, kEpochs = 2;

// `lr`, `momentum`: the torch SGD's.
es::Outcome train_worker(const std::string& id, const es::Cues& cues, double lr = em::kLr,
                         double momentum = em::kMomentum) {
  const ds::MultiWorkerOptions o = es::worker_options(cues.dir, id, 2);
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
                        torch::optim::SGDOptions(lr).momentum(momentum));
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
  state.on_membership_change([&](const ds::MembershipChange&) { cues.changed(); });
  state.run([&](ds::ElasticState& st) {
    ds::DataPosition& pos = st.position;
    for (; pos.epoch < kEpochs; ++pos.epoch, pos.batch = 0) {
      dist.set_epoch(pos.epoch);
      for (; pos.batch < dist.num_batches(); ++pos.batch, ++pos.step) {
        cues.hold_if(pos.step);
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
          cues.die_if(pos.step);
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
  es::Outcome out;
  const at::Tensor w = net->weight.detach().contiguous();
  out.weights.assign(w.data_ptr<float>(), w.data_ptr<float>() + em::kFeatures);
  const ds::Tensor cv = counts.value();
  out.counts.assign(cv.data<float>(), cv.data<float>() + kRows);
  out.redone = state.steps_redone();
  out.final_workers = s.cluster().num_workers;
  return out;
}

TEST(TorchElastic, DdpSurvivesADeathAndAJoinerGetsTheModuleAndOptimizerState) {
  if (!DISTSTRAT_HAVE_GLOO) GTEST_SKIP() << "this build has no Gloo (DISTSTRAT_WITH_GLOO)";
  diststrat_test::TempDir dir("torch_elastic");
  std::vector<es::Outcome> survivors;
  es::Outcome od;
  es::kill_then_join<es::Outcome>(
      dir.path(),
      [](const std::string& id, const es::Cues& cues) { return train_worker(id, cues); },
      &survivors, &od);
  if (::testing::Test::HasFatalFailure()) return;
  const std::vector<float> ref = em::reference(kRows, kBatch, kEpochs);
  for (const es::Outcome& o : survivors) {
    es::expect_trained(o, ref, kRows, kEpochs, 3);
    EXPECT_EQ(o.redone, 1);
  }
  es::expect_trained(od, ref, kRows, kEpochs, 3);
}

// A joiner whose torch optimizer has another learning rate (or momentum)
// would train its replica otherwise than the group's (nothing compared a
// LibTorch optimizer's options before). TrainingState::track hands them to
// the ElasticState: the joiner is refused before it is admitted, naming the
// option, and the group trains on exactly.
TEST(TorchElastic, AJoinerWithOtherOptimizerOptionsLeavesBeforeItIsAdmitted) {
  if (!DISTSTRAT_HAVE_GLOO) GTEST_SKIP() << "this build has no Gloo (DISTSTRAT_WITH_GLOO)";
  const std::vector<float> ref = em::reference(kRows, kBatch, kEpochs);
  for (const bool lr : {true, false}) {
    diststrat_test::TempDir dir(lr ? "torch_elastic_lr" : "torch_elastic_momentum");
    std::vector<es::Outcome> group;
    const std::string error = es::refused_joiner<es::Outcome>(
        dir.path(),
        [](const std::string& id, const es::Cues& cues) { return train_worker(id, cues); },
        [&](const std::string& id, const es::Cues& cues) {
          train_worker(id, cues, lr ? 0.5 : em::kLr, lr ? em::kMomentum : 0.5);
        },
        &group);
    EXPECT_NE(error.find("is configured otherwise"), std::string::npos) << error;
    EXPECT_NE(error.find(lr ? "'torch optimizer.param_groups[0].lr' is 0.5 here"
                            : "'torch optimizer.param_groups[0].momentum' is 0.5 here"),
              std::string::npos)
        << error;
    for (const es::Outcome& o : group) {
      es::expect_trained(o, ref, kRows, kEpochs, 2);
      EXPECT_EQ(o.redone, 0);
    }
  }
}

// Without TrainingState::track the module would be neither committed nor
// sent to joiners (and nothing broadcasts it under an elastic strategy): the
// first backward refuses, instead of training diverging replicas (an outside
// trial saw different weights on every worker).
TEST(TorchElastic, DdpNotTrackedByTheElasticStateIsRefused) {
  if (!DISTSTRAT_HAVE_GLOO) GTEST_SKIP() << "this build has no Gloo (DISTSTRAT_WITH_GLOO)";
  diststrat_test::TempDir dir("torch_elastic_untracked");
  ds::MultiWorkerOptions o = es::worker_options(dir.path(), "solo", 1);
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
