// Determinism mode (diststrat/determinism.h, docs/determinism.md): the same
// bits on any number of replicas, in process (the sanitizer passes run these;
// determinism_compare.sh compares Fashion-MNIST runs across processes).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "diststrat/diststrat.h"
#include "optim/exact_sum.h"
#include "optim/optim_kernels.h"
#include "runtime/determinism.h"

namespace diststrat {
namespace {

constexpr int64_t kBatch = 96;
constexpr int kShards = 12;

Dataset small_set() {
  const int64_t rows = kBatch * 3 + 40;  // three full batches and a short one
  Tensor x(Shape{rows, 16}, DType::kFloat32);
  Tensor y(Shape{rows}, DType::kInt32);
  std::mt19937 g(5);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int64_t i = 0; i < rows * 16; ++i) x.data<float>()[i] = n(g);
  for (int64_t i = 0; i < rows; ++i) y.data<int32_t>()[i] = static_cast<int32_t>(g() % 4);
  return Dataset(x, y);
}

enum class Opt { kSgdMomentum, kAdamClipAccumulate };

std::unique_ptr<Strategy> make(int replicas, int shards, bool central, bool zero) {
  std::vector<Device> devices;
  for (int i = 0; i < replicas; ++i) devices.push_back(Device::cpu(i));
  if (central) {
    CentralStorageOptions o;
    o.devices = devices;
    o.determinism.virtual_shards = shards;
    return std::make_unique<CentralStorageStrategy>(o);
  }
  MirroredOptions o;
  o.devices = devices;
  o.determinism.virtual_shards = shards;
  o.shard_optimizer_state = zero;
  return std::make_unique<MirroredStrategy>(o);
}

// The bytes of every variable after 8 steps (two epochs, short batches
// included) on `replicas` CPU replicas, with `shards` virtual shards (0: off),
// under MirroredStrategy (`zero`: with ZeRO-1) or (`central`)
// CentralStorageStrategy.
std::vector<char> train(int replicas, int shards, Opt which, bool central = false,
                        bool zero = false) {
  std::unique_ptr<Strategy> owned = make(replicas, shards, central, zero);
  Strategy& strategy = *owned;
  const nn::Mlp mlp({16, 24, 4});
  std::vector<Variable> params = mlp.create_variables(strategy, 1);
  std::unique_ptr<Optimizer> opt;
  if (which == Opt::kAdamClipAccumulate) {
    AdamOptions a;
    a.learning_rate = 0.01f;
    opt = std::make_unique<Adam>(strategy, a);
    GradientClipping c;
    c.global_norm = 0.3f;
    opt->set_clipping(c);
    opt->set_accumulation_steps(2);
  } else {
    SGDOptions s;
    s.learning_rate = 0.1f;
    s.momentum = 0.9f;
    opt = std::make_unique<SGD>(strategy, s);
  }
  const Dataset data = small_set();
  DistributedDataset dist = strategy.distribute(data, kBatch);
  std::vector<char> bytes;
  for (int epoch = 0; epoch < 2; ++epoch) {
    dist.set_epoch(epoch);
    for (const DistributedBatch& b : dist) {
      const float scale = 1.0f / static_cast<float>(b.global_size());
      PerReplica<double> loss = strategy.run([&](ReplicaContext& ctx) {
        std::vector<Tensor> values;
        for (const Variable& v : params) values.push_back(v.read(ctx));
        nn::Mlp::Step s = mlp.forward_backward(values, b.features(ctx), b.labels(ctx), scale);
        std::vector<std::pair<Tensor, Variable>> gv;
        for (size_t i = 0; i < params.size(); ++i) gv.emplace_back(s.grads[i], params[i]);
        opt->apply_gradients(ctx, gv);
        return s.loss_sum;
      });
      const double l = strategy.reduce(ReduceOp::kSum, loss);
      const char* p = reinterpret_cast<const char*>(&l);
      bytes.insert(bytes.end(), p, p + sizeof l);
    }
  }
  for (const Variable& v : strategy.variables()) {
    const Tensor t = v.value();
    const char* p = static_cast<const char*>(t.data());
    bytes.insert(bytes.end(), p, p + t.nbytes());
  }
  return bytes;
}

void expect_same_bits(const std::vector<char>& a, const std::vector<char>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size()), 0) << what;
}

TEST(Determinism, SgdMomentumGivesTheSameBitsOn1To5Replicas) {
  const std::vector<char> one = train(1, kShards, Opt::kSgdMomentum);
  expect_same_bits(one, train(2, kShards, Opt::kSgdMomentum), "1 vs 2 replicas");
  expect_same_bits(one, train(4, kShards, Opt::kSgdMomentum), "1 vs 4 replicas");
  // 12 shards on 5 replicas: 3, 3, 2, 2, 2.
  expect_same_bits(one, train(5, kShards, Opt::kSgdMomentum), "1 vs 5 replicas (uneven)");
}

