// ZeRO-1 (sharded optimizer state, issue 17 item 5), in-process: Mirrored
// replicas and multi-worker workers as threads over an InProcessGroup (the
// real fusion engine's reduce_scatter / all_gather path). Against the same
// training without sharding: weights within 1e-5 after 20 steps, every copy
// bit-identical, slot memory ~1/R, clipping / loss scaling / accumulation
// unchanged, checkpoints restorable onto other replica counts with or
// without sharding.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <cstring>
#include <exception>
#include <functional>
#include <iostream>
#include <thread>

#include "runtime/variable_impl.h"
#include "../common/zero_cases.h"
#include "diststrat/diststrat.h"
#include "harness.h"
#include "training_util.h"

namespace ds = diststrat;
namespace zc = ds::zero_cases;

namespace {

constexpr int kZeroSteps = 20;
constexpr double kTol = 1e-5;

// A file in a fresh directory under $TMPDIR (else /tmp); remove_temp
// deletes both.
std::string temp_path(const std::string& tag) {
  const char* env = std::getenv("TMPDIR");
  std::string tmpl = std::string(env && *env ? env : "/tmp") + "/diststrat_zero_XXXXXX";
  if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp " + tmpl);
  return tmpl + "/" + tag + ".safetensors";
}

void remove_temp(const std::string& path) {
  std::remove(path.c_str());
  std::remove(path.substr(0, path.rfind('/')).c_str());
}

ds::MirroredOptions mirrored(int replicas, bool zero) {
  ds::MirroredOptions o;
  o.devices = ds::testing::cpu_devices(replicas);
  o.shard_optimizer_state = zero;
  o.communication.timeout = std::chrono::seconds(60);
  return o;
}

// Runs fn(strategy, worker) on `workers` threads, each a MultiWorkerMirroredStrategy
// with `local` CPU replicas over one InProcessGroup; rethrows the first error.
void run_workers(int workers, int local, bool zero,
                 const std::function<void(ds::MultiWorkerMirroredStrategy&, int)>& fn) {
  ds::testing::rethrow_first(
      ds::testing::run_multi_worker(std::vector<bool>(static_cast<size_t>(workers), zero), local,
                                    ds::testing::comm_with_timeout(std::chrono::seconds(60)), fn));
}

// The unsharded reference: MirroredStrategy with `replicas` replicas.
std::vector<ds::Tensor> reference(int replicas, bool adam, int steps, zc::StepLog* log = nullptr,
                                  const ds::GradientClipping& clip = {}, bool loss_scale = false,
                                  int64_t poison = -1, int poison_replica = 0) {
  ds::MirroredStrategy s(mirrored(replicas, false));
  auto vars = zc::create_model(s);
  auto opt = zc::make_optimizer(s, adam);
  opt->set_clipping(clip);
  if (loss_scale) opt->enable_loss_scaling({1024.0f, 1000, 2.0f});
  zc::StepLog l = zc::train(s, *opt, vars, steps, poison, poison_replica);
  if (log) *log = l;
  return zc::values(vars);
}

int64_t unsharded_slot_bytes(bool adam) { return zc::kModelElements * 4 * (adam ? 2 : 1); }

TEST(ZeroMirrored, UnevenShardsMatchUnshardedTrainingSgdMomentumAndAdam) {
  for (bool adam : {false, true}) {
    for (int replicas : {1, 2, 3, 4}) {
      SCOPED_TRACE(std::string(adam ? "Adam" : "SGD-momentum") + ", " + std::to_string(replicas) +
                   " replicas");
      const std::vector<ds::Tensor> ref = reference(replicas, adam, kZeroSteps);
      ds::MirroredStrategy s(mirrored(replicas, true));
      auto vars = zc::create_model(s);
      auto opt = zc::make_optimizer(s, adam);
      EXPECT_EQ(opt->slot_bytes_per_replica(), 0);  // nothing created yet
      zc::train(s, *opt, vars, kZeroSteps);
      EXPECT_TRUE(opt->sharded());
      EXPECT_LE(zc::max_diff(zc::values(vars), ref), kTol);
      EXPECT_TRUE(zc::copies_identical(vars));
      EXPECT_EQ(opt->iterations().value().data<int64_t>()[0], kZeroSteps);
      // Blocks of ceil(50 / R) elements per slot: ~1/R of the full slots.
      const int64_t block = (zc::kModelElements + replicas - 1) / replicas;
      EXPECT_EQ(opt->slot_bytes_per_replica(), block * 4 * (adam ? 2 : 1));
      // No full slot copy is left behind on the variables.
      for (const ds::Variable& v : vars) EXPECT_TRUE(v.impl().slots.empty()) << v.name();
    }
  }
}

TEST(ZeroMirrored, SlotBytesAreAThirdOfUnshardedWithThreeReplicas) {
  ds::MirroredStrategy plain(mirrored(3, false)), sharded(mirrored(3, true));
  auto pv = zc::create_model(plain), sv = zc::create_model(sharded);
  auto po = zc::make_optimizer(plain, true), so = zc::make_optimizer(sharded, true);
  zc::train(plain, *po, pv, 1);
  zc::train(sharded, *so, sv, 1);
  std::cout << "Adam slot bytes per replica, 3 replicas: unsharded " << po->slot_bytes_per_replica()
            << ", ZeRO-1 " << so->slot_bytes_per_replica() << "\n";
  EXPECT_EQ(po->slot_bytes_per_replica(), unsharded_slot_bytes(true));
  EXPECT_LE(so->slot_bytes_per_replica() * 3, po->slot_bytes_per_replica() + 3 * 2 * 4);
}

TEST(ZeroMultiWorker, WorkersAsThreadsMatchUnshardedAndStayBitIdentical) {
  for (bool adam : {false, true}) {
    for (const auto& [workers, local] :
         {std::pair<int, int>{1, 1}, {2, 1}, {3, 1}, {4, 1}, {2, 2}}) {
      SCOPED_TRACE(std::string(adam ? "Adam" : "SGD-momentum") + ", " + std::to_string(workers) +
                   " workers x " + std::to_string(local));
      const std::vector<ds::Tensor> ref = reference(workers * local, adam, kZeroSteps);
      std::vector<std::vector<ds::Tensor>> copies(static_cast<size_t>(workers));
      std::vector<int64_t> bytes(static_cast<size_t>(workers));
      run_workers(workers, local, true, [&](ds::MultiWorkerMirroredStrategy& s, int w) {
        auto vars = zc::create_model(s);
        auto opt = zc::make_optimizer(s, adam);
        zc::train(s, *opt, vars, kZeroSteps);
        bytes[static_cast<size_t>(w)] = opt->slot_bytes_per_replica();
        for (const auto& v : vars) {
          for (const ds::Tensor& c : v.impl().copies)
            copies[static_cast<size_t>(w)].push_back(c.clone());
        }
      });
      std::vector<ds::Tensor> first;
      for (size_t i = 0; i < copies[0].size(); i += static_cast<size_t>(local))
        first.push_back(copies[0][i]);
      EXPECT_LE(zc::max_diff(first, ref), kTol);
      // Each worker's largest block; the blocks together hold the model once.
      const int64_t block = (zc::kModelElements + workers * local - 1) / (workers * local);
      int64_t sum = 0;
      for (int64_t b : bytes) sum += b;
      if (local == 1) EXPECT_EQ(sum, unsharded_slot_bytes(adam));
      for (int w = 0; w < workers; ++w) {
        EXPECT_LE(bytes[static_cast<size_t>(w)], block * 4 * (adam ? 2 : 1)) << "worker " << w;
        ASSERT_EQ(copies[static_cast<size_t>(w)].size(), copies[0].size());
        for (size_t i = 0; i < copies[0].size(); ++i) {
          EXPECT_EQ(0, std::memcmp(copies[static_cast<size_t>(w)][i].data(), copies[0][i].data(),
                                   copies[0][i].nbytes()))
              << "worker " << w << " copy " << i;
        }
      }
    }
  }
}

TEST(ZeroMultiWorker, UnequalLocalReplicaCountsAreUnimplemented) {
  ds::CommunicationOptions comm;
  comm.timeout = std::chrono::seconds(30);
  ds::InProcessGroup group(2, comm);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      try {
        ds::MultiWorkerOptions o;
        o.communication = comm;
        o.communicator = &group.at(w);
        o.devices = ds::testing::cpu_devices(w + 1);
        o.shard_optimizer_state = true;
        ds::MultiWorkerMirroredStrategy s(o);
      } catch (const ds::UnimplementedError& e) {
        errors[static_cast<size_t>(w)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("same number of local replicas"), std::string::npos) << e;
  }
}

// ---- items 1-3 with sharding on ----------------------------------------------

TEST(ZeroTrainingFeatures, GlobalNormClippingUsesTheGlobalNorm) {
  ds::GradientClipping clip;
  clip.global_norm = 0.2f;  // below the early norms: it clips
  for (bool adam : {false, true}) {
    zc::StepLog ref_log;
    const auto ref = reference(3, adam, kZeroSteps, &ref_log, clip);
    ds::MirroredStrategy s(mirrored(3, true));
    auto vars = zc::create_model(s);
    auto opt = zc::make_optimizer(s, adam);
    opt->set_clipping(clip);
    const zc::StepLog log = zc::train(s, *opt, vars, kZeroSteps);
    EXPECT_GT(ref_log.norms[0], clip.global_norm);
    for (int i = 0; i < kZeroSteps; ++i) {
      EXPECT_NEAR(log.norms[i], ref_log.norms[i], 1e-6 * ref_log.norms[i]) << "step " << i;
    }
    EXPECT_LE(zc::max_diff(zc::values(vars), ref), kTol);
    EXPECT_TRUE(zc::copies_identical(vars));
  }
  // Clipping by value is element-wise: fine on blocks.
  ds::GradientClipping value;
  value.value = 0.05f;
  const auto ref = reference(3, true, kZeroSteps, nullptr, value);
  ds::MirroredStrategy s(mirrored(3, true));
  auto vars = zc::create_model(s);
  auto opt = zc::make_optimizer(s, true);
  opt->set_clipping(value);
  zc::train(s, *opt, vars, kZeroSteps);
  EXPECT_LE(zc::max_diff(zc::values(vars), ref), kTol);
}

TEST(ZeroTrainingFeatures, AnInfOnOneReplicaSkipsTheStepOnEveryReplica) {
  for (const bool clip_too : {false, true}) {
    ds::GradientClipping clip;
    if (clip_too) clip.global_norm = 1000.0f;
    zc::StepLog ref_log;
    const auto ref = reference(3, true, 10, &ref_log, clip, true, /*poison=*/4, /*replica=*/2);
    ds::MirroredStrategy s(mirrored(3, true));
    auto vars = zc::create_model(s);
    auto opt = zc::make_optimizer(s, true);
    opt->set_clipping(clip);
    opt->enable_loss_scaling({1024.0f, 1000, 2.0f});
    // The inf is in variable 0 of replica 2's gradient; variable 0 lies in
    // replica 0's block, so replicas 1 and 2 learn of it only through the
    // scalar reduction.
    const zc::StepLog log = zc::train(s, *opt, vars, 10, 4, 2);
    EXPECT_EQ(log.skipped, ref_log.skipped);
    EXPECT_TRUE(log.skipped[4]);
    EXPECT_EQ(opt->skipped_steps(), 1);
    EXPECT_EQ(opt->iterations().value().data<int64_t>()[0], 9);
    EXPECT_EQ(ds::Variable(s.variable("optimizer/loss_scale")).value().data<float>()[0], 512.0f);
    EXPECT_TRUE(zc::copies_identical(vars));
    EXPECT_LE(zc::max_diff(zc::values(vars), ref), kTol);
  }
  // Across workers: the inf on worker 2's replica skips the step on all.
  std::vector<std::vector<bool>> skipped(3);
  run_workers(3, 1, true, [&](ds::MultiWorkerMirroredStrategy& s, int w) {
    auto vars = zc::create_model(s);
    auto opt = zc::make_optimizer(s, false);
    opt->enable_loss_scaling({1024.0f, 1000, 2.0f});
    skipped[static_cast<size_t>(w)] = zc::train(s, *opt, vars, 6, 3, 2).skipped;
  });
  for (int w = 0; w < 3; ++w) {
    EXPECT_EQ(skipped[static_cast<size_t>(w)],
              (std::vector<bool>{false, false, false, true, false, false}))
        << "worker " << w;
  }
}

TEST(ZeroTrainingFeatures, AccumulationCommunicatesNothingOnEarlierMicroBatches) {
  const int k = 2;
  // Two updates, one lone micro-batch (whose communication is counted), then
  // the rest: the same sequence sharded and not.
  const auto sequence = [&](ds::Strategy& s, ds::Optimizer& opt,
                            const std::vector<ds::Variable>& vars,
                            const std::function<int64_t()>& calls) {
    opt.set_accumulation_steps(k);
    zc::train(s, opt, vars, 2 * k);
    const int64_t before = calls();
    s.run([&](ds::ReplicaContext& ctx) {
      std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
      for (size_t i = vars.size(); i-- > 0;) {  // the order zc::train uses
        gv.emplace_back(
            zc::replica_grad(vars[i].read(ctx), i, 7, ctx.replica_id(), ctx.num_replicas_in_sync()),
            vars[i]);
      }
      if (opt.apply_gradients(ctx, gv).applied)
        throw std::runtime_error("micro-batch 1 of 2 applied");
    });
    const int64_t lone = calls() - before;
    zc::train(s, opt, vars, kZeroSteps - 2 * k - 1);
    return lone;
  };
  std::vector<ds::Tensor> ref;
  {
    ds::MirroredStrategy s(mirrored(2, false));
    auto vars = zc::create_model(s);
    auto opt = zc::make_optimizer(s, true);
    sequence(s, *opt, vars, [] { return int64_t{0}; });
    ref = zc::values(vars);
  }
  std::vector<std::vector<ds::Tensor>> got(2);
  std::vector<int64_t> lone_calls(2), updates(2);
  run_workers(2, 1, true, [&](ds::MultiWorkerMirroredStrategy& s, int w) {
    auto vars = zc::create_model(s);
    auto opt = zc::make_optimizer(s, true);
    lone_calls[static_cast<size_t>(w)] = sequence(s, *opt, vars, [&] { return s.stats().calls; });
    updates[static_cast<size_t>(w)] = opt->iterations().value().data<int64_t>()[0];
    got[static_cast<size_t>(w)] = zc::values(vars);
  });
  for (int w = 0; w < 2; ++w) {
    EXPECT_EQ(lone_calls[static_cast<size_t>(w)], 0) << "worker " << w;
    EXPECT_EQ(updates[static_cast<size_t>(w)], kZeroSteps / k);
    EXPECT_LE(zc::max_diff(got[static_cast<size_t>(w)], ref), kTol);
  }
}

TEST(ZeroTrainingFeatures, UnsupportedCombinationsAreUnimplementedNamingThem) {
  ds::MirroredStrategy s(mirrored(2, true));
  auto vars = zc::create_model(s);
  auto opt = zc::make_optimizer(s, false);
  ds::GradientClipping per_tensor;
  per_tensor.norm = 1.0f;
  opt->set_clipping(per_tensor);
  try {
    zc::train(s, *opt, vars, 1);
    FAIL() << "per-tensor clipping accepted";
  } catch (const ds::UnimplementedError& e) {
    EXPECT_NE(std::string(e.what()).find("clip_by_norm"), std::string::npos) << e.what();
  }
  opt->set_clipping({});
  zc::train(s, *opt, vars, 1);
  try {
    s.run([&](ds::ReplicaContext& ctx) {
      ds::Tensor g(vars[0].shape(), ds::DType::kFloat32);
      opt->apply_gradients(ctx, {{g, vars[0]}});
    });
    FAIL() << "another variable set accepted";
  } catch (const ds::UnimplementedError& e) {
    EXPECT_NE(std::string(e.what()).find("same variables"), std::string::npos) << e.what();
  }
}

// ---- checkpoints ---------------------------------------------------------------

// 10 steps sharded on 3 replicas, saved; restored onto 2 replicas without
// sharding and onto 4 with it, 10 more steps: the 20-step unsharded run.
TEST(ZeroCheckpoint, MirroredThreeShardedRestoresOnTwoUnshardedAndFourSharded) {
  for (bool adam : {false, true}) {
    SCOPED_TRACE(adam ? "Adam" : "SGD-momentum");
    const auto ref = reference(3, adam, kZeroSteps);
    const std::string path = temp_path("mirrored");
    std::vector<std::pair<std::string, ds::Tensor>> sharded_state, plain_state;
    {
      ds::MirroredStrategy s(mirrored(3, true));
      auto vars = zc::create_model(s);
      auto opt = zc::make_optimizer(s, adam);
      zc::train(s, *opt, vars, kZeroSteps / 2);
      ds::Checkpoint ck(s, {opt.get()});
      ck.save(path);
      sharded_state = ck.state();
    }
    {
      // The same file as without sharding: names, shapes and (within
      // rounding) values.
      ds::MirroredStrategy s(mirrored(3, false));
      auto vars = zc::create_model(s);
      auto opt = zc::make_optimizer(s, adam);
      zc::train(s, *opt, vars, kZeroSteps / 2);
      plain_state = ds::Checkpoint(s, {opt.get()}).state();
    }
    ASSERT_EQ(sharded_state.size(), plain_state.size());
    for (size_t i = 0; i < plain_state.size(); ++i) {
      EXPECT_EQ(sharded_state[i].first, plain_state[i].first);
      EXPECT_EQ(sharded_state[i].second.shape(), plain_state[i].second.shape())
          << plain_state[i].first;
      if (plain_state[i].second.dtype() == ds::DType::kFloat32) {
        EXPECT_LE(zc::max_diff({sharded_state[i].second}, {plain_state[i].second}), kTol)
            << plain_state[i].first;
      }
    }
    for (const auto& [replicas, zero] : {std::pair<int, bool>{2, false}, {4, true}}) {
      SCOPED_TRACE(std::to_string(replicas) + (zero ? " sharded" : " unsharded"));
      ds::MirroredStrategy s(mirrored(replicas, zero));
      auto vars = zc::create_model(s);
      auto opt = zc::make_optimizer(s, adam);
      // Sharded: one step first, so the restore writes into laid-out blocks.
      if (zero) zc::train(s, *opt, vars, 1);
      ds::Checkpoint(s, {opt.get()}).restore(path);
      EXPECT_EQ(opt->iterations().value().data<int64_t>()[0], kZeroSteps / 2);
      zc::train(s, *opt, vars, kZeroSteps / 2);
      EXPECT_LE(zc::max_diff(zc::values(vars), ref), kTol);
      EXPECT_TRUE(zc::copies_identical(vars));
    }
    remove_temp(path);
  }
}

TEST(ZeroCheckpoint, MultiWorkerThreeShardedRestoresOnTwoUnshardedAndFourSharded) {
  const bool adam = true;
  const auto ref = reference(3, adam, kZeroSteps);
  const std::string path = temp_path("multi_worker");
  run_workers(3, 1, true, [&](ds::MultiWorkerMirroredStrategy& s, int) {
    auto vars = zc::create_model(s);
    auto opt = zc::make_optimizer(s, adam);
    zc::train(s, *opt, vars, kZeroSteps / 2);
    ds::Checkpoint(s, {opt.get()}).save(path);
  });
  for (const auto& [workers, zero] : {std::pair<int, bool>{2, false}, {4, true}}) {
    SCOPED_TRACE(std::to_string(workers) + (zero ? " sharded" : " unsharded"));
    std::vector<std::vector<ds::Tensor>> got(static_cast<size_t>(workers));
    run_workers(workers, 1, zero, [&](ds::MultiWorkerMirroredStrategy& s, int w) {
      auto vars = zc::create_model(s);
      auto opt = zc::make_optimizer(s, adam);
      // Restored before the first step: full slots, cut into blocks by it.
      ds::Checkpoint(s, {opt.get()}).restore(path);
      zc::train(s, *opt, vars, kZeroSteps / 2);
      got[static_cast<size_t>(w)] = zc::values(vars);
      if (zero) {
        EXPECT_LE(opt->slot_bytes_per_replica(), 13 * 4 * 2);  // ceil(50 / 4) per slot
      }
    });
    for (int w = 0; w < workers; ++w) {
      EXPECT_LE(zc::max_diff(got[static_cast<size_t>(w)], ref), kTol) << "worker " << w;
      EXPECT_EQ(0, zc::max_diff(got[static_cast<size_t>(w)], got[0]));
    }
  }
  remove_temp(path);
}

}  // namespace
