// Issue 23, items 7-10: what the parameter server no longer takes on a
// worker's word.
//  7. each worker's requests are served at most once, in order: a replayed or
//     stale sequence number, an earlier worker incarnation, or a request meant
//     for an earlier PS incarnation is rejected naming the worker;
//  8. the update rule is fixed per variable by the chief's declaration (never
//     carried by a push; a different optimizer on another worker is an error
//     naming the field), changed only by the chief's update_hyperparameters;
//     a non-finite gradient never reaches a variable;
//  9. a save names a stem; the PS writes only into its own checkpoint
//     directory, under a name it derives;
// 10. a broadcast's size is checked before anything is allocated, and the
//     sender of a bad one is blamed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "diststrat/diststrat.h"
#include "parameter_server/strategy_impl.h"
#include "ps_wire_util.h"

using namespace ps_test;
namespace fs = std::filesystem;

namespace {

std::vector<float> value_of(ps::Service& s, const std::string& name) {
  for (const ds::ShardSnapshot& snap : s.snapshot()) {
    if (snap.variable != name) continue;
    const float* p = snap.value.data<float>();
    return std::vector<float>(p, p + snap.value.num_elements());
  }
  return {};
}

class PsTrust : public PsWire {
 protected:
  // A push of `g` to "w" with sequence number `seq`.
  RawPeer::Reply push_w(int64_t seq, std::initializer_list<float> g,
                        ps::RequestHeader* h_out = nullptr) {
    const std::vector<char> payload = floats(g);
    ps::RequestHeader h = header(ps::Op::kPush, seq, 16);
    if (h_out) *h_out = h;
    return peer_.call(h, push_body({entry(0, "w", ds::Shape{4})}), &payload);
  }
};

// ---- 7: at most once, in order ------------------------------------------------

TEST_F(PsTrust, ReplayedPushIsRejectedAndAppliedOnce) {
  start();
  create_variables();
  const int64_t seq = seq_++;
  auto r = push_w(seq, {2, 2, 2, 2});
  ASSERT_EQ(r.header.status, -1) << r.error;
  r = push_w(seq, {2, 2, 2, 2});  // the same message again
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "a replay");
  EXPECT_EQ(value_of(*service_, "w"), (std::vector<float>{0, 1, 2, 3}))
      << "applied once: w - 0.5 * 2";
  EXPECT_EQ(service_->stats().version, 1);
  EXPECT_EQ(service_->stats().pushes_rejected, 1);
}

TEST_F(PsTrust, StalePushAnEarlierWorkerIncarnationAndAnotherPsIncarnationAreRejected) {
  start();
  create_variables();
  seq_ += 10;
  auto r = push_w(seq_++, {2, 2, 2, 2});
  ASSERT_EQ(r.header.status, -1) << r.error;
  // An old sequence number of this incarnation.
  r = push_w(seq_ - 5, {2, 2, 2, 2});
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "stale");
  // A restarted worker (a larger incarnation) starts at 1 again...
  {
    ps::RequestHeader h = header(ps::Op::kPull, 1, 0, 16);
    h.incarnation = kIncarnation + 1;
    r = peer_.call(h, pull_body({entry(0, "w")}));
    ASSERT_EQ(r.header.status, -1) << r.error;
  }
  // ...and what its predecessor sent is stale, whatever its number.
  r = push_w(seq_++, {2, 2, 2, 2});
  expect_rejected(r, ds::ErrorCode::kFailedPrecondition, "earlier one");
  // A push addressed to another incarnation of this PS (sent before it
  // restarted), and one that carries none.
  {
    ps::RequestHeader h = header(ps::Op::kPush, 2, 16);
    h.incarnation = kIncarnation + 1;
    h.ps_incarnation = service_->incarnation() + 1;
    const std::vector<char> g = floats({2, 2, 2, 2});
    r = peer_.call(h, push_body({entry(0, "w", ds::Shape{4})}), &g);
    expect_rejected(r, ds::ErrorCode::kFailedPrecondition, "it restarted");
    peer_.stamp_ps_incarnation = false;
    h.seq = 3;
    h.ps_incarnation = 0;
    r = peer_.call(h, push_body({entry(0, "w", ds::Shape{4})}), &g);
    expect_rejected(r, ds::ErrorCode::kFailedPrecondition, "does not carry this PS's incarnation");
  }
  EXPECT_EQ(value_of(*service_, "w"), (std::vector<float>{0, 1, 2, 3}));
  EXPECT_EQ(service_->stats().version, 1);
}

