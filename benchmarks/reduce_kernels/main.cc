// Google Benchmark micro-benchmarks of the reduction kernels: GB/s per dtype
// (bytes read from the sources + bytes written), for the dispatched code path
// (AVX-512 / AVX2 / baseline, whichever this CPU has) and the baseline path.
//
//   build/benchmarks/reduce_kernels_bench --benchmark_filter=sum
#include <benchmark/benchmark.h>

#include <vector>

#include "allreduce/reduce_kernels.h"
#include "diststrat/dtype.h"

namespace ds = diststrat;

namespace {

// args: dtype, element count, number of sources, dispatched (1) or baseline (0)
void BM_Reduce(benchmark::State& state) {
  const auto dtype = static_cast<ds::DType>(state.range(0));
  const size_t count = static_cast<size_t>(state.range(1));
  const int n = static_cast<int>(state.range(2));
  const bool dispatched = state.range(3) != 0;
  const size_t bytes = count * ds::dtype_size(dtype);
  std::vector<std::vector<char>> srcs(n, std::vector<char>(bytes, 0));
  for (auto& s : srcs)
    for (size_t i = 0; i + 1 < bytes; i += 2) s[i + 1] = 0x3c;  // 1.0 in f16 / small values
  std::vector<char> dst(bytes);
  std::vector<const void*> ptrs;
  for (auto& s : srcs) ptrs.push_back(s.data());
  for (auto _ : state) {
    if (dispatched) {
      ds::kernels::reduce(dst.data(), ptrs.data(), n, count, dtype, ds::ReduceOp::kSum, n);
    } else {
      ds::kernels::reduce_baseline(dst.data(), ptrs.data(), n, count, dtype, ds::ReduceOp::kSum, n);
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * bytes * (n + 1));
  state.SetLabel(std::string(ds::dtype_name(dtype)) + " sum of " + std::to_string(n) + ", " +
                 (dispatched ? ds::kernels::isa_name() : "baseline"));
}

void Args(benchmark::internal::Benchmark* b) {
  for (ds::DType d : {ds::DType::kFloat32, ds::DType::kFloat64, ds::DType::kFloat16,
                      ds::DType::kBFloat16, ds::DType::kInt32, ds::DType::kInt64}) {
    for (int64_t count : {int64_t{1} << 14, int64_t{1} << 22}) {
      for (int dispatched : {1, 0}) b->Args({static_cast<int64_t>(d), count, 2, dispatched});
    }
  }
}

BENCHMARK(BM_Reduce)->Apply(Args);

}  // namespace

BENCHMARK_MAIN();
