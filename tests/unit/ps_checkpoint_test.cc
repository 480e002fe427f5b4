// ParameterServerStrategy checkpoints (PS ranks as threads): every PS rank
// writes its shard file and the chief the index; restore reassembles and
// re-splits onto another number of PS ranks and another partitioner, with
// optimizer slots and per-shard step counters bit-exact (training then
// continues identically); corrupt, missing or mismatched files are refused
// before anything is written; a save that fails before its index leaves the
// previous checkpoint the loadable one; the CheckpointManager keeps K
// checkpoints with their shard files; workers agree on a preemption step.
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <csignal>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <ostream>
#include <memory>
#include <random>
#include <thread>

#include "allreduce/transport.h"
#include "checkpoint_util.h"
#include "diststrat/diststrat.h"
#include "parameter_server/strategy_impl.h"
#include "../common/temp_dir.h"

namespace ds = diststrat;
namespace pp = diststrat::partitioners;

namespace {

using diststrat_test::temp_dir;
constexpr char kPsCheckpointTempPrefix[] =
    "diststrat_ps_ckpt_";  // removed at exit (tests/common/temp_dir.h)

std::vector<std::string> list(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) out.emplace_back(e->d_name);
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> shard_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const std::string& n : list(dir)) {
    if (n.find(".ps-") != std::string::npos) out.push_back(n);
  }
  return out;
}

struct Layout {
  int num_ps = 1;
  ds::Partitioner partitioner;
  std::string name;
};

ds::ParameterServerOptions options(const Layout& l) {
  ds::ParameterServerOptions o;
  o.num_ps = l.num_ps;
  o.partitioner = l.partitioner;
  return o;
}

std::unique_ptr<ds::Optimizer> make_optimizer(ds::Strategy& s, bool adam) {
  if (adam) return std::make_unique<ds::Adam>(s, ds::AdamOptions{0.01f});
  return std::make_unique<ds::SGD>(s, ds::SGDOptions{0.1f, 0.9f});
}

// One worker; the PS ranks are threads of this process.
struct Job {
  Job(const Layout& l, bool adam, uint64_t seed, std::vector<int64_t> sizes = {6, 7, 3})
      : strategy(std::make_unique<ds::ParameterServerStrategy>(options(l))),
        mlp(sizes),
        params(mlp.create_variables(*strategy, seed)),
        opt(make_optimizer(*strategy, adam)),
        ckpt(*strategy, {opt.get()}) {}
  void train(int steps, uint64_t seed) {
    ds::testing::mlp_train(*strategy, mlp, params, *opt, 8, steps, seed);
  }
  std::unique_ptr<ds::ParameterServerStrategy> strategy;
  ds::nn::Mlp mlp;
  std::vector<ds::Variable> params;
  std::unique_ptr<ds::Optimizer> opt;
  ds::Checkpoint ckpt;
};

struct ReshardCase {
  Layout from, to;
  bool adam;
};

void PrintTo(const ReshardCase& c, std::ostream* os) {
  *os << c.from.name << " -> " << c.to.name << (c.adam ? " (adam)" : " (momentum)");
}

class PsCheckpointReshard : public ::testing::TestWithParam<ReshardCase> {};

// Train, save, restore into a job with another layout (and other initial
// values): the same state, and 2 more steps on both give the same state again
// (so Adam's per-shard step counters came back too).
TEST_P(PsCheckpointReshard, RestoresBitExactAndContinuesIdentically) {
  const ReshardCase& c = GetParam();
  const std::string dir = temp_dir(kPsCheckpointTempPrefix), path = dir + "/ckpt-3.safetensors";
  Job a(c.from, c.adam, 3);
  a.train(3, 11);
  a.ckpt.save(path, {{"epoch", "2"}});
  // One shard file per PS rank, then the index.
  EXPECT_EQ(shard_files(dir).size(), static_cast<size_t>(c.from.num_ps));
  ds::testing::expect_state_is_file(a.ckpt, path);

  Job b(c.to, c.adam, 99);
  EXPECT_EQ(b.ckpt.restore(path), (ds::CheckpointMetadata{{"epoch", "2"}}));
  ds::testing::expect_same_state(a.ckpt, b.ckpt);
  EXPECT_EQ(b.opt->iterations().value().data<int64_t>()[0], 3);
  a.train(2, 12);
  b.train(2, 12);
  ds::testing::expect_same_state(a.ckpt, b.ckpt);
}

