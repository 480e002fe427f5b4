// allreduce_bench: an nccl-tests-style all-reduce benchmark.
//
//   mpirun -np 2 build/benchmarks/allreduce_bench --algos shm,ring,auto,mpi,gloo
//   build/benchmarks/allreduce_bench --inproc 2 --algos direct,ring
//
// One row per (algorithm, size): time p50/p99 (per iteration, the slowest
// rank), algbw = bytes / time, busbw = algbw * 2 (p - 1) / p (nccl-tests'
// convention: the bandwidth each rank's links carry in a ring), and the
// ratio of `mpi`'s p50 time to this row's (busbw relative to MPI_Allreduce).
// The machine's memory copy bandwidth is measured once as the physical
// reference. Baselines run in the same invocation: mpi = MPI_Allreduce
// (called directly; 16-bit dtypes through the kMpiNative communicator), gloo = Gloo's ring-chunked and halving-doubling
// over TCP loopback.
//
// --collectives all_reduce,reduce_scatter,all_gather adds rows for the
// other two collectives of every communicator-backed algorithm ("ring/
// reduce_scatter", ...), as ZeRO-1 uses them (a reduce-scatter plus an
// all-gather move the bytes of one all-reduce); "mpi/<collective>" is the
// kMpiNative communicator's own reduce_scatter / all_gather (only its
// all_reduce is MPI_Allreduce). nccl-tests' convention:
// size = the whole buffer (p blocks: the reduce-scatter's input, the
// all-gather's output), algbw = size / time, busbw = algbw (p - 1) / p.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../../examples/common/timeout_flag.h"
#include "allreduce/packed.h"
#include "allreduce/reduce_kernels.h"
#include "allreduce/transport.h"
#include "allreduce/transport_communicator.h"
#include "diststrat/collective.h"
#include "diststrat/config.h"
#include "diststrat/error.h"
#include "diststrat/tensor.h"

#if DISTSTRAT_HAVE_MPI
#include <mpi.h>

#include "allreduce/mpi_communicator.h"
#include "allreduce/mpi_util.h"
#endif
#if DISTSTRAT_HAVE_GLOO
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>

#include "allreduce/gloo_transport.h"
#include "allreduce/tcp_transport.h"
#endif

namespace ds = diststrat;
using BenchClock = std::chrono::steady_clock;

