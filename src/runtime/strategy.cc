#include "runtime/variable_impl.h"
#include "diststrat/strategy.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <mutex>
#include <thread>

#include "allreduce/reduce_kernels.h"
#include "runtime/collective_check.h"
#include "runtime/local_replicas.h"
#include "core/env.h"
#include "core/cpu_isa.h"
#include "runtime/determinism.h"
#include "core/thread_pool.h"
#include "core/user_text.h"
#include "runtime/work_state.h"

namespace diststrat {

// ---- Work ------------------------------------------------------------------

void Work::wait() {
  if (!state_) return;
  std::unique_lock<std::mutex> lock(state_->mu);
  // The collective behind a Work carries its own deadline and always
  // completes or fails, so this wait is bounded by it.
  state_->cv.wait(lock, [&] { return state_->done; });
  // Every waiter throws its own copy of the error.
  if (state_->failed) throw_error(state_->code, state_->message);
}

bool Work::done() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done;
}

Work Work::completed(std::exception_ptr error) {
  auto s = std::make_shared<State>();
  s->finish(error);
  return Work(s);
}

// ---- ReplicaContext --------------------------------------------------------

void check_replica_tensors(const ReplicaContext& ctx, const char* op,
                           const std::vector<Tensor>& tensors,
                           const std::vector<std::string>& names, bool host_ok) {
  const Device& mine = ctx.device();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    // Written only for a message (this runs for every tensor of every call).
    auto label = [&] {
      return i < names.size() && !names[i].empty() ? "'" + echo(names[i]) + "'"
                                                   : "#" + std::to_string(i);
    };
    DISTSTRAT_CHECK(t.defined(), kInvalidArgument, "replica ", ctx.replica_id(), ": ", op,
                    ": tensor ", label(), " is an undefined tensor");
    const Device& d = t.device();
    // CPU replicas share host memory (every host tensor is /device:CPU:0).
    const bool ok = mine.is_cpu() ? d.is_cpu() : (d == mine || (host_ok && d.is_cpu()));
    DISTSTRAT_CHECK(ok, kInvalidArgument, "replica ", ctx.replica_id(), ": ", op, ": tensor ",
                    label(), " ", t.debug_string(), " is on ", d.to_string(),
                    ", but the replica's device is ", mine.to_string(),
                    mine.is_cpu() ? " (host memory expected)" : "");
  }
}

Work ReplicaContext::all_reduce_async(ReduceOp op, std::vector<Tensor> tensors,
                                      std::vector<std::string> names) {
  try {
    all_reduce(op, tensors, names);
  } catch (...) {
    return Work::completed(std::current_exception());
  }
  return Work::completed();
}

Tensor ReplicaContext::all_reduce(ReduceOp op, const Tensor& t, const std::string& name) {
  std::vector<Tensor> v{t.clone()};
  all_reduce(op, v, {name});
  return v[0];
}

// ---- Strategy --------------------------------------------------------------

void Strategy::run_step(const std::function<void(ReplicaContext&)>& fn) {
  // A fault aimed at a replica this job does not have would never fire: a
  // test that relied on it would pass without testing anything.
  DISTSTRAT_CHECK(!fault_.active() || fault_.rank < num_replicas_in_sync(), kInvalidArgument,
                  "fault injection ", fault_kind_name(fault_.kind), ":", fault_.rank, ":",
                  fault_.step, " (DISTSTRAT_FAULT or set_fault_injection): rank ", fault_.rank,
                  " is not a replica of this job (replica ids 0..", num_replicas_in_sync() - 1,
                  ")");
  const bool counted = run_is_step();
  const int64_t step = counted ? step_++ : step_;
  const std::string where = (counted ? "step " : "before step ") + std::to_string(step) + ": ";
  // Determinism mode: the library's own runs between steps (checkpoints,
  // commits) still run once per real replica; a step once per virtual shard.
  const int shards = counted ? determinism_.virtual_shards : 0;
  const std::function<void(ReplicaContext&)> body =
      shards == 0 ? fn : [&](ReplicaContext& ctx) { run_shards(ctx, shards, fn); };
  try {
    if (!counted || !fault_.active() || fault_.step != step) {
      run_replicas(body);
    } else {
      run_replicas([&](ReplicaContext& ctx) {
        inject_fault(ctx, step);
        body(ctx);
      });
    }
  } catch (const Error& e) {
    if (e.message().rfind(where, 0) == 0) throw;
    throw_error(e.code(), where + e.message());
  }
}