const Layout kOne{1, nullptr, "ps1"};
const Layout kTwo{2, pp::FixedShards{2}, "ps2_fixed2"};
const Layout kThree{3, pp::FixedShards{3}, "ps3_fixed3"};
const Layout kTwoMin{2, pp::MinSize{16, 4}, "ps2_min16"};
const Layout kThreeMin{3, pp::MinSize{32, 3}, "ps3_min32"};

INSTANTIATE_TEST_SUITE_P(
    Ps, PsCheckpointReshard,
    ::testing::Values(ReshardCase{kOne, kOne, false}, ReshardCase{kTwo, kTwo, true},
                      ReshardCase{kThree, kThree, false}, ReshardCase{kTwo, kOne, true},
                      ReshardCase{kTwo, kThree, true}, ReshardCase{kTwoMin, kThreeMin, false},
                      ReshardCase{kThreeMin, kTwoMin, true}, ReshardCase{kOne, kThree, true}),
    [](const ::testing::TestParamInfo<ReshardCase>& i) {
      return i.param.from.name + "_to_" + i.param.to.name + (i.param.adam ? "_adam" : "_momentum");
    });

// A row-sparse table (rows pushed lazily: untouched shards have no slots
// yet) saved from 2 PS ranks restores onto 3, its slots included.
TEST(PsCheckpoint, RowSparseTablesRoundTripWithTheirSlots) {
  const std::string path = temp_dir(kPsCheckpointTempPrefix) + "/emb.safetensors";
  struct Table {
    explicit Table(const Layout& l, double init)
        : s(options(l)),
          emb(s.create_row_sparse_variable("emb", {10, 4}, ds::DType::kFloat32,
                                           ds::init::Constant{init})),
          sgd(s, {0.1f, 0.9f}),
          ckpt(s, {&sgd}) {}
    void push(std::vector<int64_t> rows) {
      s.run([&](ds::ReplicaContext& ctx) {
        ds::Tensor ids(ds::Shape{static_cast<int64_t>(rows.size())}, ds::DType::kInt64);
        for (size_t i = 0; i < rows.size(); ++i) ids.data<int64_t>()[i] = rows[i];
        ds::Tensor g(ds::Shape{static_cast<int64_t>(rows.size()), 4}, ds::DType::kFloat32);
        ds::init::Constant{1.0}(g);
        s.apply_gradients(ctx, sgd, {}, {{emb, ids, g}});
      });
      s.flush();
    }
    ds::ParameterServerStrategy s;
    ds::Variable emb;
    ds::SGD sgd;
    ds::Checkpoint ckpt;
  };
  Table a(kTwo, 1.0);
  a.push({1, 2});  // both in shard 0 of 2 (rows 0-4): shard 1 never gets slots
  a.push({2});
  a.ckpt.save(path);
  Table b(kThree, 5.0);
  b.ckpt.restore(path);
  ds::testing::expect_same_state(a.ckpt, b.ckpt);
  ds::testing::expect_state_is_file(b.ckpt, path);
  a.push({2, 9});
  b.push({2, 9});
  ds::testing::expect_same_state(a.ckpt, b.ckpt);
}

// A PS checkpoint opens whole with load_checkpoint (examples/predict) and
// restores into another strategy; a single-file checkpoint restores into a PS job.
TEST(PsCheckpoint, CrossesToAndFromSingleFileStrategies) {
  const std::string dir = temp_dir(kPsCheckpointTempPrefix);
  Job a(kTwo, false, 3);
  a.train(3, 11);
  a.ckpt.save(dir + "/ps.safetensors");
  ds::MirroredOptions mo;
  mo.devices = {ds::Device::cpu(0)};
  ds::MirroredStrategy m(mo);
  ds::nn::Mlp mlp({6, 7, 3});
  std::vector<ds::Variable> vars = mlp.create_variables(m, 5);
  ds::SGD sgd(m, {0.1f, 0.9f});
  ds::Checkpoint mc(m, {&sgd});
  mc.restore(dir + "/ps.safetensors");
  ds::testing::expect_same_state(a.ckpt, mc);
  mc.save(dir + "/single.safetensors");
  Job b(kThree, false, 7);
  b.ckpt.restore(dir + "/single.safetensors");
  ds::testing::expect_same_state(a.ckpt, b.ckpt);
}

