// gpu_bench: the GPU backend's numbers, each measured against a baseline in
// the same run.
//  1. MLP (784-256-256-10) training step, MirroredStrategy with one replica:
//     GPU vs one CPU core, same batch: the library's CPU step (built for
//     baseline x86-64) and the same step in Eigen built with -march=native
//     (native_mlp.cc), which the bar (GPU >= 10x) is held to.
//  2. All-reduce over logical GPUs of one physical GPU (the shared-device
//     reduction) vs cudaMemcpy device-to-device, per size. Rows report algbw
//     (bytes / time) and memory traffic: an n-way in-place all-reduce must
//     read n buffers and write n buffers (2·n·S bytes), a copy reads and
//     writes one (2·S), so "traffic vs copy" = (2nS/t_allreduce)/(2S/t_copy)
//     says how close the reduction runs to the copy's memory bandwidth.
//  3. NCCL all-reduce on one GPU (1 rank, out of place), nccl-tests style
//     algbw: with one rank this is a local copy, not a collective (a check
//     that NCCL loads and runs, not a bandwidth figure of the library).
// Exit status 77 (and one "skipped" line) without a GPU.
//
//   gpu_bench [--quick]     (--quick: fewer iterations and sizes)
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/device_manager_impl.h"
#include "core/device_scope.h"
#include "diststrat/diststrat.h"
#include "native_mlp.h"

namespace ds = diststrat;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Mean seconds per training step of an MLP under a one-replica MirroredStrategy on `device`.
double mlp_step_seconds(ds::Device device, std::shared_ptr<ds::DeviceManager> dm, int64_t batch,
                        int warmup, int steps) {
  ds::MirroredOptions o;
  o.devices = {device};
  o.device_manager = dm;
  ds::MirroredStrategy s(o);
  ds::nn::Mlp mlp({784, 256, 256, 10});
  auto vars = mlp.create_variables(s, 1);
  ds::SGD opt(s, {0.01f, 0.9f});
  ds::Tensor x(ds::Shape{batch, 784}, ds::DType::kFloat32), y(ds::Shape{batch}, ds::DType::kInt32);
  ds::init::RandomNormal{0, 1, 2}(x);
  for (int64_t i = 0; i < batch; ++i) y.data<int32_t>()[i] = static_cast<int32_t>(i % 10);
  auto dist = s.distribute(ds::Dataset(x, y), batch);
  const ds::DistributedBatch& b = *dist.begin();
  // The loss is read (a host wait) every kLossEvery steps, as a training
  // loop reads it when it logs, not every step.
  constexpr int kLossEvery = 100;
  double loss = 0;
  auto step = [&](int i) {
    ds::PerReplica<ds::nn::StepValue<double>> l = s.run([&](ds::ReplicaContext& ctx) {
      std::vector<ds::Tensor> p;
      for (auto& v : vars) p.push_back(v.read(ctx));
      auto st = mlp.forward_backward(p, b.features(ctx), b.labels(ctx), 1.0f / batch);
      std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
      for (size_t k = 0; k < vars.size(); ++k) gv.emplace_back(st.grads[k], vars[k]);
      opt.apply_gradients(ctx, gv);
      return st.loss_sum;
    });
    if ((i + 1) % kLossEvery == 0) loss = l[0].get();
  };
  for (int i = 0; i < warmup; ++i) step(i);
  s.synchronize();
  const auto t0 = Clock::now();
  for (int i = 0; i < steps; ++i) step(i);
  s.synchronize();  // the steps' work is done, not just enqueued
  const double seconds = seconds_since(t0) / steps;
  if (!std::isfinite(loss)) std::fprintf(stderr, "gpu_bench: the MLP's loss is %f\n", loss);
  return seconds;
}

struct ArRow {
  size_t bytes;
  double copy_s, ar_s;
};

