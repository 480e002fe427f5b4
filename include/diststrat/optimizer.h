// Optimizers. An optimizer holds hyper-parameters and an update rule; the
// strategy decides where the rule runs (on every mirrored copy, once on the
// host copy, or on the parameter servers). Slots (momentum, Adam moments) live
// beside each variable's copies and are created zero-filled on first use.
// The pieces an optimizer is configured with have headers of their own,
// included here: learning_rate_schedule.h, gradient_options.h (clipping, loss
// scaling), update_rule.h (the rule as data), optimizer_sharding.h (ZeRO-1).
//
// Rules for the calls below:
//  - Blocking: apply_gradients returns when this replica's part of the step
//    is done: its gradients reduced with the other replicas' (waiting for
//    them within the strategy's timeout) and its copies updated, a GPU
//    copy's update enqueued on the replica's stream. ParameterServerStrategy
//    pushes the gradients without waiting for the parameter servers; under
//    accumulation the first k - 1 calls of an update return at once.
//  - Ordering: every local replica calls apply_gradients with the same
//    variables in the same order, and so does every worker of a synchronous
//    strategy, configured alike (checked at the first call). Constructing an
//    optimizer and enable_loss_scaling create variables: like
//    Strategy::create_variable, outside run, on every worker in the same order.
//  - Thread safety: apply_gradients, loss_scale and learning_rate may run on
//    every replica's thread at once (inside Strategy::run); the set_* and
//    enable_* calls, gather/assign_sharded_slots and slot_bytes_per_replica
//    are not thread-safe: call them outside Strategy::run.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "diststrat/gradient_options.h"
#include "diststrat/learning_rate_schedule.h"
#include "diststrat/optimizer_sharding.h"
#include "diststrat/strategy.h"
#include "diststrat/update_rule.h"

namespace diststrat {

// What one apply_gradients call did.
struct ApplyResult {
  // Loss scaling: the step's reduced gradients were not all finite, so the
  // step was skipped (on every replica and worker alike).
  bool skipped = false;
  // Loss scaling: the scale this step's gradients were divided by; 1 without.
  float loss_scale = 1.0f;
  // False for the first k - 1 micro-batches under gradient accumulation: the
  // gradients were added to this replica's sums, nothing was communicated or
  // updated. In determinism mode also false for every virtual shard but a
  // replica's last (its gradients are held for the exact sum).
  bool applied = true;
  // The global norm of the reduced gradients before clipping, when clipping
  // by global norm (the same on every replica and worker); NaN otherwise.
  double global_norm = std::numeric_limits<double>::quiet_NaN();
};

class Optimizer {
 public:
  explicit Optimizer(Strategy& strategy);
  virtual ~Optimizer() = default;

  virtual std::string name() const = 0;
  // Names of the per-variable slots the rule needs, e.g. {"momentum"}.
  virtual std::vector<std::string> slot_names() const = 0;
  // The update rule over `count` float32 elements: var, grad and each slot
  // (parallel to slot_names()) point at the same range. `step` is the 1-based
  // number of this update. Pure: same inputs, same outputs.
  virtual void update(float* var, const float* grad, float* const* slots, size_t count,
                      int64_t step) const = 0;

  // In replica context: reduces the gradients across replicas (the strategy's
  // way) and updates the variables. Every local replica must call it with the
  // same variables in the same order. Gradients are summed: scale the loss by
  // 1 / global batch size (DistributedBatch::global_size()) so the sum is the
  // mean over the global batch.
  // Clipping (set_clipping) runs between the reduction and the update.
  // Under gradient accumulation (set_accumulation_steps(k)), the first k - 1
  // calls of each update only add the gradients to this replica's local sums
  // (no communication, no update); the k-th reduces the sums once and
  // updates. Every local replica must make the same calls.
  // Mixed precision: a float32 variable's gradient may be float16 or
  // bfloat16 (host memory); it is widened to float32 exactly (inf and NaN
  // kept, so loss scaling sees an f16 overflow) and reduced and applied in
  // float32. Any other dtype or shape mismatch is InvalidArgumentError.
  ApplyResult apply_gradients(ReplicaContext& ctx,
                              const std::vector<std::pair<Tensor, Variable>>& grads_and_vars);

  // apply_gradients for gradients the caller has already summed over every
  // replica in sync, as TensorFlow's apply_gradients(...,
  // experimental_aggregate_gradients=False): the variables are updated with
  // them as given, nothing is reduced. This is how a loop overlaps the
  // reduction with backward: hand each layer's gradients to
  // ReplicaContext::all_reduce_async(ReduceOp::kSum, ...) as backward makes
  // them (nn::Mlp::forward_backward's on_ready), wait for every Work, then
  // call this. Same checks and blocking as apply_gradients; under
  // MultiWorkerMirroredStrategy only, without clipping, loss scaling,
  // accumulation, ZeRO-1 or determinism's virtual shards (else
  // UnimplementedError: those need the reduction inside the call).
  ApplyResult apply_reduced_gradients(
      ReplicaContext& ctx, const std::vector<std::pair<Tensor, Variable>>& grads_and_vars);

