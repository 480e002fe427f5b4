// train_bench: training throughput of the Fashion-MNIST MLP (784-256-256-10;
// --width W, --depth D: D hidden layers of W, 784-W-...-W-10) under a
// strategy, batch 128 per replica, a fixed number of steps; --compression f16|bf16 casts the multi-worker all-reduces.
//
//   build/benchmarks/train_bench --strategy mirrored --replicas 1
//   mpirun -np 1 build/benchmarks/train_bench --strategy multi_worker
//   mpirun -np 2 build/benchmarks/train_bench --strategy multi_worker --timeline t.json
//   mpirun -np 3 build/benchmarks/train_bench --strategy parameter_server --ps 1
//   build/benchmarks/train_bench --strategy central_storage --replicas 2 --device gpu
//   build/benchmarks/train_bench --strategy mirrored --device gpu --replicas 4 --split-gpus 4
//
// With --overlap (default) each layer's gradients are handed to
// all_reduce_async as the backward pass produces them (last layer first), so
// their all-reduce runs on the communication thread while the earlier layers'
// backward still computes; the update is the optimizer's SGD rule
// (Optimizer::update) on the reduced gradients.
// --no-overlap uses Optimizer::apply_gradients (one fused call after
// backward). Prints samples/s (global samples over the timed steps). The
// parameter server always uses apply_gradients (the PS applies the update), and
// so do central storage (one shared copy) and --device gpu (the overlap path's
// update loop runs on the host). Also prints the mean training loss per
// example over the timed steps of every worker (loss=): under the parameter
// server reduce() covers one worker's replicas, so the workers add their
// shares to a metric on PS 0 and the chief reads the job's totals.
//
// ZeRO-1 (sharded optimizer state, mirrored and multi_worker): --zero on
// trains with MultiWorkerOptions / MirroredOptions::shard_optimizer_state
// (apply_gradients path); --zero compare builds both strategies in this one
// process and times them in alternating blocks of --block steps, so machine
// noise hits both alike, and prints each one's step time, the ratio (with
// its spread over the blocks) and optimizer-slot bytes per replica;
// --optimizer adam|sgd picks the rule.
// Determinism mode (diststrat/determinism.h): --deterministic-across-workers
// V builds the default strategy and the same strategy with V virtual shards
// in this one process and times them in alternating blocks of --block steps
// (the apply_gradients path for both: a shard cannot all-reduce on its own),
// and prints each one's samples/s, the ratio mode/default (with its spread
// over the blocks) and, under multi_worker, the bytes the cross-process
// all-reduces carried per step (the fusion engine's payload, before the
// algorithm's 2(p-1)/p) and their ratio.
// cpu_kernels= is the instruction-set variant of the CPU math in use
// (diststrat/cpu_isa.h; DISTSTRAT_CPU=baseline|avx2|avx512 forces one).
// Gradient accumulation: --accumulation k makes every update k micro-batches
// (Optimizer::set_accumulation_steps, the apply_gradients path; --steps and
// samples_per_sec count micro-batches) and, under multi_worker, prints the
// cross-process calls of the step functions per update
// (gradient_calls_per_update: 1 when only the k-th micro-batch communicates).
//
//   mpirun -np 4 build/benchmarks/train_bench --strategy multi_worker --optimizer adam --zero compare
//   mpirun -np 2 build/benchmarks/train_bench --strategy multi_worker --deterministic-across-workers 8
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <diststrat/diststrat.h>

#include "../../examples/common/timeout_flag.h"
#include "../../examples/common/loss_meter.h"

namespace ds = diststrat;

namespace {

// 784-W-...-W-10 with `depth` hidden layers.
std::vector<int64_t> layer_sizes(int64_t width, int depth) {
  std::vector<int64_t> sizes{784};
  sizes.insert(sizes.end(), static_cast<size_t>(depth), width);
  sizes.push_back(10);
  return sizes;
}

}  // namespace