namespace {

struct Config {
  std::vector<std::string> algos{
      "ring", "halving_doubling", "tree", "reduce_to_one", "hierarchical", "shm", "auto", "mpi",
      "gloo"};
  int inproc = 0;
  size_t min_bytes = 8, max_bytes = 256u << 20;
  double step_factor = 2;
  std::string dtype = "float32", op = "sum", format = "table";
  int iters = 20, warmup = 5;
  bool check = false;
  bool fusion = false;
  int fusion_tensors = 1000;
  size_t fusion_bytes = 4096;
  size_t segment_bytes = 0;
  std::string csv_out;
  std::vector<std::string> collectives{"all_reduce"};
  std::string timeout;         // --timeout seconds; empty: DISTSTRAT_TIMEOUT, else 5 minutes
  std::string gloo_interface;  // <algo>_gloo: the interface to listen on; empty: the host name
};

std::chrono::milliseconds timeout_of(const Config& c) {
  if (!c.timeout.empty()) return ds::parse_timeout_seconds(c.timeout);
  return ds::timeout_from_env().value_or(std::chrono::minutes(5));
}

struct Row {
  std::string algo;
  size_t bytes = 0, count = 0;
  double p50_us = 0, p99_us = 0, algbw = 0, busbw = 0, vs_mpi = NAN;
  std::string check = "-";
};

// One all-reduce implementation under test, as seen by one rank.
struct Runner {
  virtual ~Runner() = default;
  // Out of place: in -> out.
  virtual void all_reduce(const void* in, void* out, size_t count) = 0;
  // Prepares for `count` elements (Gloo binds buffers at construction).
  virtual void prepare(void* in, void* out, size_t count) {}
  virtual ds::Communicator* communicator() { return nullptr; }
  // Buffers of at least `bytes` for in and out, or {nullptr, nullptr}: the
  // sweep's ordinary heap buffers.
  virtual std::pair<void*, void*> buffers(size_t bytes) { return {nullptr, nullptr}; }
};

struct CommRunner : Runner {
  CommRunner(ds::Communicator& c, ds::DType d, ds::ReduceOp o) : comm(c), dtype(d), op(o) {}
  void all_reduce(const void* in, void* out, size_t count) override {
    comm.all_reduce(in, out, count, dtype, op, "bench");
  }
  ds::Communicator* communicator() override { return &comm; }
  ds::Communicator& comm;
  ds::DType dtype;
  ds::ReduceOp op;
};

// "mpi": MPI_Allreduce itself, not through diststrat (which would add its
// call comparison, allreduce/transport_communicator.h), for the dtypes MPI
// has; float16/bfloat16 go through the kMpiNative communicator (MPI_Iallreduce
// with diststrat's reduction ops). The communicator also serves the
// "mpi/<collective>" rows.
struct RawMpiRunner : CommRunner {
  using CommRunner::CommRunner;
  void all_reduce(const void* in, void* out, size_t count) override {
    MPI_Datatype type = MPI_DATATYPE_NULL;
    if (!ds::mpi::native_type(dtype, &type)) return CommRunner::all_reduce(in, out, count);
    const int rc = MPI_Allreduce(in == out ? MPI_IN_PLACE : in, out, static_cast<int>(count), type,
                                 ds::mpi::native_op(op), MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) throw ds::InternalError("MPI_Allreduce failed");
    if (op == ds::ReduceOp::kMean) ds::kernels::scale_mean(out, count, dtype, comm.size());
  }
};

// `name` less `suffix` ("shm_registered" -> "shm"), or "" when `name` does
// not end in it (or is nothing but it).
std::string base_of(const std::string& name, const std::string& suffix) {
  if (name.size() <= suffix.size() ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return "";
  }
  return name.substr(0, name.size() - suffix.size());
}

// "<algo>_registered" (shm_registered, auto_registered, ...): the algorithm
// with the tensors in memory from Communicator::allocate_buffer (as the
// multi-worker fusion buffers are, or nccl-tests' -R registered buffers): on
// one host the shared-memory path then reduces out of the peers' buffers
// without staging. The buffers are allocated once, for the largest size.
// The algorithm of an "<algo>_registered" name, or "" for any other name.
std::string registered_base(const std::string& name) { return base_of(name, "_registered"); }

// "<algo>_staged" (shm_staged, auto_staged): the algorithm with
// CommunicationOptions::shm_single_copy off, so that large all-reduces of
// ordinary buffers take the staging buffers even where cross-memory attach
// works (the comparison in docs/benchmarks.md). The algorithm of such a
// name, or "" for any other name.
std::string staged_base(const std::string& name) { return base_of(name, "_staged"); }

// "<algo>_gloo" (ring_gloo, auto_gloo): the algorithm over the elastic
// groups' transport (Gloo TCP pairs, allreduce/gloo_transport.h) instead of
// MPI's point-to-point: what an elastic job's all-reduce costs against the
// same algorithm over MPI. The algorithm of such a name, or "".
std::string gloo_base(const std::string& name) { return base_of(name, "_gloo"); }
// "<algo>_tcp" (ring_tcp, auto_tcp): the algorithm over the TCP transport of
// jobs started without a launcher (allreduce/tcp_transport.h): what a
// TF_CONFIG job's all-reduce costs against the same algorithm over MPI.
std::string tcp_base(const std::string& name) { return base_of(name, "_tcp"); }

struct RegisteredRunner : CommRunner {
  RegisteredRunner(ds::Communicator& c, ds::DType d, ds::ReduceOp o, size_t max_bytes)
      : CommRunner(c, d, o),
        in_(c.allocate_buffer(max_bytes)),
        out_(c.allocate_buffer(max_bytes)),
        max_bytes_(max_bytes) {}
  std::pair<void*, void*> buffers(size_t bytes) override {
    if (bytes > max_bytes_) throw ds::InternalError("RegisteredRunner: buffer too small");
    return {in_.get(), out_.get()};
  }
  std::shared_ptr<void> in_, out_;
  size_t max_bytes_;
};

// "memcpy": not an all-reduce but its reference floor. Every rank copies its
// n input bytes to its output at the same time, with no communication. A
// 2-rank all-reduce on registered buffers moves one such memcpy's worth of
// bytes per rank (it reads n: half its own input, half its peer's, and
// writes n: half its own output, half its peer's); on ordinary buffers the
// staged path moves two (the same, plus each half once more through the
// staging buffers: staged and published, then collected by the peer).
struct MemcpyRunner : Runner {
  explicit MemcpyRunner(ds::DType d) : es(ds::dtype_size(d)) {}
  void all_reduce(const void* in, void* out, size_t count) override {
    std::memcpy(out, in, count * es);
  }
  size_t es;
};

// ---- closed-form check: rank r contributes (r + 1) * (i % 7 + 1) (for
// product: 2 where (r + i) % 3 == 0, else 1), exact in every dtype.
double contribution(int rank, size_t i, ds::ReduceOp op) {
  if (op == ds::ReduceOp::kProduct) return (rank + i) % 3 == 0 ? 2.0 : 1.0;
  return (rank + 1.0) * static_cast<double>(i % 7 + 1);
}
double reduced(int n, size_t i, ds::ReduceOp op, ds::DType dtype) {
  double acc = contribution(0, i, op);
  for (int r = 1; r < n; ++r) {
    const double v = contribution(r, i, op);
    if (op == ds::ReduceOp::kProduct)
      acc *= v;
    else if (op == ds::ReduceOp::kMin)
      acc = std::min(acc, v);
    else if (op == ds::ReduceOp::kMax)
      acc = std::max(acc, v);
    else
      acc += v;
  }
  if (op == ds::ReduceOp::kMean) {
    const bool integer = dtype == ds::DType::kInt32 || dtype == ds::DType::kInt64;
    acc = integer ? std::floor(acc / n) : acc / n;
  }
  return acc;
}
void put(void* p, ds::DType d, size_t i, double v) {
  switch (d) {
    case ds::DType::kFloat32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      break;
    case ds::DType::kFloat64:
      static_cast<double*>(p)[i] = v;
      break;
    case ds::DType::kFloat16:
      static_cast<ds::Half*>(p)[i] = ds::Half(static_cast<float>(v));
      break;
    case ds::DType::kBFloat16:
      static_cast<ds::BFloat16*>(p)[i] = ds::BFloat16(static_cast<float>(v));
      break;
    case ds::DType::kInt32:
      static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
      break;
    case ds::DType::kInt64:
      static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v);
      break;
  }
}
double get(const void* p, ds::DType d, size_t i) {
  switch (d) {
    case ds::DType::kFloat32:
      return static_cast<const float*>(p)[i];
    case ds::DType::kFloat64:
      return static_cast<const double*>(p)[i];
    case ds::DType::kFloat16:
      return static_cast<float>(static_cast<const ds::Half*>(p)[i]);
    case ds::DType::kBFloat16:
      return static_cast<float>(static_cast<const ds::BFloat16*>(p)[i]);
    case ds::DType::kInt32:
      return static_cast<const int32_t*>(p)[i];
    case ds::DType::kInt64:
      return static_cast<double>(static_cast<const int64_t*>(p)[i]);
  }
  return NAN;
}
void fill(void* p, ds::DType d, size_t count, int rank, ds::ReduceOp op) {
  for (size_t i = 0; i < count; ++i) put(p, d, i, contribution(rank, i, op));
}
bool verify(const void* p, ds::DType d, size_t count, int n, ds::ReduceOp op) {
  const double rel = d == ds::DType::kBFloat16 ? 1e-2 : d == ds::DType::kFloat16 ? 2e-3 : 1e-6;
  for (size_t i = 0; i < count; ++i) {
    const double want = reduced(n, i, op, d);
    if (std::abs(get(p, d, i) - want) > rel * std::abs(want) + 1e-9) return false;
  }
  return true;
}

// Single-thread memcpy bandwidth (GB/s of bytes copied), best of 5 copies of
// 256 MiB: each byte is read once and written once.
double copy_bandwidth() {
  const size_t bytes = 256u << 20;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = BenchClock::now();
    std::memcpy(b.data(), a.data(), bytes);
    const double s = std::chrono::duration<double>(BenchClock::now() - t0).count();
    best = std::max(best, bytes / s / 1e9);
    a[i] = b[bytes - 1 - i];  // keep the copies observable
  }
  return best;
}

