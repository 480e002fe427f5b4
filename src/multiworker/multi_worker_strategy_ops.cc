// MultiWorkerMirroredStrategy's Strategy overrides: running a step on the
// local replicas, placing and updating variables (the chief's initial value
// for everyone), and the cross-worker collectives of cross-replica context
// (broadcast, barrier, reduce, gather), each run on the fusion engine's
// thread.
#include <algorithm>
#include <cstring>

#include "runtime/variable_impl.h"
#include "allreduce/reduce_kernels.h"
#include "core/user_text.h"
#include "multiworker/multi_worker_impl.h"

namespace diststrat {

namespace {
using Clock = Timeline::Clock;
}  // namespace

Tensor MultiWorkerMirroredStrategy::Impl::cross_gather(const Tensor& local,
                                                       const std::string& name) {
  DISTSTRAT_CHECK(local.shape().rank() >= 1, kInvalidArgument, "rank ", rank(), ": gather '", name,
                  "' of a scalar: reshape to [1]");
  const int n = cross->size();
  if (n == 1) return local;
  Tensor out;
  engine->run(
      [&](Communicator& c) {
        int64_t rows = local.shape()[0];
        std::vector<int64_t> all_rows(n);
        c.all_gather(&rows, all_rows.data(), 1, DType::kInt64, name + "/rows");
        const int64_t max_rows = *std::max_element(all_rows.begin(), all_rows.end());
        int64_t row_elems = 1;
        for (size_t i = 1; i < local.shape().rank(); ++i) row_elems *= local.shape()[i];
        const size_t esz = dtype_size(local.dtype());
        const size_t padded = static_cast<size_t>(max_rows * row_elems);
        std::vector<char> mine(padded * esz), gathered(padded * esz * n);
        if (local.nbytes()) std::memcpy(mine.data(), local.data(), local.nbytes());
        c.all_gather(mine.data(), gathered.data(), padded, local.dtype(), name);
        std::vector<int64_t> dims = local.shape().dims();
        dims[0] = 0;
        for (int64_t r : all_rows) dims[0] += r;
        out = Tensor(Shape(dims), local.dtype());
        char* dst = static_cast<char*>(out.data());
        for (int r = 0; r < n; ++r) {
          const size_t bytes = static_cast<size_t>(all_rows[r] * row_elems) * esz;
          if (bytes) std::memcpy(dst, gathered.data() + r * padded * esz, bytes);
          dst += bytes;
        }
      },
      "all_gather '" + name + "'");
  return out;
}

// An elastic commit's runs (reading and writing sharded optimizer slots)
// are the strategy's own, between the user's steps.
bool MultiWorkerMirroredStrategy::run_is_step() const {
  return Strategy::run_is_step() && !(impl_->elastic && impl_->elastic->committing);
}

void MultiWorkerMirroredStrategy::run_replicas(const std::function<void(ReplicaContext&)>& fn) {
  Impl& m = *impl_;
  if (m.elastic && run_is_step()) {
    // (Internal steps, which read and write optimizer slots on the local
    // replicas, also run between groups.)
    DISTSTRAT_CHECK(m.cross, kFailedPrecondition,
                    "MultiWorkerMirroredStrategy: this elastic worker is in no group (its last "
                    "re-forming failed)");
    DISTSTRAT_CHECK(m.elastic->state_agreed || m.elastic->state != nullptr, kFailedPrecondition,
                    "MultiWorkerMirroredStrategy (elastic): a step before ElasticState::run; the "
                    "workers' variables (created without the chief's broadcast) and a LibTorch "
                    "module's values are not the group's until run() agrees on them; make the "
                    "steps inside ElasticState::run (docs/elastic.md)");
    m.before_step();
  }
  // The step the replicas' calls are made in, which the ranks' call
  // signatures compare (fusion.h); none outside a training step.
  struct StepScope {
    FusionEngine* engine;
    ~StepScope() {
      if (engine) engine->set_step(-1);
    }
  } step_scope{m.engine.get()};
  if (m.engine) m.engine->set_step(run_is_step() ? steps_run() - 1 + m.step_offset : -1);
  const auto t0 = Clock::now();
  m.replicas->run([&](ReplicaContext& inner) {
    const int l = inner.local_replica_id();
    try {
      fn(*m.contexts[l]);
    } catch (const AbortedError&) {
      throw;
    } catch (const std::exception& e) {
      // The other local replicas may be waiting on a call this one never
      // completes: fail those calls now (their wait() throws AbortedError).
      const std::string reason = "rank " + std::to_string(m.cross ? m.rank() : -1) +
                                 ": local replica " + std::to_string(l) + " failed: " + e.what();
      {
        std::lock_guard<std::mutex> lock(m.error_mu);
        if (m.last_error.empty()) m.last_error = reason;
      }
      if (m.engine) m.engine->abort_if_pending(reason);
      throw;
    }
  });
  if (m.timeline) {
    m.timeline->complete("step " + std::to_string(m.steps), "step", Impl::kStepLane, t0,
                         Clock::now());
  }
  ++m.steps;
}

void MultiWorkerMirroredStrategy::place_variable(Variable::Impl& var, const Initializer& init) {
  Tensor initial(var.shape, var.dtype);
  init(initial);
  // Worker 0 (the chief) decides the initial value for everyone. Elastic
  // workers make no collective call here (a worker that joins a running
  // group creates its variables alone): the group's state reaches every
  // worker at ElasticState::run.
  if (impl_->cross->size() > 1 && !impl_->elastic) {
    broadcast(initial, 0, var.name + "/initial value");
  }
  impl_->replicas->place_copies(var, initial);
}

std::shared_ptr<DeviceManager> MultiWorkerMirroredStrategy::device_manager() const {
  return impl_->replicas->gpus();
}

void MultiWorkerMirroredStrategy::update(Variable& var, const std::function<void(Tensor&)>& fn) {
  impl_->replicas->for_each_copy(var.impl().copies, fn);
}

Tensor MultiWorkerMirroredStrategy::variable_value(const Variable::Impl& var) const {
  const bool aggregated = var.options.synchronization == VariableSynchronization::kOnRead &&
                          var.options.aggregation != VariableAggregation::kNone &&
                          var.options.aggregation != VariableAggregation::kOnlyFirstReplica;
  if (aggregated || var.copies.empty() || var.copies[0].device().is_cpu()) {
    return Strategy::variable_value(var);  // reduce_tensors_across stages GPU copies
  }
  return impl_->replicas->to_host(var.copies[0]);
}

void MultiWorkerMirroredStrategy::assign_variable(Variable::Impl& var, const Tensor& value) {
  DISTSTRAT_CHECK(value.shape() == var.shape && value.dtype() == var.dtype, kInvalidArgument,
                  "rank ", impl_->rank(), ": assign to variable '", var.name, "' ",
                  dtype_name(var.dtype), var.shape.to_string(), " from ", value.debug_string());
  impl_->replicas->for_each_copy(var.copies, [&](Tensor& c) { c.copy_from(value); });
}

void MultiWorkerMirroredStrategy::broadcast(Tensor& t, int root_worker, const std::string& name) {
  Impl& m = *impl_;
  DISTSTRAT_CHECK(0 <= root_worker && root_worker < m.cross->size(), kInvalidArgument, "rank ",
                  m.rank(), ": broadcast '", name, "' from worker ", root_worker, " of ",
                  m.cross->size());
  if (m.cross->size() == 1) return;
  // A GPU tensor is broadcast through a host copy.
  Tensor host = t.device().is_gpu() ? m.replicas->to_host(t) : t;
  m.engine->run(
      [&](Communicator& c) {
        c.broadcast(host.data(), static_cast<size_t>(host.num_elements()), host.dtype(),
                    root_worker, name);
      },
      "broadcast '" + name + "'");
  if (t.device().is_gpu()) {
    ScopedExec scoped(m.replicas->scope(m.replicas->replica_of(t.device()), /*with_stream=*/false));
    t.copy_from(host);
  }
}

void MultiWorkerMirroredStrategy::barrier(const std::string& name) {
  impl_->engine->run([&](Communicator& c) { c.barrier(name); }, "barrier '" + echo(name) + "'");
}

double MultiWorkerMirroredStrategy::reduce_across(ReduceOp op, const std::vector<double>& local) {
  DISTSTRAT_CHECK(!local.empty(), kInvalidArgument, "reduce of no values");
  const ReduceOp sum_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  std::vector<const void*> srcs;
  for (const double& v : local) srcs.push_back(&v);
  double acc = 0;
  kernels::reduce(&acc, srcs.data(), static_cast<int>(srcs.size()), 1, DType::kFloat64, sum_op, 1);
  if (impl_->cross->size() > 1) {
    impl_->engine->run(
        [&](Communicator& c) {
          c.all_reduce(&acc, &acc, 1, DType::kFloat64, sum_op, "strategy.reduce");
        },
        "strategy.reduce");
  }
  if (op == ReduceOp::kMean) acc /= num_replicas_in_sync();
  return acc;
}

Tensor MultiWorkerMirroredStrategy::reduce_tensors_across(ReduceOp op,
                                                          const std::vector<Tensor>& local) {
  DISTSTRAT_CHECK(!local.empty(), kInvalidArgument, "reduce of no tensors");
  const ReduceOp sum_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  Tensor out = Strategy::reduce_tensors_across(sum_op, impl_->replicas->to_host(local));
  const size_t count = static_cast<size_t>(out.num_elements());
  if (impl_->cross->size() > 1) {
    impl_->engine->run(
        [&](Communicator& c) {
          c.all_reduce(out.data(), out.data(), count, out.dtype(), sum_op, "strategy.reduce");
        },
        "strategy.reduce");
  }
  if (op == ReduceOp::kMean)
    kernels::scale_mean(out.data(), count, out.dtype(), num_replicas_in_sync());
  return out;
}

Tensor MultiWorkerMirroredStrategy::gather_across(const std::vector<Tensor>& local) {
  return impl_->cross_gather(Strategy::gather_across(impl_->replicas->to_host(local)), "gather");
}

}  // namespace diststrat
