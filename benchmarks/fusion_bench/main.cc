// fusion_bench: what the multi-worker fusion engine buys, measured in one run.
//
//   mpirun -np 2 build/benchmarks/fusion_bench            (1000 x 4 KiB f32)
//
// Rows (p50 over iterations of the slowest rank, all in this invocation):
//   fused          the K tensors through MultiWorkerMirroredStrategy's
//                  all_reduce_async (signature check, packing, background
//                  thread, unpacking), bytes_per_pack = --bytes-per-pack
//   one_tensor     one all-reduce of the same total bytes on the same
//                  communicator the engine uses (kAuto: shared memory here)
//   mpi_one        one MPI_Allreduce of the total bytes
//   mpi_separate   K separate MPI_Allreduce calls
// and the two bars: fused / one_tensor (want <= 1.3) and mpi_separate / fused
// (want >= 2.5). --sweep adds fused rows for several bytes_per_pack values,
// for K x S and for the MLP's gradients (how the default was chosen).
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "../../examples/common/timeout_flag.h"
#include "allreduce/mpi_communicator.h"
#include "diststrat/diststrat.h"

namespace ds = diststrat;
using BenchClock = std::chrono::steady_clock;

namespace {

int iters = 30, warmup = 5;

// p50 and minimum (microseconds) of the slowest rank per iteration: on a
// shared machine the minimum is the cost without interference.
struct Timing {
  double p50 = 0, min = 0;
};
Timing time_p50(const std::function<void()>& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> t(iters);
  for (int i = 0; i < iters; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = BenchClock::now();
    fn();
    t[i] = std::chrono::duration<double, std::micro>(BenchClock::now() - t0).count();
  }
  MPI_Allreduce(MPI_IN_PLACE, t.data(), iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  std::sort(t.begin(), t.end());
  return {t[iters / 2], t[0]};
}

std::vector<ds::Tensor> make_tensors(const std::vector<int64_t>& sizes) {
  std::vector<ds::Tensor> ts;
  for (int64_t n : sizes) {
    ts.emplace_back(ds::Shape{n}, ds::DType::kFloat32);
    for (int64_t i = 0; i < n; ++i) ts.back().data<float>()[i] = 1e-3f * static_cast<float>(i % 13);
  }
  return ts;
}

// The engine path: one run() whose replica enqueues every tensor and waits.
Timing time_fused(size_t bytes_per_pack, const std::vector<int64_t>& sizes,
                  std::chrono::milliseconds timeout) {
  ds::MultiWorkerOptions o;
  o.communication.bytes_per_pack = bytes_per_pack;
  o.communication.timeout = timeout;
  ds::MultiWorkerMirroredStrategy s(o);
  std::vector<ds::Tensor> ts = make_tensors(sizes);
  std::vector<std::string> names;
  for (size_t k = 0; k < ts.size(); ++k) names.push_back("t" + std::to_string(k));
  return time_p50([&] {
    s.run([&](ds::ReplicaContext& ctx) {
      ctx.all_reduce_async(ds::ReduceOp::kSum, ts, names).wait();
    });
  });
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int tensors = 1000;
  size_t tensor_bytes = 4096, bytes_per_pack = ds::kMultiWorkerBytesPerPack;
  bool sweep = false;
  CLI::App app{"Fusion engine vs one all-reduce vs separate MPI_Allreduce calls"};
  app.add_option("--tensors", tensors, "K tensors")->capture_default_str();
  app.add_option("--tensor-bytes", tensor_bytes, "S bytes each (f32)")->capture_default_str();
  app.add_option("--bytes-per-pack", bytes_per_pack, "fusion buffer size (0 = one pack)")
      ->capture_default_str();
  app.add_option("--iters", iters, "timed iterations")->capture_default_str();
  app.add_flag("--sweep", sweep, "also sweep bytes_per_pack");
  std::string timeout_flag;
  diststrat_examples::add_timeout_flag(app, timeout_flag, "120");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    MPI_Finalize();
    return rc;
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  try {
    const size_t count = tensor_bytes / 4, total = count * tensors;
    std::vector<int64_t> sizes(tensors, static_cast<int64_t>(count));

    const std::chrono::milliseconds timeout =
        !timeout_flag.empty() ? ds::parse_timeout_seconds(timeout_flag)
                              : ds::timeout_from_env().value_or(std::chrono::seconds(120));
    const Timing fused = time_fused(bytes_per_pack, sizes, timeout);

    ds::CommunicationOptions co;
    co.timeout = timeout;
    auto comm = ds::make_mpi_communicator(MPI_COMM_WORLD, co);
    std::vector<float> big(total, 1.0f), small(total, 1.0f);
    const Timing one_tensor = time_p50([&] {
      comm->all_reduce(big.data(), big.data(), total, ds::DType::kFloat32, ds::ReduceOp::kSum,
                       "one");
    });
    const Timing mpi_one = time_p50([&] {
      MPI_Allreduce(MPI_IN_PLACE, big.data(), static_cast<int>(total), MPI_FLOAT, MPI_SUM,
                    MPI_COMM_WORLD);
    });
    const Timing mpi_separate = time_p50([&] {
      for (int k = 0; k < tensors; ++k) {
        MPI_Allreduce(MPI_IN_PLACE, small.data() + k * count, static_cast<int>(count), MPI_FLOAT,
                      MPI_SUM, MPI_COMM_WORLD);
      }
    });
    if (rank == 0) {
      std::printf(
          "# fusion_bench: %d ranks, %d x %zu B f32 (%.2f MiB), bytes_per_pack %zu, p50 of %d\n",
          size, tensors, tensor_bytes, total * 4 / 1048576.0, bytes_per_pack, iters);
      std::printf("%-14s %12s %12s\n", "path", "p50_us", "min_us");
      const std::pair<const char*, Timing> rows[] = {{"fused", fused},
                                                     {"one_tensor", one_tensor},
                                                     {"mpi_one", mpi_one},
                                                     {"mpi_separate", mpi_separate}};
      for (const auto& [name, t] : rows) std::printf("%-14s %12.1f %12.1f\n", name, t.p50, t.min);
      std::printf("bar fused/one_tensor = %.2f p50, %.2f min (want <= 1.3)\n",
                  fused.p50 / one_tensor.p50, fused.min / one_tensor.min);
      std::printf("bar mpi_separate/fused = %.2f p50, %.2f min (want >= 2.5)\n",
                  mpi_separate.p50 / fused.p50, mpi_separate.min / fused.min);
    }
    if (sweep) {
      // The MLP 784-256-256-10's gradients in backprop order.
      const std::vector<int64_t> mlp = {10, 2560, 256, 65536, 256, 200704};
      if (rank == 0)
        std::printf("# bytes_per_pack sweep: p50_us / min_us\n%-14s %22s %22s\n", "bytes_per_pack",
                    "K x S", "mlp grads");
      for (size_t bpp : {size_t{16} << 10, size_t{64} << 10, size_t{256} << 10, size_t{1} << 20,
                         size_t{4} << 20, size_t{16} << 20, size_t{0}}) {
        const Timing a = time_fused(bpp, sizes, timeout);
        const Timing b = time_fused(bpp, mlp, timeout);
        if (rank == 0)
          std::printf("%-14zu %11.1f / %8.1f %11.1f / %8.1f\n", bpp, a.p50, a.min, b.p50, b.min);
      }
    }
  } catch (const ds::Error& e) {
    std::fprintf(stderr, "fusion_bench rank %d: %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return 0;
}
