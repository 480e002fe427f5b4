// Issue 46, item 4: checkpoints with TensorFlow's controls. A Checkpoint of
// named objects (tf.train.Checkpoint(model=..., optimizer=...)), restore of a
// subset with unmatched names reported (expect_partial), CheckpointManager's
// checkpoint_interval, keep_checkpoint_every_n_hours, checkpoints() and
// restore_or_initialize(), and PreemptionHandler::run(step_fn), which saves
// and exits on SIGTERM (PreemptionCheckpointHandler.run): a child SIGTERMed
// mid-step saves and exits with the documented status, and the resumed run
// ends bit-identical to an uninterrupted one.
#include <gtest/gtest.h>

#include <cmath>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "../common/compare.h"
#include "../common/temp_dir.h"
#include "checkpoint_util.h"
#include "child_util.h"
#include "diststrat/diststrat.h"

namespace ds = diststrat;

namespace {

using diststrat_test::contains;
using diststrat_test::TempDir;
using ds::testing::ckpt_path;
using ds::testing::expect_error;
constexpr char kPrefix[] = "diststrat_ckctl_";

ds::Dataset random_dataset(int64_t rows, int64_t features, int classes, uint64_t seed) {
  ds::Tensor x(ds::Shape{rows, features}, ds::DType::kFloat32),
      y(ds::Shape{rows}, ds::DType::kInt32);
  ds::init::RandomNormal{0.0, 1.0, seed}(x);
  for (int64_t i = 0; i < rows; ++i) y.data<int32_t>()[i] = static_cast<int32_t>(i % classes);
  return ds::Dataset(x, y);
}

// A model trained batch by batch, with its data position, under a
// two-replica MirroredStrategy; its Checkpoint holds named objects.
struct PositionedModel {
  explicit PositionedModel(int64_t global_batch = 16, uint64_t seed = 5)
      : strategy(std::vector<ds::Device>{ds::Device::cpu(0), ds::Device::cpu(1)}),
        mlp({6, 5, 3}),
        vars(mlp.create_variables(strategy, seed)),
        opt(strategy, {0.05f, 0.9f}),
        data(random_dataset(48, 6, 3, 11)),
        dist(strategy.distribute(data, global_batch, {true, 7, false})),
        ckpt({{"model", vars}, {"optimizer", opt}, {"position", {pos, dist}}}) {}
  // One step over the next batch; the position moves on.
  void step() {
    dist.set_epoch(pos.epoch);
    ds::testing::mlp_step(strategy, mlp, vars, opt, dist.batch(pos.batch));
    ++pos.batch, ++pos.step;
    if (pos.batch == dist.num_batches()) pos = {pos.epoch + 1, 0, pos.step};
  }
  ds::MirroredStrategy strategy;
  ds::nn::Mlp mlp;
  std::vector<ds::Variable> vars;
  ds::SGD opt;
  ds::Dataset data;
  ds::DistributedDataset dist;
  ds::DataPosition pos;
  ds::Checkpoint ckpt;
};

std::set<std::string> tensor_names(const std::string& path) {
  std::set<std::string> out;
  for (const auto& nt : ds::load_checkpoint(path).tensors) out.insert(nt.first);
  return out;
}

// Byte-equal values of the variables of two models.
void expect_same_variables(const std::vector<ds::Variable>& a, const std::vector<ds::Variable>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const ds::Tensor x = a[i].value(), y = b[i].value();
    ASSERT_EQ(x.nbytes(), y.nbytes());
    EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.nbytes())) << a[i].name();
  }
}

}  // namespace

// ---- a Checkpoint of named objects ---------------------------------------------