void Strategy::apply_reduced_gradients(ReplicaContext&, Optimizer&,
                                       const std::vector<std::pair<Tensor, Variable>>&) {
  throw UnimplementedError("Optimizer::apply_reduced_gradients under " +
                           strategy_display_name(*this) +
                           ": not available here; use apply_gradients (it reduces the gradients)");
}

void Strategy::synchronize() {
  if (synchronize_devices_) synchronize_devices_();
}

void Strategy::run_between_steps(const std::function<void(ReplicaContext&)>& fn) {
  const bool was = between_steps_;
  between_steps_ = true;
  try {
    run_step(fn);
  } catch (...) {
    between_steps_ = was;
    throw;
  }
  between_steps_ = was;
}

void Strategy::inject_fault(ReplicaContext& ctx, int64_t step) {
  if (!fault_.fires(ctx.replica_id(), step)) return;
  const std::string who =
      "rank " + std::to_string(fault_.rank) + " at step " + std::to_string(step);
  logger().error("injected fault: " + std::string(fault_kind_name(fault_.kind)) + " on " + who);
  switch (fault_.kind) {
    case FaultKind::kThrow:
      throw InternalError("injected fault: " + who + " throws");
    case FaultKind::kExit:
      std::_Exit(fault_.exit_code);
    case FaultKind::kStall:
      // Stuck for good, like a hung device: never returns. Parked, so the
      // strategy abandons this thread as soon as its peers fail, and nothing
      // it read before is raced by the frees that follow (see ThreadPool).
      ThreadPool::park_forever();
    case FaultKind::kCorrupt:
    case FaultKind::kOversize:
      inject_corruption(ctx, step);
      return;
    case FaultKind::kNone:
      return;
  }
}

void Strategy::inject_corruption(ReplicaContext& ctx, int64_t step) {
  // The peers are entering their first collective of the step; this one's
  // element count (rank + 2) disagrees with theirs.
  Tensor t(Shape{ctx.replica_id() + 2}, DType::kFloat32);
  std::memset(t.data(), 0, t.nbytes());
  std::vector<Tensor> v{t};
  ctx.all_reduce(ReduceOp::kSum, v,
                 {"fault/corrupt(rank " + std::to_string(ctx.replica_id()) + ", step " +
                  std::to_string(step) + ")"});
}

Variable Strategy::create_variable(const std::string& name, const Shape& shape, DType dtype,
                                   const Initializer& init, const VariableOptions& options) {
  DISTSTRAT_CHECK(!name.empty(), kInvalidArgument, "create_variable: empty name");
  for (const Variable& v : variables_) {
    DISTSTRAT_CHECK(v.name() != name, kInvalidArgument, "create_variable: a variable named '",
                    echo(name), "' already exists");
  }
  if (options.synchronization == VariableSynchronization::kOnRead) {
    DISTSTRAT_CHECK(!options.trainable, kInvalidArgument, "create_variable '", echo(name),
                    "': a sync-on-read (kOnRead) variable cannot be trainable; set "
                    "VariableOptions::trainable = false (as TensorFlow requires)");
    // The parameter server keeps one copy of each variable on the PS ranks
    // and its replicas read a pulled cache: there are no per-replica copies
    // to aggregate, and replica writes would be lost at the next pull.
    DISTSTRAT_CHECK(this->name() != "parameter_server", kUnimplemented,
                    "ParameterServerStrategy: create_variable '", echo(name),
                    "': sync-on-read (kOnRead) variables are not supported (the PS holds one "
                    "copy of each variable); keep per-replica metrics in run()'s results and "
                    "combine them with Strategy::reduce");
  }
  auto impl = std::make_shared<Variable::Impl>();
  impl->name = name;
  impl->shape = shape;
  impl->dtype = dtype;
  impl->options = options;
  impl->owner = this;
  impl->creation_index = static_cast<int64_t>(variables_.size());
  place_variable(*impl, init ? init : Initializer(init::Zeros{}));
  for (const Tensor& copy : impl->copies) placement_.record("variable", name, copy.device());
  variables_.emplace_back(impl);
  logger_.debug("created variable '", name, "' ", dtype_name(dtype), shape.to_string(), " on ",
                impl->copies.size(), " cop", impl->copies.size() == 1 ? "y" : "ies");
  return variables_.back();
}