// Aggregate bandwidth of `threads` memcpys of 64 MiB running at once: when
// one thread already saturates the memory bus, p ranks that each must move a
// memcpy's worth of bytes share it, and this (not one thread's memcpy) bounds
// what an all-reduce over threads of one process can reach.
// With `streaming`, the copies use kernels::copy_streaming (no
// write-allocate reads), as the all-reduce writes outputs of this size.
double concurrent_copy_bandwidth(int threads, bool streaming = false) {
  const size_t bytes = 64u << 20;
  std::vector<std::vector<char>> a(threads, std::vector<char>(bytes, 1));
  std::vector<std::vector<char>> b(threads, std::vector<char>(bytes, 2));
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = BenchClock::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        if (streaming) {
          ds::kernels::copy_streaming(b[t].data(), a[t].data(), bytes);
        } else {
          std::memcpy(b[t].data(), a[t].data(), bytes);
        }
      });
    }
    for (auto& t : ts) t.join();
    const double s = std::chrono::duration<double>(BenchClock::now() - t0).count();
    best = std::max(best, threads * bytes / s / 1e9);
  }
  return best;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t k =
      std::min(v.size() - 1, static_cast<size_t>(std::ceil(q * v.size())) - (q > 0 ? 1 : 0));
  return v[k];
}

std::vector<size_t> sizes(const Config& c) {
  std::vector<size_t> out;
  for (double b = static_cast<double>(c.min_bytes);
       b <= static_cast<double>(c.max_bytes) * 1.0000001; b *= c.step_factor) {
    out.push_back(static_cast<size_t>(b));
    if (c.step_factor <= 1) break;
  }
  return out;
}

std::string human(size_t bytes) {
  char buf[32];
  if (bytes >= (1u << 20) && bytes % (1u << 20) == 0)
    std::snprintf(buf, sizeof buf, "%zuM", bytes >> 20);
  else if (bytes >= 1024 && bytes % 1024 == 0)
    std::snprintf(buf, sizeof buf, "%zuK", bytes >> 10);
  else
    std::snprintf(buf, sizeof buf, "%zu", bytes);
  return buf;
}

// ---- how ranks are run: MPI processes, or threads of this process.
struct World {
  virtual ~World() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void barrier() = 0;
  // Element-wise max over ranks of `v` (every rank gets it).
  virtual void max_all(std::vector<double>& v) = 0;
  virtual bool all_true(bool ok) = 0;
};

// Times `iters` iterations after `warmup`; each iteration starts at a
// barrier and counts the slowest rank.
std::vector<double> time_iterations(World& w, const Config& c, const std::function<void()>& fn) {
  for (int i = 0; i < c.warmup; ++i) fn();
  std::vector<double> t(c.iters);
  for (int i = 0; i < c.iters; ++i) {
    w.barrier();
    const auto t0 = BenchClock::now();
    fn();
    t[i] = std::chrono::duration<double, std::micro>(BenchClock::now() - t0).count();
  }
  w.max_all(t);
  return t;
}

// Runs every (size, algorithm) on this rank; rank 0's rows are the result.
std::vector<Row> run_sweep(World& w, const Config& c, ds::DType dtype, ds::ReduceOp op,
                           std::vector<std::pair<std::string, Runner*>>& runners) {
  std::vector<Row> rows;
  const size_t es = ds::dtype_size(dtype);
  const int p = w.size();
  for (size_t bytes : sizes(c)) {
    const size_t count = bytes / es;
    if (count == 0) continue;
    std::vector<char> heap_in(count * es), heap_out(count * es);
    for (auto& [name, runner] : runners) {
      auto [in, out] = runner->buffers(count * es);
      if (!in) {
        in = heap_in.data();
        out = heap_out.data();
      }
      fill(in, dtype, count, w.rank(), op);
      runner->prepare(in, out, count);
      Row row;
      row.algo = name;
      row.bytes = count * es;
      row.count = count;
      const auto t = time_iterations(w, c, [&] { runner->all_reduce(in, out, count); });
      row.p50_us = percentile(t, 0.5);
      row.p99_us = percentile(t, 0.99);
      row.algbw = row.bytes / (row.p50_us * 1e-6) / 1e9;
      row.busbw = row.algbw * 2.0 * (p - 1) / p;
      if (c.check && name != "memcpy") {
        std::memset(out, 0, count * es);
        runner->all_reduce(in, out, count);
        row.check = w.all_true(verify(out, dtype, count, p, op)) ? "ok" : "FAIL";
      }
      rows.push_back(row);
    }
    // reduce_scatter / all_gather over p blocks of count / p elements.
    const size_t block = count / static_cast<size_t>(p);
    for (const std::string& coll : c.collectives) {
      if (coll == "all_reduce" || block == 0) continue;
      const bool scatter = coll == "reduce_scatter";
      for (auto& [name, runner] : runners) {
        ds::Communicator* comm = runner->communicator();
        if (!comm) continue;  // memcpy, gloo: all-reduce only
        auto [in, out] = runner->buffers(count * es);
        if (!in) {
          in = heap_in.data();
          out = heap_out.data();
        }
        fill(in, dtype, scatter ? block * p : block, w.rank(), op);
        Row row;
        row.algo = name + "/" + coll;
        row.count = block * static_cast<size_t>(p);
        row.bytes = row.count * es;
        const auto run = [&] {
          if (scatter) {
            comm->reduce_scatter(in, out, block, dtype, op, "bench");
          } else {
            comm->all_gather(in, out, block, dtype, "bench");
          }
        };
        const auto t = time_iterations(w, c, run);
        row.p50_us = percentile(t, 0.5);
        row.p99_us = percentile(t, 0.99);
        row.algbw = row.bytes / (row.p50_us * 1e-6) / 1e9;
        row.busbw = row.algbw * (p - 1) / p;
        if (c.check) {
          std::memset(out, 0, count * es);
          run();
          bool ok = true;
          const double rel = dtype == ds::DType::kBFloat16  ? 1e-2
                             : dtype == ds::DType::kFloat16 ? 2e-3
                                                            : 1e-6;
          for (size_t i = 0; i < (scatter ? block : block * p) && ok; ++i) {
            // reduce_scatter: element rank * block + i of the reduction;
            // all_gather: rank i / block's element i % block.
            const double want = scatter ? reduced(p, w.rank() * block + i, op, dtype)
                                        : contribution(static_cast<int>(i / block), i % block, op);
            ok = std::abs(get(out, dtype, i) - want) <= rel * std::abs(want) + 1e-9;
          }
          row.check = w.all_true(ok) ? "ok" : "FAIL";
        }
        rows.push_back(row);
      }
    }
  }
  for (Row& r : rows) {
    // Against the mpi row of the same collective ("mpi", "mpi/reduce_scatter").
    const size_t slash = r.algo.find('/');
    const std::string mpi =
        "mpi" + (slash == std::string::npos ? std::string() : r.algo.substr(slash));
    for (const Row& m : rows) {
      if (m.algo == mpi && m.bytes == r.bytes) r.vs_mpi = m.p50_us / r.p50_us;
    }
  }
  return rows;
}