TEST(CheckpointObjects, SavesOnlyTheChosenObjectsUnderTheirNamesAndRestoresThem) {
  TempDir dir(kPrefix);
  PositionedModel a;
  for (int i = 0; i < 4; ++i) a.step();
  // A variable outside the chosen objects (a counter: no optimizer slots) is not saved.
  ds::VariableOptions counter;
  counter.trainable = false;
  a.strategy.create_variable("unsaved", {2}, ds::DType::kFloat32, ds::init::Zeros{}, counter);
  const std::string path = dir / "named.safetensors";
  a.ckpt.save(path);
  std::set<std::string> want;
  for (const auto& nt : a.ckpt.expected_state()) want.insert(nt.first);
  EXPECT_EQ(tensor_names(path), want);
  EXPECT_TRUE(want.count("model/" + a.vars[0].name()));
  EXPECT_TRUE(want.count("optimizer/iterations"));
  EXPECT_TRUE(want.count("optimizer/" + a.vars[0].name() + "/momentum"));
  EXPECT_TRUE(want.count("position/step") && want.count("position/seed"));
  EXPECT_FALSE(want.count("unsaved") || want.count("model/unsaved"));

  PositionedModel b;
  b.ckpt.restore(path);
  expect_same_variables(a.vars, b.vars);
  EXPECT_EQ(b.pos.epoch, 1);
  EXPECT_EQ(b.pos.batch, 1);
  EXPECT_EQ(b.pos.step, 4);
  EXPECT_TRUE(b.ckpt.last_restore().missing.empty() && b.ckpt.last_restore().unused.empty());
  // Both go on alike.
  a.step();
  b.step();
  expect_same_variables(a.vars, b.vars);
}

TEST(CheckpointObjects, RefusesBadObjects) {
  PositionedModel m;
  ds::DataPosition pos;
  expect_error<ds::InvalidArgumentError>([&] { ds::Checkpoint c(ds::CheckpointObjects{}); },
                                         {"no objects"}, "empty");
  expect_error<ds::InvalidArgumentError>(
      [&] {
        ds::Checkpoint c({{"a/b", m.vars}});
      },
      {"'a/b'", "no '/'"}, "slash");
  expect_error<ds::InvalidArgumentError>(
      [&] {
        ds::Checkpoint c({{"m", m.vars}, {"m", m.opt}});
      },
      {"two objects named 'm'"}, "twice");
  expect_error<ds::InvalidArgumentError>(
      [&] {
        ds::Checkpoint c({{"position", pos}});
      },
      {"none of the objects is a variable or an optimizer"}, "position only");
  PositionedModel other;
  expect_error<ds::InvalidArgumentError>(
      [&] {
        ds::Checkpoint c({{"model", m.vars}, {"other", other.vars}});
      },
      {"object 'other' belongs to another strategy"}, "two strategies");
}

