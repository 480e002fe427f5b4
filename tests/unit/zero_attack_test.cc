// ZeRO-1 misuse (sharded optimizer state on some workers only, different
// variable lists across workers or replicas, awkward sizes) and
// mixed-precision gradients that must be rejected: a clear error on every
// worker / replica within the deadline, never a hang or wrong numbers.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <cmath>
#include <exception>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "runtime/variable_impl.h"
#include "diststrat/diststrat.h"
#include "training_util.h"

namespace ds = diststrat;

namespace {

// fn(strategy, worker) on one thread per worker (one CPU replica each) over
// one InProcessGroup, worker w sharding when zero[w]; returns each worker's
// error message ("" = none).
std::vector<std::string> run_workers(
    const std::vector<bool>& zero,
    const std::function<void(ds::MultiWorkerMirroredStrategy&, int)>& fn) {
  const std::vector<std::exception_ptr> errors = ds::testing::run_multi_worker(
      zero, 1, ds::testing::comm_with_timeout(std::chrono::seconds(20)), fn);
  std::vector<std::string> messages(errors.size());
  for (size_t w = 0; w < errors.size(); ++w) {
    if (!errors[w]) continue;
    try {
      std::rethrow_exception(errors[w]);
    } catch (const std::exception& e) {
      messages[w] = e.what();
    }
  }
  return messages;
}

ds::Tensor filled(const ds::Shape& shape, float v) {
  ds::Tensor t(shape, ds::DType::kFloat32);
  for (int64_t i = 0; i < t.num_elements(); ++i)
    t.data<float>()[i] = v + 0.125f * static_cast<float>(i);
  return t;
}

}  // namespace

TEST(ZeroMisuse, ShardingOnOneWorkerOnlyIsAnErrorOnEveryWorker) {
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::string> errors =
      run_workers({true, false}, [](ds::MultiWorkerMirroredStrategy& s, int) {
        ds::Variable a =
            s.create_variable("a", ds::Shape{6}, ds::DType::kFloat32, ds::init::Zeros{});
        ds::Adam adam(s, {});
        for (int step = 0; step < 2; ++step) {
          s.run([&](ds::ReplicaContext& ctx) {
            adam.apply_gradients(ctx, {{filled(a.shape(), 1), a}});
          });
        }
      });
  for (size_t w = 0; w < errors.size(); ++w) {
    EXPECT_NE(errors[w].find("shard_optimizer_state must be the same on every worker"),
              std::string::npos)
        << "worker " << w << ": '" << errors[w] << "'";
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15))
      << "a timeout, not a check";
}

TEST(ZeroMisuse, DifferentVariablesOfTheSameTotalSizeAcrossWorkersAreAnError) {
  // Worker 0 trains {a, b}, worker 1 {a, c}: the flat vectors have the same
  // length, so the collectives alone would match and mix b's and c's state.
  const std::vector<std::string> errors =
      run_workers({true, true}, [](ds::MultiWorkerMirroredStrategy& s, int w) {
        ds::Variable a =
            s.create_variable("a", ds::Shape{4}, ds::DType::kFloat32, ds::init::Zeros{});
        ds::Variable b =
            s.create_variable("b", ds::Shape{4}, ds::DType::kFloat32, ds::init::Zeros{});
        ds::Variable c =
            s.create_variable("c", ds::Shape{2, 2}, ds::DType::kFloat32, ds::init::Zeros{});
        ds::SGD sgd(s, {.learning_rate = 0.1f, .momentum = 0.9f});
        ds::Variable second = w == 0 ? b : c;
        s.run([&](ds::ReplicaContext& ctx) {
          sgd.apply_gradients(ctx,
                              {{filled(a.shape(), 1), a}, {filled(second.shape(), 2), second}});
        });
      });
  for (size_t w = 0; w < errors.size(); ++w) {
    EXPECT_NE(errors[w].find("sharded"), std::string::npos)
        << "worker " << w << ": '" << errors[w] << "'";
  }
}