// K tensors of S bytes: one call each vs. packed into fusion buffers of
// options.bytes_per_pack (PackedAllReduce).
std::vector<Row> run_fusion(World& w, const Config& c, ds::DType dtype, ds::ReduceOp op,
                            std::vector<std::pair<std::string, Runner*>>& runners) {
  std::vector<Row> rows;
  const size_t es = ds::dtype_size(dtype), count = std::max<size_t>(1, c.fusion_bytes / es);
  const int p = w.size();
  std::vector<ds::Tensor> tensors;
  std::vector<std::string> names;
  for (int k = 0; k < c.fusion_tensors; ++k) {
    tensors.emplace_back(ds::Shape{static_cast<int64_t>(count)}, dtype);
    fill(tensors.back().data(), dtype, count, w.rank(), op);
    names.push_back("t" + std::to_string(k));
  }
  for (auto& [name, runner] : runners) {
    ds::Communicator* comm = runner->communicator();
    if (!comm) continue;
    ds::PackedAllReduce packed;
    for (bool fused : {false, true}) {
      Row row;
      row.algo = name + (fused ? "/fused" : "/unfused");
      row.bytes = count * es * tensors.size();
      row.count = count * tensors.size();
      const auto t = time_iterations(w, c, [&] {
        if (fused) {
          packed.run(*comm, op, tensors, names, comm->options().bytes_per_pack);
        } else {
          for (auto& t : tensors) comm->all_reduce(t.data(), t.data(), count, dtype, op, "t");
        }
      });
      row.p50_us = percentile(t, 0.5);
      row.p99_us = percentile(t, 0.99);
      row.algbw = row.bytes / (row.p50_us * 1e-6) / 1e9;
      row.busbw = row.algbw * 2.0 * (p - 1) / p;
      rows.push_back(row);
    }
  }
  return rows;
}

void print(const std::string& format, const Config& c, const std::vector<Row>& rows, int ranks,
           double copy_bw, const std::string& mode, ds::DType dtype, ds::ReduceOp op, FILE* f) {
  const char* dt = ds::dtype_name(dtype);
  const char* on = ds::reduce_op_name(op);
  if (format == "json") {
    std::fprintf(f, "{\"mode\":\"%s\",\"ranks\":%d,\"copy_bandwidth_gbps\":%.3f,\"rows\":[",
                 mode.c_str(), ranks, copy_bw);
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::fprintf(f,
                   "%s{\"algo\":\"%s\",\"bytes\":%zu,\"count\":%zu,\"dtype\":\"%s\",\"op\":\"%s\","
                   "\"p50_us\":%.3f,\"p99_us\":%.3f,\"algbw_gbps\":%.4f,\"busbw_gbps\":%.4f,"
                   "\"vs_mpi\":%s,\"check\":\"%s\"}",
                   i ? "," : "", r.algo.c_str(), r.bytes, r.count, dt, on, r.p50_us, r.p99_us,
                   r.algbw, r.busbw,
                   std::isnan(r.vs_mpi) ? "null" : std::to_string(r.vs_mpi).c_str(),
                   r.check.c_str());
    }
    std::fprintf(f, "]}\n");
    return;
  }
  if (format == "csv") {
    std::fprintf(f, "algo,bytes,count,dtype,op,p50_us,p99_us,algbw_gbps,busbw_gbps,vs_mpi,check\n");
    for (const Row& r : rows) {
      std::fprintf(f, "%s,%zu,%zu,%s,%s,%.3f,%.3f,%.4f,%.4f,%s,%s\n", r.algo.c_str(), r.bytes,
                   r.count, dt, on, r.p50_us, r.p99_us, r.algbw, r.busbw,
                   std::isnan(r.vs_mpi) ? "" : std::to_string(r.vs_mpi).c_str(), r.check.c_str());
    }
    return;
  }
  std::fprintf(f, "# allreduce_bench: %s, %d ranks, dtype %s, op %s, %d iterations (+%d warmup)\n",
               mode.c_str(), ranks, dt, on, c.iters, c.warmup);
  std::fprintf(f,
               "# memory copy bandwidth: %.2f GB/s (single-thread memcpy of 256 MiB, best of 5)\n",
               copy_bw);
  std::fprintf(f, "# busbw = algbw * 2(p-1)/p; vs_mpi = MPI_Allreduce p50 time / this p50 time\n");
  std::fprintf(f, "%-26s %10s %11s %9s %7s %10s %10s %9s %9s %7s %5s\n", "algo", "size", "count",
               "dtype", "op", "p50(us)", "p99(us)", "algbw", "busbw", "vs_mpi", "check");
  for (const Row& r : rows) {
    char ratio[16] = "-";
    if (!std::isnan(r.vs_mpi)) std::snprintf(ratio, sizeof ratio, "%.2f", r.vs_mpi);
    std::fprintf(f, "%-26s %10s %11zu %9s %7s %10.1f %10.1f %9.3f %9.3f %7s %5s\n", r.algo.c_str(),
                 human(r.bytes).c_str(), r.count, dt, on, r.p50_us, r.p99_us, r.algbw, r.busbw,
                 ratio, r.check.c_str());
  }
}

// --csv-out: the same rows as CSV in a file as well (for plot_bench.py).
void write_csv(const Config& c, const std::vector<Row>& rows, int ranks, double copy_bw,
               const std::string& mode, ds::DType dtype, ds::ReduceOp op) {
  if (c.csv_out.empty()) return;
  FILE* f = std::fopen(c.csv_out.c_str(), "w");
  if (!f) throw ds::NotFoundError("cannot write --csv-out file '" + c.csv_out + "'");
  print("csv", c, rows, ranks, copy_bw, mode, dtype, op, f);
  std::fclose(f);
}