TEST(CheckpointObjects, UnmatchedNamesAreAnErrorNamingThemOrReportedWithExpectPartial) {
  TempDir dir(kPrefix);
  PositionedModel a;
  a.step();
  const std::string full = dir / "full.safetensors";
  a.ckpt.save(full);

  // A subset (the model only) of a file with more: the optimizer's and the
  // position's tensors are unused.
  PositionedModel b(16, /*seed=*/9);
  ds::Checkpoint model_only({{"model", b.vars}});
  expect_error<ds::InvalidArgumentError>(
      [&] { model_only.restore(full); },
      {"does not match", "'optimizer/iterations'", "is not in the model"}, "unused names");
  PositionedModel fresh(16, 9);
  expect_same_variables(b.vars, fresh.vars);  // untouched
  ds::RestoreOptions partial;
  partial.expect_partial = true;
  model_only.restore(full, partial);
  expect_same_variables(a.vars, b.vars);
  const ds::RestoreReport& r = model_only.last_restore();
  EXPECT_EQ(r.path, full);
  EXPECT_TRUE(r.missing.empty());
  EXPECT_EQ(std::count(r.unused.begin(), r.unused.end(), "optimizer/iterations"), 1);
  EXPECT_EQ(std::count(r.unused.begin(), r.unused.end(), "position/step"), 1);

  // More than the file holds: an object the file lacks is missing.
  const std::string small = dir / "model.safetensors";
  model_only.save(small);
  PositionedModel c(16, 13);
  ds::Variable ema =
      c.strategy.create_variable("ema", {3}, ds::DType::kFloat32, ds::init::Constant{2.0});
  ds::Checkpoint more({{"model", c.vars}, {"ema", ema}});
  expect_error<ds::InvalidArgumentError>([&] { more.restore(small); }, {"'ema/ema'", "is missing"},
                                         "missing names");
  more.restore(small, partial);
  expect_same_variables(a.vars, c.vars);
  EXPECT_EQ(more.last_restore().missing, std::vector<std::string>{"ema/ema"});
  EXPECT_TRUE(more.last_restore().unused.empty());
  EXPECT_EQ(ema.value().data<float>()[0], 2.0f);  // kept

  // A shape mismatch stays an error with expect_partial: "model/ema" is
  // F32[3] in the file, F32[5] in the Checkpoint.
  ds::Checkpoint({{"model", ema}}).save(dir / "ema.safetensors");
  PositionedModel d;
  ds::Variable ema5 =
      d.strategy.create_variable("ema", {5}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::Checkpoint shaped({{"model", ema5}});
  expect_error<ds::InvalidArgumentError>([&] { shaped.restore(dir / "ema.safetensors", partial); },
                                         {"'model/ema'", "[3] in the file"}, "shape");
}

TEST(CheckpointObjects, DataPositionIsRestoredAndItsDataOrderChecked) {
  TempDir dir(kPrefix);
  PositionedModel a;
  for (int i = 0; i < 5; ++i) a.step();
  const std::string path = dir / "p.safetensors";
  a.ckpt.save(path);
  // Another global batch: the rows would come in another order.
  PositionedModel b(/*global_batch=*/8);
  const std::vector<ds::Variable> before = b.vars;
  expect_error<ds::InvalidArgumentError>([&] { b.ckpt.restore(path); },
                                         {"global_batch 16", "this run has 8"}, "data order");
  EXPECT_EQ(b.pos.step, 0);
  PositionedModel fresh(8);
  expect_same_variables(b.vars, fresh.vars);  // nothing written
  // A position without its dataset saves and restores epoch, batch and step only.
  ds::DataPosition p{2, 1, 7}, q;
  ds::Checkpoint(ds::CheckpointObjects{{"model", a.vars}, {"position", p}})
      .save(dir / "q.safetensors");
  ds::Checkpoint(ds::CheckpointObjects{{"model", a.vars}, {"position", q}})
      .restore(dir / "q.safetensors");
  EXPECT_EQ(q.epoch, 2);
  EXPECT_EQ(q.batch, 1);
  EXPECT_EQ(q.step, 7);
}

TEST(CheckpointObjects, APositionThatContradictsItselfIsDataLoss) {
  TempDir dir(kPrefix);
  PositionedModel a;
  a.step();
  const std::string path = dir / "p.safetensors";
  a.ckpt.save(path);
  // Rewritten (checksums and all) with step 9 at epoch 0, batch 1.
  ds::SafetensorsFile f = ds::load_checkpoint(path);
  for (auto& nt : f.tensors) {
    if (nt.first == "position/step") nt.second.data<int64_t>()[0] = 9;
  }
  ds::save_safetensors(path, f.tensors);
  PositionedModel b;
  expect_error<ds::DataLossError>([&] { b.ckpt.restore(path); },
                                  {path, "contradicts itself", "step 9"}, "contradiction");
  EXPECT_EQ(b.pos.step, 0);
  PositionedModel fresh;
  expect_same_variables(b.vars, fresh.vars);
}

TEST(CheckpointObjects, ACorruptFileIsDataLossAndChangesNothing) {
  TempDir dir(kPrefix);
  PositionedModel a;
  a.step();
  const std::string path = dir / "c.safetensors";
  a.ckpt.save(path);
  std::vector<uint8_t> bytes = ds::testing::read_bytes(path);
  bytes[bytes.size() - 3] ^= 0x40;  // a flipped bit in the last tensor
  ds::testing::write_bytes(path, bytes);
  PositionedModel b;
  expect_error<ds::DataLossError>([&] { b.ckpt.restore(path); }, {path}, "corrupt");
  ds::RestoreOptions partial;
  partial.expect_partial = true;
  expect_error<ds::DataLossError>([&] { b.ckpt.restore(path, partial); }, {path},
                                  "corrupt, partial");
  EXPECT_EQ(b.pos.step, 0);
  PositionedModel fresh;
  expect_same_variables(b.vars, fresh.vars);
}

// ---- CheckpointManager ------------------------------------------------------------

TEST(CheckpointManagerControls, CheckpointIntervalSkipsSavesTooSoonUnlessForced) {
  TempDir dir(kPrefix);
  PositionedModel m;
  ds::CheckpointManagerOptions o;
  o.max_to_keep = 10;
  o.checkpoint_interval = 3;
  ds::CheckpointManager manager(m.ckpt, dir.path(), o);
  EXPECT_EQ(manager.save(0), ckpt_path(dir.path(), 0));  // the first always writes
  EXPECT_EQ(manager.save(1), "");
  EXPECT_EQ(manager.save(2), "");
  EXPECT_EQ(manager.save(3), ckpt_path(dir.path(), 3));
  EXPECT_EQ(manager.save(4, {}, /*check_interval=*/false), ckpt_path(dir.path(), 4));
  EXPECT_EQ(manager.save(6), "");
  EXPECT_EQ(manager.save(7), ckpt_path(dir.path(), 7));
  EXPECT_EQ(manager.checkpoints(),
            (std::vector<std::string>{ckpt_path(dir.path(), 0), ckpt_path(dir.path(), 3),
                                      ckpt_path(dir.path(), 4), ckpt_path(dir.path(), 7)}));
  // A resumed manager counts from the checkpoint it restored.
  ds::CheckpointManager again(m.ckpt, dir.path(), o);
  ASSERT_TRUE(again.restore_latest());
  EXPECT_EQ(again.restored_step(), 7);
  EXPECT_EQ(again.save(9), "");
  EXPECT_EQ(again.save(10), ckpt_path(dir.path(), 10));
  ds::CheckpointManagerOptions bad;
  bad.checkpoint_interval = -1;
  expect_error<ds::InvalidArgumentError>([&] { ds::CheckpointManager x(m.ckpt, dir.path(), bad); },
                                         {"checkpoint_interval -1"}, "negative interval");
}

// An injected clock's value is written into the manifest: one that is not a
// finite time fails the save before anything is written (a NaN there made
// the manifest unreadable, with the new checkpoint left unlisted).
TEST(CheckpointManagerControls, AClockThatIsNotAFiniteTimeFailsTheSaveAndWritesNothing) {
  TempDir dir(kPrefix);
  PositionedModel m;
  double now = 3600;
  ds::CheckpointManagerOptions o;
  o.max_to_keep = 1;
  o.keep_checkpoint_every_n_hours = 1;
  o.clock = [&] { return now; };
  ds::CheckpointManager manager(m.ckpt, dir.path(), o);
  manager.save(1);
  for (double bad : {std::nan(""), -1.0, HUGE_VAL}) {
    now = bad;
    try {
      manager.save(2);
      ADD_FAILURE() << "saved with the clock at " << bad;
    } catch (const ds::InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("options.clock returned"), std::string::npos)
          << e.what();
    }
    struct stat st;
    EXPECT_NE(::stat(ckpt_path(dir.path(), 2).c_str(), &st), 0) << "written at clock " << bad;
  }
  now = 7200;
  ds::CheckpointManager again(m.ckpt, dir.path(), o);  // the manifest still reads
  EXPECT_EQ(again.checkpoints(), std::vector<std::string>{ckpt_path(dir.path(), 1)});
  again.save(2);
}