  // Sets the clipping of later apply_gradients calls. Throws
  // InvalidArgumentError for a negative or non-finite field or more than one
  // set. Not thread-safe: call it outside Strategy::run.
  void set_clipping(const GradientClipping& clipping);
  const GradientClipping& clipping() const { return clipping_; }

  // Turns on dynamic loss scaling: creates the non-trainable variables
  // "<optimizer>/loss_scale" (float32), "<optimizer>/loss_scale_good_steps"
  // and "<optimizer>/skipped_steps" (int64), which checkpoints save. Like
  // create_variable: outside run, collective on every worker. Throws
  // InvalidArgumentError for bad options, FailedPreconditionError if called
  // twice. ParameterServerStrategy: UnimplementedError at apply_gradients.
  // On GPU replicas the scale is a device variable and the non-finite check
  // runs on the device (one small read per step).
  void enable_loss_scaling(const LossScaleOptions& options = {});
  bool loss_scaling() const { return loss_scale_.defined(); }
  // The current scale as this replica holds it (1 without loss scaling).
  // A GPU replica's copy is read back after its queued work (blocking, 4
  // bytes, bounded by the communication timeout).
  float loss_scale(ReplicaContext& ctx) const;
  // Steps skipped for non-finite gradients so far (0 without loss scaling).
  int64_t skipped_steps() const;

  // Gradient accumulation over k micro-batches per update (1 = off, the
  // default): DDP's no_sync, Horovod's backward_passes_per_step. iterations()
  // and the schedule count updates, not micro-batches. For the mean over the
  // concatenated batch, scale every micro-batch's loss by 1 / (the global
  // examples of all k micro-batches, a short last one included). The sums
  // are not checkpointed: save between updates. Throws InvalidArgumentError
  // for k < 1 and FailedPreconditionError while micro-batches are pending.
  // Not thread-safe: call it outside Strategy::run. GPU gradients are summed
  // on their device (one launch per micro-batch).
  void set_accumulation_steps(int k);
  int accumulation_steps() const { return accumulation_steps_; }

  // Number of completed updates (an int64 scalar variable that checkpoints
  // save with the model); neither accumulated micro-batches nor steps skipped
  // by loss scaling count.
  Variable iterations() const { return iterations_; }
  Strategy& strategy() const { return *strategy_; }

  // What every worker must configure alike, as (field, value) text: the
  // optimizer's name, its hyperparameters(), clipping, loss scaling and
  // accumulation steps (ZeRO-1 on some workers only is an error of the
  // strategy's call signature, naming shard_optimizer_state).
  // Where several processes train (MultiWorkerMirroredStrategy), the first
  // apply_gradients -- and the first after set_clipping,
  // set_accumulation_steps or enable_loss_scaling -- compares these across
  // every replica (one all_gather of a hash per field) and throws the same
  // InvalidArgumentError on every replica naming the first field that
  // differs and the replicas on each side, before any gradient moves.
  std::vector<std::pair<std::string, std::string>> configuration() const;
  // The optimizer's own hyper-parameters as (field, value) text, floats
  // exactly (SGD: learning_rate, schedule, momentum, nesterov; Adam:
  // learning_rate, schedule, beta1, beta2, epsilon). A custom optimizer
  // overrides it so workers are held to agree on its fields too.
  virtual std::vector<std::pair<std::string, std::string>> hyperparameters() const { return {}; }

  // The rule as data for device kernels; kNone (the default) means the
  // optimizer cannot update variables that live on a GPU.
  virtual UpdateRule device_rule() const { return {}; }

  // The learning rate of the update that follows `iterations` completed
  // ones (the schedule's value; what the loop logs). Default: the device
  // rule's fixed rate.
  virtual float learning_rate(int64_t iterations) const { return device_rule().learning_rate; }