// ---- 8: the rule is the PS's; non-finite gradients never land ---------------

TEST_F(PsTrust, NonFiniteGradientIsRejectedAndNeverReachesTheVariable) {
  start();
  create_variables();
  auto r = push_w(seq_++, {1, NAN, 1, 1});
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "not finite");
  r = push_w(seq_++, {1, 1, INFINITY, 1});
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "not finite");
  EXPECT_EQ(value_of(*service_, "w"), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(service_->stats().version, 0);
}

TEST_F(PsTrust, NonFiniteGradientIsSkippedAndCountedByOption) {
  ps::ServiceOptions o;
  o.skip_nonfinite_gradients = true;
  start(o);
  create_variables();
  auto r = push_w(seq_++, {1, NAN, 1, 1});
  ASSERT_EQ(r.header.status, -1) << r.error;
  EXPECT_EQ(value_of(*service_, "w"), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(service_->stats().pushes_nonfinite, 1);
  EXPECT_EQ(service_->stats().version, 0);
  EXPECT_NE(log().find("skipped"), std::string::npos) << log();
}

TEST_F(PsTrust, TheChiefsRuleIsCheckedAndOnlyTheChiefReplacesIt) {
  start();
  create_variables();  // the chief (worker 0) declared SGD 0.5
  // A rule with a NaN or absurd learning rate is never fixed or applied.
  ps::RequestHeader h = header(ps::Op::kRule, seq_++);
  auto r = peer_.call(h, rule_body(sgd(NAN), {entry(0, "w")}, true));
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "learning_rate is nan");
  r = peer_.call(header(ps::Op::kRule, seq_++), rule_body(sgd(1e30), {entry(0, "w")}, true));
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "learning_rate 1e+30");
  // Declaring another rule does not change the fixed one: it is an error naming the field.
  r = peer_.call(header(ps::Op::kRule, seq_++), rule_body(sgd(0.25), {entry(0, "w")}));
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "learning_rate 0.25, fixed 0.5");
  r = push_w(seq_++, {2, 2, 2, 2});
  ASSERT_EQ(r.header.status, -1) << r.error;
  EXPECT_EQ(value_of(*service_, "w"), (std::vector<float>{0, 1, 2, 3}));
  // The chief's explicit update: acknowledged, applied from the next push.
  r = peer_.call(header(ps::Op::kRule, seq_++), rule_body(sgd(0.25), {entry(0, "w")}, true));
  ASSERT_EQ(r.header.status, -1) << r.error;
  r = push_w(seq_++, {4, 4, 4, 4});
  ASSERT_EQ(r.header.status, -1) << r.error;
  EXPECT_EQ(value_of(*service_, "w"), (std::vector<float>{-1, 0, 1, 2}));
  // It cannot change the optimizer (its slots).
  r = peer_.call(header(ps::Op::kRule, seq_++),
                 rule_body({"adam", {0.1, 0.9, 0.999, 1e-7}}, {entry(0, "w")}, true));
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "not the optimizer");
}

// Two workers and a PS, as raw peers.
class PsTrustTwoWorkers : public ::testing::Test {
 protected:
  void SetUp() override {
    ps::ServiceOptions o;
    o.worker_ranks = {0, 1};
    o.timeout = milliseconds(2000);
    service_ = std::make_unique<ps::Service>(group_.at(2), o, logger_);
    thread_ = std::thread([this] { service_->run(); });
  }
  void TearDown() override {
    service_->stop();
    thread_.join();
  }
  ps::RequestHeader hdr(int worker, ps::Op op, int64_t payload = 0, int64_t reply = 0) {
    ps::RequestHeader h = header(op, seq_[worker]++, payload, reply);
    h.worker = worker;
    return h;
  }
  ds::InProcessTransportGroup group_{3};
  RawPeer chief_{group_.at(0), 2}, other_{group_.at(1), 2};
  ds::Logger logger_{ds::LogLevel::kError};
  std::unique_ptr<ps::Service> service_;
  std::thread thread_;
  int64_t seq_[2] = {1, 1};
};

