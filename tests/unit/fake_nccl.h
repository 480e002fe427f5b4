// A fake multi-process NCCL for the fake GPU backend (issue 45): processes
// with fake GPUs (mpirun -np 2, 3) run MultiWorkerMirroredStrategy's NCCL
// path. FakeNcclBackend::nccl_communicator returns a communicator whose
// collectives run as host functions on the given stream (in stream order, on
// the stream's executor, so they wait for whatever the stream waits for, as
// an NCCL kernel does), reducing the untagged device buffers over a host
// Communicator across the processes: the library's own CPU transport (under
// mpirun, the MPI process group, made by `transport`). The caller waits, as
// NcclCommunicator does, until the stream has run the collective, bounded by
// the communication timeout; past it, or when the transport failed, the
// communicator is aborted and the error says what NCCL would say, without
// naming a peer (NCCL does not know which peer is missing).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fake_gpu_backend.h"

namespace diststrat_test {

class FakeNcclBackend : public FakeGpuBackend {
 public:
  using Clock = std::chrono::steady_clock;
  // The host communicator under the fake NCCL communicator of `rank` of
  // `size` (collective across the processes: every rank calls it when it
  // makes its communicator).
  using Transport = std::function<std::unique_ptr<ds::Communicator>(
      const std::string& unique_id, int rank, int size, const ds::CommunicationOptions&)>;

  // `host_tag` makes the GPUs' uuids distinct per process (a process of its
  // own has GPUs of its own); `transport` as above.
  FakeNcclBackend(int devices, std::string host_tag, Transport transport)
      : FakeGpuBackend(devices), host_tag_(std::move(host_tag)), transport_(std::move(transport)) {}

  ds::GpuInfo info(int ordinal) override {
    ds::GpuInfo g = FakeGpuBackend::info(ordinal);
    g.uuid = "GPU-fake-" + host_tag_ + "-" + std::to_string(ordinal);
    return g;
  }
  std::string nccl_version() override { return "fake"; }
  std::string nccl_unique_id() override {
    ++unique_ids;
    std::string id(128, '\0');
    const std::string text = "fake-nccl-" + host_tag_ + "-" + std::to_string(::getpid());
    std::copy(text.begin(), text.end(), id.begin());
    return id;
  }
  std::unique_ptr<ds::Communicator> nccl_communicator(
      const std::string& unique_id, int rank, int size, int ordinal, void* stream,
      const ds::CommunicationOptions& options) override;

  // Counters a test reads: communicators made, collectives run (on the
  // streams' executors).
  std::atomic<int> unique_ids{0}, nccl_communicators{0}, nccl_collectives{0};
  // Called on the executor just before collective `index` (0-based, this
  // process) moves data: fault injection (a test kills the process inside
  // a collective, after the ranks' signature exchange).
  std::function<void(int index)> before_collective;
  // When each collective started and ended (steady clock; for overlap tests).
  std::vector<std::pair<Clock::time_point, Clock::time_point>> collective_times() {
    std::lock_guard<std::mutex> lock(times_mu_);
    return times_;
  }
  void note_collective(Clock::time_point start, Clock::time_point end) {
    std::lock_guard<std::mutex> lock(times_mu_);
    times_.emplace_back(start, end);
  }

 private:
  std::string host_tag_;
  Transport transport_;
  std::mutex times_mu_;
  std::vector<std::pair<Clock::time_point, Clock::time_point>> times_;
};

class FakeNcclCommunicator : public ds::Communicator {
 public:
  FakeNcclCommunicator(FakeNcclBackend* backend, std::unique_ptr<ds::Communicator> host, int rank,
                       int ordinal, void* stream)
      : b_(backend), host_(std::move(host)), rank_(rank), ordinal_(ordinal), stream_(stream) {}

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  const ds::CommunicationOptions& options() const override { return host_->options(); }