Variable Strategy::variable(const std::string& name) const {
  for (const Variable& v : variables_) {
    if (v.name() == name) return v;
  }
  throw NotFoundError("no variable named '" + echo(name) + "' in this " + this->name() +
                      " strategy");
}

namespace {
void check_tensors(const std::string& what, const PerReplica<Tensor>& values) {
  for (size_t i = 0; i < values.size(); ++i) {
    DISTSTRAT_CHECK(values[i].defined(), kInvalidArgument, what, ": the value of replica ", i,
                    " is an undefined tensor");
  }
}

std::string op_text(const char* call, ReduceOp op) {
  return std::string(call) + " " + reduce_op_name(op);
}
}  // namespace

double Strategy::reduce_across(ReduceOp op, const std::vector<double>& local) {
  DISTSTRAT_CHECK(!local.empty(), kInvalidArgument, "reduce of no values");
  double acc = local[0];
  for (size_t i = 1; i < local.size(); ++i) {
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kMean:
        acc += local[i];
        break;
      case ReduceOp::kProduct:
        acc *= local[i];
        break;
      case ReduceOp::kMin:
        acc = std::min(acc, local[i]);
        break;
      case ReduceOp::kMax:
        acc = std::max(acc, local[i]);
        break;
    }
  }
  if (op == ReduceOp::kMean) acc /= num_replicas_in_sync();
  return acc;
}

double Strategy::reduce(ReduceOp op, const PerReplica<double>& values) {
  check_value_count(op_text("reduce", op), values.size());
  if (determinism_.enabled()) return reduce_shard_values(op, values.values());
  return reduce_across(op, values.values());
}

float Strategy::reduce(ReduceOp op, const PerReplica<float>& values) {
  check_value_count(op_text("reduce", op), values.size());
  std::vector<double> d(values.begin(), values.end());
  if (determinism_.enabled()) return static_cast<float>(reduce_shard_values(op, d));
  return static_cast<float>(reduce_across(op, d));
}

Tensor Strategy::reduce_tensors_across(ReduceOp op, const std::vector<Tensor>& local) {
  DISTSTRAT_CHECK(!local.empty(), kInvalidArgument, "reduce of no tensors");
  std::vector<const void*> srcs;
  for (const Tensor& t : local) {
    DISTSTRAT_CHECK(t.shape() == local[0].shape() && t.dtype() == local[0].dtype(),
                    kInvalidArgument, "reduce: replica tensors differ: ", t.debug_string(), " vs ",
                    local[0].debug_string());
    srcs.push_back(t.data());
  }
  Tensor out(local[0].shape(), local[0].dtype());
  kernels::reduce(out.data(), srcs.data(), static_cast<int>(srcs.size()),
                  static_cast<size_t>(out.num_elements()), out.dtype(), op, num_replicas_in_sync());
  return out;
}

Tensor Strategy::reduce(ReduceOp op, const PerReplica<Tensor>& values) {
  check_value_count(op_text("reduce", op), values.size());
  check_tensors(op_text("reduce", op), values);
  if (determinism_.enabled()) return reduce_shard_tensors(op, values.values());
  return reduce_tensors_across(op, values.values());
}

