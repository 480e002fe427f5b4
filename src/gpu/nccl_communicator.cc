#include "gpu/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <mutex>
#include <shared_mutex>
#include <thread>

#include "core/gpu_backend.h"
#include "gpu/cuda_backend.h"
#include "gpu/call_gate.h"
#include "gpu/cuda_check.h"
#include "gpu/device_reduce.h"
#include "gpu/kernels.h"

namespace diststrat {
namespace gpu {

void check_nccl(int status, const char* call, const char* file, int line) {
  const ncclResult_t r = static_cast<ncclResult_t>(status);
  if (r == ncclSuccess || r == ncclInProgress) return;
  std::string msg = detail::str_cat("NCCL call ", call, " failed: ", ncclGetErrorString(r), " at ",
                                    file, ":", line);
  if (const char* last = ncclGetLastError(nullptr); last && *last)
    msg += std::string(" (") + last + ")";
  throw InternalError(msg);
}

namespace {

using Clock = DeadlineClock;

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat64:
      return ncclFloat64;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kInt32:
      return ncclInt32;
    case DType::kInt64:
      return ncclInt64;
  }
  throw InvalidArgumentError(std::string("NCCL: unsupported dtype ") + dtype_name(d));
}

// Only for ops plan_nccl_reduce let through (kMean: floating dtypes).
ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMean:
      return ncclAvg;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kProduct:
      return ncclProd;
  }
  throw InvalidArgumentError(
      detail::str_cat("NCCL: reduce op value ", static_cast<int>(op), " is not a ReduceOp"));
}

ncclUniqueId to_id(const std::string& bytes) {
  DISTSTRAT_CHECK(bytes.size() == sizeof(ncclUniqueId), kInvalidArgument, "NCCL unique id of ",
                  bytes.size(), " bytes, expected ", sizeof(ncclUniqueId));
  ncclUniqueId id;
  std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
  return id;
}

// Communicators that fail together: a local group (abort one = abort all)
// or a single multi-process rank.
//
// NCCL forbids ncclCommAbort while another thread is inside an NCCL call on
// the same communicator: every call into a communicator (enqueue,
// async-error poll) goes through `gate` (shared), abort_all and reset hold it
// exclusively (call_gate.h). Only the calls hold it, never a wait, so an
// abort is delayed by at most one enqueue, and replicas enqueue concurrently.
struct Group {
  CallGate gate;
  std::vector<ncclComm_t> comms;
  std::vector<int> ordinals;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // Recreates the communicators after an abort; null where that needs the
  // other processes (multi-process ranks).
  std::function<std::vector<ncclComm_t>()> create;

  void abort_all(const std::string& why) {
    gate.abort(why, [&] { abort_comms(comms, ordinals); });
  }

  static void abort_comms(std::vector<ncclComm_t>& comms, const std::vector<int>& ordinals) {
    for (size_t i = 0; i < comms.size(); ++i) {
      if (comms[i]) {
        cudaSetDevice(ordinals[i]);
        ncclCommAbort(comms[i]);
        comms[i] = nullptr;
      }
    }
    clear_last_error();  // failures of the cleanup are deliberately ignored
  }