TEST_F(PsTrustTwoWorkers, AnotherWorkersRuleWaitsForTheChiefsAndMustMatchIt) {
  const std::vector<char> w = floats({1, 2, 3, 4});
  auto r = chief_.call(hdr(0, ps::Op::kCreate, 16), create_body(0, "w", ds::Shape{4}, true), &w);
  ASSERT_EQ(r.header.status, -1) << r.error;
  // Worker 1 may not define the value, nor replace the rule.
  r = other_.call(hdr(1, ps::Op::kCreate, 16), create_body(0, "w", ds::Shape{4}, true), &w);
  EXPECT_NE(r.error.find("only the chief"), std::string::npos) << r.error;
  r = other_.call(hdr(1, ps::Op::kRule), rule_body(sgd(0.5), {entry(0, "w")}, true));
  EXPECT_EQ(r.header.status, static_cast<int>(ds::ErrorCode::kFailedPrecondition)) << r.error;
  // Worker 1's declaration (--lr 0.2) waits for the chief's (--lr 0.1), then fails naming both.
  other_.send(hdr(1, ps::Op::kRule), rule_body(sgd(0.2), {entry(0, "w")}));
  std::this_thread::sleep_for(milliseconds(100));
  r = chief_.call(hdr(0, ps::Op::kRule), rule_body(sgd(0.1), {entry(0, "w")}));
  ASSERT_EQ(r.header.status, -1) << r.error;
  r = other_.reply(milliseconds(3000));
  EXPECT_EQ(r.header.status, static_cast<int>(ds::ErrorCode::kInvalidArgument));
  EXPECT_NE(r.error.find("worker 1"), std::string::npos) << r.error;
  EXPECT_NE(r.error.find("learning_rate 0.2, fixed 0.1"), std::string::npos) << r.error;
}

// The updater of a variable's rule is built once per config: when the chief
// fixes the rule and when it changes it, not for another worker's matching
// declaration, a replacement by the same config, or a push; a declaration
// that waits for the chief's is checked once, not at every retry.
TEST_F(PsTrustTwoWorkers, TheUpdaterIsBuiltOncePerConfigNotPerDeclarationOrPush) {
  const std::vector<char> w = floats({1, 2, 3, 4});
  auto r = chief_.call(hdr(0, ps::Op::kCreate, 16), create_body(0, "w", ds::Shape{4}, true), &w);
  ASSERT_EQ(r.header.status, -1) << r.error;
  EXPECT_EQ(service_->updaters_built(), 0);
  r = chief_.call(hdr(0, ps::Op::kRule), rule_body(sgd(0.5), {entry(0, "w")}));
  ASSERT_EQ(r.header.status, -1) << r.error;
  r = other_.call(hdr(1, ps::Op::kRule), rule_body(sgd(0.5), {entry(0, "w")}));
  ASSERT_EQ(r.header.status, -1) << r.error;
  EXPECT_EQ(service_->updaters_built(), 1);
  const std::vector<char> g = floats({1, 1, 1, 1});
  for (int i = 1; i <= 3; ++i) {
    r = chief_.call(hdr(0, ps::Op::kPush, 16), push_body({entry(0, "w", ds::Shape{4})}, i), &g);
    ASSERT_EQ(r.header.status, -1) << r.error;
    r = other_.call(hdr(1, ps::Op::kPush, 16), push_body({entry(0, "w", ds::Shape{4})}, i), &g);
    ASSERT_EQ(r.header.status, -1) << r.error;
  }
  EXPECT_EQ(value_of(*service_, "w"), (std::vector<float>{-2, -1, 0, 1}));  // 6 steps of 0.5
  // The chief's update_hyperparameters: the same config again, then a new one.
  r = chief_.call(hdr(0, ps::Op::kRule), rule_body(sgd(0.5), {entry(0, "w")}, true));
  ASSERT_EQ(r.header.status, -1) << r.error;
  EXPECT_EQ(service_->updaters_built(), 1);
  r = chief_.call(hdr(0, ps::Op::kRule), rule_body(sgd(0.25), {entry(0, "w")}, true));
  ASSERT_EQ(r.header.status, -1) << r.error;
  EXPECT_EQ(service_->updaters_built(), 2);
  r = chief_.call(hdr(0, ps::Op::kPush, 16), push_body({entry(0, "w", ds::Shape{4})}, 4), &g);
  ASSERT_EQ(r.header.status, -1) << r.error;
  EXPECT_EQ(value_of(*service_, "w"), (std::vector<float>{-2.25f, -1.25f, -0.25f, 0.75f}));
  EXPECT_EQ(service_->updaters_built(), 2);
  // Worker 1 declares a new variable before the chief does: its request
  // waits (retried by every round of the loop) and builds at most once.
  r = chief_.call(hdr(0, ps::Op::kCreate, 16), create_body(1, "v", ds::Shape{4}, true), &w);
  ASSERT_EQ(r.header.status, -1) << r.error;
  other_.send(hdr(1, ps::Op::kRule), rule_body(sgd(0.1), {entry(1, "v")}));
  std::this_thread::sleep_for(milliseconds(100));
  r = chief_.call(hdr(0, ps::Op::kRule), rule_body(sgd(0.1), {entry(1, "v")}));
  ASSERT_EQ(r.header.status, -1) << r.error;
  r = other_.reply(milliseconds(3000));
  ASSERT_EQ(r.header.status, -1) << r.error;
  EXPECT_LE(service_->updaters_built(), 4);
}