int64_t Strategy::reduce(ReduceOp op, const PerReplica<int64_t>& values) {
  const std::string what = op_text("reduce", op) + " of PerReplica<int64_t>";
  check_value_count(what, values.size());
  DISTSTRAT_CHECK(values.size() > 0, kInvalidArgument, "reduce of no values");
  if (determinism_.enabled()) return reduce_shard_ints(op, values.values());
  if (op == ReduceOp::kProduct) {
    // Exact as well: every value is gathered (one int64 per replica) and
    // multiplied here with overflow checks, the same on every worker.
    std::vector<Tensor> local;
    for (int64_t v : values) {
      Tensor t(Shape{1}, DType::kInt64);
      t.data<int64_t>()[0] = v;
      local.push_back(t);
    }
    const Tensor all = gather_across(local);
    const int64_t* x = all.data<int64_t>();
    const int64_t n = all.num_elements();
    for (int64_t i = 0; i < n; ++i) {
      if (x[i] == 0) return 0;  // zero whatever the other factors are
    }
    int64_t product = 1;
    for (int64_t i = 0; i < n; ++i) {
      DISTSTRAT_CHECK(!__builtin_mul_overflow(product, x[i], &product), kInvalidArgument, what,
                      " over ", n, " replicas: the int64 product overflows (reduce doubles)");
    }
    return product;
  }
  if (op != ReduceOp::kSum && op != ReduceOp::kMean) {
    return reduce_tensors_across(op, scalar_tensors(values)).data<int64_t>()[0];
  }
  // Exact at any magnitude, over every worker: each value travels as a high
  // half (v >> 32, in [-2^31, 2^31)) and a low half (v & 0xffffffff, in
  // [0, 2^32)), whose int64 sums cannot overflow below 2^31 replicas; the
  // total is rebuilt in 128 bits.
  std::vector<Tensor> local;
  for (int64_t v : values) {
    Tensor t(Shape{2}, DType::kInt64);
    t.data<int64_t>()[0] = v >> 32;
    t.data<int64_t>()[1] = static_cast<int64_t>(static_cast<uint64_t>(v) & 0xffffffffu);
    local.push_back(t);
  }
  const Tensor parts = reduce_tensors_across(ReduceOp::kSum, local);
  const __int128 total = static_cast<__int128>(parts.data<int64_t>()[0]) * (__int128(1) << 32) +
                         static_cast<__int128>(parts.data<int64_t>()[1]);
  if (op == ReduceOp::kMean) {
    // The mean of int64 values is an int64; / truncates toward zero.
    return static_cast<int64_t>(total / num_replicas_in_sync());
  }
  DISTSTRAT_CHECK(
      total >= std::numeric_limits<int64_t>::min() && total <= std::numeric_limits<int64_t>::max(),
      kInvalidArgument, what, " over ", num_replicas_in_sync(),
      " replicas: the int64 sum overflows (use kMean, or reduce doubles)");
  return static_cast<int64_t>(total);
}

namespace {
// Reduces `t` over dimension `axis` with `op` (kMean: the sum; the caller
// divides), in host memory.
Tensor reduce_along(const Tensor& t, int axis, ReduceOp op) {
  const std::vector<int64_t>& dims = t.shape().dims();
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < axis; ++d) outer *= dims[d];
  for (size_t d = static_cast<size_t>(axis) + 1; d < dims.size(); ++d) inner *= dims[d];
  const int64_t len = dims[static_cast<size_t>(axis)];
  std::vector<int64_t> out_dims;
  for (size_t d = 0; d < dims.size(); ++d) {
    if (static_cast<int>(d) != axis) out_dims.push_back(dims[d]);
  }
  Tensor out{Shape(out_dims), t.dtype()};
  if (len == 0) {
    // Only a sum or a product has a value over no elements.
    if (op == ReduceOp::kProduct)
      init::Constant{1.0}(out);
    else
      out.zero();
    return out;
  }
  const size_t es = dtype_size(t.dtype());
  const char* src = static_cast<const char*>(t.data());
  char* dst = static_cast<char*>(out.data());
  const ReduceOp acc = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  for (int64_t o = 0; o < outer; ++o) {
    char* d = dst + static_cast<size_t>(o * inner) * es;
    const char* row = src + static_cast<size_t>(o * len * inner) * es;
    if (inner) std::memcpy(d, row, static_cast<size_t>(inner) * es);
    for (int64_t a = 1; a < len; ++a) {
      kernels::accumulate(d, row + static_cast<size_t>(a * inner) * es, static_cast<size_t>(inner),
                          t.dtype(), acc);
    }
  }
  return out;
}
}  // namespace

