// Trains an MLP (784-256-256-10) on Fashion-MNIST under the strategy named by
// --strategy. The training loop below is written once against Strategy&.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include <diststrat/diststrat.h>

namespace ds = diststrat;

namespace {

struct Flags {
  std::string strategy = "mirrored";
  std::string device = "cpu";
  int split_gpus = 1;
  int replicas = 2;
  int ps = 1;
  int max_staleness = -1;
  int epochs = 3;
  int64_t batch = 128;
  float lr = 0.05f;
  float momentum = 0.9f;
  uint64_t seed = 1;
  std::string data = ds::kFashionMnistDir;
  int64_t limit = 0;
  std::string timeline;
  bool replicas_given = false;
};

std::unique_ptr<ds::Strategy> make_strategy(const Flags& f) {
  std::vector<ds::Device> devices;
  for (int i = 0; i < f.replicas; ++i) {
    devices.push_back(f.device == "gpu" ? ds::Device::gpu(i) : ds::Device::cpu(i));
  }
  if (!f.timeline.empty() && f.strategy != "multi_worker") {
    throw ds::InvalidArgumentError("--timeline needs --strategy multi_worker");
  }
  if (f.strategy == "mirrored") {
    ds::MirroredOptions o;
    o.devices = devices;
    if (f.device == "gpu" && f.split_gpus > 1) {
      // Each GPU becomes split_gpus logical GPUs sharing its memory.
      o.device_manager = std::make_shared<ds::DeviceManager>();
      for (const ds::PhysicalDeviceInfo& p : o.device_manager->list_physical_devices()) {
        const size_t each = p.free_memory_bytes / 10 * 9 / static_cast<size_t>(f.split_gpus);
        o.device_manager->set_logical_device_configuration(
            p.ordinal, std::vector<ds::LogicalDeviceConfiguration>(f.split_gpus, {each}));
      }
    }
    return std::make_unique<ds::MirroredStrategy>(o);
  }
  if (f.strategy == "central_storage") return std::make_unique<ds::CentralStorageStrategy>(devices);
  // Multi-process strategies: one replica per process unless --replicas says
  // otherwise (mpirun -np N already gives one process per core).
  const std::vector<ds::Device> per_process =
      f.replicas_given ? devices : std::vector<ds::Device>{devices.front()};
  if (f.strategy == "multi_worker") {
    ds::MultiWorkerOptions o;
    o.devices = per_process;
    o.timeline_path = f.timeline;
    return std::make_unique<ds::MultiWorkerMirroredStrategy>(o);
  }
  if (f.strategy == "parameter_server") {
    ds::ParameterServerOptions o;
    o.num_ps = f.ps;
    o.devices = per_process;
    o.max_staleness = f.max_staleness;
    return std::make_unique<ds::ParameterServerStrategy>(o);
  }
  throw ds::InvalidArgumentError(
      "unknown --strategy '" + f.strategy +
      "' (available: mirrored, central_storage, multi_worker, parameter_server)");
}

// One updating line on a terminal, plain periodic lines otherwise.
class Progress {
 public:
  Progress(bool enabled, int64_t total_steps)
      : enabled_(enabled), tty_(isatty(fileno(stdout))), total_(total_steps),
        start_(std::chrono::steady_clock::now()), last_(start_) {}

  void update(int epoch, int64_t step, double loss, int64_t samples) {
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    const double since_last = std::chrono::duration<double>(now - last_).count();
    const bool final_step = step == total_;
    if (!final_step && since_last < (tty_ ? 0.2 : 5.0)) return;
    last_ = now;
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double sps = elapsed > 0 ? samples / elapsed : 0.0;
    const double eta = step > 0 ? elapsed * (total_ - step) / step : 0.0;
    std::printf("%sepoch %d  step %lld/%lld  loss %.4f  %.0f samples/s  ETA %.0fs%s",
                tty_ ? "\r" : "", epoch + 1, static_cast<long long>(step),
                static_cast<long long>(total_), loss, sps, eta, tty_ ? "   " : "\n");
    if (tty_ && final_step) std::printf("\n");
    std::fflush(stdout);
  }