  // ncclCommDestroy waits for the communicator's outstanding work without a
  // deadline: finalize (non-blocking) first and destroy only once that
  // completed; past the deadline, or on an error, abort instead.
  ~Group() {
    const auto deadline = Clock::now() + timeout;
    for (size_t i = 0; i < comms.size(); ++i) {
      if (!comms[i]) continue;
      cudaSetDevice(ordinals[i]);
      ncclResult_t st = ncclCommFinalize(comms[i]);
      while (st == ncclSuccess || st == ncclInProgress) {
        if (ncclCommGetAsyncError(comms[i], &st) != ncclSuccess) st = ncclInternalError;
        if (st == ncclSuccess) break;
        if (st != ncclInProgress || Clock::now() >= deadline) break;
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      if (st == ncclSuccess) {
        ncclCommDestroy(comms[i]);
      } else {
        ncclCommAbort(comms[i]);
      }
      comms[i] = nullptr;
    }
    clear_last_error();
  }
};

// Polls until every communicator finished its (non-blocking) initialization;
// past the deadline throws (the caller aborts what was created).
void wait_init(const std::vector<ncclComm_t>& comms, Clock::time_point deadline,
               const std::string& what) {
  for (size_t i = 0; i < comms.size(); ++i) {
    for (;;) {
      ncclResult_t st = ncclInProgress;
      DISTSTRAT_NCCL_CHECK(ncclCommGetAsyncError(comms[i], &st));
      if (st == ncclSuccess) break;
      DISTSTRAT_NCCL_CHECK(st);
      if (Clock::now() >= deadline) {
        throw DeadlineExceededError(
            detail::str_cat(what, ": rank ", i,
                            "'s NCCL communicator was not ready before the deadline (did "
                            "every rank join with the same unique id?)"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

// Owns communicators while they are created: if creation throws, an open
// ncclGroupStart is closed and every communicator made so far is aborted.
struct PendingComms {
  std::vector<ncclComm_t> comms;
  std::vector<int> ordinals;
  bool group_open = false;
  ~PendingComms() {
    if (group_open) ncclGroupEnd();
    Group::abort_comms(comms, ordinals);
  }
  std::vector<ncclComm_t> release() {
    std::vector<ncclComm_t> out = std::move(comms);
    comms.clear();
    return out;
  }
};

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Group> group, int index, int rank, int size, int ordinal,
                   void* stream, CommunicationOptions options)
      : group_(std::move(group)),
        index_(index),
        rank_(rank),
        size_(size),
        ordinal_(ordinal),
        stream_(stream),
        options_(options) {}

  ~NcclCommunicator() override {
    if (scratch_) {
      // Stream-ordered: cudaFree would wait for the whole device, without a
      // deadline. (The replicas' streams outlive their communicators.)
      cudaSetDevice(ordinal_);
      cudaFreeAsync(scratch_, stream());
      clear_last_error();  // cleanup: failures are deliberately ignored
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const CommunicationOptions& options() const override { return options_; }

  // Reductions follow plan_nccl_reduce (device_reduce.h): integer kMean is
  // ncclSum and then the library's division on the same stream.
  void all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                  const std::string& name) override {
    const DeviceReducePlan plan = plan_nccl_reduce(dtype, op, label("all_reduce", name));
    const ncclDataType_t type = nccl_type(dtype);
    const ncclRedOp_t nop = nccl_op(plan.collective_op);
    issue(
        "all_reduce", name, dtype,
        [&](ncclComm_t c) { return ncclAllReduce(in, out, count, type, nop, c, stream()); },
        divide_after(plan, out, count, dtype));
  }
  void broadcast(void* buf, size_t count, DType dtype, int root, const std::string& name) override {
    const ncclDataType_t type = nccl_type(dtype);
    issue("broadcast", name, dtype,
          [&](ncclComm_t c) { return ncclBroadcast(buf, buf, count, type, root, c, stream()); });
  }
  void all_gather(const void* in, void* out, size_t count, DType dtype,
                  const std::string& name) override {
    const ncclDataType_t type = nccl_type(dtype);
    issue("all_gather", name, dtype,
          [&](ncclComm_t c) { return ncclAllGather(in, out, count, type, c, stream()); });
  }
  void reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                      const std::string& name) override {
    const DeviceReducePlan plan = plan_nccl_reduce(dtype, op, label("reduce_scatter", name));
    const ncclDataType_t type = nccl_type(dtype);
    const ncclRedOp_t nop = nccl_op(plan.collective_op);
    issue(
        "reduce_scatter", name, dtype,
        [&](ncclComm_t c) { return ncclReduceScatter(in, out, count, type, nop, c, stream()); },
        divide_after(plan, out, count, dtype));
  }
  void barrier(const std::string& name) override {
    if (!scratch_) {
      DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal_));
      DISTSTRAT_CUDA_CHECK(cudaMallocAsync(&scratch_, sizeof(float), stream()));
    }
    all_reduce(scratch_, scratch_, 1, DType::kFloat32, ReduceOp::kSum, "barrier " + name);
  }

  void abort(const std::string& reason) override { group_->abort_all(reason); }

  void reset() override {
    group_->gate.reset([&] {
      DISTSTRAT_CHECK(group_->create != nullptr, kFailedPrecondition, "NCCL communicator of rank ",
                      rank_,
                      " was aborted; a multi-process communicator cannot be reset: create a new "
                      "one with a fresh unique id on every rank");
      group_->comms = group_->create();
    });
  }

 private:
  cudaStream_t stream() const { return stream_or_legacy(stream_); }
  std::string label(const char* kind, const std::string& name) const {
    return detail::str_cat("rank ", rank_, " NCCL ", kind, " '", name, "'");
  }
  // The division of an integer kMean, enqueued behind the sum (null when the
  // plan has none).
  std::function<void()> divide_after(const DeviceReducePlan& plan, void* out, size_t count,
                                     DType dtype) const {
    if (!plan.divide_after) return nullptr;
    return [this, out, count, dtype] {
      void* outs[1] = {out};
      const void* ins[1] = {out};
      launch_reduce(outs, 1, ins, 1, count, dtype, ReduceOp::kMean, size_, stream_);
    };
  }

  // Enqueues one NCCL collective and waits for it: first until NCCL has
  // enqueued it (non-blocking communicators may answer ncclInProgress, and
  // nothing else may be called until that finished), then until the stream
  // has run it, sleeping on a condition variable that a host function behind
  // the collective signals and waking every few ms to look at the
  // communicator's async error (a peer's failure leaves the stream stuck) and
  // the deadline. `post` (may be null) enqueues work behind the collective
  // on the same stream before the wait.
  template <typename Call>
  void issue(const char* kind, const std::string& name, DType dtype, Call&& call,
             const std::function<void()>& post = nullptr) {
    const std::string what = label(kind, name) + " (" + dtype_name(dtype) + ")";
    const auto deadline = Clock::now() + options_.timeout;
    DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal_));
    // Enqueue through the gate: an abort cannot run while this thread is
    // inside the NCCL call.
    bool in_progress = false;
    const ncclComm_t c = group_->gate.enter(what, [&] {
      ncclComm_t comm = group_->comms[static_cast<size_t>(index_)];
      const ncclResult_t r = call(comm);
      if (r != ncclSuccess && r != ncclInProgress) {
        check_nccl(r, (what + ": " + kind).c_str(), __FILE__, __LINE__);
      }
      in_progress = r == ncclInProgress;
      return comm;
    });
    // One look at the communicator (through the gate): true when its work is
    // through NCCL's enqueue; throws (after aborting the group) when NCCL
    // reported an error, AbortedError after an abort.
    const auto enqueued = [&]() -> bool {
      std::string nccl_error;
      const bool ok = group_->gate.enter(what, [&] {
        ncclResult_t st = ncclSuccess;
        DISTSTRAT_NCCL_CHECK(ncclCommGetAsyncError(c, &st));
        if (st != ncclSuccess && st != ncclInProgress) nccl_error = ncclGetErrorString(st);
        return st == ncclSuccess;
      });
      if (!nccl_error.empty()) {
        group_->abort_all(what + " failed: " + nccl_error);
        throw InternalError(what + ": NCCL reported " + nccl_error + " (communicator aborted)");
      }
      return ok;
    };
    const auto past_deadline = [&] {
      if (Clock::now() < deadline) return;
      group_->abort_all(what + " timed out");
      throw DeadlineExceededError(what + ": not complete after " +
                                  std::to_string(options_.timeout.count()) +
                                  " ms; a peer never joined (communicator aborted)");
    };
    // NCCL finishes a non-blocking enqueue on its own threads, in
    // microseconds: a short poll.
    while (in_progress && !enqueued()) {
      past_deadline();
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    if (post) post();
    HostSignalWait signal(stream_, what);
    for (;;) {
      const bool ran = signal.wait_until(std::min(deadline, Clock::now() + kSignalPoll));
      // Every wake (the last one too) looks at the communicator: an abort or
      // a peer's failure may have cut the collective short.
      enqueued();
      const cudaError_t q = cudaStreamQuery(stream());
      if (q != cudaSuccess && q != cudaErrorNotReady) {
        throw_cuda_error(q, ("cudaStreamQuery while waiting for " + what).c_str(), __FILE__,
                         __LINE__);
      }
      if (ran || q == cudaSuccess) return;
      past_deadline();
    }
  }

  std::shared_ptr<Group> group_;
  int index_;
  int rank_;
  int size_;
  int ordinal_;
  void* stream_;
  CommunicationOptions options_;
  void* scratch_ = nullptr;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_nccl_local_group(
    const std::vector<int>& ordinals, const std::vector<void*>& streams,
    const CommunicationOptions& options) {
  const int n = static_cast<int>(ordinals.size());
  DISTSTRAT_CHECK_EQ(streams.size(), ordinals.size(), "NCCL local group streams");
  auto group = std::make_shared<Group>();
  group->ordinals = ordinals;
  group->timeout = options.timeout;
  // Created in one NCCL group call with one unique id: the documented way to
  // create several ranks from one thread.
  auto create = [ordinals, n, timeout = options.timeout]() {
    ncclUniqueId id;
    DISTSTRAT_NCCL_CHECK(ncclGetUniqueId(&id));
    PendingComms pending;
    pending.comms.assign(n, nullptr);
    pending.ordinals = ordinals;
    ncclConfig_t config = nonblocking_config();
    DISTSTRAT_NCCL_CHECK(ncclGroupStart());
    pending.group_open = true;
    for (int r = 0; r < n; ++r) {
      DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinals[r]));
      DISTSTRAT_NCCL_CHECK(ncclCommInitRankConfig(&pending.comms[r], n, id, r, &config));
    }
    pending.group_open = false;
    DISTSTRAT_NCCL_CHECK(ncclGroupEnd());
    wait_init(pending.comms, Clock::now() + timeout, "NCCL local group initialization");
    return pending.release();
  };
  group->comms = create();
  group->create = create;
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < n; ++r) {
    out.push_back(
        std::make_unique<NcclCommunicator>(group, r, r, n, ordinals[r], streams[r], options));
  }
  return out;
}

