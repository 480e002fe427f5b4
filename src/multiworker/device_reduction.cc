// GPU gradients across processes through one NCCL communicator: the set-up
// agreement, and a fused call's packs moved on the devices
// (device_reduction.h).
#include "multiworker/device_reduction.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "core/device_manager_impl.h"
#include "core/gpu_backend.h"

namespace diststrat {

namespace {

using Clock = DeadlineClock;

// Why a process cannot take part (the code every rank sees).
enum Eligibility : int64_t {
  kEligible = 1,
  kSeveralReplicas = 2,
  kNoNccl = 3,
  kElastic = 4,
  kCompression = 5,
  kNotGpu = 6,
};

const char* eligibility_text(int64_t code) {
  switch (code) {
    case kSeveralReplicas:
      return "it has several local GPU replicas (NCCL serves one GPU per process)";
    case kNoNccl:
      return "its GPU backend has no NCCL";
    case kElastic:
      return "the group is elastic (a new NCCL communicator per membership is not built yet)";
    case kCompression:
      return "wire compression is on (the host path compresses)";
    case kNotGpu:
      return "its replicas are not GPUs";
    default:
      return "it cannot";
  }
}

// Words of the set-up exchange: [eligibility, uuid bytes...].
constexpr size_t kUuidWords = 15;
constexpr size_t kIdWords = 33;  // [length, id bytes (up to 256)]

}  // namespace

std::unique_ptr<DeviceReduction> DeviceReduction::create(Communicator& cross,
                                                         const std::vector<Device>& devices,
                                                         const MultiWorkerOptions& options,
                                                         int replicas_in_sync, std::string* why) {
  const bool any_gpu =
      std::any_of(devices.begin(), devices.end(), [](const Device& d) { return d.is_gpu(); });
  if (!any_gpu) {
    *why = "the replicas are CPUs";
    return nullptr;
  }
  if (options.gpu_reduction == GpuReduction::kHostStaged) {
    *why = "MultiWorkerOptions::gpu_reduction is kHostStaged";
    return nullptr;
  }
  const int rank = cross.rank(), n = cross.size();
  const std::string me = "rank " + std::to_string(rank);
  if (options.elastic.enabled()) {
    // Decided without a collective: a joiner constructs its strategy while
    // the group's members are in their steps.
    *why = eligibility_text(kElastic);
    DISTSTRAT_CHECK(options.gpu_reduction != GpuReduction::kNccl, kFailedPrecondition, me,
                    ": MultiWorkerMirroredStrategy gpu_reduction kNccl: ", *why);
    return nullptr;
  }
  DeviceManager::Impl& dm = DeviceManagerAccess::impl(*options.device_manager);
  GpuBackend& backend = dm.require_backend("MultiWorkerMirroredStrategy's NCCL reduction");

  // 1. Who can take part, on which physical GPU.
  std::vector<int64_t> mine(1 + kUuidWords, 0);
  int ordinal = -1;
  if (devices.size() != 1) {
    mine[0] = kSeveralReplicas;
  } else if (!devices[0].is_gpu()) {
    mine[0] = kNotGpu;
  } else if (options.communication.compression != Compression::kNone) {
    mine[0] = kCompression;
  } else if (backend.nccl_version().empty()) {
    mine[0] = kNoNccl;
  } else {
    mine[0] = kEligible;
    ordinal = dm.ordinal_of(devices[0]);
    std::string uuid = backend.info(ordinal).uuid;
    if (uuid.empty()) uuid = "ordinal " + std::to_string(ordinal) + " of rank " + me;
    uuid.resize(std::min(uuid.size(), kUuidWords * 8 - 1));
    std::memcpy(mine.data() + 1, uuid.data(), uuid.size());
  }
  std::vector<int64_t> all(mine.size() * static_cast<size_t>(n));
  cross.all_gather(mine.data(), all.data(), mine.size(), DType::kInt64, "NCCL eligibility");
  std::string reason;
  std::set<std::string> uuids;
  for (int r = 0; r < n && reason.empty(); ++r) {
    const int64_t* w = all.data() + mine.size() * static_cast<size_t>(r);
    if (w[0] != kEligible) {
      reason = "rank " + std::to_string(r) + " cannot take part: " + eligibility_text(w[0]);
      continue;
    }
    const std::string uuid(reinterpret_cast<const char*>(w + 1));
    if (!uuids.insert(uuid).second) {
      reason = "two processes share the physical GPU " + uuid +
               " (logical GPUs of one card; NCCL refuses duplicate devices)";
    }
  }
  const auto refuse = [&](const std::string& text) -> std::unique_ptr<DeviceReduction> {
    *why = text;
    DISTSTRAT_CHECK(options.gpu_reduction != GpuReduction::kNccl, kFailedPrecondition, me,
                    ": MultiWorkerMirroredStrategy gpu_reduction kNccl: ", text);
    return nullptr;
  };
  if (!reason.empty()) return refuse(reason);

  // 2. Rank 0's unique id, broadcast over the host group (length -1: it
  // could not make one).
  std::vector<int64_t> id_words(kIdWords, 0);
  std::string id_error;
  if (rank == 0) {
    try {
      const std::string id = backend.nccl_unique_id();
      DISTSTRAT_CHECK(id.size() <= (kIdWords - 1) * 8, kInternal, "NCCL unique id of ", id.size(),
                      " bytes");
      id_words[0] = static_cast<int64_t>(id.size());
      std::memcpy(id_words.data() + 1, id.data(), id.size());
    } catch (const std::exception& e) {
      id_words[0] = -1;
      id_error = e.what();
    }
  }
  cross.broadcast(id_words.data(), id_words.size(), DType::kInt64, 0, "NCCL unique id");
  if (id_words[0] < 0) {
    return refuse("rank 0 could not make an NCCL unique id" +
                  (id_error.empty() ? std::string() : ": " + id_error));
  }
  const std::string id(reinterpret_cast<const char*>(id_words.data() + 1),
                       static_cast<size_t>(id_words[0]));

  // 3. Every rank's communicator on a communication stream of its own; the
  // ranks agree on whether all of them got one.
  std::unique_ptr<DeviceReduction> d(new DeviceReduction());
  d->gpus_ = options.device_manager;
  d->backend_ = &backend;
  d->ordinal_ = ordinal;
  d->rank_ = rank;
  d->replicas_in_sync_ = replicas_in_sync;
  d->options_ = options.communication;
  std::string create_error;
  try {
    d->comm_stream_ = backend.create_stream(ordinal);
    d->nccl_ =
        backend.nccl_communicator(id, rank, n, ordinal, d->comm_stream_, options.communication);
  } catch (const std::exception& e) {
    create_error = e.what();
  }
  int64_t ok = create_error.empty() ? 1 : 0;
  std::vector<int64_t> oks(static_cast<size_t>(n));
  cross.all_gather(&ok, oks.data(), 1, DType::kInt64, "NCCL communicator made");
  for (int r = 0; r < n; ++r) {
    if (oks[static_cast<size_t>(r)] == 0) {
      if (d->nccl_) d->nccl_->abort("rank " + std::to_string(r) + " could not make its NCCL rank");
      return refuse("rank " + std::to_string(r) + " could not make its NCCL communicator" +
                    (r == rank ? ": " + create_error : std::string(" (see its log)")));
    }
  }
  why->clear();
  return d;
}

DeviceReduction::~DeviceReduction() {
  if (!backend_) return;
  try {
    // Nothing may still read the bucket when it goes (bounded wait).
    if (comm_stream_) {
      backend_->synchronize(ordinal_, comm_stream_, Clock::now() + options_.timeout,
                            "rank " + std::to_string(rank_) + ": NCCL communication stream");
    }
    if (bucket_) backend_->raw_free(ordinal_, bucket_);
  } catch (const std::exception&) {
    // A hung or failed device: the bucket is left to the process's end.
  }
  nccl_.reset();
  if (comm_stream_) backend_->destroy_stream(ordinal_, comm_stream_);
}

void DeviceReduction::abort(const std::string& reason) {
  if (nccl_) nccl_->abort(reason);
}

std::shared_ptr<void> DeviceReduction::ready_event(void* replica_stream) {
  // The mark behind the producers; the engine's thread makes the
  // communication stream wait for it. Destroyed with the call (also one
  // that fails before it runs).
  void* ready = backend_->create_event(ordinal_);
  std::shared_ptr<void> owned(ready,
                              [b = backend_, o = ordinal_](void* e) { b->destroy_event(o, e); });
  backend_->record_event(ordinal_, ready, replica_stream);
  return owned;
}

void DeviceReduction::order_replica_after(void* replica_stream) {
  void* done = backend_->create_event(ordinal_);
  backend_->record_event(ordinal_, done, comm_stream_);
  backend_->stream_wait_event(ordinal_, replica_stream, done);
  backend_->destroy_event(ordinal_, done);
}

Work DeviceReduction::reduce_scatter_async(FusionEngine& engine, ReduceOp op, Tensor in, Tensor out,
                                           std::string name, void* replica_stream) {
  std::shared_ptr<void> ready = ready_event(replica_stream);
  return engine.reduce_scatter_async(
      0, op, in, out, std::move(name),
      [this, op, in, out, ready, replica_stream](Communicator& cross,
                                                 const std::vector<FusionPack>& packs) mutable {
        sharded(cross, true, op, in, out, packs[0].name, ready.get(), replica_stream);
      });
}

Work DeviceReduction::all_gather_async(FusionEngine& engine, Tensor in, Tensor out,
                                       std::string name, void* replica_stream) {
  std::shared_ptr<void> ready = ready_event(replica_stream);
  return engine.all_gather_async(
      0, in, out, std::move(name),
      [this, in, out, ready, replica_stream](Communicator& cross,
                                             const std::vector<FusionPack>& packs) mutable {
        sharded(cross, false, ReduceOp::kSum, in, out, packs[0].name, ready.get(), replica_stream);
      });
}

void DeviceReduction::sharded(Communicator& cross, bool scatter, ReduceOp op, const Tensor& in,
                              Tensor& out, const std::string& name, void* ready,
                              void* replica_stream) {
  GpuBackend& b = *backend_;
  b.stream_wait_event(ordinal_, comm_stream_, ready);
  const DType dtype = in.dtype();
  const size_t block = static_cast<size_t>(scatter ? out.num_elements() : in.num_elements());
  if (block) {
    const ReduceOp sum_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
    try {
      if (scatter) {
        nccl_->reduce_scatter(in.data(), out.data(), block, dtype, sum_op, name);
      } else {
        nccl_->all_gather(in.data(), out.data(), block, dtype, name);
      }
    } catch (const std::exception& e) {
      fail(cross,
           std::string("NCCL ") + (scatter ? "reduce_scatter" : "all_gather") + " '" + name + "'",
           e);
    }
    if (scatter && op == ReduceOp::kMean) {
      const void* src[1] = {out.data()};
      b.reduce(ordinal_, comm_stream_, out.data(), src, 1, block, dtype, ReduceOp::kMean,
               replicas_in_sync_);
    }
  }
  order_replica_after(replica_stream);
}

Work DeviceReduction::all_reduce_async(FusionEngine& engine, ReduceOp op,
                                       std::vector<Tensor> tensors, std::vector<std::string> names,
                                       void* replica_stream) {
  std::shared_ptr<void> ready = ready_event(replica_stream);
  auto shared = std::make_shared<std::vector<Tensor>>(tensors);
  return engine.device_all_reduce_async(
      0, op, std::move(tensors), std::move(names),
      [this, op, shared, ready, replica_stream](Communicator& cross,
                                                const std::vector<FusionPack>& packs) {
        reduce(cross, op, *shared, packs, ready.get(), replica_stream);
      });
}

void* DeviceReduction::bucket(size_t bytes) {
  if (bucket_bytes_ >= bytes) return bucket_;
  size_t grown = 4096;
  while (grown < bytes) grown *= 2;
  const std::string what = "rank " + std::to_string(rank_) + ": NCCL fusion bucket";
  if (bucket_) {
    // The old bucket's last reads (an unpack) are on the communication stream.
    backend_->synchronize(ordinal_, comm_stream_, Clock::now() + options_.timeout, what);
    backend_->raw_free(ordinal_, bucket_);
    bucket_ = nullptr;
    bucket_bytes_ = 0;
  }
  bucket_ = backend_->raw_malloc(ordinal_, grown);
  DISTSTRAT_CHECK(bucket_ != nullptr, kResourceExhausted, what, " of ", grown,
                  " bytes: the GPU is out of memory");
  bucket_bytes_ = grown;
  return bucket_;
}

void DeviceReduction::reduce(Communicator& cross, ReduceOp op, std::vector<Tensor>& tensors,
                             const std::vector<FusionPack>& packs, void* ready,
                             void* replica_stream) {
  GpuBackend& b = *backend_;
  b.stream_wait_event(ordinal_, comm_stream_, ready);
  // kMean is summed and divided once by the replicas in sync, as on the host.
  const ReduceOp sum_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  for (const FusionPack& p : packs) {
    const DType dtype = tensors[p.begin].dtype();
    size_t bytes = 0;
    for (size_t k = p.begin; k < p.end; ++k) bytes += tensors[k].nbytes();
    const size_t count = bytes / dtype_size(dtype);
    if (count == 0) continue;  // every rank alike (the signature agreed)
    const bool alone = p.end == p.begin + 1;
    char* data =
        alone ? static_cast<char*>(tensors[p.begin].data()) : static_cast<char*>(bucket(bytes));
    if (!alone) {
      size_t off = 0;
      for (size_t k = p.begin; k < p.end; ++k) {
        const size_t nb = tensors[k].nbytes();
        if (nb) b.memcpy_async(ordinal_, data + off, tensors[k].data(), nb, comm_stream_);
        off += nb;
      }
    }
    try {
      nccl_->all_reduce(data, data, count, dtype, sum_op, p.name);
    } catch (const std::exception& e) {
      fail(cross, "NCCL all_reduce '" + p.name + "'", e);
    }
    if (op == ReduceOp::kMean) {
      const void* src[1] = {data};
      b.reduce(ordinal_, comm_stream_, data, src, 1, count, dtype, ReduceOp::kMean,
               replicas_in_sync_);
    }
    if (!alone) {
      size_t off = 0;
      for (size_t k = p.begin; k < p.end; ++k) {
        const size_t nb = tensors[k].nbytes();
        if (nb) b.memcpy_async(ordinal_, tensors[k].data(), data + off, nb, comm_stream_);
        off += nb;
      }
    }
  }
  // The replica's later work (the update) runs after the reduction.
  order_replica_after(replica_stream);
}

void DeviceReduction::fail(Communicator& cross, const std::string& what, const std::exception& e) {
  const std::string me = "rank " + std::to_string(rank_);
  // NCCL's own error does not say which peer is missing (and the
  // communicator must not be used again): abort it, then meet the other
  // ranks on the host process group, whose deadline names who never came.
  nccl_->abort(me + ": " + what + " failed: " + e.what());
  ErrorCode code = ErrorCode::kInternal;
  if (const auto* err = dynamic_cast<const Error*>(&e)) code = err->code();
  std::string peers;
  try {
    cross.barrier("after a failed NCCL collective");
    peers = "every rank reached the host process group after it (the failure is on the devices)";
  } catch (const std::exception& pe) {
    if (const auto* err = dynamic_cast<const Error*>(&pe)) code = err->code();
    peers = std::string("the host process group: ") + pe.what();
  }
  throw_error(code,
              me + ": " + what + " failed (NCCL communicator aborted): " + e.what() + "; " + peers);
}

}  // namespace diststrat