TEST(Determinism, AdamWithClippingAndAccumulationGivesTheSameBits) {
  const std::vector<char> one = train(1, kShards, Opt::kAdamClipAccumulate);
  expect_same_bits(one, train(2, kShards, Opt::kAdamClipAccumulate), "1 vs 2 replicas");
  expect_same_bits(one, train(4, kShards, Opt::kAdamClipAccumulate), "1 vs 4 replicas");
}

// ZeRO-1 (each replica updates a block of the variables, the blocks cut by
// the replica count) gives the bits of unsharded training: the block is a
// slice of the exact sum, and clipping's norm is the exact sum's, rounded
// once, not a sum of per-block norms.
TEST(Determinism, ZeroOneGivesTheSameBitsAsUnshardedTraining) {
  for (Opt which : {Opt::kSgdMomentum, Opt::kAdamClipAccumulate}) {
    const char* what = which == Opt::kSgdMomentum ? "SGD with momentum" : "Adam, clipping";
    const std::vector<char> one = train(1, kShards, which);
    for (int replicas : {2, 3, 4}) {
      SCOPED_TRACE(std::string(what) + ", ZeRO-1 on " + std::to_string(replicas) + " replicas");
      expect_same_bits(one, train(replicas, kShards, which, false, /*zero=*/true), what);
    }
  }
}

// The norm's sum: one rounding of the exact sum, whatever the order or split.
TEST(Determinism, TheExactSumRoundsOnceWhateverTheOrder) {
  optim_detail::ExactSum a;
  for (double x : {1e16, 1.0, -1e16, 1e-30}) a.add(x);
  EXPECT_EQ(a.value(), 1.0);  // a plain sum in this order gives 0
  std::vector<float> v(1000);
  std::mt19937 g(3);
  std::uniform_real_distribution<float> u(-1e3f, 1e3f);
  for (float& x : v) x = u(g) * std::pow(10.0f, static_cast<float>(g() % 8) - 4.0f);
  optim_detail::ExactSum whole;
  whole.add_squares(v.data(), v.size());
  for (int trial = 0; trial < 5; ++trial) {
    std::shuffle(v.begin(), v.end(), g);
    optim_detail::ExactSum parts;
    parts.add_squares(v.data(), 333);
    parts.add_squares(v.data() + 333, v.size() - 333);
    EXPECT_EQ(parts.value(), whole.value());
  }
}

TEST(Determinism, CentralStorageGivesTheSameBitsAsMirrored) {
  const std::vector<char> one = train(1, kShards, Opt::kSgdMomentum);
  expect_same_bits(one, train(1, kShards, Opt::kSgdMomentum, true), "central storage, 1 replica");
  expect_same_bits(one, train(3, kShards, Opt::kSgdMomentum, true), "central storage, 3 replicas");
}

TEST(Determinism, WithTheModeOffReplicaCountsDiffer) {
  // What the mode is for: without it the split changes the sums' rounding.
  const std::vector<char> one = train(1, 0, Opt::kSgdMomentum);
  const std::vector<char> four = train(4, 0, Opt::kSgdMomentum);
  ASSERT_EQ(one.size(), four.size());
  EXPECT_NE(std::memcmp(one.data(), four.data(), one.size()), 0);
}

TEST(Determinism, ShardsCutTheBatchTheSameWayWhateverTheReplicas) {
  // The partial last batch: 40 rows in 12 shards, the first 4 shards 4 rows.
  int64_t total = 0;
  for (int s = 0; s < kShards; ++s) {
    int64_t begin = 0, len = 0;
    shard_rows(40, kShards, s, &begin, &len);
    EXPECT_EQ(begin, total);
    EXPECT_EQ(len, s < 4 ? 4 : 3);
    total += len;
  }
  EXPECT_EQ(total, 40);
  // Contiguous shard ranges per replica, in order: 12 on 5 = 3, 3, 2, 2, 2.
  const int want[] = {0, 3, 6, 8, 10};
  for (int r = 0; r < 5; ++r) {
    EXPECT_EQ(shards_of_replica(r, 5, kShards).first, want[r]);
    EXPECT_EQ(shards_of_replica(r, 5, kShards).count, r < 2 ? 3 : 2);
  }
}

