// Row-sparse push benchmark, in one process (PS thread + worker): the cost
// of a row-sparse push of 1% of the rows of a 1M x 64 f32 table against a
// dense push of the whole table (post -> PS applied SGD -> acknowledged),
// median of several reps. (Training throughput of the parameter server is
// benchmarks/train_bench --strategy parameter_server; scripts/ps_bench.sh
// runs both bars.)
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>

#include <diststrat/diststrat.h>

#include "../../examples/common/timeout_flag.h"
#include "allreduce/transport.h"
#include "parameter_server/client.h"
#include "parameter_server/messages.h"
#include "parameter_server/strategy_impl.h"
#include "parameter_server/shard_updater.h"

namespace ds = diststrat;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int sparse(int64_t rows, int64_t dim, double fraction, int reps, const std::string& timeout) {
  ds::ParameterServerOptions o;
  diststrat_examples::apply_timeout(timeout, o.communication);
  ds::InProcessTransportGroup group(2);  // worker 0, PS 1
  auto ps = ds::ps::make_strategy(group.at(1), o);
  double dense_s = 0, sparse_s = 0;
  int64_t touched = 0;
  {
    auto worker = ds::ps::make_strategy(group.at(0), o);
    ds::Variable table = worker->create_row_sparse_variable("table", ds::Shape{rows, dim},
                                                            ds::DType::kFloat32, ds::init::Zeros{});
    // Row-sparse: a whole training step through the strategy (run, which
    // also pulls the step counter, apply_gradients, flush until applied).
    ds::SGD sgd(*worker, {0.01f});
    std::mt19937_64 g(5);
    touched = static_cast<int64_t>(static_cast<double>(rows) * fraction);
    std::vector<double> sparse_times;
    for (int r = 0; r < reps; ++r) {
      std::vector<int64_t> all(static_cast<size_t>(rows));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), g);
      ds::Tensor ids(ds::Shape{touched}, ds::DType::kInt64);
      std::copy(all.begin(), all.begin() + touched, ids.data<int64_t>());
      ds::Tensor grads(ds::Shape{touched, dim}, ds::DType::kFloat32);
      ds::init::Constant{1.0}(grads);
      const auto t0 = Clock::now();
      worker->run([&](ds::ReplicaContext& ctx) {
        worker->apply_gradients(ctx, sgd, {}, {{table, ids, grads}});
      });
      worker->flush();  // the push is applied and acknowledged
      sparse_times.push_back(seconds_since(t0));
    }
    sparse_s = median(sparse_times);
    worker->flush();
  }
  // Dense push of the whole table, timed from the post of the push to its
  // acknowledgement. Driven with the wire protocol directly: through the
  // strategy a dense variable would also be pulled whole every step, which
  // is not the push being measured.
  ps->join();
  {
    ds::InProcessTransportGroup group2(2);
    auto ps2 = ds::ps::make_strategy(group2.at(1), o);
    ds::ps::Client client(group2.at(0), {1}, 0, std::chrono::seconds(300));
    ds::ps::Entry e;
    e.var_id = 0;
    e.name = "table";
    e.dtype = static_cast<int32_t>(ds::DType::kFloat32);
    e.shape = ds::Shape{rows, dim};
    {
      ds::ps::CreateRequest create;
      create.var_id = e.var_id;
      create.name = e.name;
      create.dtype = e.dtype;
      create.full_shape = e.shape;
      create.rows = rows;
      create.has_value = true;
      auto value = std::make_shared<ds::Tensor>(ds::Shape{rows, dim}, ds::DType::kFloat32);
      auto c = client.post(0, ds::ps::Op::kCreate, ds::ps::encode(create), value, value->data(),
                           value->nbytes(), nullptr, 0, "create");
      client.wait(c);
      // Pushes carry no update rule: the chief declares it once (kRule).
      const ds::ps::RuleRequest rule{false, {"sgd", {0.01, 0.0, 0.0}}, {e}};
      c = client.post(0, ds::ps::Op::kRule, ds::ps::encode(rule), nullptr, nullptr, 0, nullptr, 0,
                      "update rule");
      client.wait(c);
    }
    auto grad = std::make_shared<ds::Tensor>(ds::Shape{rows, dim}, ds::DType::kFloat32);
    ds::init::Constant{1.0}(*grad);
    std::vector<double> dense_times;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = Clock::now();
      ds::ps::PushRequest push;
      push.steps_after = r + 1;
      push.pulled_version = 0;
      push.entries = {e};
      auto c = client.post(0, ds::ps::Op::kPush, ds::ps::encode(push), grad, grad->data(),
                           grad->nbytes(), nullptr, 0, "dense push");
      client.wait(c);
      dense_times.push_back(seconds_since(t0));
    }
    dense_s = median(dense_times);
    auto done = client.post(0, ds::ps::Op::kDone, {}, nullptr, nullptr, 0, nullptr, 0, "done");
    client.wait(done);
    ps2->join();
  }
  std::printf("sparse: table=%lldx%lld f32 (%.0f MB) rows_pushed=%lld (%.1f%%)\n",
              static_cast<long long>(rows), static_cast<long long>(dim), rows * dim * 4 / 1e6,
              static_cast<long long>(touched), 100.0 * fraction);
  std::printf("sparse: dense_push_ms=%.2f row_sparse_push_ms=%.2f ratio=%.4f (bar <= 0.05)\n",
              dense_s * 1e3, sparse_s * 1e3, sparse_s / dense_s);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Row-sparse vs dense parameter-server push"};
  int reps = 5;
  int64_t rows = 1000000, dim = 64;
  double fraction = 0.01;
  app.add_option("--rows", rows)->capture_default_str();
  app.add_option("--dim", dim)->capture_default_str();
  app.add_option("--fraction", fraction)->capture_default_str();
  app.add_option("--reps", reps)->capture_default_str();
  std::string timeout;
  diststrat_examples::add_timeout_flag(app, timeout);
  CLI11_PARSE(app, argc, argv);
  try {
    return sparse(rows, dim, fraction, reps, timeout);
  } catch (const ds::Error& e) {
    std::fprintf(stderr, "ps_bench: %s\n", e.what());
    return 1;
  }
}