 private:
  bool enabled_, tty_;
  int64_t total_;
  std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"Train an MLP on Fashion-MNIST with a diststrat strategy"};
  app.add_option("--strategy", f.strategy,
                 "mirrored | central_storage | multi_worker (under mpirun) | parameter_server")
      ->capture_default_str();
  app.add_option("--ps", f.ps, "parameter_server: PS ranks (the last ranks of the job)")
      ->check(CLI::Range(1, 1024))->capture_default_str();
  app.add_option("--max-staleness", f.max_staleness,
                 "parameter_server: steps a worker may run ahead of the slowest (-1 = async)")
      ->capture_default_str();
  app.add_option("--device", f.device, "where replicas compute: cpu or gpu")
      ->check(CLI::IsMember({"cpu", "gpu"}))->capture_default_str();
  app.add_option("--split-gpus", f.split_gpus, "logical GPUs per physical GPU (--device gpu)")
      ->check(CLI::Range(1, 16))->capture_default_str();
  app.add_option("--replicas", f.replicas,
                 "replicas (devices) per process (multi_worker, parameter_server default: 1)")
      ->check(CLI::Range(1, 256))->capture_default_str();
  app.add_option("--epochs", f.epochs, "passes over the training set")
      ->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--batch", f.batch, "global batch size")->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--lr", f.lr, "learning rate (SGD)")->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--momentum", f.momentum, "SGD momentum")->check(CLI::Range(0.0, 0.999))
      ->capture_default_str();
  app.add_option("--seed", f.seed, "initialization and shuffling seed")->capture_default_str();
  app.add_option("--data", f.data, "directory with the IDX files")->capture_default_str();
  app.add_option("--limit", f.limit, "use only the first N training rows (0 = all)")
      ->capture_default_str();
  app.add_option("--timeline", f.timeline,
                 "write a Chrome trace (Perfetto) of the communication to FILE (multi_worker)");
  CLI11_PARSE(app, argc, argv);
  f.replicas_given = app.count("--replicas") > 0;

  try {
    std::unique_ptr<ds::Strategy> strategy = make_strategy(f);
    auto* ps = dynamic_cast<ds::ParameterServerStrategy*>(strategy.get());
    if (ps && ps->is_ps()) {  // PS ranks serve until the workers are done
      ps->join();
      return 0;
    }
    const ds::ClusterInfo cluster = strategy->cluster();
    const bool chief = cluster.is_chief() || cluster.world_size == 1;

    const ds::Dataset train = ds::load_mnist_split(f.data, "train", f.limit);
    const ds::Dataset test = ds::load_mnist_split(f.data, "t10k");

    ds::nn::Mlp mlp({784, 256, 256, 10});
    std::vector<ds::Variable> params = mlp.create_variables(*strategy, f.seed);
    ds::SGD opt(*strategy, {f.lr, f.momentum});

    ds::DistributeOptions dopts;
    dopts.seed = f.seed;
    ds::DistributedDataset dist = strategy->distribute(train, f.batch, dopts);
    Progress progress(chief, dist.num_batches() * f.epochs);

    const auto t0 = std::chrono::steady_clock::now();
    int64_t step = 0, samples = 0;
    for (int epoch = 0; epoch < f.epochs; ++epoch) {
      dist.set_epoch(epoch);
      for (const ds::DistributedBatch& batch : dist) {
        const float scale = 1.0f / static_cast<float>(batch.global_size());
        ds::PerReplica<double> loss = strategy->run([&](ds::ReplicaContext& ctx) {
          std::vector<ds::Tensor> values;
          for (const ds::Variable& v : params) values.push_back(v.read(ctx));
          ds::nn::Mlp::Step s =
              mlp.forward_backward(values, batch.features(ctx), batch.labels(ctx), scale);
          std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
          for (size_t i = 0; i < params.size(); ++i) gv.emplace_back(s.grads[i], params[i]);
          opt.apply_gradients(ctx, gv);
          return s.loss_sum * scale;
        });
        const double mean_loss = strategy->reduce(ds::ReduceOp::kSum, loss);
        samples += batch.global_size();
        progress.update(epoch, ++step, mean_loss, samples);
      }
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    strategy->barrier("evaluate");  // every worker's updates are in
    std::string extra;
    if (ps) {
      const ds::ParameterServerStats st = ps->stats();
      char buf[96];
      std::snprintf(buf, sizeof(buf), " mean_staleness=%.2f max_staleness=%lld", st.mean_staleness,
                    static_cast<long long>(st.max_staleness));
      extra = buf;
    }
    std::vector<ds::Tensor> values;
    for (const ds::Variable& v : params) values.push_back(v.value());
    const ds::Tensor logits = mlp.predict(values, test.features());
    const double accuracy =
        static_cast<double>(ds::nn::count_correct(logits, test.labels())) / test.size();
    if (chief) {
      // The line keeps issue 2's exact form on CPU; extras go at the end.
      if (f.device != "cpu") extra += " device=" + f.device;
      std::printf("final: strategy=%s replicas=%d epochs=%d test_accuracy=%.4f samples_per_sec=%.0f%s\n",
                  strategy->name().c_str(), strategy->num_replicas_in_sync(), f.epochs, accuracy,
                  samples / seconds, extra.c_str());
    }
    return 0;
  } catch (const ds::Error& e) {
    std::fprintf(stderr, "fashion_mnist: %s\n", e.what());
    return 1;
  }
}
