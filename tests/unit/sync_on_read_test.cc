// Sync-on-read (kOnRead) variables under every strategy: a cross-replica
// assign reads back what was assigned, for every aggregation, and a
// checkpoint save + restore leaves value() unchanged (TensorFlow's rule: the
// checkpoint holds the aggregated value, restore writes it back so that the
// aggregate is that value), also when restoring onto another replica or
// worker count. Multi-worker runs its workers as threads over an
// InProcessGroup.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "diststrat/diststrat.h"
#include "diststrat/multi_worker_mirrored.h"
#include "strategy_configs.h"
#include "../common/temp_dir.h"
#include "../common/compare.h"

namespace ds = diststrat;

namespace {

using diststrat_test::same_bytes;
using ds::testing::cpu_devices;

using Config = ds::testing::StrategyConfig;
using ds::testing::with_strategy;

const std::vector<Config>& setups() {
  static const std::vector<Config> s = {
      {"mirrored", 1, 1},        {"mirrored", 1, 2},        {"mirrored", 1, 3},
      {"central_storage", 1, 1}, {"central_storage", 1, 2}, {"central_storage", 1, 3},
      {"multi_worker", 2, 1},    {"multi_worker", 2, 2},    {"multi_worker", 3, 1},
  };
  return s;
}

using diststrat_test::temp_dir;
constexpr char kOnReadTempPrefix[] =
    "diststrat-onread-";  // removed at exit (tests/common/temp_dir.h)

ds::VariableOptions on_read(ds::VariableAggregation a) {
  ds::VariableOptions o;
  o.synchronization = ds::VariableSynchronization::kOnRead;
  o.aggregation = a;
  o.trainable = false;
  return o;
}

const std::vector<std::pair<const char*, ds::VariableAggregation>> kAggregations = {
    {"sum", ds::VariableAggregation::kSum},
    {"mean", ds::VariableAggregation::kMean},
    {"only_first_replica", ds::VariableAggregation::kOnlyFirstReplica},
    {"none", ds::VariableAggregation::kNone},
};

// {10, -3.5, 7, 1e6 + 1} as f32, or {10, -3, 7, 1e12 + 1} as i64.
ds::Tensor sample(ds::DType dtype) {
  ds::Tensor t(ds::Shape{4}, dtype);
  if (dtype == ds::DType::kFloat32) {
    const float v[] = {10.0f, -3.5f, 7.0f, 1e6f + 1.0f};
    std::memcpy(t.data(), v, sizeof v);
  } else {
    const int64_t v[] = {10, -3, 7, 1000000000001};
    std::memcpy(t.data(), v, sizeof v);
  }
  return t;
}

std::string values_of(const ds::Tensor& t) {
  std::string s;
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    s +=
        (i ? ", " : "") + (t.dtype() == ds::DType::kFloat32 ? std::to_string(t.data<float>()[i])
                                                            : std::to_string(t.data<int64_t>()[i]));
  }
  return "{" + s + "}";
}

}  // namespace

TEST(SyncOnRead, CrossReplicaAssignReadsBackForEveryAggregationAndStrategy) {
  for (const Config& s : setups()) {
    with_strategy(s, [&](ds::Strategy& st, int worker) {
      for (ds::DType dtype : {ds::DType::kFloat32, ds::DType::kInt64}) {
        for (const auto& [agg_name, agg] : kAggregations) {
          const std::string name = std::string("v/") + agg_name + "/" + ds::dtype_name(dtype);
          ds::Variable v =
              st.create_variable(name, ds::Shape{4}, dtype, ds::init::Zeros{}, on_read(agg));
          const ds::Tensor want = sample(dtype);
          v.assign(want);
          const ds::Tensor got = v.value();
          EXPECT_TRUE(same_bytes(got, want))
              << s.label() << " worker " << worker << " " << name << ": assign " << values_of(want)
              << " then value() " << values_of(got);
        }
      }
    });
  }
}