  // Applies the rule to one tensor with its slot tensors (helper for
  // strategies); GPU tensors are updated on the calling replica's stream.
  // Strategies call it once per variable (per local copy) with the reduced
  // gradient after the reduction, in the same order on every replica: under
  // clipping by global norm or loss scaling, the calls of one apply_gradients
  // on one thread are held until the last, then checked, clipped together
  // and applied in order (or all dropped for a skipped step).
  void update_tensor(Tensor& var, const Tensor& grad, std::vector<Tensor*> slots,
                     int64_t step) const;
  // update_tensor over a step's list, in order, every entry at `step`:
  // GPU variables of one device (without clipping or loss scaling, which
  // hold the updates and apply them so at the end of the step) are updated
  // by one multi-tensor launch (GpuBackend::apply_update_list) with the
  // same bits as one launch per variable; anything else goes through
  // update_tensor one entry at a time.
  struct TensorUpdate {
    Tensor* var = nullptr;
    Tensor grad;
    std::vector<Tensor*> slots;
  };
  // `step_counter`: the host int64 counter `step` was read from (and that
  // holds `step` when the launches run). Inside a captured step (a
  // MirroredStrategy::compile step on GPUs) the update's rate is then read
  // from device memory, recomputed from the counter before every replay, so
  // the schedule and Adam's bias correction follow the replays; without a
  // counter, or with clipping or loss scaling, a captured update is refused.
  void update_tensors(const std::vector<TensorUpdate>& updates, int64_t step,
                      const Tensor* step_counter = nullptr) const;

  // ZeRO-1, called by a strategy's apply_gradients in place of its
  // all-reduce and per-copy updates when the strategy shards optimizer state
  // (MirroredOptions / MultiWorkerOptions::shard_optimizer_state). The
  // variables of the call, in creation order, are laid end to end as one flat
  // vector of N float32 elements, cut into R blocks of B = ceil(N / R)
  // (the last blocks shorter or empty: no divisibility needed); global
  // replica r owns block r. The gradients are reduce-scattered (each replica
  // receives the sum of its block only), each replica updates its block of
  // the variables with its block of the slots (slots are allocated for that
  // block only: ~1/R of the non-sharded slot memory), and the updated blocks
  // are all-gathered into every replica's copies, so the copies stay
  // bit-identical. Global-norm clipping sums the blocks' squared norms with
  // one scalar reduction; loss scaling reduces the non-finite decision the
  // same way (they share the one scalar). Every call of this optimizer must
  // pass the same variables (UnimplementedError otherwise); float32, each
  // replica's variables and gradients in one place (host memory, or its GPU:
  // its buffers and slot blocks are then allocated there and the
  // collectives get device buffers); per-tensor clip_by_norm is
  // UnimplementedError (each replica sees only a piece of a tensor).
  // Slots that exist in full when the first sharded call comes (restored
  // from a checkpoint) are cut into the blocks and the full copies freed
  // once every local replica has taken its block.
  void apply_sharded(ReplicaContext& ctx,
                     const std::vector<std::pair<Tensor, Variable>>& grads_and_vars,
                     const ShardedCollectives& collectives);
  // True once apply_sharded has laid out this optimizer's state.
  bool sharded() const;
  // Whether the slot `slot_name` of `var` is held in blocks by this
  // optimizer (checkpoints gather it with gather_sharded_slots).
  bool sharded_slot(const Variable::Impl& var, const std::string& slot_name) const;
  // Full host values of sharded slots, gathered from every replica's block
  // (one all_gather per slot name). Cross-replica context, collective on
  // every worker (it runs one Strategy::run). Blocking.
  std::vector<Tensor> gather_sharded_slots(
      const std::vector<std::pair<const Variable::Impl*, std::string>>& slots) const;
  // Writes full host `values` of sharded slots: each local replica keeps its
  // block. Cross-replica context; no communication (every worker has the
  // full values). Blocking.
  void assign_sharded_slots(const std::vector<std::pair<const Variable::Impl*, std::string>>& slots,
                            const std::vector<Tensor>& values) const;
  // Forgets the ZeRO-1 layout and every local replica's slot blocks (their
  // values are dropped): the next sharded call lays the state out again for
  // the replicas in sync then, keeping its block of the full slots assigned
  // meanwhile (Checkpoint::assign), as on a first call. For a group whose
  // size changed (elastic training does it at every re-forming). Cross-replica
  // context; no communication. Not thread-safe with run().
  void reset_sharding() const;
  // Bytes of optimizer slots (this optimizer's slot_names() of every
  // trainable variable) the largest local replica holds now: the full slots
  // of every variable without sharding, the replica's blocks with it.
  // Slots not created yet count 0. Not thread-safe with run().
  int64_t slot_bytes_per_replica() const;

