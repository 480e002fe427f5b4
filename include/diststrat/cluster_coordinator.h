// ClusterCoordinator: TensorFlow 2's parameter-server training
// (tf.distribute.coordinator.ClusterCoordinator) over ParameterServerStrategy.
// One process, the coordinator, schedules functions; the other workers run
// them and send their results back; the functions read and update the PS
// variables through the strategy exactly as a per-worker loop does.
//
// C++ cannot ship a closure to another process, so a function is a NAME in
// a FunctionRegistry that every process of the job fills the same way (the
// one program every process runs registers its functions before it makes the
// coordinator). Arguments and results are bytes (Bytes); encode_tensors /
// decode_tensors carry tensors. A function receives its worker's strategy and
// the arguments, and returns the result bytes:
//
//   ```cpp fragment=coordinator norun
//   ds::ParameterServerStrategy strategy(options);
//   if (strategy.is_ps()) { strategy.join(); return 0; }
//   // Every worker creates the variables, in the same order, as today.
//   ds::Variable w = strategy.create_variable("w", ds::Shape{4}, ds::DType::kFloat32,
//                                             ds::init::Zeros{});
//   ds::SGD sgd(strategy, {0.01f});
//   ds::FunctionRegistry fns;  // filled the same way by every process
//   fns.register_function("train_step", [&](ds::ParameterServerStrategy& s, const ds::Bytes& args) {
//     const int64_t step = decode_step(args);
//     s.run([&](ds::ReplicaContext& ctx) {
//       ds::Tensor g(ds::Shape{4}, ds::DType::kFloat32);  // the gradient of batch `step`
//       ds::init::Constant{1.0 / (step + 1)}(g);
//       sgd.apply_gradients(ctx, {{g, w}});
//     });
//     return ds::encode_tensors({w.value()});
//   });
//   ds::ClusterCoordinator coordinator(strategy, fns);
//   if (!coordinator.is_coordinator()) { coordinator.serve(); return 0; }
//   coordinator.declare_update_rule(sgd);  // the chief fixes the PS's update rule
//   std::vector<ds::RemoteValue> values;
//   for (int64_t i = 0; i < steps; ++i) values.push_back(coordinator.schedule("train_step", encode_step(i)));
//   coordinator.join();
//   for (const ds::RemoteValue& v : values) use(ds::decode_tensors(v.fetch()));
//   ```
//
// Roles. The coordinator is the chief (worker index 0): it is the process
// TF_CONFIG's "chief" task (or mpirun's rank 0) names, the one that already
// writes checkpoint indexes and sets hyper-parameters, and the only worker
// every job has. It runs no function itself; the other workers (at least
// one) serve. PS ranks are not involved beyond their usual service.
//
// Dispatch. schedule() only queues; a dispatcher thread of the coordinator
// sends each queued function to an idle worker (one function per worker at a
// time) and collects results. Each dispatch of a function is an ATTEMPT with
// its own id.
//
// Faults (see docs/parameter_server.md, "Coordinator"):
//  - A worker whose attempt is not answered within function_timeout (stopped,
//    hung, or its host gone), or whose connection fails (its process died:
//    survivable only in a TF_CONFIG job with
//    ParameterServerOptions::survive_worker_loss; mpirun ends the job), loses
//    the attempt: the function is queued again and runs on another worker
//    (re-runs are counted: CoordinatorStats::reruns). A late result of a lost
//    attempt is refused (counted: late_results_refused) and the worker that
//    sent it is taken back as idle; so each function's RESULT is delivered
//    exactly once, the result of the attempt that was accepted first. Its
//    EFFECTS (pushes to the PS) may land more than once: a lost attempt may
//    have pushed before it was lost (TensorFlow documents the same).
//  - A function that throws fails its RemoteValue with that error (not
//    re-run: it is the program's error); the next join(), done() or
//    schedule() raises the first such error (then forgets the errors), and
//    fetch() of that value raises it.
//  - A function lost max_attempts times, or no worker left to run it, fails
//    its RemoteValue with UnavailableError naming the function and the
//    workers lost.
//  - The PS ranks take a variable's update rule from the chief only: call
//    declare_update_rule before scheduling functions that push gradients.
//  - A PS failure reaches the functions' pushes and pulls as today's
//    strategy errors; those fail the function (and so the job) with the
//    error naming the PS. The coordinator's own failure ends the job: a
//    serving worker's wait for the next function fails (serve throws
//    UnavailableError when the coordinator's connection broke, or
//    DeadlineExceededError naming its rank after `timeout` of silence).
//
// Thread safety: schedule/join/done/fetch may be called from any thread of
// the coordinator process; serve() from one thread of a serving worker.
// Every wait has a deadline (CoordinatorOptions).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "diststrat/parameter_server.h"
#include "diststrat/tensor.h"