// ---- 23.11: a worker that fails tells the PS, which fails the others ---------

// Worker 1 waits in a barrier for worker 0; worker 0 fails (kAbort, as the
// strategy sends it while an exception unwinds). Worker 1's waiting barrier,
// and every later request of it, fails at once naming worker 0 and its
// reason; the PS's loop ends when both have left, and failure() names worker
// 0. (Before: worker 0 said done, the barrier waited out the deadline, and
// the PS blamed worker 1 for its silence.)
TEST_F(PsTrustTwoWorkers, AFailedWorkerAbortsTheOthersRequestsNamingItself) {
  ps::Writer b;
  b.put<int64_t>(1);
  other_.send(hdr(1, ps::Op::kBarrier), b.bytes());
  std::this_thread::sleep_for(milliseconds(100));
  ps::Writer why;
  why.put_string("rank 0 left during an exception: no training data\n(second line)");
  const auto t0 = ds::Clock::now();
  auto r = chief_.call(hdr(0, ps::Op::kAbort), why.bytes());
  ASSERT_EQ(r.header.status, -1) << r.error;
  r = other_.reply(milliseconds(1000));
  EXPECT_LT(ds::Clock::now() - t0, milliseconds(1000));  // not the 2 s deadline
  EXPECT_EQ(r.header.status, static_cast<int>(ds::ErrorCode::kAborted)) << r.error;
  EXPECT_NE(r.error.find(
                "barrier from worker 1: the job is ending: worker 0 (rank 0) failed: rank 0 left "
                "during an exception: no training data\\n(second line)"),
            std::string::npos)
      << r.error;
  r = other_.call(hdr(1, ps::Op::kPull, 0, 0), pull_body({}));
  EXPECT_EQ(r.header.status, static_cast<int>(ds::ErrorCode::kAborted)) << r.error;
  EXPECT_EQ(service_->failure(),
            "worker 0 (rank 0) failed: rank 0 left during an exception: no training "
            "data\\n(second line)");
  r = other_.call(hdr(1, ps::Op::kDone), {});
  EXPECT_EQ(r.header.status, -1) << r.error;
  thread_.join();  // the loop ends by itself: both workers left
  thread_ = std::thread([] {});
}

// ---- 9: the PS writes only into its own directory ----------------------------

std::vector<char> save_body(const std::string& stem, const std::string& dir = "") {
  ps::Writer w;
  w.put_string(stem).put<uint64_t>(0xabc).put_string(dir);
  return w.bytes();
}