TEST(ZeroMisuse, DifferentVariablesAcrossMirroredReplicasAreAnErrorNotAHang) {
  ds::MirroredOptions o;
  o.devices = ds::testing::cpu_devices(2);
  o.shard_optimizer_state = true;
  o.communication.timeout = std::chrono::seconds(20);
  ds::MirroredStrategy s(o);
  ds::Variable a = s.create_variable("a", ds::Shape{4}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::Variable b = s.create_variable("b", ds::Shape{3}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::Adam adam(s, {});
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(s.run([&](ds::ReplicaContext& ctx) {
    if (ctx.local_replica_id() == 0) {
      adam.apply_gradients(ctx, {{filled(a.shape(), 1), a}, {filled(b.shape(), 1), b}});
    } else {
      adam.apply_gradients(ctx, {{filled(a.shape(), 1), a}});
    }
  }),
               ds::Error);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15))
      << "a timeout, not a check";
}

TEST(ZeroMisuse, EmptyAndOneElementVariablesOnFourReplicasMatchUnsharded) {
  std::vector<std::vector<float>> result;
  for (bool zero : {false, true}) {
    ds::MirroredOptions o;
    o.devices = ds::testing::cpu_devices(4);
    o.shard_optimizer_state = zero;
    ds::MirroredStrategy s(o);
    ds::Variable e =
        s.create_variable("empty", ds::Shape{0}, ds::DType::kFloat32, ds::init::Zeros{});
    ds::Variable one =
        s.create_variable("one", ds::Shape{1}, ds::DType::kFloat32, ds::init::Constant{0.5});
    ds::Adam adam(s, {.learning_rate = 0.05f});
    adam.set_clipping({.global_norm = 1.0f});
    for (int step = 0; step < 3; ++step) {
      s.run([&](ds::ReplicaContext& ctx) {
        adam.apply_gradients(ctx, {{ds::Tensor(ds::Shape{0}, ds::DType::kFloat32), e},
                                   {filled(one.shape(), 0.5f + ctx.replica_id()), one}});
      });
    }
    std::vector<float> copies;
    for (const ds::Tensor& c : one.impl().copies) copies.push_back(c.data<float>()[0]);
    result.push_back(copies);
  }
  for (size_t r = 0; r < 4; ++r) EXPECT_EQ(result[1][r], result[0][r]) << "replica " << r;
}

TEST(MixedPrecisionMisuse, WrongShapeAndLowPrecisionVariablesAreRejected) {
  ds::MirroredOptions o;
  o.devices = ds::testing::cpu_devices(2);
  o.shard_optimizer_state = true;
  ds::MirroredStrategy s(o);
  ds::Variable a = s.create_variable("a", ds::Shape{4}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::SGD sgd(s, {.learning_rate = 0.1f});
  EXPECT_THROW(s.run([&](ds::ReplicaContext& ctx) {
    sgd.apply_gradients(ctx, {{ds::Tensor(ds::Shape{5}, ds::DType::kFloat16), a}});
  }),
               ds::InvalidArgumentError);
  ds::MirroredStrategy plain(ds::MirroredOptions{.devices = ds::testing::cpu_devices(2)});
  ds::Variable h = plain.create_variable("h", ds::Shape{4}, ds::DType::kFloat16, ds::init::Zeros{});
  ds::SGD sgd2(plain, {.learning_rate = 0.1f});
  EXPECT_THROW(plain.run([&](ds::ReplicaContext& ctx) {
    sgd2.apply_gradients(ctx, {{ds::Tensor(ds::Shape{4}, ds::DType::kFloat16), h}});
  }),
               ds::UnimplementedError);
}

TEST(MixedPrecisionMisuse, BFloat16NaNUnderZeroSkipsTheStepWithLossScaling) {
  ds::MirroredOptions o;
  o.devices = ds::testing::cpu_devices(3);
  o.shard_optimizer_state = true;
  ds::MirroredStrategy s(o);
  ds::Variable a =
      s.create_variable("a", ds::Shape{5}, ds::DType::kFloat32, ds::init::Constant{1.0});
  ds::Adam adam(s, {});
  adam.enable_loss_scaling({8.0f, 1000, 2.0f});
  std::vector<char> skipped(3);  // one byte per replica thread (not vector<bool>'s shared words)
  s.run([&](ds::ReplicaContext& ctx) {
    ds::Tensor g(a.shape(), ds::DType::kBFloat16);
    uint16_t* p = static_cast<uint16_t*>(g.data());
    for (int i = 0; i < 5; ++i) p[i] = ds::BFloat16::from_float(1.0f);
    if (ctx.replica_id() == 2) p[0] = ds::BFloat16::from_float(std::nanf(""));
    skipped[static_cast<size_t>(ctx.local_replica_id())] =
        adam.apply_gradients(ctx, {{g, a}}).skipped;
  });
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_TRUE(skipped[r]) << "replica " << r;
    for (int i = 0; i < 5; ++i)
      EXPECT_EQ(a.impl().copies[r].data<float>()[i], 1.0f) << "replica " << r;
  }
  EXPECT_EQ(adam.skipped_steps(), 1);
}