namespace diststrat {

// Bytes that travel: a function's arguments and its result.
using Bytes = std::vector<char>;

// A scheduled function's body: runs on a serving worker with its strategy.
using RemoteFunction = std::function<Bytes(ParameterServerStrategy& strategy, const Bytes& args)>;

// Named functions, filled the same way by every process of the job.
class FunctionRegistry {
 public:
  // `name`: 1..256 characters, not registered before (else
  // InvalidArgumentError); `fn` not empty.
  void register_function(const std::string& name, RemoteFunction fn);
  bool contains(const std::string& name) const { return functions_.count(name) != 0; }
  // InvalidArgumentError naming `name` when it is not registered.
  const RemoteFunction& at(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  std::map<std::string, RemoteFunction> functions_;
};

// Host tensors as bytes (dtype, shape, data of each, with a magic and a
// length check) and back; decode throws InvalidArgumentError on bytes that
// are short, long or not an encoding.
Bytes encode_tensors(const std::vector<Tensor>& tensors);
std::vector<Tensor> decode_tensors(const Bytes& bytes);

struct CoordinatorOptions {
  // A dispatched function not answered within this is lost (its worker
  // stopped, hung or gone) and runs again elsewhere. 0 = the strategy's
  // communication.timeout. Set it above the longest function's running time.
  std::chrono::milliseconds function_timeout{0};
  // Deadline of join(), fetch() and of a serving worker's wait for its next
  // function (the coordinator pings idle workers every quarter of it).
  // 0 = the strategy's communication.timeout.
  std::chrono::milliseconds timeout{0};
  // A function lost this many times fails (UnavailableError).
  int max_attempts = 4;
};

struct CoordinatorStats {
  int64_t scheduled = 0;             // functions scheduled
  int64_t attempts = 0;              // dispatches (scheduled + re-runs, + ones still running)
  int64_t reruns = 0;                // dispatches of a function after a lost attempt
  int64_t results_delivered = 0;     // results accepted (at most one per function)
  int64_t late_results_refused = 0;  // results of lost attempts, refused
  int64_t failed = 0;                // functions that raised or were lost too often
  std::vector<int> lost_workers;     // worker indices that lost an attempt (in order; repeats)
};

// The asynchronously available result of one scheduled function.
class RemoteValue {
 public:
  struct State;
  RemoteValue() = default;
  explicit RemoteValue(std::shared_ptr<State> state) : state_(std::move(state)) {}
  // The function's id (0, 1, ... in schedule order) and name.
  int64_t id() const;
  const std::string& function() const;
  // Whether the result (or the error) has arrived. Does not block.
  bool ready() const;
  // Blocks until the result arrives (deadline: CoordinatorOptions::timeout,
  // DeadlineExceededError naming the function) and returns it, or throws
  // the function's error. May be called again (the same bytes).
  Bytes fetch() const;

 private:
  std::shared_ptr<State> state_;
};

class ClusterCoordinator {
 public:
  // Every worker of the job makes one, after creating its variables, with
  // the same registry; PS ranks do not (FailedPreconditionError). On the
  // coordinator it starts the dispatcher thread.
  ClusterCoordinator(ParameterServerStrategy& strategy, const FunctionRegistry& functions,
                     CoordinatorOptions options = {});
  // Coordinator: tells the serving workers to leave serve() (after join()
  // if functions are outstanding: it waits for them up to the timeout,
  // dropping errors) and stops the dispatcher. Never throws.
  ~ClusterCoordinator();
  ClusterCoordinator(const ClusterCoordinator&) = delete;
  ClusterCoordinator& operator=(const ClusterCoordinator&) = delete;

  bool is_coordinator() const;

  // Coordinator: fixes `optimizer` as the update rule of every float32
  // variable created so far whose rule is not fixed yet, as the chief's first push
  // would in a per-worker loop (the PS ranks take a variable's rule from the
  // chief only; docs/parameter_server.md). Call it before scheduling
  // functions that apply gradients: otherwise their first push waits for
  // the chief and fails at the deadline saying so. Blocking (one round trip
  // to each PS rank holding such a variable).
  void declare_update_rule(const Optimizer& optimizer);

  // Coordinator: queues `function` (registered: else InvalidArgumentError)
  // with `args`; returns at once. Raises a pending error of an earlier
  // function first (as TF's schedule does).
  RemoteValue schedule(const std::string& function, Bytes args = {});
  // Coordinator: blocks until every scheduled function has a result or an
  // error (deadline: timeout from the call, DeadlineExceededError naming
  // the functions still out and their workers); raises the first error.
  void join();
  // Coordinator: whether every scheduled function has finished (does not
  // block); raises the first error like join().
  bool done();
  // Coordinator: the results of `values`, in order (each as RemoteValue::fetch).
  static std::vector<Bytes> fetch(const std::vector<RemoteValue>& values);
  // Coordinator: what happened so far (thread-safe).
  CoordinatorStats stats() const;

  // Serving workers: runs the functions the coordinator sends until it says
  // stop (returns) or is silent for `timeout` (DeadlineExceededError naming
  // its rank). A function's exception is sent back as its error; serve
  // goes on. FailedPreconditionError on the coordinator.
  void serve();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace diststrat