TEST_F(PsTrust, SaveWritesOnlyIntoTheConfiguredDirectoryUnderADerivedName) {
  const fs::path root = fs::temp_directory_path() / ("ps_trust_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root / "ckpt");
  const fs::path victim = root / "victim.txt";
  std::ofstream(victim) << "unrelated";
  ps::ServiceOptions o;
  start(o);
  create_variables();
  // Without a directory of its own, the PS writes nothing.
  auto r = peer_.call(header(ps::Op::kSave, seq_++, 0, 8), save_body("model"));
  expect_rejected(r, ds::ErrorCode::kFailedPrecondition, "no checkpoint directory");
  service_->set_checkpoint_dir((root / "ckpt").string());
  // A directory other than its own is refused.
  r = peer_.call(header(ps::Op::kSave, seq_++, 0, 8), save_body("model", root.string()));
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "writes only into its own");
  // Paths are not names: each is rejected, and nothing outside is touched.
  for (const std::string bad : {victim.string(), std::string("../victim.txt"), std::string(".."),
                                std::string("a/b"), std::string(".hidden")}) {
    r = peer_.call(header(ps::Op::kSave, seq_++, 0, 8), save_body(bad));
    expect_rejected(r, ds::ErrorCode::kInvalidArgument, "is not a checkpoint name");
  }
  std::string text;
  std::getline(std::ifstream(victim), text);
  EXPECT_EQ(text, "unrelated");
  r = peer_.call(header(ps::Op::kSave, seq_++, 0, 8), save_body("model"));
  ASSERT_EQ(r.header.status, -1) << r.error;
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root / "ckpt"))
    names.push_back(e.path().filename().string());
  ASSERT_EQ(names.size(), 1u);
  EXPECT_EQ(names[0], "model.ps-0-of-1.0000000000000abc.safetensors");
  EXPECT_EQ(std::distance(fs::directory_iterator(root), fs::directory_iterator()), 2);
  fs::remove_all(root);
}

// ---- 10: broadcast sizes, before any allocation --------------------------------

std::vector<char> broadcast_body(int64_t count, bool root, int64_t bytes) {
  ps::Writer w;
  w.put<int64_t>(count).put<uint8_t>(root ? 1 : 0).put<int64_t>(bytes);
  return w.bytes();
}

TEST_F(PsTrust, BroadcastClaiming2GiBOr2To40IsRejectedAtOnceNamingTheRoot) {
  ps::ServiceOptions o;
  o.max_broadcast_bytes = 1 << 20;
  start(o);
  const auto t0 = ds::Clock::now();
  auto r = peer_.call(header(ps::Op::kBroadcast, seq_++, int64_t{2} << 30),
                      broadcast_body(1, true, int64_t{2} << 30));
  expect_rejected(r, ds::ErrorCode::kResourceExhausted,
                  "the root (worker 0) sends 2147483648 bytes");
  r = peer_.call(header(ps::Op::kBroadcast, seq_++, int64_t{1} << 40),
                 broadcast_body(1, true, int64_t{1} << 40));
  expect_rejected(r, ds::ErrorCode::kResourceExhausted, "1099511627776 bytes");
  // A receiver expecting more than a broadcast may carry.
  r = peer_.call(header(ps::Op::kBroadcast, seq_++, 0, int64_t{1} << 21),
                 broadcast_body(1, false, int64_t{1} << 21));
  expect_rejected(r, ds::ErrorCode::kResourceExhausted, "more than a broadcast may carry");
  EXPECT_LT(ds::Clock::now() - t0, milliseconds(900)) << "answered at once, not at the deadline";
  // A header whose payload disagrees with the declared size.
  r = peer_.call(header(ps::Op::kBroadcast, seq_++, int64_t{2} << 30), broadcast_body(1, true, 8));
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "declares 8");
  EXPECT_TRUE(service_->gone_workers().empty());
  // A good one still goes through (one worker: root and only receiver).
  const std::vector<char> eight(8, 'x');
  r = peer_.call(header(ps::Op::kBroadcast, seq_++, 8), broadcast_body(1, true, 8), &eight);
  ASSERT_EQ(r.header.status, -1) << r.error;
  // Counts go up by one per worker.
  r = peer_.call(header(ps::Op::kBroadcast, seq_++, 8), broadcast_body(1, true, 8), &eight);
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "they count up by one");
}