namespace {

std::string temp_dir() {
  const char* env = std::getenv("TMPDIR");
  std::string tmpl = std::string(env && *env ? env : "/tmp") + "/diststrat_zero_attack_XXXXXX";
  if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp " + tmpl);
  return tmpl;
}

// Three Adam steps on 3 sharded replicas of {w: 7, s: 1}, saved to `path`.
void save_sharded(const std::string& path) {
  ds::MirroredOptions o;
  o.devices = ds::testing::cpu_devices(3);
  o.shard_optimizer_state = true;
  ds::MirroredStrategy s(o);
  ds::Variable w =
      s.create_variable("w", ds::Shape{7}, ds::DType::kFloat32, ds::init::Constant{1.0});
  ds::Variable b =
      s.create_variable("s", ds::Shape{1}, ds::DType::kFloat32, ds::init::Constant{1.0});
  ds::Adam adam(s, {});
  for (int step = 0; step < 3; ++step) {
    s.run([&](ds::ReplicaContext& ctx) {
      adam.apply_gradients(ctx, {{filled(w.shape(), 0.5f), w}, {filled(b.shape(), -1), b}});
    });
  }
  ds::Checkpoint(s, {&adam}).save(path);
}

// Restores `path` into a fresh model (sharded or not, before or after a
// first step); returns the error, "" if it restored.
std::string restore(const std::string& path, bool zero, bool step_first) {
  ds::MirroredOptions o;
  o.devices = ds::testing::cpu_devices(2);
  o.shard_optimizer_state = zero;
  ds::MirroredStrategy s(o);
  ds::Variable w =
      s.create_variable("w", ds::Shape{7}, ds::DType::kFloat32, ds::init::Constant{1.0});
  ds::Variable b =
      s.create_variable("s", ds::Shape{1}, ds::DType::kFloat32, ds::init::Constant{1.0});
  ds::Adam adam(s, {});
  auto step = [&] {
    s.run([&](ds::ReplicaContext& ctx) {
      adam.apply_gradients(ctx, {{filled(w.shape(), 0.5f), w}, {filled(b.shape(), -1), b}});
    });
  };
  if (step_first) step();
  try {
    ds::Checkpoint(s, {&adam}).restore(path);
  } catch (const ds::Error& e) {
    return e.what();
  }
  step();
  return "";
}

}  // namespace

