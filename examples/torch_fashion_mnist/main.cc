// Trains a LibTorch CNN (cnn.h: two conv + pool layers, two dense) on
// Fashion-MNIST under the strategy named by --strategy, with
// diststrat::libtorch::DistributedDataParallel: the examples/fashion_mnist
// loop with a torch::nn::Module and torch's optimizer instead of the
// library's MLP. The loop below is written once against Strategy&:
//
//   build/examples/torch_fashion_mnist --strategy mirrored --replicas 2
//   build/examples/torch_fashion_mnist --strategy central_storage --replicas 2
//   mpirun -np 2 build/examples/torch_fashion_mnist --strategy multi_worker
//   mpirun -np 3 build/examples/torch_fashion_mnist --strategy parameter_server --ps 1
//
// The synchronous strategies train with DistributedDataParallel and one
// torch::optim::SGD per replica; the parameter server with
// ParameterServerModel (the module's parameters view the worker's pull
// cache, backward pushes the gradients, the PS ranks apply a diststrat SGD of
// the same learning rate and momentum). Flags (examples/common/train_flags.h)
// and the `final:` line are fashion_mnist's. With --checkpoint-dir (the
// synchronous strategies) it saves the module's parameters and buffers, the
// SGD momentum and the step (diststrat::libtorch::TrainingState) and the data
// position every --checkpoint-every steps, resumes from the latest
// checkpoint on start (bit-identical to an uninterrupted run), and on SIGTERM
// stops at a step boundary every process agrees on, saves and exits 0.
// --device gpu (mirrored: --replicas GPUs, or with --logical-gpus as many
// logical GPUs of GPU 0; multi_worker: one GPU per process) trains the CNN
// on CUDA; it exits 2 with the reason where LibTorch has no CUDA (Debian's)
// and for central_storage / parameter_server (docs/torch.md). Each
// replica runs its forward/backward on its own thread with one LibTorch
// intra-op thread (one replica = one core; --threads gives a process of one
// replica more).
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <diststrat/diststrat.h>
#include <diststrat/torch.h>

#include "../common/elastic_loop.h"
#include "../common/loss_meter.h"
#include "../common/make_strategy.h"
#include "../common/train_flags.h"
#include "../common/train_position.h"

#include "cnn.h"

namespace ds = diststrat;
namespace dt = diststrat::libtorch;
using torch_fashion_mnist::CnnImpl;

