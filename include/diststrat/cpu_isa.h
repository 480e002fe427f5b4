// The instruction set of the CPU math kernels, chosen at run time.
//
// The hot CPU kernels (the GEMMs, element-wise layers and losses of nn.h, the
// optimizers' updates, clipping and loss-scale checks, dtype casts, the
// all-reduce's reduction kernels) are compiled once per variant: baseline
// x86-64 (SSE2), AVX2 (with FMA and F16C) and AVX-512 (F, BW, DQ, VL). Each
// process runs one variant: the best this CPU has, unless the environment
// variable DISTSTRAT_CPU=baseline|avx2|avx512 forces one (an unknown name, or
// a variant this CPU cannot run, is an InvalidArgumentError naming the
// variable, thrown by strategy or ProcessGroup set-up, or the first kernel
// call), or
// limit_cpu_isa lowered it. Results of the variants agree to float rounding
// (the GEMMs' FMA contractions and block sizes differ); one variant on every
// rank makes replicas update bit-identically, so MultiWorkerMirroredStrategy
// lowers every rank to the lowest variant of the job at set-up (an elastic
// group does not, as a joiner may bring a lower CPU later: set DISTSTRAT_CPU
// alike on every host there; ParameterServerStrategy's asynchronous updates
// need no agreement).
//
// Rules: no call blocks or communicates; thread-safe.
#pragma once

namespace diststrat {

enum class CpuIsa { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

// "baseline", "avx2", "avx512".
const char* cpu_isa_name(CpuIsa isa);

// The best variant this CPU runs (CPUID). kBaseline on other architectures
// and in builds without the variants.
CpuIsa cpu_isa_supported();

// The variant the kernels use now. The first call decides (DISTSTRAT_CPU, or
// cpu_isa_supported()) and throws InvalidArgumentError for a bad
// DISTSTRAT_CPU; later calls return the decision.
CpuIsa cpu_isa();

// Lowers the process's variant to `most` if that is lower than the one in
// use, never raises it, and returns the variant in use afterwards (a value
// that is no CpuIsa is an InvalidArgumentError). For
// programs whose processes must compute bit-identically (ranks of one job on
// different CPUs): all-reduce cpu_isa() with min over the job, then call this
// on every rank before the first step. One variant per process: every
// strategy and kernel of the process uses the lowered one from then on.
CpuIsa limit_cpu_isa(CpuIsa most);

}  // namespace diststrat