// Every way a PS checkpoint can be broken is refused, naming the file and
// tensor, and the model is left untouched.
TEST(PsCheckpoint, BrokenCheckpointsAreRefusedAndChangeNothing) {
  const std::string dir = temp_dir(kPsCheckpointTempPrefix), path = dir + "/ckpt-1.safetensors";
  Job a(kTwo, true, 3);
  a.train(2, 11);
  a.ckpt.save(path);
  const std::vector<std::string> shards = shard_files(dir);
  ASSERT_EQ(shards.size(), 2u);
  Job b(kThree, true, 9);
  b.train(1, 4);
  const auto before = b.ckpt.state();
  auto unchanged = [&] {
    const auto now = b.ckpt.state();
    ASSERT_EQ(now.size(), before.size());
    for (size_t i = 0; i < now.size(); ++i) {
      EXPECT_EQ(0,
                std::memcmp(now[i].second.data(), before[i].second.data(), now[i].second.nbytes()))
          << now[i].first;
    }
  };
  auto expect_error = [&](const std::string& p, ds::ErrorCode code,
                          const std::vector<std::string>& words) {
    try {
      b.ckpt.restore(p);
      ADD_FAILURE() << "no error for " << p;
    } catch (const ds::Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      for (const std::string& w : words)
        EXPECT_NE(e.message().find(w), std::string::npos) << w << " in " << e.what();
    }
    unchanged();
  };
  auto copy = [](const std::string& from, const std::string& to) {
    std::ifstream in(from, std::ios::binary);
    std::ofstream out(to, std::ios::binary);
    out << in.rdbuf();
  };
  auto backup = dir + "/backup";
  copy(dir + "/" + shards[1], backup);

  // A flipped byte in a shard file's data: the file and the tensor are named.
  {
    std::fstream f(dir + "/" + shards[1], std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  expect_error(path, ds::ErrorCode::kDataLoss, {shards[1], "checksum"});
  // A missing shard file.
  ::unlink((dir + "/" + shards[1]).c_str());
  expect_error(path, ds::ErrorCode::kNotFound, {shards[1]});
  // A shard file of another save under the expected name (index/shard disagreement).
  {
    const std::string other = temp_dir(kPsCheckpointTempPrefix);
    a.ckpt.save(other + "/ckpt-1.safetensors");
    const auto os = shard_files(other);
    copy(other + "/" + os[1], dir + "/" + shards[1]);
  }
  expect_error(path, ds::ErrorCode::kDataLoss, {shards[1], "another save"});
  copy(backup, dir + "/" + shards[1]);
  // A truncated index.
  copy(path, dir + "/index.bak");
  ASSERT_EQ(::truncate(path.c_str(), 20), 0);
  expect_error(path, ds::ErrorCode::kDataLoss, {path});
  copy(dir + "/index.bak", path);
  // Another model (7 hidden units there, 5 here): the tensors are named.
  Job c(kTwo, true, 1, {6, 5, 3});
  try {
    c.ckpt.restore(path);
    ADD_FAILURE() << "another model was restored";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(e.message().find("dense0/kernel"), std::string::npos) << e.what();
    EXPECT_NE(e.message().find(path), std::string::npos) << e.what();
  }
  // Intact again: it restores.
  b.ckpt.restore(path);
  ds::testing::expect_same_state(a.ckpt, b.ckpt);
}

// A save that fails after the PS ranks wrote their shards but before the
// index (the index's path is taken by a directory: its rename fails) leaves
// `latest` on the previous checkpoint, which loads and restores; the next
// successful save prunes the failed save's shard files.
TEST(PsCheckpoint, FailureBetweenShardsAndIndexLeavesThePreviousCheckpoint) {
  const std::string dir = temp_dir(kPsCheckpointTempPrefix);
  Job a(kTwo, false, 3);
  ds::CheckpointManager manager(a.ckpt, dir, {2});
  a.train(1, 1);
  manager.save(1, {{"step", "1"}});
  const auto good = a.ckpt.state();
  a.train(1, 2);
  ASSERT_EQ(::mkdir((dir + "/ckpt-2.safetensors").c_str(), 0755), 0);
  EXPECT_THROW(manager.save(2, {{"step", "2"}}), ds::Error);
  EXPECT_EQ(shard_files(dir).size(), 4u);  // 2 of step 1, 2 orphans of step 2
  EXPECT_EQ(*manager.latest(), dir + "/ckpt-1.safetensors");
  Job b(kOne, false, 8);
  ds::CheckpointManager mb(b.ckpt, dir, {2});
  EXPECT_EQ(mb.restore_latest()->at("step"), "1");
  const auto restored = b.ckpt.state();
  ASSERT_EQ(restored.size(), good.size());
  for (size_t i = 0; i < good.size(); ++i) {
    EXPECT_EQ(
        0, std::memcmp(restored[i].second.data(), good[i].second.data(), good[i].second.nbytes()));
  }
  ::rmdir((dir + "/ckpt-2.safetensors").c_str());
  manager.save(3, {{"step", "3"}});
  manager.save(4, {{"step", "4"}});
  // Kept: 2 indexes, their 2 x 2 shard files, `latest`, the manager's manifest.
  EXPECT_EQ(list(dir).size(), 8u);
  EXPECT_EQ(shard_files(dir).size(), 4u);
  for (const std::string& n : shard_files(dir))
    EXPECT_TRUE(n.rfind("ckpt-3.", 0) == 0 || n.rfind("ckpt-4.", 0) == 0) << n;
}

// Two workers and two PS ranks as threads of one process (the MPI layout):
// both workers save through a CheckpointManager at the same step, and the
// checkpoint holds exactly both workers' pushes before it (a consistent cut);
// a new job with three PS ranks resumes on both workers (each gets the
// metadata) and keeps training.
TEST(PsCheckpoint, TwoWorkersSaveAConsistentCutAndAJobWithThreePsRanksResumes) {
  const std::string dir = temp_dir(kPsCheckpointTempPrefix);
  auto run_job = [&](int num_ps,
                     const std::function<void(ds::ParameterServerStrategy&, int)>& body) {
    ds::ParameterServerOptions o;
    o.num_ps = num_ps;
    o.partitioner = pp::FixedShards{num_ps};
    o.communication.timeout = std::chrono::seconds(30);
    ds::InProcessTransportGroup group(2 + num_ps);
    std::vector<std::unique_ptr<ds::ParameterServerStrategy>> ps;
    for (int p = 0; p < num_ps; ++p) ps.push_back(ds::ps::make_strategy(group.at(2 + p), o));
    std::vector<std::thread> workers;
    std::vector<std::string> errors(2);
    for (int w = 0; w < 2; ++w) {
      workers.emplace_back([&, w] {
        try {
          auto s = ds::ps::make_strategy(group.at(w), o);
          body(*s, w);
        } catch (const std::exception& e) {
          errors[w] = e.what();
        }
      });
    }
    for (auto& t : workers) t.join();
    for (auto& p : ps) p->join();
    EXPECT_EQ(errors[0], "");
    EXPECT_EQ(errors[1], "");
  };
  run_job(2, [&](ds::ParameterServerStrategy& s, int w) {
    ds::testing::CheckpointedMlp m(s, 3, dir);
    for (int step = 1; step <= 4; ++step) {
      ds::testing::mlp_train(s, m.mlp, m.vars, m.adam, 16, 1, 10 + step);
      m.manager.save(step, {{"step", std::to_string(step)}});
      if (w == 0) {
        // Nobody pushed since: the PS state is the file, and it holds 2 x step pushes.
        ds::testing::expect_state_is_file(m.ckpt, *m.manager.latest());
        EXPECT_EQ(m.adam.iterations().value().data<int64_t>()[0], 2 * step);
      }
      s.barrier("checked");
    }
  });
  EXPECT_EQ(list(dir).size(), 8u);  // ckpt-3, ckpt-4 with 2 shard files each, latest, manifest
  run_job(3, [&](ds::ParameterServerStrategy& s, int w) {
    ds::testing::CheckpointedMlp m(s, 77, dir);
    auto md = m.manager.restore_latest();
    ASSERT_TRUE(md.has_value());
    EXPECT_EQ(md->at("step"), "4") << "worker " << w;
    if (w == 0) ds::testing::expect_state_is_file(m.ckpt, dir + "/ckpt-4.safetensors");
    s.barrier("checked");
    ds::testing::mlp_train(s, m.mlp, m.vars, m.adam, 16, 1, 20);
    s.flush();
    s.barrier("trained");
    EXPECT_EQ(m.adam.iterations().value().data<int64_t>()[0], 10);
    s.barrier("done");
  });
}

// SIGTERM (simulated) while two workers train at their own pace: both stop
// at the same step, agreed through PS 0 without lockstep, and the checkpoint
// they save there holds both workers' pushes up to it.
TEST(PsCheckpoint, WorkersAgreeOnAPreemptionStep) {
  const std::string dir = temp_dir(kPsCheckpointTempPrefix);
  ds::ParameterServerOptions o;
  o.num_ps = 1;
  o.communication.timeout = std::chrono::seconds(30);
  ds::InProcessTransportGroup group(3);
  auto ps = ds::ps::make_strategy(group.at(2), o);
  std::vector<std::unique_ptr<ds::ParameterServerStrategy>> s;
  for (int w = 0; w < 2; ++w) s.push_back(ds::ps::make_strategy(group.at(w), o));
  // Before the threads: a handler's constructor clears the per-process flag.
  std::vector<std::unique_ptr<ds::PreemptionHandler>> handlers;
  for (int w = 0; w < 2; ++w) handlers.push_back(std::make_unique<ds::PreemptionHandler>(*s[w]));
  std::vector<int64_t> stopped(2, -1);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      try {
        ds::nn::Mlp mlp({6, 7, 3});
        auto vars = mlp.create_variables(*s[w], 3);
        ds::SGD sgd(*s[w], {0.1f, 0.9f});
        ds::Checkpoint ckpt(*s[w], {&sgd});
        ds::CheckpointManager manager(ckpt, dir);
        for (int64_t step = 1; step <= 200; ++step) {
          ds::testing::mlp_train(*s[w], mlp, vars, sgd, 16, 1, step);
          if (w == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the slower one
          if (w == 0 && step == 5) ds::PreemptionHandler::notify_preemption();
          if (handlers[w]->should_stop(step)) {
            manager.save(step, {{"step", std::to_string(step)}});
            stopped[w] = step;
            return;
          }
        }
      } catch (const std::exception& e) {
        errors[w] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_GE(stopped[0], 5);
  EXPECT_EQ(stopped[0], stopped[1]);
  const ds::SafetensorsFile f =
      ds::load_checkpoint(dir + "/ckpt-" + std::to_string(stopped[0]) + ".safetensors");
  EXPECT_EQ(f.metadata.at("step"), std::to_string(stopped[0]));
  EXPECT_EQ(f.find("optimizer/iterations")->data<int64_t>()[0], 2 * stopped[0]);
  handlers.clear();
  s.clear();
  ps->join();
}

// A child trains under two PS threads and saves in a loop (the variable equal
// to the step number); it is SIGKILLed at random points — inside a shard
// file's write, between the shard files and the index, inside `latest` or the
// pruning. After every kill the latest checkpoint loads whole and verified.
TEST(PsCheckpoint, KillDuringSaveAlwaysLeavesALoadableLatest) {
  const ds::testing::KillStats st = ds::testing::kill_during_save(
      temp_dir(kPsCheckpointTempPrefix),
      [](const std::string& dir, int64_t first_step) {
        ds::ParameterServerStrategy s(options(kTwo));
        ds::Variable big =
            s.create_variable("big", {128, 256}, ds::DType::kFloat32, ds::init::Zeros{});
        ds::testing::save_step_valued_forever(s, {big}, dir, first_step);
      },
      {"big"}, 25, 8, 777);
  std::printf(
      "PS kill-during-save: %d kills (%d inside a file write), %d checked, last step %lld\n",
      st.kills, st.mid_write, st.checked, static_cast<long long>(st.last_step));
  EXPECT_GE(st.checked, 5);
}

TEST(PsCheckpoint, PsRanksRefuseToSaveThemselves) {
  ds::ParameterServerOptions o;
  ds::InProcessTransportGroup group(2);
  auto ps = ds::ps::make_strategy(group.at(1), o);
  ds::Checkpoint ckpt(*ps);
  try {
    ckpt.save(temp_dir(kPsCheckpointTempPrefix) + "/x.safetensors");
    ADD_FAILURE() << "a PS rank saved";
  } catch (const ds::FailedPreconditionError& e) {
    EXPECT_NE(e.message().find("rank 1 (ps 0)"), std::string::npos) << e.what();
  }
}

}  // namespace