namespace {

using diststrat_examples::Position;

// The flags both training examples share (examples/common/train_flags.h),
// and this one's own.
struct Flags : diststrat_examples::TrainFlags {
  int threads = 1;
  bool logical_gpus = false;
  bool deterministic = false;
};

// --deterministic: LibTorch's deterministic kernels (cuDNN's convolutions
// and cuBLAS's included), so that two GPU runs give the same weights. Call
// before any CUDA work: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when its first
// handle is made (an existing value is kept).
void use_deterministic_kernels() {
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  at::globalContext().setDeterministicCuDNN(true);
  at::globalContext().setBenchmarkCuDNN(false);
}

// --device gpu: why it cannot run, on one line, or "" when it can. Without
// CUDA (Debian's LibTorch) nothing can.
std::string gpu_refusal(const Flags& f) {
  if (!torch::cuda::is_available()) {
    return "this LibTorch has no CUDA or sees no CUDA device (torch::cuda::is_available() is "
           "false); --device gpu needs a CUDA build of LibTorch and a visible GPU";
  }
  if (f.strategy == "parameter_server") {
    return "not supported by diststrat::libtorch yet: ParameterServerModel's parameters view the "
           "worker's host pull cache, so a CUDA module's forward would mix devices (docs/torch.md)";
  }
  if (f.strategy == "central_storage") {
    return "not supported by diststrat::libtorch yet: CUDA modules train under --strategy "
           "mirrored or multi_worker; central_storage is untested with them (docs/torch.md)";
  }
  return "";
}

std::unique_ptr<ds::Strategy> make_example_strategy(const Flags& f) {
  if (f.elastic && f.device == "gpu") {
    // The library's elastic path has no test with CUDA modules yet.
    throw ds::UnimplementedError(
        "--elastic with --device gpu: not supported by this example yet (elastic training of "
        "CUDA modules is untested; docs/torch.md)");
  }
  if (f.strategy == "parameter_server" && !f.checkpoint_dir.empty()) {
    // The PS variables and the PS's SGD slots would checkpoint (a plain
    // ds::Checkpoint), but not the batch norms' running statistics, which
    // each worker keeps: a resumed run would not equal an uninterrupted one.
    throw ds::InvalidArgumentError(
        "--checkpoint-dir with --strategy parameter_server: not supported by this example (the "
        "batch norms' running statistics are each worker's own and would not be restored)");
  }
  // --logical-gpus: MirroredStrategy's --replicas GPUs are logical GPUs of
  // GPU 0 (a one-GPU machine), 1 GiB each.
  std::shared_ptr<ds::DeviceManager> local_gpus;
  if (f.device == "gpu" && f.strategy == "mirrored" && f.logical_gpus && f.replicas > 1) {
    local_gpus = std::make_shared<ds::DeviceManager>();
    local_gpus->set_logical_device_configuration(
        0, std::vector<ds::LogicalDeviceConfiguration>(static_cast<size_t>(f.replicas),
                                                       {size_t{1} << 30}));
  }
  return diststrat_examples::make_strategy(f, local_gpus);
}

// Test accuracy of `model` on `test` (rows in chunks, no autograd; leaves
// the model in eval mode).
double evaluate(CnnImpl& model, const ds::Dataset& test) {
  torch::NoGradGuard no_grad;
  model.eval();  // the batch norms' running statistics
  const torch::Device device = model.parameters().front().device();  // a GPU replica's module
  const at::Tensor x = dt::to_torch(test.features()).to(device);
  const at::Tensor y = dt::to_torch(test.labels()).to(device);
  int64_t correct = 0;
  for (int64_t begin = 0; begin < x.size(0); begin += 1000) {
    const int64_t n = std::min<int64_t>(1000, x.size(0) - begin);
    correct += torch_fashion_mnist::count_correct(model.forward(x.narrow(0, begin, n)),
                                                  y.narrow(0, begin, n));
  }
  return static_cast<double>(correct) / static_cast<double>(x.size(0));
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"Train a LibTorch CNN on Fashion-MNIST with a diststrat strategy"};
  diststrat_examples::add_strategy_flags(app, f,
                                         "where replicas compute: cpu (gpu needs a CUDA LibTorch)");
  diststrat_examples::add_training_flags(app, f);
  app.get_option("--limit")->check(CLI::NonNegativeNumber);
  app.add_option(
         "--threads", f.threads,
         "LibTorch intra-op threads of a process with one replica (several replicas: 1 each)")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_flag("--logical-gpus", f.logical_gpus,
               "--device gpu --strategy mirrored: the --replicas GPUs are logical GPUs of GPU 0 "
               "(1 GiB each), for a machine with one GPU");
  app.add_flag("--deterministic", f.deterministic,
               "LibTorch's deterministic kernels only (on a GPU: the same weights run after run; "
               "slower)");
  CLI11_PARSE(app, argc, argv);
  f.replicas_given = app.count("--replicas") > 0;
  if (f.deterministic) use_deterministic_kernels();
  if (f.device == "gpu") {  // before any set-up: every rank of a job says the same and exits
    const std::string refusal = gpu_refusal(f);
    if (!refusal.empty()) {
      std::fprintf(stderr, "torch_fashion_mnist: --device gpu: %s\n", refusal.c_str());
      return 2;
    }
  }

