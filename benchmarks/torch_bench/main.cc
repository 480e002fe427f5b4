// torch_bench: training throughput of the LibTorch CNN of
// examples/torch_fashion_mnist (cnn.h) on Fashion-MNIST, batch 64 per
// process, one replica (one core: LibTorch intra-op threads 1) per process,
// plain SGD with momentum, a fixed number of steps. One configuration per
// run; scripts/torch_bench.sh runs them all in turn (1 and 2 processes, each
// mode, alternating rounds) and prints the ratios.
//
//   mpirun -np 2 build/benchmarks/torch_bench --mode ddp              (overlap on)
//   mpirun -np 2 build/benchmarks/torch_bench --mode ddp --no-overlap
//   mpirun -np 2 build/benchmarks/torch_bench --mode c10d
//   build/benchmarks/torch_bench --mode c10d --rank R --world-size N --store FILE   (no mpirun)
//
// --mode ddp: diststrat::libtorch::DistributedDataParallel over
// MultiWorkerMirroredStrategy (ddp_loop.cc). --mode c10d: LibTorch's own
// c10d::ProcessGroupGloo with the loop of pytorch/examples' C++ dist-mnist
// (c10d_loop.cc). Rendezvous of --mode c10d: a c10d::FileStore; ranks from
// mpirun (OMPI_COMM_WORLD_RANK / _SIZE) and the file
// $TMPDIR/torch_bench_c10d.<mpirun job id> unless --rank, --world-size and
// --store say otherwise (then launch the N processes any way you like, with
// one --store path that does not exist yet).
//
// Prints (rank 0) one line:
//   torch_bench: mode=ddp_overlap processes=2 batch_per_process=64 steps=200
//                seconds=... loss=... samples_per_sec=...
// samples_per_sec = steps * 64 * processes / seconds (barrier to barrier);
// loss = the mean training loss over every process's timed batches (the
// modes train the same rows from the same initial weights, so it agrees
// across modes to float tolerance: a check that they do the same work).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <diststrat/diststrat.h>
#include <diststrat/torch.h>

#include "../../examples/common/timeout_flag.h"
#include "c10d_loop.h"
#include "ddp_loop.h"

namespace ds = diststrat;
namespace dt = diststrat::libtorch;

namespace {

// An integer environment variable, or `fallback` when unset.
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > 1 << 20) {
    throw ds::InvalidArgumentError(std::string(name) + "='" + v + "': not a rank or size");
  }
  return static_cast<int>(x);
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = "ddp", data_dir = ds::kFashionMnistDir, store, timeout;
  torch_bench::Config config;
  torch_bench::DdpMode ddp;
  int rank = -1, world = -1;
  int64_t rows = 16384;
  CLI::App app{"Training throughput of the LibTorch Fashion-MNIST CNN: diststrat DDP vs c10d Gloo"};
  app.add_option("--mode", mode,
                 "ddp (diststrat::libtorch::DistributedDataParallel) | c10d (ProcessGroupGloo)")
      ->check(CLI::IsMember({"ddp", "c10d"}))
      ->capture_default_str();
  app.add_flag("--overlap,!--no-overlap", ddp.overlap,
               "ddp: all-reduce buckets from the autograd hooks, during backward")
      ->capture_default_str();
  app.add_option("--bytes-per-bucket", ddp.bytes_per_bucket,
                 "ddp: DdpOptions::bytes_per_bucket (0 = one bucket, -1 = DdpOptions' default)")
      ->check(CLI::Range(int64_t{-1}, int64_t{1} << 40))
      ->capture_default_str();
  app.add_option("--steps", config.steps, "timed steps")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--warmup", config.warmup, "untimed steps first")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--batch", config.batch, "rows per process and step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--lr", config.lr, "SGD learning rate")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seed", config.seed, "initial weights")->capture_default_str();
  app.add_option("--threads", config.threads, "LibTorch intra-op threads per process")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--rows", rows, "training rows used (cyclically)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--data", data_dir, "Fashion-MNIST IDX directory")->capture_default_str();
  app.add_option("--rank", rank, "c10d without mpirun: this process's rank");
  app.add_option("--world-size", world, "c10d without mpirun: number of processes");
  app.add_option("--store", store,
                 "c10d: the FileStore path (one new path, shared by every process)");
  diststrat_examples::add_timeout_flag(app, timeout);
  CLI11_PARSE(app, argc, argv);

  try {
    if (!timeout.empty()) config.timeout_s = ds::parse_timeout_seconds(timeout).count() / 1000.0;
    const ds::Dataset train = ds::load_mnist_split(data_dir, "train", rows);
    const int64_t usable = train.size() / config.batch * config.batch;
    if (usable == 0) {
      throw ds::InvalidArgumentError("--rows " + std::to_string(train.size()) +
                                     " is less than one batch of " + std::to_string(config.batch));
    }
    torch_bench::Data data;
    data.x = dt::to_torch(train.features()).narrow(0, 0, usable);
    data.y = dt::to_torch(train.labels()).narrow(0, 0, usable).to(torch::kLong);

    torch_bench::Result r;
    std::string label;
    if (mode == "c10d") {
      if (rank < 0) rank = env_int("OMPI_COMM_WORLD_RANK", 0);
      if (world < 0) world = env_int("OMPI_COMM_WORLD_SIZE", 1);
      if (rank >= world) {
        throw ds::InvalidArgumentError("--rank " + std::to_string(rank) +
                                       " is not below --world-size " + std::to_string(world));
      }
      if (store.empty()) {
        const char* job = std::getenv("OMPI_MCA_ess_base_jobid");
        if (world > 1 && job == nullptr) {
          throw ds::InvalidArgumentError("--mode c10d with " + std::to_string(world) +
                                         " processes outside mpirun needs --store FILE");
        }
        const char* tmp = std::getenv("TMPDIR");
        store = std::string(tmp && *tmp ? tmp : "/tmp") + "/torch_bench_c10d." +
                (job ? std::string(job) : std::to_string(::getpid()));
      }
      if (usable < config.batch * world) {
        throw ds::InvalidArgumentError("--rows: fewer than one batch per process");
      }
      r = torch_bench::run_c10d_gloo(config, data, rank, world, store);
      label = "c10d_gloo";
    } else {
      r = torch_bench::run_diststrat_ddp(config, data, ddp, &rank, &world);
      label = ddp.overlap ? "ddp_overlap" : "ddp_no_overlap";
    }
    if (rank == 0) {
      std::printf(
          "torch_bench: mode=%s processes=%d batch_per_process=%lld steps=%d threads=%d "
          "seconds=%.3f loss=%.4f samples_per_sec=%.0f\n",
          label.c_str(), world, static_cast<long long>(config.batch), config.steps, config.threads,
          r.seconds, r.mean_loss,
          static_cast<double>(config.steps) * config.batch * world / r.seconds);
    }
    return 0;
  } catch (const ds::Error& e) {
    std::fprintf(stderr, "torch_bench: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {  // c10::Error from c10d, gloo's exceptions
    std::fprintf(stderr, "torch_bench: rank %d: %s\n", rank, e.what());
    return 1;
  }
}