TEST(SyncOnRead, ReplicaUpdatesAggregateAsDocumented) {
  for (const Config& s : setups()) {
    with_strategy(s, [&](ds::Strategy& st, int worker) {
      const int n = st.num_replicas_in_sync();
      ds::Variable sum =
          st.create_variable("sum", ds::Shape{}, ds::DType::kInt64, ds::init::Zeros{},
                             on_read(ds::VariableAggregation::kSum));
      ds::Variable mean =
          st.create_variable("mean", ds::Shape{}, ds::DType::kFloat32, ds::init::Zeros{},
                             on_read(ds::VariableAggregation::kMean));
      ds::Variable first =
          st.create_variable("first", ds::Shape{}, ds::DType::kFloat32, ds::init::Zeros{},
                             on_read(ds::VariableAggregation::kOnlyFirstReplica));
      st.run([&](ds::ReplicaContext& ctx) {
        sum.read(ctx).data<int64_t>()[0] += ctx.replica_id() + 1;
        mean.read(ctx).data<float>()[0] = float(ctx.replica_id());
        first.read(ctx).data<float>()[0] = float(ctx.replica_id() + 7);
      });
      const std::string where = s.label() + " worker " + std::to_string(worker);
      EXPECT_EQ(sum.value().data<int64_t>()[0], int64_t(n) * (n + 1) / 2) << where;
      EXPECT_EQ(mean.value().data<float>()[0], float(n - 1) / 2) << where;
      EXPECT_EQ(first.value().data<float>()[0], 7.0f) << where;
    });
  }
}

// The counter: replicas count rows, the program saves and restores
// every "epoch"; the count must not change across 5 save/restore cycles, and
// counting goes on from the restored value.
TEST(SyncOnRead, CounterSurvivesFiveSaveRestoreCyclesUnderEveryStrategy) {
  for (const Config& s : setups()) {
    const std::string dir = temp_dir(kOnReadTempPrefix);
    with_strategy(s, [&](ds::Strategy& st, int worker) {
      const std::string where = s.label() + " worker " + std::to_string(worker);
      const int n = st.num_replicas_in_sync();
      std::vector<ds::Variable> vars;
      for (const auto& [agg_name, agg] : kAggregations) {
        vars.push_back(st.create_variable(std::string("count/") + agg_name, ds::Shape{2},
                                          ds::DType::kFloat32, ds::init::Zeros{}, on_read(agg)));
        vars.push_back(st.create_variable(std::string("count64/") + agg_name, ds::Shape{2},
                                          ds::DType::kInt64, ds::init::Zeros{}, on_read(agg)));
      }
      auto count_rows = [&] {
        st.run([&](ds::ReplicaContext& ctx) {
          for (ds::Variable& v : vars) {
            ds::Tensor t = v.read(ctx);
            if (t.dtype() == ds::DType::kFloat32) {
              t.data<float>()[0] += 1920.0f;
              t.data<float>()[1] += float(ctx.replica_id());
            } else {
              t.data<int64_t>()[0] += 1920;
              t.data<int64_t>()[1] += ctx.replica_id();
            }
          }
        });
      };
      count_rows();
      ds::Checkpoint ckpt(st);
      std::vector<ds::Tensor> before;
      for (ds::Variable& v : vars) before.push_back(v.value());
      // The sum counter: 1920 rows per replica, replica ids summed.
      EXPECT_EQ(before[0].data<float>()[0], 1920.0f * n) << where;
      EXPECT_EQ(before[1].data<int64_t>()[1], int64_t(n) * (n - 1) / 2) << where;
      for (int cycle = 0; cycle < 5; ++cycle) {
        const std::string path = dir + "/c" + std::to_string(cycle) + ".safetensors";
        ckpt.save(path);
        for (ds::Variable& v : vars) v.assign(ds::Tensor(v.shape(), v.dtype()));  // scramble: zeros
        ckpt.restore(path);
        for (size_t k = 0; k < vars.size(); ++k) {
          const ds::Tensor now = vars[k].value();
          EXPECT_TRUE(same_bytes(now, before[k]))
              << where << " cycle " << cycle << " '" << vars[k].name()
              << "': " << values_of(before[k]) << " became " << values_of(now);
        }
      }
      // Counting continues from the restored value.
      count_rows();
      const ds::Tensor sum = vars[0].value();
      EXPECT_EQ(sum.data<float>()[0], 2 * 1920.0f * n) << where;
      const ds::Tensor sum64 = vars[1].value();
      EXPECT_EQ(sum64.data<int64_t>()[1], int64_t(n) * (n - 1)) << where;
    });
  }
}