  void all_reduce(const void* in, void* out, size_t n, ds::DType d, ds::ReduceOp op,
                  const std::string& name) override {
    const auto plan = ds::gpu::plan_nccl_reduce(d, op, label("all_reduce", name));
    const void* i = FakeGpuBackend::untag(in);
    void* o = FakeGpuBackend::untag(out);
    const int ranks = size();
    run("all_reduce", name, [=, h = host_.get()] {
      h->all_reduce(i, o, n, d, plan.collective_op, name);
      if (plan.divide_after) ds::kernels::scale_mean(o, n, d, ranks);
    });
  }
  void broadcast(void* buf, size_t n, ds::DType d, int root, const std::string& name) override {
    void* p = FakeGpuBackend::untag(buf);
    run("broadcast", name, [=, h = host_.get()] { h->broadcast(p, n, d, root, name); });
  }
  void all_gather(const void* in, void* out, size_t n, ds::DType d,
                  const std::string& name) override {
    const void* i = FakeGpuBackend::untag(in);
    void* o = FakeGpuBackend::untag(out);
    run("all_gather", name, [=, h = host_.get()] { h->all_gather(i, o, n, d, name); });
  }
  void reduce_scatter(const void* in, void* out, size_t n, ds::DType d, ds::ReduceOp op,
                      const std::string& name) override {
    const auto plan = ds::gpu::plan_nccl_reduce(d, op, label("reduce_scatter", name));
    const void* i = FakeGpuBackend::untag(in);
    void* o = FakeGpuBackend::untag(out);
    const int ranks = size();
    run("reduce_scatter", name, [=, h = host_.get()] {
      h->reduce_scatter(i, o, n, d, plan.collective_op, name);
      if (plan.divide_after) ds::kernels::scale_mean(o, n, d, ranks);
    });
  }
  void barrier(const std::string& name) override {
    run("barrier", name, [h = host_.get(), name] { h->barrier(name); });
  }
  void abort(const std::string& reason) override {
    aborted_ = true;
    host_->abort(reason);  // a collective in flight on the executor fails now
  }
  void reset() override {
    throw ds::FailedPreconditionError(
        "fake NCCL: a multi-process communicator cannot be reset: create a new one");
  }

 private:
  std::string label(const char* kind, const std::string& name) const {
    return "rank " + std::to_string(rank_) + " fake NCCL " + kind + " '" + name + "'";
  }
  // Enqueues the collective on the stream, then waits for the stream to run
  // it (bounded), as NcclCommunicator::issue does.
  void run(const char* kind, const std::string& name, std::function<void()> fn) {
    const std::string what = label(kind, name);
    DISTSTRAT_CHECK(!aborted_, kAborted, what, ": the NCCL communicator was aborted");
    struct Outcome {
      std::mutex mu;
      std::string error;
    };
    auto outcome = std::make_shared<Outcome>();
    FakeNcclBackend* b = b_;
    b_->launch_host_function(ordinal_, stream_, "fake nccl", [b, fn, outcome] {
      const int index = b->nccl_collectives++;
      if (b->before_collective) b->before_collective(index);
      const auto start = FakeNcclBackend::Clock::now();
      try {
        fn();
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(outcome->mu);
        outcome->error = e.what();
      }
      b->note_collective(start, FakeNcclBackend::Clock::now());
    });
    const auto timeout = host_->options().timeout;
    try {
      b_->synchronize(ordinal_, stream_, ds::DeadlineClock::now() + timeout, what);
    } catch (const ds::DeadlineExceededError&) {
      abort(what + " timed out");
      throw ds::DeadlineExceededError(what + ": not complete after " +
                                      std::to_string(timeout.count()) +
                                      " ms; a peer never joined (communicator aborted)");
    }
    std::string error;
    {
      std::lock_guard<std::mutex> lock(outcome->mu);
      error = outcome->error;
    }
    if (!error.empty()) {
      // What NCCL says when a peer is gone: nothing about which one.
      abort(what + " failed");
      throw ds::InternalError(what +
                              ": NCCL reported remote process exited or there was a network "
                              "error (ncclRemoteError) (communicator aborted)");
    }
  }

  FakeNcclBackend* b_;
  std::unique_ptr<ds::Communicator> host_;
  int rank_;
  int ordinal_;
  void* stream_;
  std::atomic<bool> aborted_{false};
};

inline std::unique_ptr<ds::Communicator> FakeNcclBackend::nccl_communicator(
    const std::string& unique_id, int rank, int size, int ordinal, void* stream,
    const ds::CommunicationOptions& options) {
  DISTSTRAT_CHECK(unique_id.size() == 128, kInvalidArgument, "fake NCCL unique id of ",
                  unique_id.size(), " bytes, expected 128");
  DISTSTRAT_CHECK(transport_ != nullptr, kUnimplemented, "fake NCCL: no transport given");
  std::unique_ptr<ds::Communicator> host = transport_(unique_id, rank, size, options);
  DISTSTRAT_CHECK(host->rank() == rank && host->size() == size, kInternal,
                  "fake NCCL: the transport's rank ", host->rank(), " of ", host->size(),
                  " is not NCCL rank ", rank, " of ", size);
  ++nccl_communicators;
  return std::make_unique<FakeNcclCommunicator>(this, std::move(host), rank, ordinal, stream);
}

}  // namespace diststrat_test
