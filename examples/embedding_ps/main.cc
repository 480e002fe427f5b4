// A bag-of-ids classifier with a large embedding table on parameter servers.
// Each step pulls only the table rows its batch uses (gather_rows) and pushes
// gradients for only those rows (SparseGradient); the small dense layer is
// pulled and pushed whole. Run in one process (PS threads) or as a job:
//
//   build/examples/embedding_ps
//   mpirun -np 3 build/examples/embedding_ps --ps 1      # 1 PS + 2 workers
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <tuple>

#include <diststrat/diststrat.h>

#include "../common/terminate_on_nan.h"
#include "../common/timeout_flag.h"

namespace ds = diststrat;

namespace {

struct Flags {
  int ps = 1;
  int replicas = 1;
  int64_t vocab = 50000;
  int64_t dim = 16;
  int64_t ids_per_example = 4;
  int64_t examples = 200000;
  int64_t batch = 256;
  int epochs = 3;
  float lr = 20.0f;
  uint64_t seed = 1;
};

// Ids are skewed towards small values (as word or item ids are); the label
// says whether the ids' hidden scores sum to a positive number.
ds::Dataset make_data(const Flags& f, int64_t n, uint64_t seed) {
  std::mt19937_64 truth(12345), g(seed);
  std::normal_distribution<double> normal;
  std::vector<double> score(static_cast<size_t>(f.vocab));
  for (double& s : score) s = normal(truth);
  ds::Tensor ids(ds::Shape{n, f.ids_per_example}, ds::DType::kInt64);
  ds::Tensor labels(ds::Shape{n}, ds::DType::kInt32);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int64_t i = 0; i < n; ++i) {
    double sum = 0;
    for (int64_t k = 0; k < f.ids_per_example; ++k) {
      const auto id = static_cast<int64_t>(static_cast<double>(f.vocab) * std::pow(u(g), 3.0));
      ids.data<int64_t>()[i * f.ids_per_example + k] = std::min(id, f.vocab - 1);
      sum += score[static_cast<size_t>(std::min(id, f.vocab - 1))];
    }
    labels.data<int32_t>()[i] = sum > 0 ? 1 : 0;
  }
  return ds::Dataset(ids, labels);
}

struct Lookup {
  ds::Tensor unique_ids;      // int64 [u]
  std::vector<int64_t> slot;  // per (example, k): row in unique_ids
};

Lookup unique_ids(const ds::Tensor& ids) {
  Lookup l;
  std::map<int64_t, int64_t> pos;
  const int64_t* p = ids.data<int64_t>();
  std::vector<int64_t> uniq;
  for (int64_t i = 0; i < ids.num_elements(); ++i) {
    auto [it, fresh] = pos.emplace(p[i], static_cast<int64_t>(uniq.size()));
    if (fresh) uniq.push_back(p[i]);
    l.slot.push_back(it->second);
  }
  l.unique_ids = ds::Tensor(ds::Shape{static_cast<int64_t>(uniq.size())}, ds::DType::kInt64);
  std::copy(uniq.begin(), uniq.end(), l.unique_ids.data<int64_t>());
  return l;
}