std::string nccl_version_string() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since 2.9.
  return detail::str_cat(v / 10000, ".", v / 100 % 100, ".", v % 100);
}

std::string make_nccl_unique_id() {
  ncclUniqueId id;
  DISTSTRAT_NCCL_CHECK(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

std::unique_ptr<Communicator> make_nccl_communicator(const std::string& unique_id, int rank,
                                                     int size, int ordinal, void* stream,
                                                     const CommunicationOptions& options) {
  DISTSTRAT_CHECK(rank >= 0 && rank < size, kInvalidArgument, "NCCL communicator rank ", rank,
                  " of ", size);
  const ncclUniqueId id = to_id(unique_id);
  PendingComms pending;
  pending.comms = {nullptr};
  pending.ordinals = {ordinal};
  ncclConfig_t config = nonblocking_config();
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  DISTSTRAT_NCCL_CHECK(ncclCommInitRankConfig(&pending.comms[0], size, id, rank, &config));
  wait_init(pending.comms, Clock::now() + options.timeout,
            detail::str_cat("NCCL communicator initialization of rank ", rank, " of ", size));
  auto group = std::make_shared<Group>();
  group->ordinals = {ordinal};
  group->timeout = options.timeout;
  group->comms = pending.release();
  return std::make_unique<NcclCommunicator>(group, 0, rank, size, ordinal, stream, options);
}

}  // namespace gpu
}  // namespace diststrat