TEST(CheckpointManagerControls, KeepsACheckpointEveryNHoursBeyondMaxToKeep) {
  TempDir dir(kPrefix);
  PositionedModel m;
  double now = 0;  // hours, in seconds
  ds::CheckpointManagerOptions o;
  o.max_to_keep = 2;
  o.keep_checkpoint_every_n_hours = 2;
  o.clock = [&] { return now; };
  {
    ds::CheckpointManager manager(m.ckpt, dir.path(), o);  // made at hour 0
    for (int step = 1; step <= 6; ++step) {
      now = step * 3600.0;  // one save an hour
      manager.save(step);
    }
    // Pruned in turn: 1 (hour 1 < 0 + 2), 2 kept (hour 2), 3 (3 < 2 + 2), 4 kept (hour 4).
    EXPECT_EQ(manager.checkpoints(),
              (std::vector<std::string>{ckpt_path(dir.path(), 5), ckpt_path(dir.path(), 6)}));
  }
  struct stat st;
  for (int step : {2, 4, 5, 6})
    EXPECT_EQ(::stat(ckpt_path(dir.path(), step).c_str(), &st), 0) << step;
  for (int step : {1, 3}) EXPECT_NE(::stat(ckpt_path(dir.path(), step).c_str(), &st), 0) << step;
  // A restarted manager keeps what was kept and goes on from the last one kept (hour 4).
  now = 7 * 3600.0;
  ds::CheckpointManager manager(m.ckpt, dir.path(), o);
  manager.save(7);  // prunes 5 (hour 5 < 4 + 2)
  now = 8 * 3600.0;
  manager.save(8);  // keeps 6 (hour 6)
  EXPECT_EQ(manager.checkpoints(),
            (std::vector<std::string>{ckpt_path(dir.path(), 7), ckpt_path(dir.path(), 8)}));
  for (int step : {2, 4, 6, 7, 8})
    EXPECT_EQ(::stat(ckpt_path(dir.path(), step).c_str(), &st), 0) << step;
  EXPECT_NE(::stat(ckpt_path(dir.path(), 5).c_str(), &st), 0);
  // Kept checkpoints are the manager's own: restore_latest falls back to them.
  std::remove(ckpt_path(dir.path(), 8).c_str());
  std::remove(ckpt_path(dir.path(), 7).c_str());
  std::remove((dir / "latest").c_str());
  PositionedModel r;
  ds::CheckpointManager reader(r.ckpt, dir.path(), o);
  ASSERT_TRUE(reader.restore_latest());
  EXPECT_EQ(reader.restored_step(), 6);
  // Without the option, the kept ones stay kept (never pruned or counted).
  ds::CheckpointManager plain(m.ckpt, dir.path(), {2});
  for (int step = 20; step <= 23; ++step) plain.save(step);
  for (int step : {2, 4, 6, 22, 23})
    EXPECT_EQ(::stat(ckpt_path(dir.path(), step).c_str(), &st), 0) << step;
  EXPECT_EQ(plain.checkpoints(),
            (std::vector<std::string>{ckpt_path(dir.path(), 22), ckpt_path(dir.path(), 23)}));
}

