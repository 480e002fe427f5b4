#include "gpu/shared_device_group.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <sstream>

#include "gpu/cuda_backend.h"
#include "gpu/cuda_check.h"
#include "gpu/device_reduce.h"
#include "gpu/kernels.h"

namespace diststrat {
namespace gpu {

namespace {

using Clock = DeadlineClock;

// What one rank brings to a collective.
struct Arrival {
  const void* in = nullptr;
  void* out = nullptr;
  size_t count = 0;
  DType dtype = DType::kFloat32;
  int op = -1;  // ReduceOp, or -1 where none
  int root = -1;
  std::string kind;  // "all_reduce", ...
  std::string name;
};

struct Shared {
  Shared(int n, int ordinal)
      : n(n), ordinal(ordinal), arrivals(n), ready(n), done(n), here(n, false) {}
  const int n;
  const int ordinal;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Arrival> arrivals;
  std::vector<cudaEvent_t> ready;  // per rank: its inputs are ready
  std::vector<cudaEvent_t> done;   // per rank: its part of the collective ran
  // Reusable barrier: generation advances when all n arrived.
  std::vector<bool> here;
  int arrived = 0;
  long generation = 0;
  bool aborted = false;
  std::string abort_reason;

  // Blocks until all ranks arrive (or deadline / abort). `publish` runs under
  // the lock before arriving.
  void meet(int rank, const std::string& what, Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu);
    if (aborted) throw AbortedError(what + ": " + abort_reason);
    const long gen = generation;
    here[rank] = true;
    if (++arrived == n) {
      arrived = 0;
      std::fill(here.begin(), here.end(), false);
      ++generation;
      cv.notify_all();
      return;
    }
    if (!cv.wait_until(lock, deadline, [&] { return generation != gen || aborted; })) {
      std::ostringstream missing;
      for (int r = 0; r < n; ++r) {
        if (!here[r]) missing << (missing.tellp() > 0 ? ", " : "") << r;
      }
      aborted = true;
      abort_reason = what + ": rank(s) " + missing.str() + " never arrived";
      cv.notify_all();
      throw DeadlineExceededError(detail::str_cat("rank ", rank, " ", what, ": rank(s) ",
                                                  missing.str(), " of the logical GPUs on GPU ",
                                                  ordinal, " never arrived"));
    }
    if (generation == gen) throw AbortedError(what + ": " + abort_reason);
  }
};

class SharedDeviceCommunicator : public Communicator {
 public:
  SharedDeviceCommunicator(std::shared_ptr<Shared> shared, int rank, void* stream,
                           CommunicationOptions options)
      : shared_(std::move(shared)), rank_(rank), stream_(stream), options_(options) {}

  int rank() const override { return rank_; }
  int size() const override { return shared_->n; }
  const CommunicationOptions& options() const override { return options_; }

  // Every dtype and op (device_reduce.h); an unknown one is refused before
  // the rendezvous, on every rank alike.
  void all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                  const std::string& name) override {
    check_device_reduce(dtype, op, detail::str_cat("rank ", rank_, " all_reduce '", name, "'"));
    Arrival a{in, out, count, dtype, static_cast<int>(op), -1, "all_reduce", name};
    run(a, [&](const std::vector<Arrival>& all) {
      const int n = shared_->n;
      // Slice r of n, a multiple of 64 elements so vector loads stay aligned.
      const size_t chunk = ((count + n - 1) / n + 63) / 64 * 64;
      const size_t lo = std::min(count, chunk * rank_), hi = std::min(count, lo + chunk);
      if (hi == lo) return;
      const size_t esz = dtype_size(dtype), off = lo * esz;
      std::vector<const void*> ins(n);
      std::vector<void*> outs(n);
      for (int k = 0; k < n; ++k) {
        ins[k] = static_cast<const char*>(all[k].in) + off;
        outs[k] = static_cast<char*>(all[k].out) + off;
      }
      launch_reduce(outs.data(), n, ins.data(), n, hi - lo, dtype, op, n, stream_);
    });
  }

  void broadcast(void* buf, size_t count, DType dtype, int root, const std::string& name) override {
    DISTSTRAT_CHECK(root >= 0 && root < size(), kInvalidArgument, "broadcast '", name, "': root ",
                    root, " of ", size(), " ranks");
    Arrival a{buf, buf, count, dtype, -1, root, "broadcast", name};
    run(a, [&](const std::vector<Arrival>& all) {
      if (rank_ != root && count) {
        DISTSTRAT_CUDA_CHECK(cudaMemcpyAsync(buf, all[root].in, count * dtype_size(dtype),
                                             cudaMemcpyDeviceToDevice, as_stream()));
      }
    });
  }

  void all_gather(const void* in, void* out, size_t count, DType dtype,
                  const std::string& name) override {
    Arrival a{in, out, count, dtype, -1, -1, "all_gather", name};
    run(a, [&](const std::vector<Arrival>& all) {
      const size_t bytes = count * dtype_size(dtype);
      for (int k = 0; k < shared_->n; ++k) {
        char* dst = static_cast<char*>(out) + k * bytes;
        if (bytes && dst != all[k].in) {
          DISTSTRAT_CUDA_CHECK(
              cudaMemcpyAsync(dst, all[k].in, bytes, cudaMemcpyDeviceToDevice, as_stream()));
        }
      }
    });
  }