Tensor Strategy::reduce(ReduceOp op, const PerReplica<Tensor>& values, int axis) {
  const std::string what = op_text("reduce", op) + " along axis " + std::to_string(axis);
  check_value_count(what, values.size());
  check_tensors(what, values);
  DISTSTRAT_CHECK(!determinism_.enabled(), kUnimplemented, what,
                  " in determinism mode (reduce each shard's value along the axis in the step "
                  "function, then Strategy::reduce without an axis)");
  DISTSTRAT_CHECK(values.size() > 0, kInvalidArgument, "reduce of no tensors");
  const int rank = static_cast<int>(values[0].shape().rank());
  for (size_t i = 1; i < values.size(); ++i) {
    const Shape& s0 = values[0].shape();
    const Shape& si = values[i].shape();
    // Axis 0 gathers (dimension 0 may differ); other axes need equal shapes.
    bool same = si.rank() == s0.rank() && values[i].dtype() == values[0].dtype();
    for (size_t d = 0; same && d < s0.rank(); ++d) {
      same = si[d] == s0[d] || (d == 0 && (axis == 0 || axis == -rank));
    }
    DISTSTRAT_CHECK(same, kInvalidArgument, what, ": the value of replica ", i, " ",
                    values[i].debug_string(), " does not match replica 0's ",
                    values[0].debug_string());
  }
  DISTSTRAT_CHECK(-rank <= axis && axis < rank, kInvalidArgument, "reduce along axis ", axis,
                  " of ", values[0].debug_string(), ": the axis must lie in [", -rank, ", ", rank,
                  ")");
  const int a = axis < 0 ? axis + rank : axis;
  // Axis 0: every row of every replica, gathered (rows may differ per
  // replica). Another axis: equal shapes, reduced over the replicas first
  // (the two reductions commute elementwise).
  const ReduceOp across = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  const Tensor combined =
      a == 0 ? gather_across(values.values()) : reduce_tensors_across(across, values.values());
  const int64_t len = combined.shape()[static_cast<size_t>(a)];
  const int64_t elements = a == 0 ? len : len * num_replicas_in_sync();
  DISTSTRAT_CHECK(elements > 0 || op == ReduceOp::kSum || op == ReduceOp::kProduct,
                  kInvalidArgument, "reduce ", reduce_op_name(op), " along axis ", axis, " of ",
                  values[0].debug_string(), ": no elements to reduce");
  Tensor out = reduce_along(combined, a, op);
  if (op == ReduceOp::kMean) {
    DISTSTRAT_CHECK_LE(elements, static_cast<int64_t>(std::numeric_limits<int>::max()),
                       "reduce kMean: elements along the axis");
    kernels::scale_mean(out.data(), static_cast<size_t>(out.num_elements()), out.dtype(),
                        static_cast<int>(elements));
  }
  return out;
}

Tensor Strategy::gather_across(const std::vector<Tensor>& local) {
  DISTSTRAT_CHECK(!local.empty(), kInvalidArgument, "gather of no tensors");
  std::vector<int64_t> dims = local[0].shape().dims();
  DISTSTRAT_CHECK(!dims.empty(), kInvalidArgument, "gather of scalars: use reduce");
  int64_t rows = 0;
  for (const Tensor& t : local) {
    std::vector<int64_t> d = t.shape().dims();
    DISTSTRAT_CHECK(d.size() == dims.size() &&
                        std::equal(d.begin() + 1, d.end(), dims.begin() + 1) &&
                        t.dtype() == local[0].dtype(),
                    kInvalidArgument, "gather: ", t.debug_string(), " does not stack with ",
                    local[0].debug_string());
    rows += d[0];
  }
  dims[0] = rows;
  Tensor out(Shape(dims), local[0].dtype());
  char* p = static_cast<char*>(out.data());
  for (const Tensor& t : local) {
    if (t.nbytes()) std::memcpy(p, t.data(), t.nbytes());
    p += t.nbytes();
  }
  return out;
}

