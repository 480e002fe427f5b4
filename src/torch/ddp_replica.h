// DistributedDataParallel's state per local replica (the step in progress,
// the accumulation window, gradients from outside ddp.backward) and what the
// DDP sources share about it: the step flags' layout in the last bucket and
// the replica whose autograd pass runs on this thread. Internal (src/torch).
#pragma once

#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "diststrat/torch.h"

namespace diststrat::libtorch {

namespace ddp_detail {

// Floats after the per-parameter "no gradient" flags in the last bucket
// (Replica::unused_flags says which is which).
constexpr size_t kStepFlags = 8;
// Counts sent as float32 are exact below 2^24; the sync index goes mod 2^20.
constexpr int64_t kSyncIndexModulus = int64_t{1} << 20;

// The replica whose backward() runs an autograd pass on this thread (CPU
// passes run on the caller's thread), so that a hook of another replica's
// parameter, reached because the step used the wrong replica's module, is
// told apart from this replica's own.
struct ActivePass {
  const DistributedDataParallel* ddp = nullptr;
  int local = -1;
};
extern thread_local ActivePass active_pass;  // defined in ddp_reducer.cc

}  // namespace ddp_detail

// One per local replica (state_[local]): its thread, its hooks and (the
// stray_ fields) any thread that runs a pass through its module touch it.
struct DistributedDataParallel::Replica {
  int local = 0;
  // The replica's torch device: its module's parameters live there.
  torch::Device device{torch::kCPU};
  bool cuda = false;
  // This replica's backward() is inside its autograd pass. A CUDA pass runs
  // the gradient hooks on autograd's thread of that device, not on the
  // caller's (ActivePass is not set there): this tells them apart from
  // gradients that reach the parameters outside ddp.backward.
  std::atomic<bool> in_pass{false};
  // A CUDA replica's step flags, on its device (an all-reduce takes the
  // tensors of one device); read back into unused_flags after the waits.
  at::Tensor flags_device;
  std::vector<at::Tensor> params;  // requires_grad, in names_ order
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::vector<uintptr_t> hook_keys;

  bool in_no_sync = false;
  // The accumulation window (micro-batches since the last synchronization).
  int64_t window_global_rows = 0;
  int64_t window_rows = 0;     // this replica's rows in the window
  int64_t window_batches = 0;  // backward() calls in the window
  // Synchronizing backward() calls in the current Strategy::run (the run
  // told apart by Strategy::steps_run()).
  int64_t run_seen = -1;
  int64_t sync_index = 0;
  // Every parameter of the module (named_parameters() order, with or
  // without requires_grad) when DDP was constructed: a replaced layer is
  // found by identity.
  std::vector<at::Tensor> module_params;
  std::vector<char> module_trainable;  // their requires_grad then
  // Per parameter: a gradient reached it in a pass of this replica's
  // backward() in the window (the hook fired with a defined .grad).
  std::vector<char> got_grad;
  // Per parameter: the .grad it had when the window began (moved aside).
  std::vector<at::Tensor> stash;
  bool window_ran_pass = false;  // an autograd pass ran in the window
  // The synchronizing backward in progress.
  bool syncing = false;
  ReplicaContext* ctx = nullptr;
  float scale = 1.0f;
  std::vector<char> ready;   // per parameter: its bucket may include it
  std::vector<int> pending;  // per bucket: parameters not ready yet
  size_t next_bucket = 0;    // first bucket not launched
  std::vector<Work> works;
  std::exception_ptr launch_error;
  // float32 [P + kStepFlags], summed over replicas (last bucket): [k] =
  // replicas that ran a pass but got no gradient for parameter k, [P] =
  // replicas whose backward failed, [P+1] = their window rows, [P+2] =
  // their window global_rows, [P+3] = their window backward() calls,
  // [P+4] = their synchronization index in this run() (what they must agree
  // on), [P+5] = replicas that ran an autograd pass in the window, [P+6] =
  // replicas with gradients from outside ddp.backward, [P+7] = the sum of
  // those replicas' ids + 1 (names the replica when there is one).
  Tensor unused_flags;
  bool failed = false;  // this replica's autograd pass failed
  // Set by a hook of another replica's parameter during this replica's pass.
  std::string foreign_parameter;
  // Gradients accumulated into this replica's parameters outside any
  // backward() of this DDP (any thread may run such a pass: guarded).
  std::mutex stray_mu;
  std::vector<char> stray;   // per parameter, since the last synchronization
  std::string stray_first;   // the first such parameter's name
  int64_t stray_count = 0;   // parameters in `stray`
  bool stray_sent = false;   // the current synchronization carries them
  std::string stray_report;  // what they were, once sent and cleared
  std::atomic<int64_t> launched{0}, in_hook{0}, sync_steps{0};
};

namespace ddp_detail {

// After the reduction of the step flags, unless find_unused_parameters: a
// parameter that some replica ran a pass for and got no gradient is
// InvalidArgumentError on every replica (ddp_step_checks.cc).
void check_all_used(ReplicaContext& ctx, const std::vector<std::string>& names,
                    const DistributedDataParallel::Replica& r);

}  // namespace ddp_detail

}  // namespace diststrat::libtorch