TEST(Determinism, RunCallsTheStepOncePerShardAndReduceCombinesThemAll) {
  MirroredOptions o;
  o.devices = {Device::cpu(0), Device::cpu(1), Device::cpu(2)};
  o.determinism.virtual_shards = 8;  // 3, 3, 2
  MirroredStrategy strategy(o);
  PerReplica<int64_t> ids = strategy.run([](ReplicaContext& ctx) {
    EXPECT_EQ(ctx.num_replicas_in_sync(), 8);
    EXPECT_EQ(ctx.virtual_shard(), ctx.replica_id());
    return static_cast<int64_t>(ctx.virtual_shard());
  });
  ASSERT_EQ(ids.size(), 8u);
  for (int s = 0; s < 8; ++s) EXPECT_EQ(ids[static_cast<size_t>(s)], s);
  EXPECT_EQ(strategy.reduce(ReduceOp::kSum, ids), 28);
  PerReplica<double> x = strategy.run([](ReplicaContext& ctx) { return 0.5 * ctx.replica_id(); });
  EXPECT_EQ(strategy.reduce(ReduceOp::kMean, x), 14.0 / 8);
  EXPECT_EQ(strategy.reduce(ReduceOp::kMax, x), 3.5);
}

// Gradients handed in directly (SGD, learning rate 1: w = -sum): the
// shards' sum is exact where float addition in any order is not.
TEST(Determinism, TheShardSumIsExactWhereFloatAdditionIsNot) {
  for (int replicas : {1, 3}) {
    MirroredOptions o;
    for (int i = 0; i < replicas; ++i) o.devices.push_back(Device::cpu(i));
    o.determinism.virtual_shards = 12;
    MirroredStrategy strategy(o);
    Variable w = strategy.create_variable("w", Shape{2}, DType::kFloat32, init::Zeros{});
    SGDOptions s;
    s.learning_rate = 1.0f;
    SGD opt(strategy, s);
    strategy.run([&](ReplicaContext& ctx) {
      // Element 0: 2^24, ten 1s, -2^24 (float sums in order give 0 or 2^24).
      // Element 1: 1e-3 in every shard.
      const int shard = ctx.virtual_shard();
      Tensor g(Shape{2}, DType::kFloat32);
      g.data<float>()[0] = shard == 0 ? 16777216.0f : shard == 11 ? -16777216.0f : 1.0f;
      g.data<float>()[1] = 1e-3f;
      opt.apply_gradients(ctx, {{g, w}});
    });
    const Tensor v = w.value();
    EXPECT_EQ(v.data<float>()[0], -10.0f) << replicas << " replicas";
    // 12 * float(1e-3) rounded once to float.
    const double exact = 12.0 * static_cast<double>(1e-3f);
    EXPECT_EQ(v.data<float>()[1], -static_cast<float>(exact)) << replicas << " replicas";
  }
}