TEST_F(PsTrustTwoWorkers, BroadcastReceiverAndRootDisagreeingOnTheSizeAreNamed) {
  // Worker 1 waits for 16 bytes; the root announces 8: the root is blamed.
  other_.send(hdr(1, ps::Op::kBroadcast, 0, 16), broadcast_body(1, false, 16));
  std::this_thread::sleep_for(milliseconds(100));
  const std::vector<char> eight(8, 'x');
  auto r = chief_.call(hdr(0, ps::Op::kBroadcast, 8), broadcast_body(1, true, 8), &eight);
  EXPECT_EQ(r.header.status, static_cast<int>(ds::ErrorCode::kInvalidArgument));
  EXPECT_NE(r.error.find("worker 0 (the root) sends 8 bytes, worker 1 expects 16"),
            std::string::npos)
      << r.error;
}

// ---- through the strategy ----------------------------------------------------------

TEST(PsTrustStrategy, UpdateHyperparametersIsAppliedByThePsAndChiefOnly) {
  ds::ParameterServerStrategy strategy(ds::ParameterServerOptions{});
  ds::Variable w =
      strategy.create_variable("w", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::SGD sgd(strategy, {1.0f});
  auto step = [&] {
    strategy.run([&](ds::ReplicaContext& ctx) {
      ds::Tensor g(ds::Shape{2}, ds::DType::kFloat32);
      ds::init::Constant{1.0}(g);
      sgd.apply_gradients(ctx, {{g, w}});
    });
    strategy.flush();
  };
  step();
  EXPECT_EQ(w.value().data<float>()[0], -1.0f);
  ds::SGD lower(strategy, {0.25f});  // ReduceLROnPlateau's new rate
  strategy.update_hyperparameters(lower);
  step();  // with the old optimizer object: the PS applies its rule
  EXPECT_EQ(w.value().data<float>()[0], -1.25f);
}

TEST(PsTrustStrategy, NonFiniteGradientIsRejectedOrSkippedThroughTheStrategy) {
  for (bool skip : {false, true}) {
    SCOPED_TRACE(skip ? "skip" : "reject");
    ds::ParameterServerOptions o;
    o.skip_nonfinite_gradients = skip;
    ds::ParameterServerStrategy strategy(o);
    ds::Variable w =
        strategy.create_variable("w", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
    ds::SGD sgd(strategy, {1.0f});
    strategy.run([&](ds::ReplicaContext& ctx) {
      ds::Tensor g(ds::Shape{2}, ds::DType::kFloat32);
      g.data<float>()[0] = NAN;
      g.data<float>()[1] = 1;
      sgd.apply_gradients(ctx, {{g, w}});
    });
    if (skip) {
      strategy.flush();
      EXPECT_EQ(strategy.stats().pushes_nonfinite, 1);
    } else {
      try {
        strategy.flush();
        ADD_FAILURE() << "no error";
      } catch (const ds::InvalidArgumentError& e) {
        EXPECT_NE(e.message().find("not finite"), std::string::npos) << e.message();
      }
    }
    EXPECT_EQ(w.value().data<float>()[0], 0.0f);
    EXPECT_EQ(w.value().data<float>()[1], 0.0f);
  }
}

TEST(PsTrustStrategy, DifferentLearningRatesOnTwoWorkersAreAnErrorNamingTheFieldAndTheWorker) {
  ds::ParameterServerOptions o;
  o.communication.timeout = std::chrono::seconds(10);
  ds::InProcessTransportGroup group(3);
  auto ps = ds::ps::make_strategy(group.at(2), o);
  std::string error1;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto s = ds::ps::make_strategy(group.at(r), o);
      ds::Variable w =
          s->create_variable("w", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
      ds::SGD sgd(*s, {r == 0 ? 0.1f : 0.2f});  // --lr differs on rank 1
      try {
        s->run([&](ds::ReplicaContext& ctx) {
          ds::Tensor g(ds::Shape{2}, ds::DType::kFloat32);
          ds::init::Constant{1.0}(g);
          sgd.apply_gradients(ctx, {{g, w}});
        });
        s->flush();
      } catch (const ds::Error& e) {
        if (r == 1) error1 = e.message();
      }
    });
  }
  for (auto& t : threads) t.join();
  ps->join();
  EXPECT_NE(error1.find("worker 1"), std::string::npos) << error1;
  EXPECT_NE(error1.find("learning_rate 0.2"), std::string::npos) << error1;
}

}  // namespace