// Bars from the issue, computed from one run's rows.
void print_bars(const std::vector<Row>& rows, double copy_bw, int ranks, const std::string& mode) {
  auto find = [&](const std::string& algo, size_t bytes) -> const Row* {
    for (const Row& r : rows)
      if (r.algo == algo && r.bytes == bytes) return &r;
    return nullptr;
  };
  std::printf("# ---- bars ----\n");
  if (mode == "mpi") {
    for (const char* ours : {"shm", "shm_registered", "auto", "auto_registered"}) {
      double worst = INFINITY, worst_big = INFINITY;
      for (const Row& r : rows) {
        if (r.algo != ours || std::isnan(r.vs_mpi) || r.bytes < 4096) continue;
        worst = std::min(worst, r.vs_mpi);
        if (r.bytes >= (16u << 20)) worst_big = std::min(worst_big, r.vs_mpi);
      }
      if (std::isfinite(worst)) {
        std::printf(
            "# %s vs MPI_Allreduce: min ratio %.2f over 4K..max (bar >= 1.0), min %.2f at >= 16M "
            "(bar >= 2.0)\n",
            ours, worst, worst_big);
      }
    }
    // Per size >= 1M: our fastest row against Gloo's faster algorithm.
    double worst_gloo = INFINITY;
    std::string per_size;
    std::vector<size_t> seen;
    for (const Row& r : rows) {
      if (r.bytes < (1u << 20) || std::find(seen.begin(), seen.end(), r.bytes) != seen.end())
        continue;
      const Row* g1 = find("gloo_ring_chunked", r.bytes);
      const Row* g2 = find("gloo_halving_doubling", r.bytes);
      if (!g1 && !g2) continue;
      seen.push_back(r.bytes);
      double gbest = 0;
      const Row* obest = nullptr;
      for (const Row& o : rows)
        if (o.bytes == r.bytes && o.algo.rfind("gloo", 0) != 0 && o.algo != "mpi" &&
            o.algo != "memcpy" && (!obest || o.busbw > obest->busbw))
          obest = &o;
      if (!obest) continue;
      if (g1) gbest = std::max(gbest, g1->busbw);
      if (g2) gbest = std::max(gbest, g2->busbw);
      worst_gloo = std::min(worst_gloo, obest->busbw / gbest);
      char buf[96];
      std::snprintf(buf, sizeof buf, "%s%s %.2f (%s)", per_size.empty() ? "" : ", ",
                    human(r.bytes).c_str(), obest->busbw / gbest, obest->algo.c_str());
      per_size += buf;
    }
    if (std::isfinite(worst_gloo))
      std::printf(
          "# best of ours vs Gloo's best at >= 1M: min ratio %.2f (bar >= 3.0); per size: %s\n",
          worst_gloo, per_size.c_str());
    // Times in memcpys of n bytes per rank (see MemcpyRunner): registered
    // paths move 1 memcpy's worth of bytes per rank, the staged path 2.
    bool explained = false;
    for (const Row& m : rows) {
      if (m.algo != "memcpy" || m.bytes < (16u << 20) || ranks != 2) continue;
      if (!explained) {
        std::printf(
            "# in memcpys (every rank copying n bytes at once, the memcpy row): a 2-rank "
            "all-reduce on registered buffers moves 1 memcpy's worth of bytes per rank, the "
            "staged path on ordinary buffers 2 (each half once more through the staging "
            "buffers); where n outgrows the caches a memcpy also pays for the write-allocate "
            "reads, the staging copies (in cache) do not\n");
        explained = true;
      }
      std::string line;
      for (const char* a : {"mpi", "shm", "auto", "shm_registered", "auto_registered"}) {
        const Row* r = find(a, m.bytes);
        if (!r) continue;
        char buf[64];
        std::snprintf(buf, sizeof buf, ", %s %.2f", a, r->p50_us / m.p50_us);
        line += buf;
      }
      const Row* mpi = find("mpi", m.bytes);
      char need[64] = "";
      if (mpi)
        std::snprintf(need, sizeof need, "; 2x MPI_Allreduce needs <= %.2f",
                      mpi->p50_us / m.p50_us / 2);
      std::printf("#   %s: memcpy %.0f us%s%s\n", human(m.bytes).c_str(), m.p50_us, line.c_str(),
                  need);
    }
  } else if (ranks == 2) {
    for (const Row& r : rows) {
      if (r.bytes == (64u << 20) && (r.algo == "direct" || r.algo == "auto")) {
        // The ceiling, expressed as algbw: an all-reduce of n bytes over 2
        // ranks of one process must read both inputs (2n) and write both
        // outputs (2n), i.e. move two memcpys' worth of n bytes, however the
        // work is split. The machine moves `two` GB/s of memcpy when both
        // cores copy at once (measured now), so algbw <= two / 2.
        const double two = concurrent_copy_bandwidth(2);
        const double ceiling = two / 2;
        std::printf(
            "# in-process %s, 2 ranks, 64M: algbw %.2f GB/s = %.2f of the ceiling %.2f GB/s "
            "(bar >= 0.7).\n",
            r.algo.c_str(), r.algbw, r.algbw / ceiling, ceiling);
        std::printf(
            "# ceiling: a 2-rank all-reduce of n bytes moves two memcpys of n bytes (reads "
            "2n, writes 2n); two memcpys running at once on this machine move %.2f GB/s "
            "together (measured: 2 threads x 64 MiB, best of 5), so algbw <= %.2f / 2 = "
            "%.2f GB/s. For reference, one thread alone copies %.2f GB/s (%s reaches %.2f "
            "of that).\n",
            two, two, ceiling, copy_bw, r.algo.c_str(), r.algbw / copy_bw);
        // memcpy reads each destination line before writing it (write-allocate);
        // at this size the all-reduce writes its outputs with streaming stores,
        // which do not. The same ceiling from two streaming copies:
        const double two_streaming = concurrent_copy_bandwidth(2, true);
        std::printf(
            "# with streaming copies instead of memcpy (no write-allocate reads, as %s "
            "writes its outputs at this size) two copies move %.2f GB/s together: ceiling "
            "%.2f GB/s, %s reaches %.2f of it.\n",
            r.algo.c_str(), two_streaming, two_streaming / 2, r.algo.c_str(),
            r.algbw / (two_streaming / 2));
      }
    }
  }
}