  try {
    std::unique_ptr<ds::Strategy> strategy = make_example_strategy(f);
    auto* ps = dynamic_cast<ds::ParameterServerStrategy*>(strategy.get());
    if (ps && ps->is_ps()) {  // PS ranks serve until the workers are done
      ps->join();
      return 0;
    }
    const ds::ClusterInfo cluster = strategy->cluster();
    const bool chief = cluster.is_chief() || cluster.world_size == 1;

    const ds::Dataset train = ds::load_mnist_split(f.data, "train", f.limit);
    const ds::Dataset test = ds::load_mnist_split(f.data, "t10k", f.test_limit);

    // Every process builds the module alike. DDP checks that the replicas
    // agree and broadcasts the chief's values; the PS keeps the chief's.
    // Both clone one module per further local replica.
    torch::manual_seed(f.seed);
    torch_fashion_mnist::use_intra_op_threads(f.threads);
    auto net = std::make_shared<CnnImpl>();
    std::unique_ptr<dt::DistributedDataParallel> ddp;
    std::unique_ptr<ds::SGD> ps_sgd;  // the update the PS ranks apply
    std::unique_ptr<dt::ParameterServerModel> ps_model;
    // One optimizer per local replica, each over its replica's module: every
    // replica applies the same (all-reduced) gradients, so they stay equal.
    std::vector<std::unique_ptr<torch::optim::SGD>> optimizers;
    if (ps) {
      ps_sgd = std::make_unique<ds::SGD>(*strategy, ds::SGDOptions{f.lr, f.momentum});
      ps_model = std::make_unique<dt::ParameterServerModel>(*ps, net, *ps_sgd);
    } else {
      ddp = std::make_unique<dt::DistributedDataParallel>(*strategy, net);
      for (int i = 0; i < ddp->num_local_replicas(); ++i) {
        optimizers.push_back(std::make_unique<torch::optim::SGD>(
            ddp->module(i)->parameters(), torch::optim::SGDOptions(f.lr).momentum(f.momentum)));
      }
    }

    ds::DistributeOptions dopts;
    dopts.seed = f.seed;
    ds::DistributedDataset dist = strategy->distribute(train, f.batch, dopts);

    // Checkpoints (synchronous strategies): the module's parameters and
    // buffers, the SGD momentum and the step, mirrored into strategy
    // variables by TrainingState, plus the data position as metadata.
    // (--elastic: the elastic state commits the module and the optimizers
    // through it at every step, and sends them to joiners.)
    std::unique_ptr<dt::TrainingState> state;
    std::unique_ptr<ds::Checkpoint> checkpoint;
    std::unique_ptr<ds::CheckpointManager> manager;
    std::unique_ptr<ds::PreemptionHandler> preemption;
    Position pos;
    // An elastic group's chief is its rank 0, whichever worker that is now.
    auto is_chief = [&] { return f.elastic ? strategy->cluster().worker_index == 0 : chief; };
    if (!f.checkpoint_dir.empty() || f.elastic) {
      std::vector<torch::optim::Optimizer*> opts;
      for (const auto& o : optimizers) opts.push_back(o.get());
      state = std::make_unique<dt::TrainingState>(*ddp, opts);  // collective (not when elastic)
      checkpoint = std::make_unique<ds::Checkpoint>(*strategy);
    }
    // The manager's constructor and restore_latest are collective: an
    // elastic job makes the manager at every (re)start of its group, inside
    // ElasticState::run, and restores only when the group holds no state.
    auto make_manager = [&] {
      manager = std::make_unique<ds::CheckpointManager>(
          *checkpoint, f.checkpoint_dir, ds::CheckpointManagerOptions{f.max_to_keep});
    };
    auto restore = [&](Position& at) {
      if (std::optional<ds::CheckpointMetadata> md = manager->restore_latest()) {
        // After a fallback (a corrupt newest checkpoint) this is not what `latest` names.
        const std::string from = manager->restored_path().value_or("?");
        at =
            diststrat_examples::resume_position(f, *md, f.checkpoint_dir, from, dist, std::nullopt);
        const int64_t step = state->apply();  // into every local replica's module and optimizer
        if (step != at.step) {
          throw ds::DataLossError("checkpoint '" + from + "': torch/step " + std::to_string(step) +
                                  " but metadata step " + std::to_string(at.step));
        }
        if (is_chief()) diststrat_examples::print_resumed(from, at);
      }
    };
    if (!f.checkpoint_dir.empty() && !f.elastic) {
      make_manager();
      restore(pos);
      // (An elastic worker has no handler: SIGTERM ends it like any death.)
      preemption = std::make_unique<ds::PreemptionHandler>(
          *strategy, diststrat_examples::preemption_options(f));
    }
    auto save = [&](const Position& at, const char* why) {
      state->capture(at.step);
      const std::string path =
          manager->save(at.step, diststrat_examples::position_metadata(f, dist, at, "torch:cnn"));
      if (is_chief())
        std::printf("%s: saved %s at step %lld\n", why, path.c_str(),
                    static_cast<long long>(at.step));
      std::fflush(stdout);
    };
    diststrat_examples::LossMeter meter(*strategy, "torch_fashion_mnist/train_loss");
    // The loss stays a (device) tensor until it is read: `.item()` every
    // kLossEvery steps, at the end of each epoch, and before a checkpoint is
    // saved or the loop stops (so a diverged model is never saved), then
    // reduced, NaN-checked and added to the meter. Every worker reads at the
    // same steps (the reduction is collective).
    constexpr int64_t kLossEvery = 50;
    struct StepLoss {
      at::Tensor mean;  // this replica's mean loss (undefined: no rows)
      double rows = 0;
    };
    diststrat_examples::PendingLosses<StepLoss> pending(
        *strategy, meter, "torch_fashion_mnist",
        [](const StepLoss& l) { return l.rows > 0 ? l.mean.item<double>() * l.rows : 0.0; });
    auto read_and_save = [&](const Position& at, const char* why) {
      pending.read();
      save(at, why);
    };

    const auto t0 = std::chrono::steady_clock::now();
    int64_t samples = 0, steps_this_run = 0;
    // Why the run ended early (end_of_step), kGoOn while it has not.
    diststrat_examples::StepEnd ended = diststrat_examples::StepEnd::kGoOn;
    const auto stopped = [&] { return ended != diststrat_examples::StepEnd::kGoOn; };
    // The loop from `pos`; under --elastic ElasticState::run calls it again
    // from the committed position after each membership change.
    auto train_from = [&](Position& pos) {
      // (After an elastic group change: losses of the old group's steps are
      // not read, as a joiner has none to match.)
      pending.clear();
      for (; pos.epoch < f.epochs; ++pos.epoch, pos.batch = 0) {
        const int epoch = static_cast<int>(pos.epoch);
        dist.set_epoch(epoch);
        while (pos.batch < dist.num_batches()) {
          const ds::DistributedBatch batch = dist.batch(pos.batch);
          ds::PerReplica<StepLoss> loss = strategy->run([&](ds::ReplicaContext& ctx) {
            torch_fashion_mnist::use_intra_op_threads(f.threads);
            CnnImpl& model = *(ps_model ? ps_model->module(ctx) : ddp->module(ctx))->as<CnnImpl>();
            torch::optim::SGD* opt = ps_model ? nullptr : optimizers[ctx.local_replica_id()].get();
            const at::Tensor x = dt::to_torch(batch.features(ctx));  // zero-copy views
            const at::Tensor y = dt::to_torch(batch.labels(ctx));
            if (opt) opt->zero_grad();
            // The mean over this replica's rows (NaN for a replica without
            // rows in a short last batch: backward then runs none for it).
            const at::Tensor l = torch_fashion_mnist::mean_cross_entropy(model.forward(x), y);
            if (ps_model) {
              ps_model->backward(ctx, l, x.size(0), batch.global_size());  // pushes the gradients
            } else {
              ddp->backward(ctx, l, x.size(0),
                            batch.global_size());  // grads: the global batch's mean
              opt->step();
            }
            return StepLoss{l.detach(), static_cast<double>(x.size(0))};
          });
          pending.add(pos.step + 1, std::move(loss));
          samples += batch.global_size();
          ++pos.batch;
          ++pos.step;
          if (pos.step % kLossEvery == 0 || pos.batch == dist.num_batches()) pending.read();
          ++steps_this_run;
          if (is_chief() && pos.batch == dist.num_batches()) {
            const double s =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            std::printf("epoch %d/%d  loss %.4f  %.0f samples/s\n", epoch + 1, f.epochs,
                        meter.mean_since_last(), samples / s);
            std::fflush(stdout);
          }
          ended = diststrat_examples::end_of_step(f, pos, dist.num_batches(), is_chief(),
                                                  preemption.get(), read_and_save);
          if (stopped()) {
            pending.read();
            return;
          }
        }
      }
    };
    if (f.elastic) {
      ds::ElasticState elastic(dynamic_cast<ds::MultiWorkerMirroredStrategy&>(*strategy));
      state->track(elastic);  // the module and the optimizers: committed and sent to joiners
      diststrat_examples::ElasticLoop loop;
      loop.train = train_from;
      if (!f.checkpoint_dir.empty()) {
        loop.begin = make_manager;
        loop.restore = restore;
        loop.end = [&](const Position& at) {
          if (!stopped()) save(at, "finished");
        };
      }
      pos = diststrat_examples::run_elastic(elastic, pos, loop);
    } else {
      train_from(pos);
      if (manager && !stopped() && steps_this_run > 0) save(pos, "finished");
    }
    if (stopped()) return diststrat_examples::exit_status(f, ended);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    strategy->barrier("evaluate");  // every worker's updates (and loss additions) are in
    std::string extra;
    CnnImpl& model = *(ps_model ? ps_model->module(0) : ddp->module(0))->as<CnnImpl>();
    if (ps_model) {
      // The PS holds the trained values; module 0 views the cache of this
      // worker's last pull, so refresh it (the PS's values, read now).
      torch::NoGradGuard no_grad;
      for (const auto& p : model.named_parameters()) {
        p.value().copy_(dt::to_torch(ps_model->variable(p.key()).value()));
      }
      const ds::ParameterServerStats st = ps->stats();
      char buf[96];
      std::snprintf(buf, sizeof(buf), " mean_staleness=%.2f max_staleness=%lld", st.mean_staleness,
                    static_cast<long long>(st.max_staleness));
      extra = buf;
    }
    const double train_loss = meter.totals().mean();
    if (is_chief()) {
      // Synchronous strategies: every replica holds the same weights, module 0 stands for all.
      const double accuracy = evaluate(model, test);
      std::printf(
          "final: strategy=%s replicas=%d epochs=%d test_accuracy=%.4f samples_per_sec=%.0f%s "
          "train_loss=%.4f\n",
          strategy->name().c_str(), strategy->num_replicas_in_sync(), f.epochs, accuracy,
          seconds > 0 ? samples / seconds : 0.0, extra.c_str(), train_loss);
    }
    return 0;
  } catch (const ds::Error& e) {
    std::fprintf(stderr, "torch_fashion_mnist: %s\n", e.what());
    return 1;
  } catch (const c10::Error& e) {  // LibTorch's own errors (a shape, a dtype)
    std::fprintf(stderr, "torch_fashion_mnist: %s\n", e.what_without_backtrace());
    return 1;
  }
}