 private:
  struct Held;
  struct Accumulator;
  struct Zero;
  struct Agreement;
  struct ShardSums;
  // deterministic_sum.cc: determinism mode's exact sum of the virtual
  // shards' gradients; null for every shard but a replica's last, whose call
  // gets the sum and the real replica's context to reduce and update with.
  static std::shared_ptr<ShardSums> new_shard_sums();
  ReplicaContext* combine_shards(ReplicaContext& ctx,
                                 const std::vector<std::pair<Tensor, Variable>>& grads_and_vars,
                                 std::vector<std::pair<Tensor, Variable>>& combined);
  // optimizer_agreement.cc: the cross-worker comparison of configuration().
  static std::shared_ptr<Agreement> new_agreement();
  void configuration_changed();
  void agree_on_configuration(ReplicaContext& ctx);
  // gradient_accumulation.cc: one micro-batch added to this replica's sums;
  // the k-th reduces them and updates.
  ApplyResult accumulate_micro_batch(
      ReplicaContext& ctx, const std::vector<std::pair<Tensor, Variable>>& grads_and_vars);
  // clipping_and_loss_scaling.cc: the strategy's reduction and update, the
  // step's updates held for global-norm clipping and loss scaling.
  ApplyResult reduce_and_update(ReplicaContext& ctx,
                                const std::vector<std::pair<Tensor, Variable>>& grads_and_vars);
  void apply_clipped(Tensor& var, const Tensor& grad, const std::vector<Tensor*>& slots,
                     int64_t step, float scale) const;
  void update_now(Tensor& var, const Tensor& grad, const std::vector<Tensor*>& slots,
                  int64_t step) const;
  // update_now over a list at one step: one apply_update_list launch when
  // every variable is on one GPU, else update_now per entry.
  void update_now_list(const std::vector<TensorUpdate>& updates, int64_t step,
                       const Tensor* step_counter = nullptr) const;
  // device_training.cc: a step's held updates of GPU variables, transformed
  // (unscaled, checked, clipped) by one launch each and applied.
  struct DeviceStep;
  void flush_on_device(DeviceStep& step) const;

  Strategy* strategy_;
  Variable iterations_;
  GradientClipping clipping_;
  std::shared_ptr<Held> held_;  // per-thread updates held (global norm, loss scaling)
  int accumulation_steps_ = 1;
  LossScaleOptions loss_scale_options_;
  Variable loss_scale_, good_steps_, skipped_steps_;
  std::shared_ptr<Accumulator> accumulator_;  // per local replica sums
  std::shared_ptr<Zero> zero_;                // ZeRO-1 layout and slot blocks
  std::shared_ptr<Agreement> agreement_;      // configuration agreed per local replica
  std::shared_ptr<ShardSums> shard_sums_;     // determinism mode: shards' gradients held
};

struct SGDOptions {
  float learning_rate = 0.01f;
  float momentum = 0.0f;  // 0 = plain SGD
  bool nesterov = false;
  LearningRateSchedule schedule;  // default: learning_rate at every step
};

// lr = schedule at step - 1 (the learning rate when constant);
// v = momentum * v - lr * g; w += v  (Keras' SGD; nesterov: w += momentum * v - lr * g)
class SGD : public Optimizer {
 public:
  SGD(Strategy& strategy, SGDOptions options = {});
  std::string name() const override { return "sgd"; }
  std::vector<std::string> slot_names() const override;
  void update(float* var, const float* grad, float* const* slots, size_t count,
              int64_t step) const override;
  UpdateRule device_rule() const override;
  float learning_rate(int64_t iterations) const override;
  std::vector<std::pair<std::string, std::string>> hyperparameters() const override;
  const SGDOptions& options() const { return options_; }
  // The rule and its slots without an SGD object (parameter servers apply
  // it); `step` is 1-based, as in update().
  static void apply(const SGDOptions& options, float* var, const float* grad, float* const* slots,
                    size_t count, int64_t step);
  static std::vector<std::string> slot_names_for(const SGDOptions& options);

 private:
  SGDOptions options_;
};

struct AdamOptions {
  float learning_rate = 0.001f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float epsilon = 1e-7f;
  LearningRateSchedule schedule;  // default: learning_rate at every step
};

// Kingma & Ba with bias correction (Keras' Adam); the rate of update `step`
// is the schedule at step - 1.
class Adam : public Optimizer {
 public:
  Adam(Strategy& strategy, AdamOptions options = {});
  std::string name() const override { return "adam"; }
  std::vector<std::string> slot_names() const override { return {"m", "v"}; }
  void update(float* var, const float* grad, float* const* slots, size_t count,
              int64_t step) const override;
  UpdateRule device_rule() const override;
  float learning_rate(int64_t iterations) const override;
  std::vector<std::pair<std::string, std::string>> hyperparameters() const override;
  const AdamOptions& options() const { return options_; }
  // The rule without an Adam object (parameter servers apply it).
  static void apply(const AdamOptions& options, float* var, const float* grad, float* const* slots,
                    size_t count, int64_t step);

 private:
  AdamOptions options_;
};

}  // namespace diststrat
