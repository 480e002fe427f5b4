// One worker of an elastic job (diststrat/elastic.h) for the process tests
// (tests/elastic/elastic_cell.sh): a linear model trained with SGD over a
// fixed synthetic dataset, plus a row counter that the optimizer updates
// (+lr for every use of a row), so that the end state proves that every row
// was used exactly once per epoch whatever happened. Each worker prints
//   "<id>: group G rank R of N (step S)"        after every membership change
//   "<id>: step S at T ms"                      after each step (T: CLOCK_REALTIME)
//   "<id>: final workers=N steps=S weight_diff=D count_error=E changes=C redone=R"
// where D is the largest difference from the same training run sequentially
// over the same global batches, and E the largest |uses - epochs| of a row.
// --zero-adam: the weights with Adam and the optimizer state sharded over the
// workers (ZeRO-1, shard_optimizer_state), the reference likewise.
// --deterministic-across-workers V: determinism mode (docs/determinism.md);
// --save PATH: the final variables' bytes (w, then row_uses) written to
// PATH.<id>, for a `cmp` against another run's.
#include <time.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../common/elastic_model.h"
#include "diststrat/diststrat.h"

namespace ds = diststrat;

namespace {

using diststrat_test::elastic_model::kFeatures;
using diststrat_test::elastic_model::kLr;
using diststrat_test::elastic_model::kMomentum;
using diststrat_test::elastic_model::make_data;
using diststrat_test::elastic_model::reference;
using diststrat_test::elastic_model::reference_adam;

long long now_ms() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<long long>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"One worker of an elastic test job"};
  std::string rendezvous, id, listen_host;
  int min_workers = 1, max_workers = 0, rows = 512, batch = 32, epochs = 3, delay_ms = 0;
  int settle_ms = 1000, timeout_ms = 10000;
  app.add_option("--rendezvous", rendezvous, "redis://host:port/job or file:///dir/job")
      ->required();
  app.add_option("--id", id, "worker id")->required();
  app.add_option("--listen-host", listen_host, "address peers reach this worker at");
  app.add_option("--min-workers", min_workers)->check(CLI::Range(1, 1000));
  app.add_option("--max-workers", max_workers)->check(CLI::Range(0, 1000));
  app.add_option("--rows", rows)->check(CLI::Range(1, 1 << 20));
  app.add_option("--batch", batch)->check(CLI::Range(1, 1 << 20));
  app.add_option("--epochs", epochs)->check(CLI::Range(1, 1000));
  app.add_option("--step-delay-ms", delay_ms, "sleep per step (stretches the run)")
      ->check(CLI::Range(0, 10000));
  app.add_option("--settle-ms", settle_ms)->check(CLI::Range(1, 600000));
  app.add_option("--timeout-ms", timeout_ms)->check(CLI::Range(100, 600000));
  bool zero_adam = false;
  app.add_flag("--zero-adam", zero_adam, "Adam, its state sharded over the workers (ZeRO-1)");
  int virtual_shards = 0;
  app.add_option("--deterministic-across-workers", virtual_shards, "determinism mode's V")
      ->check(CLI::Range(0, 1 << 20));
  std::string save;
  app.add_option("--save", save, "write the final variables' bytes to PATH.<id>");
  CLI11_PARSE(app, argc, argv);

  try {
    ds::MultiWorkerOptions o;
    o.elastic.rendezvous = rendezvous;
    o.elastic.worker_id = id;
    o.elastic.listen_host = listen_host;
    o.elastic.min_workers = min_workers;
    o.elastic.max_workers = max_workers;
    o.elastic.settle_timeout = std::chrono::milliseconds(settle_ms);
    o.elastic.join_poll = std::chrono::milliseconds(100);
    o.elastic.join_timeout = std::chrono::seconds(120);
    o.communication.timeout = std::chrono::milliseconds(timeout_ms);
    o.shard_optimizer_state = zero_adam;
    o.determinism.virtual_shards = virtual_shards;
    ds::MultiWorkerMirroredStrategy s(o);
    ds::Variable w =
        s.create_variable("w", ds::Shape{kFeatures}, ds::DType::kFloat32, ds::init::Zeros{});
    ds::Variable uses =
        s.create_variable("row_uses", ds::Shape{rows}, ds::DType::kFloat32, ds::init::Zeros{});
    // The weights with momentum, or Adam (slots to commit, restore and
    // send); the counter without (each use adds exactly lr).
    std::unique_ptr<ds::Optimizer> weights_opt;
    if (zero_adam) {
      namespace em = diststrat_test::elastic_model;
      weights_opt =
          std::make_unique<ds::Adam>(s, ds::AdamOptions{em::kAdamLr, em::kBeta1, em::kBeta2,
                                                        em::kEpsilon, ds::LearningRateSchedule{}});
    } else {
      weights_opt = std::make_unique<ds::SGD>(s, ds::SGDOptions{kLr, kMomentum});
    }
    ds::Optimizer& opt = *weights_opt;
    ds::SGD count_opt(s, {kLr, 0.0f});
    ds::DistributeOptions dopts;
    dopts.shuffle = false;
    ds::DistributedDataset dist = s.distribute(make_data(rows), batch, dopts);
    ds::ElasticState state(s, {&opt, &count_opt});
    state.on_membership_change([&](const ds::MembershipChange& c) {
      std::printf("%s: group %lld rank %d of %d (step %lld)\n", id.c_str(),
                  static_cast<long long>(c.group), c.rank, c.num_workers,
                  static_cast<long long>(c.step));
      std::fflush(stdout);
    });
    state.run([&](ds::ElasticState& st) {
      ds::DataPosition& pos = st.position;
      for (; pos.epoch < epochs; ++pos.epoch, pos.batch = 0) {
        dist.set_epoch(pos.epoch);
        for (; pos.batch < dist.num_batches(); ++pos.batch, ++pos.step) {
          const ds::DistributedBatch b = dist.batch(pos.batch);
          s.run([&](ds::ReplicaContext& ctx) {
            ds::Tensor gw(ds::Shape{kFeatures}, ds::DType::kFloat32);
            ds::Tensor gu(ds::Shape{rows}, ds::DType::kFloat32);
            diststrat_test::elastic_model::gradients(b.features(ctx), b.labels(ctx), w.read(ctx),
                                                     b.global_size(), rows, &gw, &gu);
            opt.apply_gradients(ctx, {{gw, w}});
            count_opt.apply_gradients(ctx, {{gu, uses}});
          });
          std::printf("%s: step %lld at %lld ms\n", id.c_str(),
                      static_cast<long long>(pos.step + 1), now_ms());
          std::fflush(stdout);
          if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
        }
      }
    });
    const std::vector<float> ref =
        zero_adam ? reference_adam(rows, batch, epochs) : reference(rows, batch, epochs);
    const ds::Tensor wv = w.value(), uv = uses.value();
    double weight_diff = 0, count_error = 0;
    for (int f = 0; f < kFeatures; ++f) {
      weight_diff = std::max(weight_diff, std::fabs(double(wv.data<float>()[f]) - ref[f]));
    }
    for (int r = 0; r < rows; ++r) {
      count_error = std::max(count_error, std::fabs(double(uv.data<float>()[r]) / kLr - epochs));
    }
    if (!save.empty()) {
      std::ofstream out(save + "." + id, std::ios::binary);
      out.write(static_cast<const char*>(wv.data()), static_cast<std::streamsize>(wv.nbytes()));
      out.write(static_cast<const char*>(uv.data()), static_cast<std::streamsize>(uv.nbytes()));
      if (!out) throw ds::InternalError("cannot write " + save + "." + id);
    }
    std::printf(
        "%s: final workers=%d steps=%lld weight_diff=%.3g count_error=%.3g changes=%lld "
        "redone=%lld\n",
        id.c_str(), s.cluster().num_workers, static_cast<long long>(state.position.step),
        weight_diff, count_error, static_cast<long long>(state.membership_changes()),
        static_cast<long long>(state.steps_redone()));
    return 0;
  } catch (const ds::Error& e) {
    std::fprintf(stderr, "%s: %s\n", id.c_str(), e.what());
    return 1;
  }
}