// ---- in-process mode: threads over InProcessGroup / InProcessTransportGroup.
class SpinBarrier {
 public:
  explicit SpinBarrier(int n) : n_(n) {}
  void wait() {
    const long gen = gen_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      arrived_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_acq_rel);
      return;
    }
    while (gen_.load(std::memory_order_acquire) == gen) std::this_thread::yield();
  }

 private:
  const int n_;
  std::atomic<int> arrived_{0};
  std::atomic<long> gen_{0};
};

struct ThreadShared {
  explicit ThreadShared(int n) : barrier(n), slots(n) {}
  SpinBarrier barrier;
  std::vector<std::vector<double>> slots;
  std::vector<char> oks = std::vector<char>(64, 1);
};

class ThreadWorld : public World {
 public:
  ThreadWorld(ThreadShared& s, int rank, int size) : s_(s), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void barrier() override { s_.barrier.wait(); }
  void max_all(std::vector<double>& v) override {
    s_.slots[rank_] = v;
    s_.barrier.wait();
    for (int r = 0; r < size_; ++r)
      for (size_t i = 0; i < v.size(); ++i) v[i] = std::max(v[i], s_.slots[r][i]);
    s_.barrier.wait();
  }
  bool all_true(bool ok) override {
    s_.oks[rank_] = ok;
    s_.barrier.wait();
    bool all = true;
    for (int r = 0; r < size_; ++r) all = all && s_.oks[r];
    s_.barrier.wait();
    return all;
  }

 private:
  ThreadShared& s_;
  int rank_, size_;
};

int run_inproc(const Config& c, ds::DType dtype, ds::ReduceOp op) {
  const int n = c.inproc;
  std::vector<std::string> algos;
  for (const auto& a : c.algos) {
    if (a == "mpi" || a == "shm" || a == "gloo" || a == "memcpy" || !registered_base(a).empty() ||
        !staged_base(a).empty() || !gloo_base(a).empty() || !tcp_base(a).empty()) {
      std::fprintf(stderr, "# --inproc: skipping '%s' (needs mpirun)\n", a.c_str());
      continue;
    }
    algos.push_back(a);
  }
  ds::CommunicationOptions base;
  base.segment_bytes = c.segment_bytes;
  base.timeout = timeout_of(c);
  ds::InProcessGroup direct(n, base);
  ds::InProcessTransportGroup transports(n);
  ThreadShared shared(n);
  double copy_bw = copy_bandwidth();
  std::vector<Row> result;
  std::vector<std::thread> threads;
  std::vector<std::string> errors(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        ThreadWorld w(shared, r, n);
        std::vector<std::unique_ptr<ds::Communicator>> owned;
        std::vector<std::unique_ptr<Runner>> runners_owned;
        std::vector<std::pair<std::string, Runner*>> runners;
        for (const auto& a : algos) {
          ds::Communicator* comm;
          if (a == "direct" || a == "auto") {
            comm = &direct.at(r);  // the shared-address-space path is what kAuto uses in-process
          } else {
            ds::CommunicationOptions o = base;
            o.algorithm = ds::parse_algorithm(a);
            o.hierarchical_group_size = std::max(1, n / 2);
            owned.push_back(std::make_unique<ds::TransportCommunicator>(transports.at(r), o));
            comm = owned.back().get();
          }
          runners_owned.push_back(std::make_unique<CommRunner>(*comm, dtype, op));
          runners.emplace_back(a, runners_owned.back().get());
        }
        auto rows =
            c.fusion ? run_fusion(w, c, dtype, op, runners) : run_sweep(w, c, dtype, op, runners);
        if (r == 0) result = rows;
      } catch (const std::exception& e) {
        errors[r] = e.what();
        for (int q = 0; q < n; ++q) direct.at(q).abort(e.what());
        transports.at(r).abort(e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    if (!errors[r].empty()) {
      std::fprintf(stderr, "rank %d: %s\n", r, errors[r].c_str());
      return 1;
    }
  }
  print(c.format, c, result, n, copy_bw, "in-process", dtype, op, stdout);
  write_csv(c, result, n, copy_bw, "in-process", dtype, op);
  if (c.format == "table") print_bars(result, copy_bw, n, "inproc");
  return 0;
}

#if DISTSTRAT_HAVE_MPI
class MpiWorld : public World {
 public:
  MpiWorld() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void barrier() override { MPI_Barrier(MPI_COMM_WORLD); }
  void max_all(std::vector<double>& v) override {
    MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_DOUBLE, MPI_MAX,
                  MPI_COMM_WORLD);
  }
  bool all_true(bool ok) override {
    int v = ok ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    return v == 1;
  }

 private:
  int rank_ = 0, size_ = 1;
};

#if DISTSTRAT_HAVE_GLOO
// Gloo's algorithms over TCP loopback; they reduce in place on buffers bound
// at construction, so prepare() builds them per size and all_reduce copies
// the input in first (as an out-of-place MPI_Allreduce would).
template <typename T>
class GlooRunner : public Runner {
 public:
  GlooRunner(std::shared_ptr<gloo::rendezvous::Context> ctx, bool halving_doubling, ds::ReduceOp op)
      : ctx_(std::move(ctx)), hd_(halving_doubling), op_(op) {}
  void prepare(void* in, void* out, size_t count) override {
    const gloo::ReductionFunction<T>* fn = gloo::ReductionFunction<T>::sum;
    if (op_ == ds::ReduceOp::kProduct) fn = gloo::ReductionFunction<T>::product;
    if (op_ == ds::ReduceOp::kMin) fn = gloo::ReductionFunction<T>::min;
    if (op_ == ds::ReduceOp::kMax) fn = gloo::ReductionFunction<T>::max;
    std::vector<T*> ptrs{static_cast<T*>(out)};
    if (hd_) {
      algo_ = std::make_unique<gloo::AllreduceHalvingDoubling<T>>(ctx_, ptrs,
                                                                  static_cast<int>(count), fn);
    } else {
      algo_ =
          std::make_unique<gloo::AllreduceRingChunked<T>>(ctx_, ptrs, static_cast<int>(count), fn);
    }
  }
  void all_reduce(const void* in, void* out, size_t count) override {
    std::memcpy(out, in, count * sizeof(T));
    algo_->run();
    if (op_ == ds::ReduceOp::kMean) {
      T* p = static_cast<T*>(out);
      for (size_t i = 0; i < count; ++i) p[i] /= static_cast<T>(ctx_->size);
    }
  }