TEST(CheckpointManagerControls, ADamagedManifestTimeIsDataLoss) {
  TempDir dir(kPrefix);
  PositionedModel m;
  ds::CheckpointManagerOptions o;
  o.keep_checkpoint_every_n_hours = 1;
  { ds::CheckpointManager(m.ckpt, dir.path(), o).save(1); }
  std::ifstream in(dir / "manifest");
  std::string header, line;
  std::getline(in, header);
  std::getline(in, line);
  in.close();
  ASSERT_EQ(std::count(line.begin(), line.end(), ' '), 2) << line;  // name, CRC, time
  std::ofstream(dir / "manifest") << header << "\n" << line << "x\n";
  expect_error<ds::DataLossError>([&] { ds::CheckpointManager x(m.ckpt, dir.path(), o); },
                                  {"manifest", "damaged"}, "bad time");
  // A line listed twice (the manager never writes one) is damage too.
  std::ofstream(dir / "manifest") << header << "\n" << line << "\n" << line << "\n";
  expect_error<ds::DataLossError>([&] { ds::CheckpointManager x(m.ckpt, dir.path(), o); },
                                  {"manifest", "listed twice"}, "a line twice");
}

TEST(CheckpointManagerControls, RestoreOrInitializeRestoresTheLatestOrRunsTheInitFunction) {
  TempDir dir(kPrefix);
  PositionedModel m;
  ds::CheckpointManager manager(m.ckpt, dir.path());
  int inits = 0;
  EXPECT_EQ(manager.restore_or_initialize([&] { ++inits; }), std::nullopt);
  EXPECT_EQ(inits, 1);
  EXPECT_FALSE(manager.restored_step());
  for (int i = 0; i < 3; ++i) m.step();
  manager.save(3);
  PositionedModel b;
  ds::CheckpointManager other(b.ckpt, dir.path());
  EXPECT_EQ(other.restore_or_initialize([&] { ++inits; }), ckpt_path(dir.path(), 3));
  EXPECT_EQ(inits, 1);
  EXPECT_EQ(other.restored_step(), 3);
  EXPECT_EQ(b.pos.step, 3);
  expect_same_variables(m.vars, b.vars);
}