TEST(ZeroCheckpointTampering, ChangedSlotShapeAndTruncationAreRejectedWithAndWithoutSharding) {
  const std::string dir = temp_dir();
  const std::string good = dir + "/good.safetensors";
  save_sharded(good);
  for (bool zero : {false, true}) {
    for (bool step_first : {false, true}) {
      EXPECT_EQ(restore(good, zero, step_first), "")
          << "zero " << zero << " step_first " << step_first;
    }
  }
  // A slot of w with 6 elements instead of 7 (checksums rewritten: the file
  // is self-consistent, only its shapes are wrong).
  ds::SafetensorsFile f = ds::load_safetensors(good);
  std::vector<std::pair<std::string, ds::Tensor>> tensors;
  bool changed = false;
  for (auto& [name, t] : f.tensors) {
    if (!changed && name.rfind("w/", 0) == 0) {
      tensors.emplace_back(name, filled(ds::Shape{6}, 0.0f));
      changed = true;
    } else {
      tensors.emplace_back(name, t);
    }
  }
  ASSERT_TRUE(changed);
  const std::string reshaped = dir + "/reshaped.safetensors";
  ds::save_safetensors(reshaped, tensors);
  // The file's bytes cut in half.
  const std::string truncated = dir + "/truncated.safetensors";
  {
    std::FILE* in = std::fopen(good.c_str(), "rb");
    ASSERT_NE(in, nullptr);
    std::vector<char> bytes(1 << 16);
    const size_t n = std::fread(bytes.data(), 1, bytes.size(), in);
    std::fclose(in);
    std::FILE* out = std::fopen(truncated.c_str(), "wb");
    ASSERT_NE(out, nullptr);
    std::fwrite(bytes.data(), 1, n / 2, out);
    std::fclose(out);
  }
  for (const std::string& bad : {reshaped, truncated}) {
    for (bool zero : {false, true}) {
      for (bool step_first : {false, true}) {
        const std::string e = restore(bad, zero, step_first);
        EXPECT_NE(e.find(bad), std::string::npos)
            << bad << " zero " << zero << " step_first " << step_first << ": '" << e << "'";
      }
    }
  }
  for (const std::string& p : {good, reshaped, truncated}) std::remove(p.c_str());
  std::remove(dir.c_str());
}

namespace {

// `steps` Adam steps (global-norm clipping 1.0) on `replicas` Mirrored
// replicas of `sizes`; replica `poison_replica` puts `poison` into element
// 0 of variable 0's gradient at step 1 (none if poison_replica < 0).
// Returns replica 0's values, all variables laid end to end.
std::vector<float> train_sizes(bool zero, int replicas, const std::vector<int64_t>& sizes,
                               int steps, int poison_replica = -1, float poison = 0.0f,
                               bool clip = true) {
  ds::MirroredOptions o;
  o.devices = ds::testing::cpu_devices(replicas);
  o.shard_optimizer_state = zero;
  ds::MirroredStrategy s(o);
  std::vector<ds::Variable> vars;
  for (size_t k = 0; k < sizes.size(); ++k) {
    vars.push_back(s.create_variable("v" + std::to_string(k), ds::Shape{sizes[k]},
                                     ds::DType::kFloat32,
                                     ds::init::Constant{0.01 * static_cast<double>(k % 17)}));
  }
  ds::Adam adam(s, {.learning_rate = 0.01f});
  if (clip) adam.set_clipping({.global_norm = 1.0f});
  for (int step = 0; step < steps; ++step) {
    s.run([&](ds::ReplicaContext& ctx) {
      std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
      for (size_t k = 0; k < vars.size(); ++k) {
        ds::Tensor g =
            filled(vars[k].shape(), 0.1f * static_cast<float>((k + ctx.replica_id()) % 5) - 0.2f);
        if (step == 1 && k == 0 && ctx.replica_id() == poison_replica) g.data<float>()[0] = poison;
        gv.emplace_back(g, vars[k]);
      }
      adam.apply_gradients(ctx, gv);
    });
  }
  std::vector<float> out;
  for (const ds::Variable& v : vars) {
    const ds::Tensor& c = v.impl().copies[0];
    out.insert(out.end(), c.data<float>(), c.data<float>() + c.num_elements());
  }
  return out;
}

}  // namespace

TEST(ZeroMisuse, ManyTinyVariablesMatchUnsharded) {
  std::vector<int64_t> sizes;
  for (int k = 0; k < 3000; ++k) sizes.push_back(k % 3);  // 0, 1 or 2 elements
  const std::vector<float> plain = train_sizes(false, 4, sizes, 3);
  const std::vector<float> zero = train_sizes(true, 4, sizes, 3);
  ASSERT_EQ(plain.size(), zero.size());
  for (size_t i = 0; i < plain.size(); ++i) ASSERT_NEAR(zero[i], plain[i], 1e-6) << "element " << i;
}