Strategy::Strategy(LogLevel log_level, std::string log_prefix)
    : logger_(log_level, std::move(log_prefix)), fault_(FaultInjection::from_env()) {
  env::warn_unknown_variables_once(logger_);
  // A bad DISTSTRAT_CPU is a set-up error of every strategy, not the first
  // step's (the variant itself is decided once per process).
  cpu::isa_from_env();
  cpu_isa();
}

Tensor Strategy::gather(const PerReplica<Tensor>& values) {
  check_value_count("gather", values.size());
  check_tensors("gather", values);
  DISTSTRAT_CHECK(!determinism_.enabled(), kUnimplemented,
                  "gather in determinism mode (not built yet: docs/determinism.md)");
  return gather_across(values.values());
}

void Strategy::broadcast(Tensor&, int, const std::string&) {}
void Strategy::barrier(const std::string&) {}

void Strategy::update(Variable& var, const std::function<void(Tensor&)>& fn) {
  for (Tensor& copy : var.impl().copies) fn(copy);
}

Tensor Strategy::read_variable(const Variable::Impl& var, const ReplicaContext& ctx) const {
  if (var.copies.size() == 1) return var.copies[0];
  const size_t i = static_cast<size_t>(ctx.local_replica_id());
  DISTSTRAT_CHECK_LT(i, var.copies.size(),
                     "read of variable '" + echo(var.name) + "': local replica");
  return var.copies[i];
}

Tensor Strategy::variable_value(const Variable::Impl& var) const {
  if (var.options.synchronization == VariableSynchronization::kOnRead) {
    return const_cast<Strategy*>(this)->on_read_value(var);
  }
  return var.copies.at(0).clone();
}

Tensor Strategy::on_read_value(const Variable::Impl& var) {
  DISTSTRAT_CHECK(!var.copies.empty(), kFailedPrecondition, "value of variable '", echo(var.name),
                  "': it has no copies on this process");
  switch (var.options.aggregation) {
    case VariableAggregation::kSum:
      return reduce_tensors_across(ReduceOp::kSum, var.copies);
    case VariableAggregation::kMean:
      return reduce_tensors_across(ReduceOp::kMean, var.copies);
    case VariableAggregation::kNone:
    case VariableAggregation::kOnlyFirstReplica:
      break;
  }
  // Global replica 0's copy: the process that holds it contributes it, every
  // other one zeros, and the sum over processes is that copy exactly (a
  // host copy of it with one process).
  if (first_local_replica() == 0) return reduce_tensors_across(ReduceOp::kSum, {var.copies[0]});
  Tensor zeros(var.shape, var.dtype);
  zeros.zero();
  return reduce_tensors_across(ReduceOp::kSum, {zeros});
}

void Strategy::on_read_assign(Variable& var, const Tensor& value) {
  const Variable::Impl& v = var.impl();
  DISTSTRAT_CHECK(value.shape() == v.shape && value.dtype() == v.dtype, kInvalidArgument,
                  "assign to variable '", echo(v.name), "' ", dtype_name(v.dtype),
                  v.shape.to_string(), " from ", value.debug_string());
  if (v.options.aggregation != VariableAggregation::kSum) {
    // The mean of equal copies, and the first copy, are the value itself.
    assign_variable(var.impl(), value);
    return;
  }
  // A sum: global replica 0 holds the value, every other replica zero.
  Tensor zeros(v.shape, v.dtype);
  zeros.zero();
  const Tensor* first = first_local_replica() == 0 ? &v.copies.at(0) : nullptr;
  update(var, [&](Tensor& copy) { copy.copy_from(&copy == first ? value : zeros); });
}

void Strategy::assign_variable(Variable::Impl& var, const Tensor& value) {
  DISTSTRAT_CHECK(value.shape() == var.shape && value.dtype() == var.dtype, kInvalidArgument,
                  "assign to variable '", echo(var.name), "' ", dtype_name(var.dtype),
                  var.shape.to_string(), " from ", value.debug_string());
  for (Tensor& c : var.copies) c.copy_from(value);
}

}  // namespace diststrat