int main(int argc, char** argv) {
  std::string strategy_name = "multi_worker", data_dir = ds::kFashionMnistDir, timeline;
  std::string device = "cpu";
  int replicas = 1, steps = 300, warmup = 30, num_ps = 1, split_gpus = 1, max_staleness = -1;
  int64_t per_replica_batch = 128;
  float lr = 0.05f;
  bool overlap = true;
  int64_t width = 256;
  int depth = 2;
  std::string compression = "none";
  std::string zero = "off", optimizer = "sgd";
  int accumulation = 1;
  int block = 20;
  int virtual_shards = 0;
  std::string rendezvous, listen_host;
  int min_workers = 1;
  CLI::App app{"Training throughput of the Fashion-MNIST MLP under a strategy"};
  app.add_option("--strategy", strategy_name,
                 "mirrored | central_storage | multi_worker | parameter_server")
      ->capture_default_str();
  app.add_option("--device", device, "where replicas compute: cpu or gpu")
      ->check(CLI::IsMember({"cpu", "gpu"}))
      ->capture_default_str();
  app.add_option("--ps", num_ps, "parameter_server: PS ranks (the last ranks)")
      ->capture_default_str();
  app.add_option(
         "--max-staleness", max_staleness,
         "parameter_server: steps a worker may run ahead of the slowest (-1 = async, 0 = lockstep)")
      ->capture_default_str();
  app.add_option("--replicas", replicas, "local devices per process")->capture_default_str();
  app.add_option("--split-gpus", split_gpus,
                 "mirrored, central_storage on GPUs: logical GPUs per physical GPU")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps first")->capture_default_str();
  app.add_option("--batch", per_replica_batch, "batch per replica")->capture_default_str();
  app.add_flag("--overlap,!--no-overlap", overlap, "all-reduce each layer during backward")
      ->capture_default_str();
  app.add_option("--width", width, "hidden width of the MLP (784-W-...-W-10)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16))
      ->capture_default_str();
  app.add_option("--depth", depth,
                 "hidden layers of the MLP (784-W-...-W-10; more of them give the backward pass "
                 "gradients to overlap with before the input layer's, which comes last)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--compression", compression, "multi_worker wire compression: none | f16 | bf16")
      ->check(CLI::IsMember({"none", "f16", "bf16"}))
      ->capture_default_str();
  app.add_option("--zero", zero,
                 "ZeRO-1 sharded optimizer state: off | on | compare (mirrored, multi_worker)")
      ->check(CLI::IsMember({"off", "on", "compare"}))
      ->capture_default_str();
  app.add_option("--optimizer", optimizer, "sgd | adam")
      ->check(CLI::IsMember({"sgd", "adam"}))
      ->capture_default_str();
  app.add_option("--accumulation", accumulation,
                 "micro-batches per update (Optimizer::set_accumulation_steps; the apply_gradients "
                 "path); --steps counts micro-batches")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--block", block,
                 "--zero compare, --deterministic-across-workers: steps per timed block")
      ->capture_default_str();
  app.add_option("--deterministic-across-workers", virtual_shards,
                 "compare the default with determinism mode of V virtual shards (mirrored, "
                 "multi_worker): both in this process, timed in alternating blocks")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--timeline", timeline, "Chrome trace of the communication (multi_worker)");
  app.add_option("--data", data_dir, "Fashion-MNIST IDX directory")->capture_default_str();
  app.add_option("--rendezvous", rendezvous,
                 "multi_worker: an elastic group (diststrat/elastic.h) formed through this store "
                 "(redis://host:port/job or file:///dir/job) instead of mpirun; the timed loop "
                 "runs in ElasticState::run, committing at every step");
  app.add_option("--listen-host", listen_host, "--rendezvous: the address peers reach us at");
  app.add_option("--min-workers", min_workers,
                 "--rendezvous: the group forms once this many workers arrived")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  std::string timeout;
  diststrat_examples::add_timeout_flag(app, timeout);
  CLI11_PARSE(app, argc, argv);

  try {
    std::vector<ds::Device> devices;
    for (int i = 0; i < replicas; ++i) {
      devices.push_back(device == "gpu" ? ds::Device::gpu(i) : ds::Device::cpu(i));
    }
    if (device == "gpu") overlap = false;
    // Multi-process strategies on GPUs: each process of the host uses (and
    // leases) its own `replicas` GPUs.
    const std::shared_ptr<ds::DeviceManager> process_gpus =
        device == "gpu"
            ? std::make_shared<ds::DeviceManager>(ds::gpu_options_for_local_process(replicas))
            : nullptr;
    ds::CommunicationOptions comm;
    diststrat_examples::apply_timeout(timeout, comm);
    // One-process strategies: each GPU split into `split_gpus` logical GPUs
    // sharing its memory (several replicas on one physical GPU).
    std::shared_ptr<ds::DeviceManager> local_gpus;
    if (device == "gpu" && split_gpus > 1) {
      local_gpus = std::make_shared<ds::DeviceManager>();
      for (const ds::PhysicalDeviceInfo& p : local_gpus->list_physical_devices()) {
        const size_t each = p.free_memory_bytes / 10 * 9 / static_cast<size_t>(split_gpus);
        local_gpus->set_logical_device_configuration(
            p.ordinal, std::vector<ds::LogicalDeviceConfiguration>(split_gpus, {each}));
      }
    }
    const auto make_strategy = [&](bool shard, int shards) -> std::unique_ptr<ds::Strategy> {
      if (strategy_name == "mirrored") {
        ds::MirroredOptions o;
        o.devices = devices;
        o.device_manager = local_gpus;
        o.communication = comm;
        o.shard_optimizer_state = shard;
        o.determinism.virtual_shards = shards;
        return std::make_unique<ds::MirroredStrategy>(o);
      }
      if (strategy_name == "multi_worker") {
        ds::MultiWorkerOptions o;
        o.devices = devices;
        o.device_manager = process_gpus;
        o.timeline_path = timeline;
        o.communication.compression = compression == "f16"    ? ds::Compression::kFloat16
                                      : compression == "bf16" ? ds::Compression::kBFloat16
                                                              : ds::Compression::kNone;
        o.communication.timeout = comm.timeout;
        o.shard_optimizer_state = shard;
        o.determinism.virtual_shards = shards;
        if (!rendezvous.empty()) {
          o.elastic.rendezvous = rendezvous;
          o.elastic.listen_host = listen_host;
          o.elastic.min_workers = min_workers;
          o.elastic.max_workers = min_workers;  // all start together: no settle wait
        }
        return std::make_unique<ds::MultiWorkerMirroredStrategy>(o);
      }
      throw ds::InvalidArgumentError(
          "--zero and --deterministic-across-workers need --strategy mirrored or multi_worker");
    };
    const auto make_optimizer = [&](ds::Strategy& s) -> std::unique_ptr<ds::Optimizer> {
      if (optimizer == "adam") {
        ds::AdamOptions o;
        o.learning_rate = lr / 50;
        return std::make_unique<ds::Adam>(s, o);
      }
      return std::make_unique<ds::SGD>(s, ds::SGDOptions{lr, 0.0f});
    };
    if (zero != "off" || optimizer != "sgd" || virtual_shards > 0)
      overlap = false;  // the optimizer's own path
    if (virtual_shards > 0 && (zero != "off" || accumulation > 1 || !rendezvous.empty()))
      throw ds::InvalidArgumentError(
          "--deterministic-across-workers compares plain runs: without --zero, --accumulation, "
          "--rendezvous");
    if (zero == "compare" || virtual_shards > 0) {
      // Both strategies in this process, timed in alternating blocks: the
      // default (runs[0]) and ZeRO-1 or determinism mode (runs[1]).
      const bool det = virtual_shards > 0;
      struct Run {
        std::unique_ptr<ds::Strategy> strategy;
        std::vector<ds::Variable> params;
        std::unique_ptr<ds::Optimizer> opt;
        ds::DistributedDataset dist;
        int64_t next = 0;
        double seconds = 0;
        int64_t wire_bytes = 0;  // multi_worker: the engine's payload over the timed blocks
      };
      const ds::Dataset train = ds::load_mnist_split(data_dir, "train");
      const ds::nn::Mlp mlp(layer_sizes(width, depth));
      Run runs[2];
      for (int z = 0; z < 2; ++z) {
        Run& r = runs[z];
        r.strategy =
            det ? make_strategy(false, z == 1 ? virtual_shards : 0) : make_strategy(z == 1, 0);
        r.params = mlp.create_variables(*r.strategy, 1);
        r.opt = make_optimizer(*r.strategy);
        r.dist =
            r.strategy->distribute(train, per_replica_batch * r.strategy->num_replicas_in_sync());
      }
      const auto engine_bytes = [](const Run& r) -> int64_t {
        const auto* mw = dynamic_cast<const ds::MultiWorkerMirroredStrategy*>(r.strategy.get());
        return mw ? mw->stats().bytes : 0;
      };
      const auto step = [&](Run& r) {
        const ds::DistributedBatch batch = r.dist.batch(r.next++ % r.dist.num_batches());
        const float scale = 1.0f / static_cast<float>(batch.global_size());
        r.strategy->run([&](ds::ReplicaContext& ctx) {
          std::vector<ds::Tensor> values;
          for (const ds::Variable& v : r.params) values.push_back(v.read(ctx));
          auto s = mlp.forward_backward(values, batch.features(ctx), batch.labels(ctx), scale);
          std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
          for (size_t i = 0; i < r.params.size(); ++i) gv.emplace_back(s.grads[i], r.params[i]);
          r.opt->apply_gradients(ctx, gv);
        });
      };
      for (Run& r : runs) {
        for (int i = 0; i < warmup; ++i) step(r);
      }
      std::vector<double> ratios;
      const int blocks = std::max(1, steps / std::max(1, block));
      for (int b = 0; b < blocks; ++b) {
        double t[2];
        for (int z = 0; z < 2; ++z) {
          // Alternate which goes first, so neither always follows the other.
          Run& r = runs[(b + z) % 2];
          r.strategy->barrier("block start");
          const int64_t bytes_before = engine_bytes(r);
          const auto start = std::chrono::steady_clock::now();
          for (int i = 0; i < block; ++i) step(r);
          r.strategy->barrier("block end");
          const double sec =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          r.wire_bytes += engine_bytes(r) - bytes_before;
          r.seconds += sec;
          t[(b + z) % 2] = sec;
        }
        ratios.push_back(t[1] / t[0]);
      }
      std::sort(ratios.begin(), ratios.end());
      const bool chief =
          runs[0].strategy->cluster().is_chief() || runs[0].strategy->cluster().world_size == 1;
      if (chief && det) {
        const int n = blocks * block;
        double samples_per_sec[2];
        for (int z = 0; z < 2; ++z) {
          samples_per_sec[z] =
              double(n) * double(runs[z].dist.global_batch_size()) / runs[z].seconds;
          std::printf(
              "train_bench: strategy=%s virtual_shards=%d workers=%d replicas=%d "
              "global_batch=%lld width=%lld depth=%d optimizer=%s steps=%d step_ms=%.3f "
              "samples_per_sec=%.0f wire_bytes_per_step=%lld cpu_kernels=%s\n",
              runs[z].strategy->name().c_str(), z == 1 ? virtual_shards : 0,
              runs[z].strategy->cluster().num_workers, runs[z].strategy->num_replicas_in_sync(),
              static_cast<long long>(runs[z].dist.global_batch_size()),
              static_cast<long long>(width), depth, optimizer.c_str(), n, 1e3 * runs[z].seconds / n,
              samples_per_sec[z], static_cast<long long>(runs[z].wire_bytes / n),
              ds::cpu_isa_name(ds::cpu_isa()));
        }
        // Step-time ratios inverted: samples/s of the mode over the default's.
        char wire[64] = "n/a (no cross-process all-reduce)";
        if (runs[0].wire_bytes > 0)
          std::snprintf(wire, sizeof wire, "%.3f",
                        double(runs[1].wire_bytes) / double(runs[0].wire_bytes));
        std::printf(
            "train_bench: deterministic/default samples/s %.3f (blocks of %d: min %.3f median "
            "%.3f max %.3f), wire bytes per step %s\n",
            samples_per_sec[1] / samples_per_sec[0], block, 1 / ratios.back(),
            1 / ratios[ratios.size() / 2], 1 / ratios.front(), wire);
      } else if (chief) {
        const int n = blocks * block;
        for (int z = 0; z < 2; ++z) {
          std::printf(
              "train_bench: strategy=%s zero=%d optimizer=%s workers=%d replicas=%d "
              "batch_per_replica=%lld width=%lld depth=%d steps=%d step_ms=%.3f "
              "optimizer_slot_bytes_per_replica=%lld\n",
              runs[z].strategy->name().c_str(), z, optimizer.c_str(),
              runs[z].strategy->cluster().num_workers, runs[z].strategy->num_replicas_in_sync(),
              static_cast<long long>(per_replica_batch), static_cast<long long>(width), depth, n,
              1e3 * runs[z].seconds / n,
              static_cast<long long>(runs[z].opt->slot_bytes_per_replica()));
        }
        std::printf(
            "train_bench: zero/plain step time %.3f (blocks of %d: min %.3f median %.3f max %.3f), "
            "slot bytes %.3f\n",
            runs[1].seconds / runs[0].seconds, block, ratios.front(), ratios[ratios.size() / 2],
            ratios.back(),
            double(runs[1].opt->slot_bytes_per_replica()) /
                double(std::max<int64_t>(1, runs[0].opt->slot_bytes_per_replica())));
      }
      return 0;
    }
    std::unique_ptr<ds::Strategy> strategy;
    if (strategy_name == "mirrored" || strategy_name == "multi_worker") {
      strategy = make_strategy(zero == "on", 0);
    } else if (zero != "off") {
      throw ds::InvalidArgumentError("--zero needs --strategy mirrored or multi_worker");
    } else if (strategy_name == "central_storage") {
      ds::CentralStorageOptions o;
      o.devices = devices;
      o.device_manager = local_gpus;
      o.communication = comm;
      strategy = std::make_unique<ds::CentralStorageStrategy>(o);
      overlap = false;
    } else if (strategy_name == "parameter_server") {
      ds::ParameterServerOptions o;
      o.num_ps = num_ps;
      o.devices = devices;
      o.device_manager = process_gpus;
      o.max_staleness = max_staleness;
      o.communication.timeout = comm.timeout;
      auto ps = std::make_unique<ds::ParameterServerStrategy>(o);
      if (ps->is_ps()) {
        ps->join();
        return 0;
      }
      strategy = std::move(ps);
      overlap = false;
    } else {
      throw ds::InvalidArgumentError("unknown --strategy '" + strategy_name + "'");
    }
    const bool chief = strategy->cluster().is_chief() || strategy->cluster().world_size == 1;
    const ds::Dataset train = ds::load_mnist_split(data_dir, "train");
    const ds::nn::Mlp mlp(layer_sizes(width, depth));
    std::vector<ds::Variable> params = mlp.create_variables(*strategy, 1);
    std::unique_ptr<ds::Optimizer> opt_ptr = make_optimizer(*strategy);
    ds::Optimizer& opt = *opt_ptr;
    if (accumulation > 1) {
      opt.set_accumulation_steps(accumulation);
      overlap = false;  // accumulation lives in apply_gradients
    }
    auto* multi_worker = dynamic_cast<ds::MultiWorkerMirroredStrategy*>(strategy.get());
    int64_t grad_calls = 0;  // cross-process calls of the timed steps' run() (not the loss meter)
    const int64_t global_batch = per_replica_batch * strategy->num_replicas_in_sync();
    ds::DistributedDataset dist = strategy->distribute(train, global_batch);

    diststrat_examples::LossMeter meter(*strategy, "train_bench/loss");
    double loss = 0;
    int64_t done = 0, epoch = 0;
    auto t0 = std::chrono::steady_clock::now();
    // The timed loop (a benchmark expects no membership change: after one it
    // would start over with its own counters).
    auto timed_loop = [&] {
      while (done < warmup + steps) {
        dist.set_epoch(epoch++);
        for (const ds::DistributedBatch& batch : dist) {
          if (done == warmup) {
            strategy->barrier("timing start");
            meter.mean_since_last();  // the warmup's
            t0 = std::chrono::steady_clock::now();
          }
          if (done++ == warmup + steps) break;
          const float scale = 1.0f / static_cast<float>(batch.global_size() * accumulation);
          const int64_t calls_before = multi_worker ? multi_worker->stats().calls : 0;
          ds::PerReplica<ds::Tensor> step_loss = strategy->run([&](ds::ReplicaContext& ctx) {
            std::vector<ds::Tensor> values;
            for (const ds::Variable& v : params) values.push_back(v.read(ctx));
            ds::Tensor sum_and_rows(ds::Shape{2}, ds::DType::kFloat64);
            sum_and_rows.data<double>()[1] = static_cast<double>(batch.labels(ctx).shape()[0]);
            if (!overlap) {
              auto s = mlp.forward_backward(values, batch.features(ctx), batch.labels(ctx), scale);
              std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
              for (size_t i = 0; i < params.size(); ++i) gv.emplace_back(s.grads[i], params[i]);
              opt.apply_gradients(ctx, gv);
              sum_and_rows.data<double>()[0] = s.loss_sum;
              return sum_and_rows;
            }
            std::vector<ds::Work> works;
            auto s = mlp.forward_backward(
                values, batch.features(ctx), batch.labels(ctx), scale,
                [&](size_t layer, const ds::Tensor& dw, const ds::Tensor& db) {
                  works.push_back(ctx.all_reduce_async(ds::ReduceOp::kSum, {dw, db},
                                                       {params[2 * layer].name() + "/grad",
                                                        params[2 * layer + 1].name() + "/grad"}));
                });
            for (ds::Work& w : works) w.wait();
            // The optimizer's own rule (SGD, no slots): the same CPU kernel
            // the --no-overlap path runs through apply_gradients.
            for (size_t i = 0; i < params.size(); ++i)
              opt.update(values[i].data<float>(), s.grads[i].data<float>(), nullptr,
                         static_cast<size_t>(values[i].num_elements()), done);
            sum_and_rows.data<double>()[0] = s.loss_sum;
            return sum_and_rows;
          });
          if (multi_worker && done > warmup)
            grad_calls += multi_worker->stats().calls - calls_before;
          meter.add(strategy->reduce(ds::ReduceOp::kSum, step_loss));
        }
      }
    };
    if (!rendezvous.empty()) {
      DISTSTRAT_CHECK(multi_worker, kInvalidArgument, "--rendezvous needs --strategy multi_worker");
      ds::ElasticState state(*multi_worker, {&opt});
      state.run([&](ds::ElasticState&) { timed_loop(); });
    } else {
      timed_loop();
    }
    strategy->barrier("timing end");
    loss = meter.mean_since_last();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (chief) {
      std::printf(
          "train_bench: strategy=%s workers=%d replicas=%d batch_per_replica=%lld overlap=%d "
          "width=%lld depth=%d compression=%s zero=%s optimizer=%s steps=%d seconds=%.3f loss=%.4f "
          "samples_per_sec=%.0f optimizer_slot_bytes_per_replica=%lld accumulation=%d "
          "gradient_calls_per_update=%.2f cpu_kernels=%s\n",
          strategy->name().c_str(), strategy->cluster().num_workers,
          strategy->num_replicas_in_sync(), static_cast<long long>(per_replica_batch),
          overlap ? 1 : 0, static_cast<long long>(width), depth, compression.c_str(), zero.c_str(),
          optimizer.c_str(), steps, seconds, loss, steps * global_batch / seconds,
          static_cast<long long>(opt.slot_bytes_per_replica()), accumulation,
          multi_worker ? double(grad_calls) / (double(steps) / accumulation) : 0.0,
          ds::cpu_isa_name(ds::cpu_isa()));
    }
    return 0;
  } catch (const ds::Error& e) {
    std::fprintf(stderr, "train_bench: %s\n", e.what());
    return 1;
  }
}