// ---- PreemptionHandler::run ---------------------------------------------------------

namespace {
constexpr int64_t kRunSteps = 12;

// Trains a PositionedModel through PreemptionHandler::run on `dir` up to
// kRunSteps run() calls in all; `in_step(handler)` runs inside each step,
// before training. Returns the model.
std::unique_ptr<PositionedModel> run_with_handler(
    const std::string& dir, const ds::PreemptionOptions& o,
    const std::function<void(const ds::PreemptionHandler&)>& in_step) {
  auto m = std::make_unique<PositionedModel>();
  ds::CheckpointManager manager(m->ckpt, dir, {2});
  ds::PreemptionHandler handler(manager, o);
  while (handler.total_run_calls() < kRunSteps && !handler.preempted()) {
    handler.run([&] {
      in_step(handler);
      m->step();
    });
  }
  return m;
}

// A child trains from scratch and is SIGTERMed in the middle of its 5th
// step; it must save step 5 and exit with `expected_exit`. A resumed run
// then ends bit-identical to an uninterrupted one.
void sigterm_mid_step_then_resume(const ds::PreemptionOptions& o, int expected_exit) {
  TempDir dir(kPrefix);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = diststrat_test::start_child([&] {
    ::close(fds[0]);
    run_with_handler(dir.path(), o, [&](const ds::PreemptionHandler& h) {
      if (h.total_run_calls() != 4) return;
      // In step 5: tell the parent, and wait here (at most 20 s) until the signal came.
      if (::write(fds[1], "s", 1) != 1) std::_Exit(90);
      for (int i = 0; i < 20000 && !h.signalled(); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
    return 91;  // ran to the end: not preempted
  });
  ASSERT_GT(pid, 0);
  ::close(fds[1]);
  char c = 0;
  const bool in_step = ::read(fds[0], &c, 1) == 1;
  ::close(fds[0]);
  if (in_step) ::kill(pid, SIGTERM);
  const diststrat_test::ChildResult r = diststrat_test::wait_for_child(pid);
  ASSERT_TRUE(in_step);
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.term_signal, 0);
  EXPECT_EQ(r.exit_code, expected_exit);
  // Saved at the step boundary after the step the signal interrupted.
  EXPECT_EQ(ds::latest_checkpoint(dir.path()), ckpt_path(dir.path(), 5));
  const ds::SafetensorsFile f = ds::load_checkpoint(ckpt_path(dir.path(), 5));
  EXPECT_EQ(f.find("position/step")->data<int64_t>()[0], 5);

  auto resumed = run_with_handler(dir.path(), o, [](const ds::PreemptionHandler&) {});
  TempDir other(kPrefix);
  auto straight = run_with_handler(other.path(), o, [](const ds::PreemptionHandler&) {});
  EXPECT_EQ(resumed->pos.step, kRunSteps);
  EXPECT_EQ(straight->pos.step, kRunSteps);
  ds::testing::expect_same_state(resumed->ckpt, straight->ckpt);
}
}  // namespace

TEST(PreemptionRun, SigtermMidStepSavesExitsWithTheDefaultStatusAndResumesBitIdentical) {
  sigterm_mid_step_then_resume({}, ds::kPreemptedExitCode);
}

TEST(PreemptionRun, SigtermMidStepSavesAndExitsZeroWhenSoConfigured) {
  ds::PreemptionOptions o;
  o.exit_code = 0;
  sigterm_mid_step_then_resume(o, 0);
}

TEST(PreemptionRun, AnotherSignalAndAnExitFunction) {
  TempDir dir(kPrefix);
  ds::PreemptionOptions o;
  o.signals = {SIGUSR1};
  o.exit_code = 42;
  int exited_with = -1;
  o.exit_fn = [&](int code) { exited_with = code; };  // returns: run() returns
  auto m = run_with_handler(dir.path(), o, [](const ds::PreemptionHandler& h) {
    if (h.total_run_calls() == 2) ::raise(SIGUSR1);
  });
  EXPECT_EQ(exited_with, 42);
  EXPECT_EQ(m->pos.step, 3);
  EXPECT_EQ(ds::latest_checkpoint(dir.path()), ckpt_path(dir.path(), 3));
}

TEST(PreemptionRun, GracePeriodTrainsOnThenSavesAgainBeforeItEnds) {
  TempDir dir(kPrefix);
  double now = 0;
  ds::PreemptionOptions o;
  o.grace_period_s = 10;
  o.clock = [&] { return now; };
  bool exited = false;
  o.exit_fn = [&](int) { exited = true; };
  auto m = std::make_unique<PositionedModel>();
  ds::CheckpointManagerOptions mo;
  mo.max_to_keep = 5;
  ds::CheckpointManager manager(m->ckpt, dir.path(), mo);
  ds::PreemptionHandler handler(manager, o);
  while (!handler.preempted()) {
    ASSERT_LT(handler.total_run_calls(), 40);
    handler.run([&] {
      now += 1;  // every step takes a second
      if (handler.total_run_calls() == 2) ds::PreemptionHandler::notify_preemption();
      m->step();
    });
  }
  // Seen at the end of step 3 (second 3): saved there; then steps until one
  // more step (1 s) would end at the grace period's end (3 + 10).
  EXPECT_TRUE(exited);
  EXPECT_EQ(handler.total_run_calls(), 12);
  EXPECT_EQ(manager.checkpoints(),
            (std::vector<std::string>{ckpt_path(dir.path(), 3), ckpt_path(dir.path(), 12)}));
  expect_error<ds::FailedPreconditionError>([&] { handler.run([] {}); }, {"preempted"},
                                            "run after the preemption");
}

TEST(PreemptionRun, NeedsAManagerAndValidOptions) {
  PositionedModel m;
  ds::PreemptionHandler plain(m.strategy);
  expect_error<ds::FailedPreconditionError>([&] { plain.run([] {}); }, {"CheckpointManager"},
                                            "no manager");
  TempDir dir(kPrefix);
  ds::CheckpointManager manager(m.ckpt, dir.path());
  ds::PreemptionOptions o;
  o.grace_period_s = -1;
  expect_error<ds::InvalidArgumentError>([&] { ds::PreemptionHandler h(manager, o); },
                                         {"grace_period_s -1"}, "negative grace");
  o.grace_period_s = 0;
  o.exit_code = 256;
  expect_error<ds::InvalidArgumentError>([&] { ds::PreemptionHandler h(manager, o); },
                                         {"exit_code 256"}, "exit code");
  // run() returns what the step returns.
  ds::PreemptionHandler h(manager);
  EXPECT_EQ(h.run([] { return 7; }), 7);
  EXPECT_EQ(h.total_run_calls(), 1);
}
