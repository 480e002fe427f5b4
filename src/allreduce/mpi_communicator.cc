// The MPI communicator: the point-to-point algorithms over the MPI transport,
// plus MPI's own MPI_Iallreduce (kMpiNative, polled against the deadline) and,
// when every rank shares one node, the shared-memory communicator.

#include "core/flight_recorder.h"
#include "allreduce/mpi_communicator.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "allreduce/mpi_util.h"
#include "allreduce/reduce_kernels.h"
#include "allreduce/shm_communicator.h"
#include "allreduce/transport_communicator.h"
#include "core/fnv1a.h"

namespace diststrat {
namespace {

// MPI has no 16-bit float types: float16/bfloat16 travel as 2-byte opaque
// elements, reduced by these user ops (accumulating as the kernels do).
template <DType D, ReduceOp O>
void reduce_16bit(void* in, void* inout, int* len, MPI_Datatype*) {
  kernels::accumulate(inout, in, static_cast<size_t>(*len), D, O);
}

struct SixteenBitOps {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op ops[2][4] = {};  // [float16, bfloat16][sum, product, min, max]

  SixteenBitOps() {
    DISTSTRAT_MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &type));
    DISTSTRAT_MPI_CHECK(MPI_Type_commit(&type));
    create<DType::kFloat16>(ops[0]);
    create<DType::kBFloat16>(ops[1]);
  }
  ~SixteenBitOps() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    for (auto& row : ops)
      for (MPI_Op& op : row) MPI_Op_free(&op);
    MPI_Type_free(&type);
  }
  template <DType D>
  static void create(MPI_Op* row) {
    DISTSTRAT_MPI_CHECK(MPI_Op_create(&reduce_16bit<D, ReduceOp::kSum>, 1, &row[0]));
    DISTSTRAT_MPI_CHECK(MPI_Op_create(&reduce_16bit<D, ReduceOp::kProduct>, 1, &row[1]));
    DISTSTRAT_MPI_CHECK(MPI_Op_create(&reduce_16bit<D, ReduceOp::kMin>, 1, &row[2]));
    DISTSTRAT_MPI_CHECK(MPI_Op_create(&reduce_16bit<D, ReduceOp::kMax>, 1, &row[3]));
  }
  MPI_Op op(DType dtype, ReduceOp op) const {
    const int d = dtype == DType::kFloat16 ? 0 : 1;
    switch (op) {
      case ReduceOp::kProduct:
        return ops[d][1];
      case ReduceOp::kMin:
        return ops[d][2];
      case ReduceOp::kMax:
        return ops[d][3];
      default:
        return ops[d][0];  // kSum, kMean (divided afterwards)
    }
  }
};

class MpiCommunicator : public TransportCommunicator {
 public:
  MpiCommunicator(Transport& transport, std::unique_ptr<Transport> owned, MPI_Comm comm,
                  const CommunicationOptions& options, const std::vector<int>& hosts)
      : TransportCommunicator(transport, options, hosts, std::move(owned),
                              {Algorithm::kMpiNative, Algorithm::kSharedMemory}) {
    native_ = mpi::dup(comm, "mpi communicator set-up", options.timeout);
    DISTSTRAT_MPI_CHECK(MPI_Comm_set_errhandler(native_, MPI_ERRORS_RETURN));
    // Shared memory needs every rank on one host (whatever grouping
    // hierarchical_group_size imposes on the point-to-point algorithms).
    const bool one_host =
        std::all_of(hosts.begin(), hosts.end(), [&](int h) { return h == hosts[0]; });
    if (one_host && size() > 1) shm_ = make_shm_communicator(comm, options);
    if (options.algorithm == Algorithm::kSharedMemory) {
      DISTSTRAT_CHECK(shm_ != nullptr, kFailedPrecondition, "rank ", rank(),
                      ": algorithm 'shm' needs every rank on one node (and more than one rank)");
    }
  }
  ~MpiCommunicator() override {
    // A collective that timed out is still pending on native_ (MPI cannot
    // cancel it): the process is marked failed, and native_ left to its end.
    if (aborted_) mpi::mark_failed();
    if (!native_pending_) mpi::free_comm(&native_, options_.timeout);
  }