 private:
  std::shared_ptr<gloo::rendezvous::Context> ctx_;
  bool hd_;
  ds::ReduceOp op_;
  std::unique_ptr<gloo::Algorithm> algo_;
};

std::shared_ptr<gloo::rendezvous::Context> gloo_context(int rank, int size) {
  // A file store in a directory rank 0 names under $TMPDIR (default /tmp);
  // ranks share it on one host. Rank 0 removes it once every rank is
  // connected, or when its own connect throws.
  char dir[256] = {0};
  if (rank == 0) {
    const char* tmp = std::getenv("TMPDIR");
    std::snprintf(dir, sizeof dir, "%s/allreduce_bench_gloo_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) {
      const int err = errno;
      dir[0] = '\0';  // tells the other ranks
      MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
      throw ds::InternalError(std::string("rank 0: mkdtemp failed for the Gloo file store: ") +
                              std::strerror(err));
    }
  }
  MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (dir[0] == '\0') {
    throw ds::InternalError("rank " + std::to_string(rank) +
                            ": rank 0 could not make the Gloo file store");
  }
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore store(dir);
    ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    ctx->connectFullMesh(store, dev);
  } catch (...) {
    std::error_code ec;
    if (rank == 0) std::filesystem::remove_all(dir, ec);
    throw;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  std::error_code ec;
  if (rank == 0) std::filesystem::remove_all(dir, ec);
  return ctx;
}
#endif

#if DISTSTRAT_HAVE_GLOO
// The Gloo transport's address exchange over MPI_COMM_WORLD: make_gloo_
// transport publishes its rank's key once, then waits for the others', so
// publish is an all-gather of every rank's (key, value) and wait_for a look-up.
class MpiAddressExchange : public ds::AddressExchange {
 public:
  void publish(const std::string& key, const std::string& value, ds::Clock::time_point) override {
    const std::string mine = key + '\n' + value;
    int size = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const int len = static_cast<int>(mine.size());
    std::vector<int> lens(size), offsets(size);
    MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, MPI_COMM_WORLD);
    int total = 0;
    for (int r = 0; r < size; ++r) offsets[r] = total, total += lens[r];
    std::string all(total, '\0');
    MPI_Allgatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), offsets.data(), MPI_CHAR,
                   MPI_COMM_WORLD);
    for (int r = 0; r < size; ++r) {
      const std::string kv = all.substr(offsets[r], lens[r]);
      const size_t nl = kv.find('\n');
      values_[kv.substr(0, nl)] = kv.substr(nl + 1);
    }
  }
  std::string wait_for(const std::string& key, ds::Clock::time_point) override {
    auto it = values_.find(key);
    if (it == values_.end()) throw ds::InternalError("allreduce_bench: no address for " + key);
    return it->second;
  }

 private:
  std::map<std::string, std::string> values_;
};

std::unique_ptr<ds::Transport> gloo_transport_for(const Config& c, int rank, int size, int serial) {
  MpiAddressExchange exchange;
  ds::GlooTransportOptions o;
  o.group = "allreduce_bench/" + std::to_string(serial);
  o.interface = c.gloo_interface;
  return ds::make_gloo_transport(rank, size, exchange, o, ds::Clock::now() + timeout_of(c));
}

std::unique_ptr<ds::Transport> tcp_transport_for(const Config& c, int rank, int size, int serial) {
  MpiAddressExchange exchange;
  ds::TcpTransportOptions o;
  o.group = "allreduce_bench_tcp/" + std::to_string(serial);
  return ds::make_tcp_transport(rank, size, exchange, o, ds::Clock::now() + timeout_of(c));
}
#endif