// h[i] = mean of the rows of example i's ids.
ds::Tensor pool(const Lookup& l, const ds::Tensor& rows, int64_t n, int64_t k, int64_t dim) {
  ds::Tensor h(ds::Shape{n, dim}, ds::DType::kFloat32);
  float* hp = h.data<float>();
  const float* r = rows.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < k; ++j) {
      const float* row = r + l.slot[i * k + j] * dim;
      for (int64_t d = 0; d < dim; ++d) hp[i * dim + d] += row[d] / static_cast<float>(k);
    }
  }
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"Embedding-table classifier on parameter servers (row-sparse pull/push)"};
  app.add_option("--ps", f.ps, "PS ranks (the last ranks of the job)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--replicas", f.replicas, "CPU replicas per worker")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--vocab", f.vocab, "rows of the embedding table")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40))
      ->capture_default_str();
  app.add_option("--dim", f.dim, "embedding width")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--examples", f.examples, "training examples")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 32))
      ->capture_default_str();
  app.add_option("--batch", f.batch, "global batch size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--epochs", f.epochs, "passes over the training set")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--lr", f.lr, "SGD learning rate")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  std::string timeout;
  diststrat_examples::add_timeout_flag(app, timeout);
  CLI11_PARSE(app, argc, argv);

  try {
    ds::ParameterServerOptions o;
    o.num_ps = f.ps;
    diststrat_examples::apply_timeout(timeout, o.communication);
    for (int i = 0; i < f.replicas; ++i) o.devices.push_back(ds::Device::cpu(i));
    // Split the table over every PS rank.
    o.partitioner = ds::partitioners::FixedShards{f.ps};
    ds::ParameterServerStrategy strategy(o);
    if (strategy.is_ps()) {
      strategy.join();
      return 0;
    }
    const bool chief = strategy.cluster().is_chief();
    ds::Variable table = strategy.create_row_sparse_variable(
        "embedding", ds::Shape{f.vocab, f.dim}, ds::DType::kFloat32,
        ds::init::RandomNormal{0.0, 0.1, f.seed});
    ds::Variable w =
        strategy.create_variable("dense/kernel", ds::Shape{f.dim, 2}, ds::DType::kFloat32,
                                 ds::init::GlorotUniform{f.seed + 1});
    ds::Variable b = strategy.create_variable("dense/bias", ds::Shape{2}, ds::DType::kFloat32,
                                              ds::init::Zeros{});
    ds::SGD sgd(strategy, {f.lr});

    const ds::Dataset train = make_data(f, f.examples, 7);
    const ds::Dataset test = make_data(f, 5000, 8);
    ds::DistributeOptions dopts;
    dopts.seed = f.seed;
    ds::DistributedDataset dist = strategy.distribute(train, f.batch, dopts);

    int64_t rows_moved = 0, steps = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int epoch = 0; epoch < f.epochs; ++epoch) {
      dist.set_epoch(epoch);
      // reduce() here covers this worker's replicas only: each worker adds its
      // share of every step to a metric on PS 0, which holds every worker's.
      const std::string metric = "embedding_ps/loss/epoch-" + std::to_string(epoch + 1);
      for (const ds::DistributedBatch& batch : dist) {
        const float scale = 1.0f / static_cast<float>(batch.global_size());
        auto loss = strategy.run([&](ds::ReplicaContext& ctx) {
          const ds::Tensor& ids = batch.features(ctx);
          const int64_t n = ids.shape()[0];
          const Lookup l = unique_ids(ids);
          const ds::Tensor rows = strategy.gather_rows(table, l.unique_ids);
          const ds::Tensor h = pool(l, rows, n, f.ids_per_example, f.dim);
          ds::Tensor logits(ds::Shape{n, 2}, ds::DType::kFloat32),
              dlogits(ds::Shape{n, 2}, ds::DType::kFloat32);
          ds::nn::dense_forward(h, w.read(ctx), b.read(ctx), logits);
          const double l_sum =
              ds::nn::softmax_cross_entropy(logits, batch.labels(ctx), dlogits, scale);
          ds::Tensor dh(ds::Shape{n, f.dim}, ds::DType::kFloat32);
          ds::Tensor dw(ds::Shape{f.dim, 2}, ds::DType::kFloat32),
              db(ds::Shape{2}, ds::DType::kFloat32);
          ds::nn::dense_backward(h, w.read(ctx), dlogits, &dh, dw, db);
          // Each id's row receives dh / k from every example that uses it.
          ds::Tensor drows(rows.shape(), ds::DType::kFloat32);
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t j = 0; j < f.ids_per_example; ++j) {
              float* dst = drows.data<float>() + l.slot[i * f.ids_per_example + j] * f.dim;
              for (int64_t d = 0; d < f.dim; ++d) {
                dst[d] += dh.data<float>()[i * f.dim + d] / static_cast<float>(f.ids_per_example);
              }
            }
          }
          strategy.apply_gradients(ctx, sgd, {{dw, w}, {db, b}}, {{table, l.unique_ids, drows}});
          return std::make_tuple(l_sum, static_cast<double>(n), l.unique_ids.num_elements());
        });
        double loss_sum = 0, examples = 0;
        for (const auto& [ls, n, u] : loss) {
          loss_sum += ls;
          examples += n;
          rows_moved += u;
        }
        diststrat_examples::terminate_on_nan(loss_sum, examples, steps + 1, "embedding_ps");
        strategy.add_to_metric(metric, loss_sum, examples);
        ++steps;
      }
      if (chief) {
        // Workers run at their own pace: this is every example any worker had
        // finished in this epoch when the chief finished it.
        const ds::MetricTotals t = strategy.read_metric(metric);
        std::printf("epoch %d  mean loss %.4f (over %.0f examples of every worker)\n", epoch + 1,
                    t.mean(), t.count);
      }
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    strategy.barrier("evaluate");
    // Evaluate: pull the rows the test set uses, once.
    const Lookup l = unique_ids(test.features());
    const ds::Tensor rows = strategy.gather_rows(table, l.unique_ids);
    const ds::Tensor h = pool(l, rows, test.size(), f.ids_per_example, f.dim);
    ds::Tensor logits(ds::Shape{test.size(), 2}, ds::DType::kFloat32);
    ds::nn::dense_forward(h, w.value(), b.value(), logits);
    const double accuracy =
        static_cast<double>(ds::nn::count_correct(logits, test.labels())) / test.size();
    const ds::ParameterServerStats st = strategy.stats();
    if (chief) {
      const double rows_per_step = static_cast<double>(rows_moved) / std::max<int64_t>(steps, 1);
      std::printf(
          "final: strategy=parameter_server workers=%d test_accuracy=%.4f steps=%lld "
          "rows_per_step=%.0f (%.2f%% of %lld) seconds=%.1f mean_staleness=%.2f "
          "max_staleness=%lld pushes_applied=%lld\n",
          strategy.cluster().num_workers, accuracy, static_cast<long long>(steps), rows_per_step,
          100.0 * rows_per_step / static_cast<double>(f.vocab), static_cast<long long>(f.vocab),
          seconds, st.mean_staleness, static_cast<long long>(st.max_staleness),
          static_cast<long long>(st.pushes_applied));
    }
    strategy.barrier("done");
    return 0;
  } catch (const ds::Error& e) {
    std::fprintf(stderr, "embedding_ps: %s\n", e.what());
    return 1;
  }
}