  void all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                  const std::string& name) override {
    const Algorithm algorithm = options_.algorithm;
    if (use_shm()) {
      flight::note_algorithm("shm");
      return shm_->all_reduce(in, out, count, dtype, op, name);
    }
    if (algorithm != Algorithm::kMpiNative) {
      return TransportCommunicator::all_reduce(in, out, count, dtype, op, name);
    }
    guarded({"all_reduce", count, dtype, &op, nullptr, &name, "mpi"}, [&] {
      // MPI_Allreduce with mismatched counts or types is undefined (Open MPI
      // ends the job, or reduces garbage): compare the calls first.
      agree_on_call({CallKind::kAllReduce, count, dtype, &op, -1, &algorithm, &name});
      flight::note_algorithm("mpi");
      MPI_Datatype type;
      MPI_Op mpi_op = mpi::native_op(op);
      if (dtype == DType::kFloat16 || dtype == DType::kBFloat16) {
        type = sixteen_bit_.type;
        mpi_op = sixteen_bit_.op(dtype, op);
      } else {
        DISTSTRAT_CHECK(mpi::native_type(dtype, &type), kUnimplemented,
                        "MPI_Allreduce has no native type for ", dtype_name(dtype),
                        "; use another algorithm");
      }
      DISTSTRAT_CHECK_LE(count, static_cast<size_t>(INT_MAX), "MPI_Allreduce element count");
      MPI_Request req;
      const void* src = in == out ? MPI_IN_PLACE : in;
      DISTSTRAT_MPI_CHECK(
          MPI_Iallreduce(src, out, static_cast<int>(count), type, mpi_op, native_, &req));
      wait_native(&req);
      if (op == ReduceOp::kMean) kernels::scale_mean(out, count, dtype, size());
    });
  }

  void broadcast(void* buf, size_t count, DType dtype, int root, const std::string& name) override {
    if (use_shm()) return shm_->broadcast(buf, count, dtype, root, name);
    TransportCommunicator::broadcast(buf, count, dtype, root, name);
  }
  void all_gather(const void* in, void* out, size_t count, DType dtype,
                  const std::string& name) override {
    if (use_shm()) return shm_->all_gather(in, out, count, dtype, name);
    TransportCommunicator::all_gather(in, out, count, dtype, name);
  }
  void reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                      const std::string& name) override {
    if (use_shm()) return shm_->reduce_scatter(in, out, count, dtype, op, name);
    TransportCommunicator::reduce_scatter(in, out, count, dtype, op, name);
  }
  void barrier(const std::string& name) override {
    if (use_shm()) return shm_->barrier(name);
    TransportCommunicator::barrier(name);
  }
  // Shared-memory buffers whenever the ranks share a host (whichever
  // algorithm this communicator runs, they are ordinary memory to it).
  std::shared_ptr<void> allocate_buffer(size_t bytes) override {
    return shm_ ? shm_->allocate_buffer(bytes) : Communicator::allocate_buffer(bytes);
  }
  void abort(const std::string& reason) override {
    if (shm_) shm_->abort(reason);
    TransportCommunicator::abort(reason);
  }
  void reset() override {
    if (shm_) shm_->reset();
    TransportCommunicator::reset();
  }

 private:
  bool use_shm() const {
    return shm_ && (options_.algorithm == Algorithm::kSharedMemory ||
                    options_.algorithm == Algorithm::kAuto);
  }

  // Polls a non-blocking MPI collective until it completes or the deadline
  // passes. On the deadline the collective cannot be cancelled (MPI has no
  // way to), so the communicator is unusable afterwards; the error says so.
  void wait_native(MPI_Request* req) {
    const auto end = deadline();
    for (unsigned spin = 0;; ++spin) {
      int flag = 0;
      DISTSTRAT_MPI_CHECK(MPI_Test(req, &flag, MPI_STATUS_IGNORE));
      if (flag) return;
      if (Clock::now() >= end) {
        aborted_ = true;
        native_pending_ = true;
        mpi::mark_failed();
        abort_reason_ = "an earlier MPI_Iallreduce timed out and cannot be cancelled";
        throw DeadlineExceededError("MPI_Iallreduce did not complete within " +
                                    std::to_string(options_.timeout.count()) +
                                    " ms: some rank never joined");
      }
      // Sleeps rather than yields after the first polls, as the transport's
      // waits do (mpi_transport.cc): a yielding thread keeps taking CPU
      // from the compute thread it overlaps with.
      if (spin >= 256) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  MPI_Comm native_ = MPI_COMM_NULL;
  bool native_pending_ = false;  // an MPI_Iallreduce on native_ was given up on
  SixteenBitOps sixteen_bit_;
  std::unique_ptr<Communicator> shm_;
};

// The options that decide which path and algorithm a call takes (and so
// which messages it sends) must be the same on every rank: ranks whose
// options differ would meet in different protocols (shared memory against
// point-to-point) and wait out their deadlines. One allgather at set-up;
// every rank throws the same InvalidArgumentError naming the field.
void check_same_options(MPI_Comm comm, const CommunicationOptions& o) {
  int rank = 0, size = 1;
  DISTSTRAT_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  DISTSTRAT_MPI_CHECK(MPI_Comm_size(comm, &size));
  static const char* const fields[] = {"algorithm",
                                       "custom_algorithm",
                                       "segment_bytes",
                                       "auto_tiny_message_bytes",
                                       "auto_small_message_bytes",
                                       "hierarchical_group_size"};
  constexpr int kFields = 6;
  const int64_t mine[kFields] = {static_cast<int64_t>(o.algorithm),
                                 static_cast<int64_t>(fnv1a(o.custom_algorithm)),
                                 static_cast<int64_t>(o.segment_bytes),
                                 static_cast<int64_t>(o.auto_tiny_message_bytes),
                                 static_cast<int64_t>(o.auto_small_message_bytes),
                                 static_cast<int64_t>(o.hierarchical_group_size)};
  std::vector<int64_t> all(static_cast<size_t>(kFields) * size);
  mpi::allgather(mine, all.data(), kFields, MPI_INT64_T, comm,
                 "mpi communicator set-up: CommunicationOptions", o.timeout);
  for (int r = 1; r < size; ++r) {
    for (int f = 0; f < kFields; ++f) {
      const int64_t a = all[f], b = all[static_cast<size_t>(r) * kFields + f];
      if (a == b) continue;
      auto show = [&](int64_t v) {
        return f == 0 ? std::string("'") + algorithm_name(static_cast<Algorithm>(v)) + "'"
                      : std::to_string(v);
      };
      const std::string who =
          "rank " + std::to_string(rank) +
          ": mpi communicator set-up: ranks disagree on CommunicationOptions::" + fields[f] + ": ";
      if (f == 1) {
        throw InvalidArgumentError(who + "rank 0 and rank " + std::to_string(r) +
                                   " name different custom algorithms");
      }
      throw InvalidArgumentError(who + "rank 0 has " + show(a) + ", rank " + std::to_string(r) +
                                 " has " + show(b));
    }
  }
}

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm,
                                                    const CommunicationOptions& options) {
  check_same_options(comm, options);
  std::unique_ptr<Transport> transport = make_mpi_transport(comm, options.timeout);
  Transport& ref = *transport;
  return std::make_unique<MpiCommunicator>(
      ref, std::move(transport), comm, options,
      mpi::node_group(comm, "mpi communicator set-up", options.timeout).leaders);
}

}  // namespace diststrat
