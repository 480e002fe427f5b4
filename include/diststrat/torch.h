// LibTorch integration (target diststrat::torch; the only diststrat header
// that includes torch headers). Namespace diststrat::libtorch, so that
// `using namespace diststrat;` never shadows ::torch. docs/torch.md has the
// details.
//
//   namespace ds = diststrat; namespace dt = diststrat::libtorch;
//   ds::MultiWorkerMirroredStrategy strategy;          // or Mirrored / CentralStorage
//   auto net = std::make_shared<Net>();                 // a torch::nn::Cloneable<Net>
//   dt::DistributedDataParallel ddp(strategy, net);     // collective: checks + broadcasts
//   std::vector<std::unique_ptr<torch::optim::SGD>> opt;  // one per local replica
//   for (int i = 0; i < ddp.num_local_replicas(); ++i)
//     opt.push_back(std::make_unique<torch::optim::SGD>(ddp.module(i)->parameters(), 0.05));
//   for (const ds::DistributedBatch& batch : strategy.distribute(data, 256)) {
//     ds::PerReplica<float> loss = strategy.run([&](ds::ReplicaContext& ctx) {
//       auto& model = ddp.module(ctx);               // this replica's module
//       at::Tensor x = dt::to_torch(batch.features(ctx));     // zero-copy
//       at::Tensor y = dt::to_torch(batch.labels(ctx));
//       torch::optim::SGD& o = *opt[ctx.local_replica_id()];
//       o.zero_grad();
//       at::Tensor l = torch::nll_loss(model->as<Net>()->forward(x), y);  // mean over x's rows
//       ddp.backward(ctx, l, x.size(0), batch.global_size());  // grads = global mean
//       o.step();
//       return x.size(0) ? l.item<float>() : 0.0f;
//     });
//   }
//
// Strategies: MultiWorkerMirroredStrategy (gradients go through its fusion
// engine, overlapped with backward), MirroredStrategy and
// CentralStorageStrategy (one module clone per local replica, gradients
// reduced in-process; every replica applies the same update to its clone, so
// the clones stay bit-identical). ParameterServerStrategy is not supported
// (the constructor throws UnimplementedError).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "diststrat/strategy.h"
#include "diststrat/tensor.h"

namespace diststrat::libtorch {

// ---- conversions (zero-copy) ------------------------------------------------

// A diststrat Tensor viewing `t`'s memory (no copy); it holds a reference to
// `t`'s storage, so the memory stays valid for as long as the Tensor (or any
// copy/view of it) lives. CPU tensors -> Device::cpu(0); CUDA tensors -> the
// GPU of that CUDA ordinal (through the calling thread's DeviceManager inside
// Strategy::run, as Tensor::from_dlpack does). dtypes float32/64, float16,
// bfloat16, int32/64. A non-contiguous tensor, another dtype, another device
// type or a sparse/quantized tensor is InvalidArgumentError naming what is
// wrong (call .contiguous() first). An undefined at::Tensor gives an
// undefined Tensor. Does not block; thread-safe.
Tensor to_diststrat(const at::Tensor& t);

// An at::Tensor viewing `t`'s memory (no copy), writable: writes through it
// change `t`. It holds a reference to `t`'s storage, so the memory stays
// valid until the last at::Tensor sharing it is gone (memory `t` merely
// wraps, Tensor::wrap, stays the caller's to keep alive). GPU tensors become
// CUDA tensors of the matching ordinal. An undefined Tensor gives an
// undefined at::Tensor. Does not block; thread-safe.
at::Tensor to_torch(const Tensor& t);

// ---- DistributedDataParallel --------------------------------------------------

struct DdpOptions {
  // false (default): a parameter (requires_grad) that got no gradient in a
  // synchronizing backward() on any replica is InvalidArgumentError on every
  // replica, naming the parameter(s) and how many replicas missed them
  // (after the step's collectives completed, so no rank hangs). true: such a
  // gradient counts as zero on that replica (as torch DDP's
  // find_unused_parameters), and the parameter's grad is defined afterwards.
  bool find_unused_parameters = false;
  // true (default): each bucket of gradients is handed to the strategy's
  // all-reduce from the autograd hook the moment its last gradient is
  // accumulated, overlapping communication with the rest of backward.
  // false: nothing is sent until backward has finished, then every bucket
  // (the "after backward" loop of hand-written LibTorch programs).
  bool overlap = true;
  // Bucket size in bytes: consecutive parameters (in reverse registration
  // order, the order backprop produces them) are grouped into buckets of up
  // to this many bytes, one all-reduce call per bucket (which the
  // multi-worker fusion engine packs into one message). 0 = one bucket.
  size_t bytes_per_bucket = 256 << 10;
};

struct DdpStats {
  int64_t sync_steps = 0;        // backward() calls that synchronized
  int64_t buckets_launched = 0;  // bucket all-reduces started (this process, all replicas)
  // Buckets started from an autograd hook, i.e. while backward was still
  // running (overlap); the rest started after backward returned.
  int64_t buckets_in_hook = 0;
};

// Data parallel training of a torch::nn::Module under a synchronous
// strategy. Not copyable or movable (the hooks refer to it).
class DistributedDataParallel {
 public:
  // Collective and blocking, in cross-replica context (outside
  // Strategy::run): every worker process constructs it at the same point
  // with the same module architecture.
  //  1. Checks that every replica of the job has the same parameters and
  //     buffers (names, dtypes, shapes, in named_parameters() /
  //     named_buffers() order); a difference is InvalidArgumentError on every
  //     rank naming the first differing parameter/buffer and the replica.
  //  2. Broadcasts every parameter and buffer from the chief (worker 0), in
  //     place, into `module`.
  //  3. With several local replicas, clones `module` (Module::clone(), so it
  //     must be a torch::nn::Cloneable) once per further replica; module(0)
  //     is `module` itself.
  //  4. Registers a post-hook on each parameter's gradient accumulator.
  // Parameters must be dense, contiguous, on the replica's device (CPU, or
  // the replica's GPU), of a dtype to_diststrat accepts.
  // ParameterServerStrategy: UnimplementedError.
  DistributedDataParallel(Strategy& strategy, std::shared_ptr<torch::nn::Module> module,
                          DdpOptions options = {});
  // Removes the hooks (the modules stay usable as plain modules).
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  int num_local_replicas() const { return static_cast<int>(replicas_.size()); }
  // Local replica i's module (0 = the module given). Thread-safe.
  const std::shared_ptr<torch::nn::Module>& module(int local_replica) const;
  // This replica's module, in replica context. When several replicas share
  // the process it also sets LibTorch's intra-op threads to 1 on the calling
  // thread (at::set_num_threads(1): one replica = one core; note that this
  // also shrinks LibTorch's process-wide pthreadpool).
  const std::shared_ptr<torch::nn::Module>& module(ReplicaContext& ctx);
  // Parameter names (named_parameters() order, requires_grad ones only).
  const std::vector<std::string>& parameter_names() const { return names_; }

