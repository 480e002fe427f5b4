// Workers must configure the optimizer alike (issue 23, item 6): a learning
// rate, schedule, momentum, clipping, loss scaling or accumulation setting
// that differs on one worker is an InvalidArgumentError on every
// worker at the first apply_gradients (and at the first after a change),
// naming the field and the replicas on each side -- never a silent run.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "diststrat/diststrat.h"
#include "training_util.h"

namespace ds = diststrat;
using diststrat::testing::run_multi_worker;

namespace {

ds::CommunicationOptions comm() {
  ds::CommunicationOptions c;
  c.timeout = std::chrono::seconds(20);
  return c;
}

// One apply_gradients of a 4-element variable on every worker; `setup`
// configures worker w's optimizer (made by `make`). Returns each worker's
// error text ("" = none).
std::vector<std::string> one_step(
    int workers, const std::function<std::unique_ptr<ds::Optimizer>(ds::Strategy&, int)>& make,
    const std::function<void(ds::Optimizer&, int)>& setup = nullptr, int steps = 1,
    std::vector<bool> zero = {}) {
  if (zero.empty()) zero.assign(static_cast<size_t>(workers), false);
  std::vector<std::string> errors(static_cast<size_t>(workers));
  const auto eps =
      run_multi_worker(zero, 1, comm(), [&](ds::MultiWorkerMirroredStrategy& s, int w) {
        ds::Variable v =
            s.create_variable("w", ds::Shape{4}, ds::DType::kFloat32, ds::init::Constant{1.0f});
        std::unique_ptr<ds::Optimizer> opt = make(s, w);
        if (setup) setup(*opt, w);
        for (int step = 0; step < steps; ++step) {
          s.run([&](ds::ReplicaContext& ctx) {
            ds::Tensor g(ds::Shape{4}, ds::DType::kFloat32);
            for (int i = 0; i < 4; ++i) g.data<float>()[i] = 0.5f;
            opt->apply_gradients(ctx, {{g, v}});
          });
        }
      });
  for (size_t w = 0; w < eps.size(); ++w) {
    if (!eps[w]) continue;
    try {
      std::rethrow_exception(eps[w]);
    } catch (const ds::Error& e) {
      errors[w] = e.message();
    }
  }
  return errors;
}

std::unique_ptr<ds::Optimizer> make_sgd(ds::Strategy& s, float lr, float momentum = 0.9f) {
  ds::SGDOptions o;
  o.learning_rate = lr;
  o.momentum = momentum;
  return std::make_unique<ds::SGD>(s, o);
}

void expect_every_worker_names(const std::vector<std::string>& errors, const std::string& field) {
  for (size_t w = 0; w < errors.size(); ++w) {
    EXPECT_NE(errors[w].find("configuration differs across workers"), std::string::npos)
        << "worker " << w << ": " << errors[w];
    EXPECT_NE(errors[w].find(field), std::string::npos) << "worker " << w << ": " << errors[w];
  }
}

TEST(OptimizerAgreement, ADifferentLearningRateOnOneWorkerIsAnErrorOnEveryWorker) {
  const auto errors =
      one_step(3, [](ds::Strategy& s, int w) { return make_sgd(s, w == 2 ? 0.1f : 0.05f); });
  expect_every_worker_names(errors, "'learning_rate'");
  EXPECT_NE(errors[0].find("replica(s) 2 differs from replica(s) 0, 1"), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[2].find("learning_rate: 0.100000001"), std::string::npos) << errors[2];
  EXPECT_NE(errors[0].find("learning_rate: 0.0500000007"), std::string::npos) << errors[0];
}

TEST(OptimizerAgreement, EveryFieldIsCompared) {
  expect_every_worker_names(
      one_step(2, [](ds::Strategy& s, int w) { return make_sgd(s, 0.05f, w ? 0.8f : 0.9f); }),
      "'momentum'");
  expect_every_worker_names(one_step(2,
                                     [](ds::Strategy& s, int w) -> std::unique_ptr<ds::Optimizer> {
                                       if (w == 0) return make_sgd(s, 0.05f);
                                       return std::make_unique<ds::Adam>(s, ds::AdamOptions{});
                                     }),
                            "'optimizer'");
  expect_every_worker_names(one_step(2,
                                     [](ds::Strategy& s, int w) {
                                       ds::SGDOptions o;
                                       o.schedule =
                                           ds::LearningRateSchedule::cosine_decay(100, w ? 10 : 0);
                                       return std::make_unique<ds::SGD>(s, o);
                                     }),
                            "'schedule'");
  expect_every_worker_names(one_step(2,
                                     [](ds::Strategy& s, int w) {
                                       ds::AdamOptions o;
                                       o.beta2 = w ? 0.99f : 0.999f;
                                       return std::make_unique<ds::Adam>(s, o);
                                     }),
                            "'beta2'");
  const auto by_sgd = [](ds::Strategy& s, int) { return make_sgd(s, 0.05f); };
  expect_every_worker_names(one_step(2, by_sgd,
                                     [](ds::Optimizer& o, int w) {
                                       o.set_clipping({w ? 1.0f : 2.0f, 0, 0});
                                     }),
                            "'clipping'");
  expect_every_worker_names(
      one_step(2, by_sgd, [](ds::Optimizer& o, int w) { o.set_accumulation_steps(w ? 2 : 1); }),
      "'accumulation_steps'");
  // (Loss scaling on one worker only is already a mismatched collective:
  // enabling it creates variables, collectively.)
  expect_every_worker_names(one_step(2, by_sgd,
                                     [](ds::Optimizer& o, int w) {
                                       ds::LossScaleOptions l;
                                       l.growth_interval = w ? 1000 : 2000;
                                       o.enable_loss_scaling(l);
                                     }),
                            "'loss_scaling'");
  // (ZeRO-1 on one worker only: ZeroMisuse.ShardingOnOneWorkerOnlyIsAnErrorOnEveryWorker.)
}

TEST(OptimizerAgreement, TheSameConfigurationTrainsAndIsComparedOnlyOnce) {
  const auto errors = one_step(
      3, [](ds::Strategy& s, int) { return make_sgd(s, 0.05f); },
      [](ds::Optimizer& o, int) {
        o.set_clipping({1.0f, 0, 0});
      },
      5);
  for (const std::string& e : errors) EXPECT_EQ(e, "");
}

TEST(OptimizerAgreement, AChangeAfterTheFirstStepIsComparedAgain) {
  std::vector<std::string> errors(2);
  const auto eps =
      run_multi_worker({false, false}, 1, comm(), [&](ds::MultiWorkerMirroredStrategy& s, int w) {
        ds::Variable v =
            s.create_variable("w", ds::Shape{4}, ds::DType::kFloat32, ds::init::Constant{1.0f});
        ds::SGD opt(s, {0.05f});
        auto step = [&] {
          s.run([&](ds::ReplicaContext& ctx) {
            ds::Tensor g(ds::Shape{4}, ds::DType::kFloat32);
            opt.apply_gradients(ctx, {{g, v}});
          });
        };
        step();
        step();
        opt.set_clipping({w ? 3.0f : 4.0f, 0, 0});  // every worker changes it, differently
        step();
      });
  for (size_t w = 0; w < 2; ++w) {
    ASSERT_TRUE(eps[w]) << "worker " << w << " trained on with different clipping";
    try {
      std::rethrow_exception(eps[w]);
    } catch (const ds::Error& e) {
      EXPECT_NE(e.message().find("'clipping'"), std::string::npos) << e.message();
    }
  }
}

TEST(OptimizerAgreement, NonFiniteHyperParametersAreRejectedAtConstruction) {
  ds::MirroredStrategy s({ds::Device::cpu(0)});
  EXPECT_THROW(ds::SGD(s, {std::numeric_limits<float>::infinity()}), ds::InvalidArgumentError);
  EXPECT_THROW(ds::SGD(s, {std::numeric_limits<float>::quiet_NaN()}), ds::InvalidArgumentError);
  ds::AdamOptions a;
  a.learning_rate = std::numeric_limits<float>::infinity();
  EXPECT_THROW(ds::Adam(s, a), ds::InvalidArgumentError);
  a = {};
  a.beta1 = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(ds::Adam(s, a), ds::InvalidArgumentError);
  a = {};
  a.beta2 = 1.0f;
  EXPECT_THROW(ds::Adam(s, a), ds::InvalidArgumentError);
  a = {};
  a.epsilon = 0.0f;
  EXPECT_THROW(ds::Adam(s, a), ds::InvalidArgumentError);
}

}  // namespace