int run_mpi(const Config& c, ds::DType dtype, ds::ReduceOp op) {
  MpiWorld w;
  double copy_bw = 0;
  if (w.rank() == 0) copy_bw = copy_bandwidth();
  MPI_Barrier(MPI_COMM_WORLD);
  std::vector<std::unique_ptr<ds::Transport>> transports;  // <algo>_gloo's; outlive comms
  std::vector<std::unique_ptr<ds::Communicator>> comms;
  std::vector<std::unique_ptr<Runner>> owned;
  std::vector<std::pair<std::string, Runner*>> runners;
  for (const auto& a : c.algos) {
    if (a == "gloo") {
#if DISTSTRAT_HAVE_GLOO
      if (dtype != ds::DType::kFloat32) {
        if (w.rank() == 0) std::fprintf(stderr, "# gloo baseline runs float32 only; skipped\n");
        continue;
      }
      auto ctx = gloo_context(w.rank(), w.size());
      owned.push_back(std::make_unique<GlooRunner<float>>(ctx, false, op));
      runners.emplace_back("gloo_ring_chunked", owned.back().get());
      owned.push_back(std::make_unique<GlooRunner<float>>(ctx, true, op));
      runners.emplace_back("gloo_halving_doubling", owned.back().get());
#else
      if (w.rank() == 0) std::fprintf(stderr, "# built without Gloo: 'gloo' skipped\n");
#endif
      continue;
    }
    if (a == "memcpy") {
      owned.push_back(std::make_unique<MemcpyRunner>(dtype));
      runners.emplace_back(a, owned.back().get());
      continue;
    }
    const bool registered = !registered_base(a).empty();
    const bool staged = !staged_base(a).empty();
    const bool over_gloo = !gloo_base(a).empty();
    const bool over_tcp = !tcp_base(a).empty();
    const std::string base = registered  ? registered_base(a)
                             : staged    ? staged_base(a)
                             : over_gloo ? gloo_base(a)
                             : over_tcp  ? tcp_base(a)
                                         : a;
    if (registered && base == "mpi")
      throw ds::InvalidArgumentError("mpi_registered: MPI_Allreduce has no registered buffers");
    ds::CommunicationOptions o;
    o.algorithm = base == "mpi" ? ds::Algorithm::kMpiNative : ds::parse_algorithm(base);
    o.segment_bytes = c.segment_bytes;
    o.timeout = timeout_of(c);
    o.shm_single_copy = !staged;
    if (base == "direct") {
      if (w.rank() == 0)
        std::fprintf(stderr, "# 'direct' is in-process only (--inproc); skipped\n");
      continue;
    }
    if (over_gloo || over_tcp) {
#if DISTSTRAT_HAVE_GLOO
      if (base == "mpi" || base == "shm")
        throw ds::InvalidArgumentError(a +
                                       ": the Gloo and TCP transports run the point-to-point "
                                       "algorithms");
      transports.push_back(over_tcp
                               ? tcp_transport_for(c, w.rank(), w.size(), int(transports.size()))
                               : gloo_transport_for(c, w.rank(), w.size(), int(transports.size())));
      comms.push_back(std::make_unique<ds::TransportCommunicator>(*transports.back(), o));
      owned.push_back(std::make_unique<CommRunner>(*comms.back(), dtype, op));
      runners.emplace_back(a, owned.back().get());
#else
      if (w.rank() == 0) std::fprintf(stderr, "# built without Gloo: '%s' skipped\n", a.c_str());
#endif
      continue;
    }
    comms.push_back(ds::make_mpi_communicator(MPI_COMM_WORLD, o));
    if (registered) {
      owned.push_back(std::make_unique<RegisteredRunner>(*comms.back(), dtype, op, c.max_bytes));
    } else if (base == "mpi") {
      owned.push_back(std::make_unique<RawMpiRunner>(*comms.back(), dtype, op));
    } else {
      owned.push_back(std::make_unique<CommRunner>(*comms.back(), dtype, op));
    }
    runners.emplace_back(a, owned.back().get());
  }
  auto rows = c.fusion ? run_fusion(w, c, dtype, op, runners) : run_sweep(w, c, dtype, op, runners);
  if (w.rank() == 0) {
    print(c.format, c, rows, w.size(), copy_bw, "mpi", dtype, op, stdout);
    write_csv(c, rows, w.size(), copy_bw, "mpi", dtype, op);
    if (c.format == "table") print_bars(rows, copy_bw, w.size(), "mpi");
  }
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"diststrat all-reduce benchmark (nccl-tests style)"};
  std::string algos, collectives;
  app.add_option("--collectives", collectives,
                 "comma-separated: all_reduce (always), reduce_scatter, all_gather (rows per "
                 "communicator-backed algorithm)");
  app.add_option("--algos", algos,
                 "comma-separated: ring,halving_doubling,tree,reduce_to_one,hierarchical,shm,auto,"
                 "mpi,gloo (and direct with --inproc); <algo>_registered = that algorithm on "
                 "buffers from Communicator::allocate_buffer; <algo>_staged = shm or auto without "
                 "the single-copy path (staging buffers only); <algo>_gloo = that point-to-point "
                 "algorithm over the elastic groups' Gloo TCP transport; <algo>_tcp = over the TCP "
                 "transport of TF_CONFIG jobs; memcpy = each rank "
                 "copies in to out, no communication (the reference floor)");
  app.add_option("--inproc", c.inproc, "run N ranks as threads of this process instead of MPI");
  app.add_option("--min-bytes", c.min_bytes, "smallest message");
  app.add_option("--max-bytes", c.max_bytes, "largest message");
  app.add_option("--step-factor", c.step_factor, "size multiplier between rows");
  app.add_option("--dtype", c.dtype, "float32|float64|float16|bfloat16|int32|int64");
  app.add_option("--op", c.op, "sum|mean|min|max|product");
  app.add_option("--iters", c.iters, "timed iterations per row");
  app.add_option("--warmup", c.warmup, "untimed iterations per row");
  app.add_flag("--check", c.check, "verify every row's result against closed-form values");
  app.add_option("--format", c.format, "table|csv|json")
      ->check(CLI::IsMember({"table", "csv", "json"}));
  app.add_flag("--fusion", c.fusion, "K tensors of S bytes: one call each vs PackedAllReduce");
  app.add_option("--fusion-tensors", c.fusion_tensors, "K for --fusion");
  app.add_option("--fusion-bytes", c.fusion_bytes, "S for --fusion");
  app.add_option("--csv-out", c.csv_out, "also write the rows as CSV to this file");
  app.add_option("--segment-bytes", c.segment_bytes,
                 "CommunicationOptions::segment_bytes (0 = default)");
  app.add_option("--gloo-interface", c.gloo_interface,
                 "<algo>_gloo: the network interface to listen on (default: the host name's "
                 "address)");
  diststrat_examples::add_timeout_flag(app, c.timeout);
  CLI11_PARSE(app, argc, argv);
  if (!algos.empty()) {
    c.algos.clear();
    std::stringstream ss(algos);
    for (std::string a; std::getline(ss, a, ',');)
      if (!a.empty()) c.algos.push_back(a);
  }
  if (!collectives.empty()) {
    c.collectives.clear();
    std::stringstream ss(collectives);
    for (std::string a; std::getline(ss, a, ',');) {
      if (a.empty()) continue;
      if (a != "all_reduce" && a != "reduce_scatter" && a != "all_gather") {
        std::fprintf(stderr, "allreduce_bench: unknown collective '%s'\n", a.c_str());
        return 2;
      }
      c.collectives.push_back(a);
    }
  }
  // Upper-case "256M" style sizes are not parsed; use bytes (CLI11 accepts 268435456).
  try {
    const ds::DType dtype = ds::dtype_from_name(c.dtype);
    ds::ReduceOp op = ds::ReduceOp::kSum;
    bool found = false;
    for (ds::ReduceOp o : {ds::ReduceOp::kSum, ds::ReduceOp::kMean, ds::ReduceOp::kMin,
                           ds::ReduceOp::kMax, ds::ReduceOp::kProduct}) {
      if (c.op == ds::reduce_op_name(o)) op = o, found = true;
    }
    if (!found) throw ds::InvalidArgumentError("unknown --op '" + c.op + "'");
    if (c.inproc > 0) return run_inproc(c, dtype, op);
#if DISTSTRAT_HAVE_MPI
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
    int rc = run_mpi(c, dtype, op);
    MPI_Finalize();
    return rc;
#else
    std::fprintf(stderr, "built without MPI: use --inproc N\n");
    return 2;
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce_bench: %s\n", e.what());
    return 1;
  }
}