  void reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                      const std::string& name) override {
    check_device_reduce(dtype, op, detail::str_cat("rank ", rank_, " reduce_scatter '", name, "'"));
    Arrival a{in, out, count, dtype, static_cast<int>(op), -1, "reduce_scatter", name};
    run(a, [&](const std::vector<Arrival>& all) {
      const int n = shared_->n;
      const size_t off = rank_ * count * dtype_size(dtype);
      std::vector<const void*> ins(n);
      for (int k = 0; k < n; ++k) ins[k] = static_cast<const char*>(all[k].in) + off;
      void* o = out;
      launch_reduce(&o, 1, ins.data(), n, count, dtype, op, n, stream_);
    });
  }

  void barrier(const std::string& name) override {
    shared_->meet(rank_, "barrier '" + name + "'", deadline());
  }

  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lock(shared_->mu);
    if (!shared_->aborted) {
      shared_->aborted = true;
      shared_->abort_reason = reason;
    }
    shared_->cv.notify_all();
  }

  void reset() override {
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->aborted = false;
    shared_->abort_reason.clear();
    shared_->arrived = 0;
    std::fill(shared_->here.begin(), shared_->here.end(), false);
  }

 private:
  cudaStream_t as_stream() const { return stream_or_legacy(stream_); }
  Clock::time_point deadline() const { return Clock::now() + options_.timeout; }

  // The four steps of the header comment; `body` enqueues this rank's part.
  template <typename Body>
  void run(const Arrival& mine, Body&& body) {
    const std::string what = detail::str_cat(mine.kind, " '", mine.name, "'");
    const auto until = deadline();
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(shared_->ordinal));
    if (shared_->n == 1) {
      // One replica: the result is its input. No rendezvous, no drain; the
      // copy (if out of place) is ordered on the replica's stream.
      const size_t bytes = mine.count * dtype_size(mine.dtype);
      if (bytes && mine.kind != "broadcast" && mine.out != mine.in) {
        DISTSTRAT_CUDA_CHECK(
            cudaMemcpyAsync(mine.out, mine.in, bytes, cudaMemcpyDeviceToDevice, as_stream()));
      }
      return;
    }
    DISTSTRAT_CUDA_CHECK(cudaEventRecord(shared_->ready[rank_], as_stream()));
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->arrivals[rank_] = mine;
    }
    shared_->meet(rank_, what + " (enter)", until);
    std::vector<Arrival> all;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      all = shared_->arrivals;
    }
    for (int k = 0; k < shared_->n; ++k) {
      const Arrival& o = all[k];
      if (o.kind != mine.kind || o.count != mine.count || o.dtype != mine.dtype ||
          o.op != mine.op || o.root != mine.root) {
        abort(detail::str_cat(what, ": rank ", k, " called ", o.kind, " '", o.name, "' with ",
                              o.count, " x ", dtype_name(o.dtype), " while rank ", rank_,
                              " called it with ", mine.count, " x ", dtype_name(mine.dtype)));
        throw InvalidArgumentError(
            detail::str_cat("rank ", rank_, " ", what, " (", mine.count, " x ",
                            dtype_name(mine.dtype), ") does not match rank ", k, "'s ", o.kind,
                            " '", o.name, "' (", o.count, " x ", dtype_name(o.dtype), ")"));
      }
      if (k != rank_) DISTSTRAT_CUDA_CHECK(cudaStreamWaitEvent(as_stream(), shared_->ready[k], 0));
    }
    body(all);
    // Step 4 on the device: every rank's stream goes on only after every
    // peer's part ran (an event recorded before the exit meeting is re-
    // recorded only after the next enter meeting, when every peer's wait
    // for it is enqueued).
    DISTSTRAT_CUDA_CHECK(cudaEventRecord(shared_->done[rank_], as_stream()));
    shared_->meet(rank_, what + " (exit)", until);
    for (int k = 0; k < shared_->n; ++k) {
      if (k != rank_) DISTSTRAT_CUDA_CHECK(cudaStreamWaitEvent(as_stream(), shared_->done[k], 0));
    }
  }

  std::shared_ptr<Shared> shared_;
  int rank_;
  void* stream_;
  CommunicationOptions options_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_shared_device_group(
    const SharedDeviceGroupSpec& spec, const CommunicationOptions& options) {
  const int n = static_cast<int>(spec.streams.size());
  DISTSTRAT_CHECK(n >= 1 && n <= kMaxReduceBuffers, kInvalidArgument, "shared-device group of ", n,
                  " logical GPUs: must be in [1, ", kMaxReduceBuffers, "]");
  auto shared = std::shared_ptr<Shared>(new Shared(n, spec.ordinal), [](Shared* s) {
    cudaSetDevice(s->ordinal);
    for (cudaEvent_t e : s->ready) {
      if (e) cudaEventDestroy(e);
    }
    for (cudaEvent_t e : s->done) {
      if (e) cudaEventDestroy(e);
    }
    clear_last_error();  // cleanup: failures are deliberately ignored
    delete s;
  });
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(spec.ordinal));
  for (int r = 0; r < n; ++r) {
    DISTSTRAT_CUDA_CHECK(cudaEventCreateWithFlags(&shared->ready[r], cudaEventDisableTiming));
    DISTSTRAT_CUDA_CHECK(cudaEventCreateWithFlags(&shared->done[r], cudaEventDisableTiming));
  }
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < n; ++r) {
    out.push_back(std::make_unique<SharedDeviceCommunicator>(shared, r, spec.streams[r], options));
  }
  return out;
}

}  // namespace gpu
}  // namespace diststrat