// The gradients cross the workers once, as one int64 sum (8 bytes per
// element) after a max of one int64 per tensor; the strategy's own float
// all-reduce of the result is skipped (it was a third all-reduce, 4 bytes
// per element more, before SummedContext).
TEST(Determinism, MultiWorkerSendsTheGradientsOnceAsInt64) {
  CommunicationOptions comm;
  comm.timeout = std::chrono::seconds(60);
  InProcessGroup group(2, comm);
  const nn::Mlp mlp({16, 24, 4});
  const int64_t params = 16 * 24 + 24 + 24 * 4 + 4;
  std::vector<int64_t> bytes(2, -1);
  std::vector<std::vector<char>> values(2);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(2);
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      try {
        MultiWorkerOptions o;
        o.communication = comm;
        o.communicator = &group.at(w);
        o.devices = {Device::cpu(0)};
        o.determinism.virtual_shards = 4;
        MultiWorkerMirroredStrategy s(o);
        std::vector<Variable> vars = mlp.create_variables(s, 1);
        SGD opt(s, SGDOptions{0.1f, 0.0f});
        const Dataset data = small_set();
        DistributedDataset dist = s.distribute(data, kBatch);
        const DistributedBatch b = dist.batch(0);
        const int64_t before = s.stats().bytes;
        s.run([&](ReplicaContext& ctx) {
          std::vector<Tensor> v;
          for (const Variable& var : vars) v.push_back(var.read(ctx));
          nn::Mlp::Step st = mlp.forward_backward(v, b.features(ctx), b.labels(ctx), 1.0f / kBatch);
          std::vector<std::pair<Tensor, Variable>> gv;
          for (size_t i = 0; i < vars.size(); ++i) gv.emplace_back(st.grads[i], vars[i]);
          opt.apply_gradients(ctx, gv);
        });
        bytes[static_cast<size_t>(w)] = s.stats().bytes - before;
        for (const Variable& var : vars) {
          const Tensor t = var.value();
          const char* p = static_cast<const char*>(t.data());
          values[static_cast<size_t>(w)].insert(values[static_cast<size_t>(w)].end(), p,
                                                p + t.nbytes());
        }
      } catch (...) {
        errors[static_cast<size_t>(w)] = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  EXPECT_EQ(bytes[0], 8 * params + 8 * 4)
      << "int64 sums of " << params << " elements + 4 exponents";
  EXPECT_EQ(bytes[1], bytes[0]);
  expect_same_bits(values[0], values[1], "the two workers' variables");
}

// The exact sum's element-wise kernels give the same integers (and floats)
// in every instruction-set variant this CPU runs.
TEST(Determinism, FixedPointKernelsAgreeAcrossVariants) {
  std::mt19937 g(7);
  std::uniform_int_distribution<int> e(-30, 30);
  const size_t n = 1037, shards = 3;  // not a multiple of any vector width
  std::vector<std::vector<float>> x(shards, std::vector<float>(n));
  for (auto& s : x)
    for (float& v : s)
      v = std::ldexp(static_cast<float>(g() % 16777216) / 16777216.0f, e(g)) * (g() % 2 ? 1 : -1);
  x[1][5] = 1.5f * std::ldexp(1.0f, 30);  // the largest; ties at the coarse grid below
  std::vector<const float*> src;
  for (const auto& s : x) src.push_back(s.data());
  const optim_detail::OptimKernels* variants[] = {&optim_detail::isa_baseline::kOptimKernels,
                                                  &optim_detail::isa_avx2::kOptimKernels,
                                                  &optim_detail::isa_avx512::kOptimKernels};
  const int usable = static_cast<int>(cpu_isa_supported());
  std::vector<int64_t> q0(n);
  std::vector<float> f0(n), c0(n);
  for (int shift : {0, 31 - 2 - 30, 61 - 2 - 30}) {
    for (int i = 0; i <= usable; ++i) {
      std::vector<int64_t> q(n);
      std::vector<float> f(n), c(n);
      const int32_t m = variants[i]->copy_max_abs_bits(c.data(), x[1].data(), n);
      variants[i]->fixed_point_sum(q.data(), src.data(), shards, n, shift);
      variants[i]->from_fixed_point(f.data(), q.data(), n, shift);
      if (i == 0) {
        q0 = q;
        f0 = f;
        c0 = c;
        float largest;
        std::memcpy(&largest, &m, sizeof largest);
        EXPECT_EQ(largest, x[1][5]);
        EXPECT_EQ(std::memcmp(c.data(), x[1].data(), n * sizeof(float)), 0);
        // Spot check against the definition (round half to even).
        int64_t want = 0;
        for (size_t j = 0; j < shards; ++j)
          want += std::llrint(std::ldexp(static_cast<double>(x[j][5]), shift));
        EXPECT_EQ(q[5], want) << "shift " << shift;
        continue;
      }
      EXPECT_EQ(q, q0) << cpu_isa_name(static_cast<CpuIsa>(i)) << " shift " << shift;
      EXPECT_EQ(std::memcmp(f.data(), f0.data(), n * sizeof(float)), 0)
          << cpu_isa_name(static_cast<CpuIsa>(i));
      EXPECT_EQ(std::memcmp(c.data(), c0.data(), n * sizeof(float)), 0);
    }
  }
}

TEST(Determinism, RefusesWhatWouldBreakTheBits) {
  // The code of the error fn throws; kInternal when it throws none.
  const auto code_of = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return e.code() == ErrorCode::kInternal ? ErrorCode::kAborted : e.code();
    }
    return ErrorCode::kInternal;
  };
  MirroredOptions o;
  o.devices = {Device::cpu(0), Device::cpu(1)};
  o.determinism.virtual_shards = 4;
  MirroredOptions compressed = o;
  compressed.communication.compression = Compression::kFloat16;
  EXPECT_EQ(code_of([&] { MirroredStrategy s(compressed); }), ErrorCode::kInvalidArgument);
  MirroredOptions few = o;
  few.determinism.virtual_shards = 1;
  EXPECT_EQ(code_of([&] { MirroredStrategy s(few); }), ErrorCode::kInvalidArgument);
  MirroredStrategy strategy(o);
  EXPECT_EQ(
      code_of([&] { strategy.run([](ReplicaContext& ctx) { ctx.barrier("from a shard"); }); }),
      ErrorCode::kFailedPrecondition);
  EXPECT_EQ(code_of([&] {
              strategy.distribute_datasets_from_function(
                  [](const InputContext&) { return small_set(); }, kBatch);
            }),
            ErrorCode::kUnimplemented);
}

}  // namespace
}  // namespace diststrat