// Shared-device all-reduce over `n` logical GPUs of physical GPU 0, and a
// device-to-device copy of the same size on the same GPU.
std::vector<ArRow> logical_allreduce(int n, const std::vector<size_t>& sizes, int iters) {
  const size_t biggest = sizes.back();
  auto dm = std::make_shared<ds::DeviceManager>();
  dm->set_visible_devices({0});
  dm->set_logical_device_configuration(
      0, std::vector<ds::LogicalDeviceConfiguration>(n, {2 * biggest + (64u << 20)}));
  ds::MirroredOptions o;
  o.device_manager = dm;
  ds::MirroredStrategy s(o);
  std::vector<ArRow> rows;
  ds::GpuBackend& backend = ds::DeviceManagerAccess::impl(*dm).require_backend("gpu_bench");
  for (size_t bytes : sizes) {
    const int64_t count = static_cast<int64_t>(bytes / 4);
    ArRow row{bytes, 0, 0};
    // Copy baseline on logical GPU 0 (the default stream, synchronized).
    {
      ds::ExecScope scope;
      scope.device = ds::Device::gpu(0);
      scope.devices = dm.get();
      ds::ScopedExec scoped(scope);
      ds::Tensor a(ds::Shape{count}, ds::DType::kFloat32, ds::Device::gpu(0));
      ds::Tensor b(ds::Shape{count}, ds::DType::kFloat32, ds::Device::gpu(0));
      const auto deadline = [] { return Clock::now() + std::chrono::seconds(60); };
      // Each copy is waited for, as each all-reduce call below waits for its
      // kernel: both pay the same per-iteration synchronisation.
      for (int i = 0; i < 3; ++i) {
        backend.memcpy_async(0, b.data(), a.data(), bytes, nullptr);
        backend.synchronize(0, nullptr, deadline(), "copy warmup");
      }
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) {
        backend.memcpy_async(0, b.data(), a.data(), bytes, nullptr);
        backend.synchronize(0, nullptr, deadline(), "copy");
      }
      row.copy_s = seconds_since(t0) / iters;
    }
    s.run([&](ds::ReplicaContext& ctx) {
      ds::Tensor t(ds::Shape{count}, ds::DType::kFloat32, ctx.device());
      std::vector<ds::Tensor> v{t};
      for (int i = 0; i < 3; ++i) ctx.all_reduce(ds::ReduceOp::kMax, v, {"bench"});
      ctx.barrier("start");
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) ctx.all_reduce(ds::ReduceOp::kMax, v, {"bench"});
      if (ctx.replica_id() == 0) row.ar_s = seconds_since(t0) / iters;
    });
    rows.push_back(row);
  }
  return rows;
}