TEST(SyncOnRead, RestoreOntoAnotherReplicaOrWorkerCountKeepsTheAggregate) {
  const std::vector<std::pair<Config, Config>> pairs = {
      {{"mirrored", 1, 2}, {"mirrored", 1, 3}},
      {{"mirrored", 1, 3}, {"central_storage", 1, 2}},
      {{"central_storage", 1, 2}, {"multi_worker", 3, 1}},
      {{"multi_worker", 2, 2}, {"mirrored", 1, 1}},
      {{"multi_worker", 2, 1}, {"multi_worker", 2, 2}},
  };
  for (const auto& [from, to] : pairs) {
    const std::string path = temp_dir(kOnReadTempPrefix) + "/x.safetensors";
    std::vector<ds::Tensor> saved;
    auto make = [&](ds::Strategy& st) {
      std::vector<ds::Variable> vars;
      for (const auto& [agg_name, agg] : kAggregations) {
        vars.push_back(st.create_variable(std::string("m/") + agg_name, ds::Shape{1},
                                          ds::DType::kInt64, ds::init::Zeros{}, on_read(agg)));
      }
      return vars;
    };
    with_strategy(from, [&](ds::Strategy& st, int worker) {
      std::vector<ds::Variable> vars = make(st);
      st.run([&](ds::ReplicaContext& ctx) {
        for (ds::Variable& v : vars) v.read(ctx).data<int64_t>()[0] = 100 + 10 * ctx.replica_id();
      });
      std::vector<ds::Tensor> values;
      for (ds::Variable& v : vars) values.push_back(v.value());
      ds::Checkpoint(st).save(path);
      if (worker == 0) saved = values;
    });
    with_strategy(to, [&](ds::Strategy& st, int worker) {
      std::vector<ds::Variable> vars = make(st);
      ds::Checkpoint(st).restore(path);
      for (size_t k = 0; k < vars.size(); ++k) {
        const ds::Tensor got = vars[k].value();
        EXPECT_TRUE(same_bytes(got, saved[k]))
            << from.label() << " -> " << to.label() << " worker " << worker << " '"
            << vars[k].name() << "': saved " << values_of(saved[k]) << ", restored "
            << values_of(got);
      }
    });
  }
}

TEST(SyncOnRead, TrainableSyncOnReadVariablesAreRejected) {
  ds::MirroredStrategy st(cpu_devices(2));
  ds::VariableOptions o = on_read(ds::VariableAggregation::kSum);
  o.trainable = true;
  try {
    st.create_variable("bn/moving_mean", ds::Shape{3}, ds::DType::kFloat32, ds::init::Zeros{}, o);
    ADD_FAILURE() << "a trainable kOnRead variable was accepted";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("bn/moving_mean"), std::string::npos) << e.what();
  }
}

// ParameterServerStrategy keeps one copy of every variable on the PS and the
// worker's replicas read a pulled cache: per-replica copies have no place
// there, so a kOnRead variable is refused by name instead of silently
// losing every replica's writes at the next pull.
TEST(SyncOnRead, ParameterServerRejectsSyncOnReadVariablesByName) {
  ds::ParameterServerOptions o;
  o.num_ps = 1;
  o.communication.timeout = std::chrono::seconds(30);
  ds::InProcessTransportGroup group(2);  // worker 0, PS rank 1
  auto ps = ds::ps::make_strategy(group.at(1), o);
  {
    auto worker = ds::ps::make_strategy(group.at(0), o);
    try {
      worker->create_variable("metrics/count", ds::Shape{}, ds::DType::kFloat32, ds::init::Zeros{},
                              on_read(ds::VariableAggregation::kSum));
      ADD_FAILURE() << "ParameterServerStrategy accepted a kOnRead variable";
    } catch (const ds::UnimplementedError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("metrics/count"), std::string::npos) << msg;
      EXPECT_NE(msg.find("ParameterServerStrategy"), std::string::npos) << msg;
    }
    // Ordinary variables still work on the same strategy.
    ds::Variable w =
        worker->create_variable("w", ds::Shape{2}, ds::DType::kFloat32, ds::init::Constant{1});
    EXPECT_EQ(w.value().data<float>()[1], 1.0f);
  }
  ps->join();
}