TEST(ZeroMisuse, NonFiniteGradientsWithoutLossScalingGiveTheUnshardedResult) {
  for (float poison : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
    for (bool clip : {false, true}) {
      SCOPED_TRACE(std::to_string(poison) + (clip ? " with clipping" : " without clipping"));
      const std::vector<float> plain = train_sizes(false, 3, {5, 1, 4}, 3, 2, poison, clip);
      const std::vector<float> zero = train_sizes(true, 3, {5, 1, 4}, 3, 2, poison, clip);
      ASSERT_EQ(plain.size(), zero.size());
      for (size_t i = 0; i < plain.size(); ++i) {
        EXPECT_EQ(std::isnan(zero[i]), std::isnan(plain[i])) << "element " << i;
        if (!std::isnan(plain[i])) EXPECT_NEAR(zero[i], plain[i], 1e-6) << "element " << i;
      }
    }
  }
}

TEST(ZeroMisuse, AVariableCreatedAfterTheFirstStepIsUnimplementedOnEveryReplica) {
  ds::MirroredOptions o;
  o.devices = ds::testing::cpu_devices(3);
  o.shard_optimizer_state = true;
  o.communication.timeout = std::chrono::seconds(20);
  ds::MirroredStrategy s(o);
  ds::Variable a = s.create_variable("a", ds::Shape{5}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::Adam adam(s, {});
  s.run([&](ds::ReplicaContext& ctx) { adam.apply_gradients(ctx, {{filled(a.shape(), 1), a}}); });
  ds::Variable late =
      s.create_variable("late", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
  std::vector<std::string> errors(3);
  EXPECT_THROW(s.run([&](ds::ReplicaContext& ctx) {
    try {
      adam.apply_gradients(ctx, {{filled(a.shape(), 1), a}, {filled(late.shape(), 1), late}});
    } catch (const ds::UnimplementedError& e) {
      errors[static_cast<size_t>(ctx.local_replica_id())] = e.what();
      throw;
    }
  }),
               ds::UnimplementedError);
  for (const std::string& e : errors) EXPECT_NE(e.find("other variables"), std::string::npos) << e;
  // The optimizer's state is intact: the original variable list still trains.
  s.run([&](ds::ReplicaContext& ctx) { adam.apply_gradients(ctx, {{filled(a.shape(), 1), a}}); });
  EXPECT_EQ(adam.iterations().value().data<int64_t>()[0], 2);
}

TEST(ZeroMisuse, AVariablePassedTwiceIsAnErrorNotASilentlyDifferentUpdate) {
  // Laid out twice, the two pieces would get their own slots and the second
  // would overwrite the first in the all-gather: neither the unsharded
  // result nor an error. Rejected before any collective, on every replica.
  ds::MirroredOptions o;
  o.devices = ds::testing::cpu_devices(2);
  o.shard_optimizer_state = true;
  o.communication.timeout = std::chrono::seconds(20);
  ds::MirroredStrategy s(o);
  ds::Variable a = s.create_variable("a", ds::Shape{3}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::Variable b = s.create_variable("b", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::Adam adam(s, {});
  std::vector<std::string> errors(2);
  EXPECT_THROW(s.run([&](ds::ReplicaContext& ctx) {
    try {
      adam.apply_gradients(
          ctx, {{filled(a.shape(), 1), a}, {filled(b.shape(), 1), b}, {filled(a.shape(), 2), a}});
    } catch (const ds::InvalidArgumentError& e) {
      errors[static_cast<size_t>(ctx.local_replica_id())] = e.what();
      throw;
    }
  }),
               ds::InvalidArgumentError);
  for (const std::string& e : errors)
    EXPECT_NE(e.find("'a' twice"), std::string::npos) << "'" << e << "'";
  EXPECT_FALSE(adam.sharded()) << "nothing was laid out";
  // The right call still works afterwards.
  s.run([&](ds::ReplicaContext& ctx) {
    adam.apply_gradients(ctx, {{filled(a.shape(), 1), a}, {filled(b.shape(), 1), b}});
  });
  EXPECT_EQ(adam.iterations().value().data<int64_t>()[0], 1);
}