// NCCL all-reduce with one rank on GPU 0, out of place; seconds per call.
double nccl_single_gpu(size_t bytes, int iters, std::string* skipped) {
  ds::GpuOptions go;
  go.visible_devices = std::vector<int>{0};
  auto dm = std::make_shared<ds::DeviceManager>(go);
  ds::GpuBackend& b = ds::DeviceManagerAccess::impl(*dm).require_backend("gpu_bench");
  void* stream = b.create_stream(0);
  ds::CommunicationOptions co;
  co.timeout = std::chrono::seconds(60);
  std::vector<std::unique_ptr<ds::Communicator>> comm;
  try {
    comm = b.nccl_local_group({0}, {stream}, co);
  } catch (const ds::UnimplementedError& e) {
    *skipped = e.what();
    b.destroy_stream(0, stream);
    return 0;
  }
  ds::ExecScope scope;
  scope.device = ds::Device::gpu(0);
  scope.devices = dm.get();
  ds::ScopedExec scoped(scope);
  const int64_t count = static_cast<int64_t>(bytes / 4);
  ds::Tensor in(ds::Shape{count}, ds::DType::kFloat32, ds::Device::gpu(0));
  ds::Tensor out(ds::Shape{count}, ds::DType::kFloat32, ds::Device::gpu(0));
  for (int i = 0; i < 3; ++i) {
    comm[0]->all_reduce(in.data(), out.data(), count, ds::DType::kFloat32, ds::ReduceOp::kSum, "w");
  }
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    comm[0]->all_reduce(in.data(), out.data(), count, ds::DType::kFloat32, ds::ReduceOp::kSum, "x");
  }
  const double t = seconds_since(t0) / iters;
  comm.clear();
  b.destroy_stream(0, stream);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  try {
    {
      ds::GpuOptions probe;
      probe.take_leases = false;
      if (ds::DeviceManager(probe).list_physical_devices().empty()) {
        std::printf("gpu_bench: skipped: no GPU visible to the CUDA runtime\n");
        return 77;
      }
    }
    auto phys = ds::DeviceManager().list_physical_devices();
    std::printf("gpu_bench on %s (%.0f GiB)\n", phys[0].name.c_str(),
                phys[0].total_memory_bytes / double(1ull << 30));
    {
      ds::GpuOptions probe;
      probe.take_leases = false;
      ds::DeviceManager dm(probe);
      const std::string v =
          ds::DeviceManagerAccess::impl(dm).require_backend("gpu_bench").nccl_version();
      std::printf("NCCL at run time: %s\n\n", v.empty() ? "none (built without NCCL)" : v.c_str());
      std::printf("result nccl_version=%s\n", v.empty() ? "none" : v.c_str());
    }

    // 1. MLP step.
    const int64_t batch = 512;
    auto gpu_dm = std::make_shared<ds::DeviceManager>();
    const double gpu_s = mlp_step_seconds(ds::Device::gpu(0), gpu_dm, batch, 5, quick ? 30 : 100);
    gpu_dm.reset();
    const double cpu_s = mlp_step_seconds(ds::Device::cpu(0), nullptr, batch, 2, quick ? 5 : 10);
    double checksum = 0;
    const double native_s = native_mlp_step_seconds(batch, 2, quick ? 5 : 10, &checksum);
    std::printf("MLP 784-256-256-10 training step, batch %lld (MirroredStrategy, 1 replica)\n",
                static_cast<long long>(batch));
    std::printf("  %-12s %10s %14s\n", "device", "step ms", "samples/s");
    std::printf("  %-12s %10.3f %14.0f\n", "GPU", gpu_s * 1e3, batch / gpu_s);
    std::printf("  %-12s %10.3f %14.0f   (the library, baseline x86-64)\n", "CPU 1 core",
                cpu_s * 1e3, batch / cpu_s);
    std::printf("  %-12s %10.3f %14.0f   (Eigen, -march=native; weights sum %.3f)\n", "CPU native",
                native_s * 1e3, batch / native_s, checksum);
    std::printf("  speedup GPU/CPU: %.1fx (library), %.1fx (-march=native core)\n\n", cpu_s / gpu_s,
                native_s / gpu_s);

    // 2. Logical-GPU all-reduce vs copy.
    const int n = 2;
    std::vector<size_t> sizes =
        quick ? std::vector<size_t>{16u << 20, 256u << 20}
              : std::vector<size_t>{1u << 20, 16u << 20, 64u << 20, 256u << 20};
    const auto rows = logical_allreduce(n, sizes, quick ? 10 : 20);
    std::printf("All-reduce (max, f32, in place) over %d logical GPUs of GPU 0 vs D2D copy\n", n);
    std::printf("  %10s %10s %11s %10s %11s %13s %16s\n", "bytes", "copy ms", "copy GB/s", "ar ms",
                "ar algbw", "ar traffic", "traffic vs copy");
    double ratio_256 = 0, algbw_256 = 0, copy_256 = 0;
    for (const ArRow& r : rows) {
      const double copy_gbs = r.bytes / r.copy_s / 1e9;  // bytes copied per second
      const double algbw = r.bytes / r.ar_s / 1e9;
      const double traffic = 2.0 * n * r.bytes / r.ar_s / 1e9;  // bytes read + written
      const double copy_traffic = 2.0 * r.bytes / r.copy_s / 1e9;
      const double ratio = traffic / copy_traffic;
      std::printf("  %10zu %10.3f %11.1f %10.3f %11.1f %13.1f %16.2f\n", r.bytes, r.copy_s * 1e3,
                  copy_gbs, r.ar_s * 1e3, algbw, traffic, ratio);
      if (r.bytes == (256u << 20)) {
        ratio_256 = ratio;
        algbw_256 = algbw;
        copy_256 = copy_gbs;
      }
    }
    std::printf("\n");

    // 3. NCCL, one GPU.
    std::string nccl_skip;
    const double nccl_s = nccl_single_gpu(256u << 20, quick ? 10 : 20, &nccl_skip);
    const double nccl_gbs = nccl_s > 0 ? (256u << 20) / nccl_s / 1e9 : 0;
    if (nccl_s > 0) {
      std::printf(
          "NCCL all-reduce, 1 rank on GPU 0, 256 MiB f32 out of place: %.3f ms, algbw %.1f "
          "GB/s\n\n",
          nccl_s * 1e3, nccl_gbs);
    } else {
      std::printf("NCCL all-reduce: skipped (%s)\n\n", nccl_skip.c_str());
    }

    // Machine-readable summary.
    std::printf("result mlp_gpu_step_ms=%.4f\n", gpu_s * 1e3);
    std::printf("result mlp_gpu_samples_per_s=%.0f\n", batch / gpu_s);
    std::printf("result mlp_cpu_step_ms=%.4f\n", cpu_s * 1e3);
    std::printf("result mlp_speedup=%.2f\n", cpu_s / gpu_s);
    std::printf("result mlp_native_step_ms=%.4f\n", native_s * 1e3);
    std::printf("result mlp_speedup_native=%.2f\n", native_s / gpu_s);
    std::printf("result logical_allreduce_256MiB_algbw_GBs=%.1f\n", algbw_256);
    std::printf("result d2d_copy_256MiB_GBs=%.1f\n", copy_256);
    std::printf("result logical_allreduce_traffic_vs_copy=%.3f\n", ratio_256);
    std::printf("result nccl_1gpu_256MiB_algbw_GBs=%.1f\n", nccl_gbs);
    return 0;
  } catch (const ds::Error& e) {
    std::fprintf(stderr, "gpu_bench: %s\n", e.what());
    return 1;
  }
}