  // Replica context; every replica in sync calls it (also one with zero
  // rows). `loss` is the mean loss over this replica's `rows` rows of the
  // current (micro-)batch (a scalar); `global_rows` the rows of that batch
  // over every replica in sync (DistributedBatch::global_size()). Runs the
  // backward pass; outside no_sync() it also synchronizes: when it returns,
  // every parameter's .grad holds the gradient of the mean loss over all
  // rows of every replica and of every micro-batch accumulated under
  // no_sync() since the last synchronization (the true global batch, so a
  // short last batch is weighted right), identical on every replica.
  // A replica with rows == 0 runs no backward (its loss is NaN) and
  // contributes zero. Blocking (the strategy's deadline bounds every wait);
  // errors of the collectives (a peer that never arrives, a mismatch) are
  // thrown here. Call it from the replica's own thread.
  void backward(ReplicaContext& ctx, const at::Tensor& loss, int64_t rows, int64_t global_rows);

  // RAII guard (torch DDP's no_sync): backward() calls while it lives only
  // accumulate gradients locally; the first backward() after it is gone
  // synchronizes everything accumulated. Per replica: each replica takes its
  // own guard on its own thread. Not nestable for one replica.
  class NoSync {
   public:
    ~NoSync();
    NoSync(NoSync&& o) noexcept;
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    friend class DistributedDataParallel;
    NoSync(DistributedDataParallel* ddp, int local) : ddp_(ddp), local_(local) {}
    DistributedDataParallel* ddp_;
    int local_;
  };
  NoSync no_sync(ReplicaContext& ctx);

  const DdpOptions& options() const { return options_; }
  Strategy& strategy() const { return *strategy_; }
  DdpStats stats() const;

  struct Replica;  // per local replica state (src/torch/ddp.cc)

 private:
  void on_gradient_ready(int local, size_t param);
  void launch_ready_buckets(Replica& r, bool in_hook);
  void launch_bucket(Replica& r, size_t bucket, bool in_hook);

  Strategy* strategy_;
  DdpOptions options_;
  std::vector<std::shared_ptr<torch::nn::Module>> replicas_;
  std::vector<std::string> names_;           // parameters with requires_grad
  std::vector<std::vector<size_t>> buckets_;  // parameter indices, launch order
  std::vector<size_t> bucket_of_;             // parameter index -> bucket
  std::vector<std::unique_ptr<Replica>> state_;
};

}  // namespace diststrat::libtorch
