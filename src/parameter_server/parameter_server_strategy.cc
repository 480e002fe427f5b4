// ParameterServerStrategy on a worker: its variables (placed on the PS
// ranks, read from the pulled cache, assigned through the PS ranks) and the
// step protocol (pull before a step, push after it, prefetch the next pull
// right behind the push; row-sparse gathers and pushes), and the reductions
// over this worker's replicas. Set-up and roles are strategy_setup.cc, the
// calls that coordinate the workers strategy_coordination.cc, the worker
// runtime worker.{h,cc}, checkpoints strategy_checkpoint.cc; the PS side
// service*.cc; the wire protocol wire.h.

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "runtime/variable_impl.h"
#include "allreduce/reduce_kernels.h"
#include "diststrat/optimizer.h"
#include "runtime/local_replicas.h"
#include "parameter_server/client.h"
#include "parameter_server/messages.h"
#include "parameter_server/worker.h"
#include "parameter_server/shard_updater.h"

namespace diststrat {

void ParameterServerStrategy::place_variable(Variable::Impl& var, const Initializer& init) {
  Impl& m = *impl_;
  m.require_worker("create_variable");
  std::lock_guard<std::mutex> lock(m.mu);
  auto vi = std::make_unique<Impl::VarInfo>();
  vi->id = var.creation_index;
  vi->var = &var;
  vi->row_sparse = m.creating_row_sparse;
  DISTSTRAT_CHECK(!vi->row_sparse || var.shape.rank() >= 1, kInvalidArgument,
                  "row-sparse variable '", var.name, "' needs at least one dimension");
  const int64_t rows = var.shape.rank() == 0 ? 1 : var.shape[0];
  vi->row_bytes =
      dtype_size(var.dtype) * static_cast<size_t>(rows ? var.shape.num_elements() / rows : 0);
  if (var.shape.rank() == 0) vi->row_bytes = dtype_size(var.dtype);
  int64_t n = 1;
  if (var.shape.rank() >= 1 && m.options.partitioner) {
    n = m.options.partitioner(var.shape, var.dtype);
    DISTSTRAT_CHECK(n >= 1 && n <= std::max<int64_t>(1, rows), kInvalidArgument,
                    "partitioner split '", var.name, "' ", var.shape.to_string(), " into ", n,
                    " shards");
  }
  for (const auto& [offset, count] : shard_rows(rows, n)) {
    Impl::ShardPlace sp;
    sp.ps = static_cast<int>(m.next_ps++ % static_cast<int64_t>(m.ps_ranks.size()));
    sp.index = static_cast<int64_t>(vi->shards.size());
    sp.offset = offset;
    sp.rows = count;
    vi->shards.push_back(sp);
  }
  // The chief initializes and sends the value; the others only declare the
  // variable and wait until the chief's value is there.
  Tensor value;
  if (!vi->row_sparse) {
    var.copies.emplace_back(var.shape, var.dtype);
    init(var.copies[0]);
    value = var.copies[0];
  } else if (m.chief()) {
    value = Tensor(var.shape, var.dtype);
    init(value);
  }
  auto owner = std::make_shared<Tensor>(value);
  std::vector<ps::Client::CallPtr> calls;
  for (const Impl::ShardPlace& sp : vi->shards) {
    ps::CreateRequest req;
    req.var_id = vi->id;
    req.name = var.name;
    req.dtype = static_cast<int32_t>(var.dtype);
    req.full_shape = var.shape;
    req.shard_index = sp.index;
    req.num_shards = n;
    req.row_offset = sp.offset;
    req.rows = sp.rows;
    req.has_value = m.chief();
    const size_t bytes = m.chief() ? static_cast<size_t>(sp.rows) * vi->row_bytes : 0;
    const char* data =
        m.chief() ? static_cast<const char*>(value.data()) + sp.offset * vi->row_bytes : nullptr;
    calls.push_back(m.client->post(sp.ps, ps::Op::kCreate, ps::encode(req), owner, data, bytes,
                                   nullptr, 0, "create of '" + var.name + "'"));
  }
  m.wait_all(calls);
  m.info_of[&var] = vi.get();
  m.vars.push_back(std::move(vi));
}

Variable ParameterServerStrategy::create_row_sparse_variable(const std::string& name,
                                                             const Shape& shape, DType dtype,
                                                             const Initializer& init,
                                                             const VariableOptions& options) {
  impl_->creating_row_sparse = true;
  try {
    Variable v = create_variable(name, shape, dtype, init, options);
    impl_->creating_row_sparse = false;
    return v;
  } catch (...) {
    impl_->creating_row_sparse = false;
    throw;
  }
}

void ParameterServerStrategy::inject_corruption(ReplicaContext&, int64_t) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);  // guards the client
  if (fault_injection().kind == FaultKind::kOversize) {
    m.client->oversize_next_push();
  } else {
    m.client->corrupt_next_push();
  }
}

void ParameterServerStrategy::run_replicas(const std::function<void(ReplicaContext&)>& fn) {
  Impl& m = *impl_;
  m.require_worker("run");
  const auto t0 = Clock::now();
  {
    std::lock_guard<std::mutex> lock(m.mu);
    // An earlier push's rejection is reported first; a failed pull is not
    // kept, so the next run pulls afresh.
    std::exception_ptr earlier = m.client->take_deferred();
    try {
      if (m.pull_calls.empty()) m.post_dense_pull();
      m.finish_dense_pull();
    } catch (...) {
      m.pull_calls.clear();
      if (!earlier) earlier = m.client->take_deferred();  // completed by the wait
      if (!earlier) throw;
    }
    if (!earlier) earlier = m.client->take_deferred();
    if (earlier) std::rethrow_exception(earlier);
  }
  const auto t1 = Clock::now();
  try {
    m.in_step = true;
    m.replicas->run(fn);
    m.in_step = false;
  } catch (...) {
    m.in_step = false;
    std::lock_guard<std::mutex> lock(m.staged_mu);
    m.staged.clear();
    throw;
  }
  const auto t2 = Clock::now();
  if (m.before_push) {
    try {
      m.before_push();
    } catch (...) {
      std::lock_guard<std::mutex> lock(m.staged_mu);
      m.staged.clear();
      throw;
    }
  }
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<Impl::StagedPush> staged;
  {
    std::lock_guard<std::mutex> slock(m.staged_mu);
    staged.swap(m.staged);
  }
  for (Impl::StagedPush& s : staged) m.post_push(s);
  // Prefetch: the next step's pull travels behind the push.
  if (!staged.empty()) m.post_dense_pull();
  m.client->poll();
  m.progress_cv.notify_all();
  ++m.runs;
  m.pull_wait_s += std::chrono::duration<double>(t1 - t0).count();
  m.replicas_s += std::chrono::duration<double>(t2 - t1).count();
  m.push_post_s += std::chrono::duration<double>(Clock::now() - t2).count();
}

void ParameterServerStrategy::apply_gradients(
    ReplicaContext& ctx, Optimizer& optimizer,
    const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) {
  apply_gradients(ctx, optimizer, grads_and_vars, {});
}

void ParameterServerStrategy::apply_gradients(
    ReplicaContext& ctx, Optimizer& optimizer,
    const std::vector<std::pair<Tensor, Variable>>& grads_and_vars,
    const std::vector<SparseGradient>& sparse) {
  Impl& m = *impl_;
  const ps::OptimizerConfig config = ps::describe_optimizer(optimizer);
  std::vector<Tensor> grads;
  std::vector<std::string> names;
  for (const auto& [g, v] : grads_and_vars) {
    const Impl::VarInfo& vi = m.info(v.impl());
    DISTSTRAT_CHECK(!vi.row_sparse, kInvalidArgument, "apply_gradients: variable '", v.name(),
                    "' is row-sparse: pass its gradient as a SparseGradient");
    DISTSTRAT_CHECK(g.shape() == v.shape() && g.dtype() == v.dtype(), kInvalidArgument,
                    "apply_gradients: gradient ", g.debug_string(), " does not match variable '",
                    v.name(), "' ", dtype_name(v.dtype()), v.shape().to_string());
    grads.push_back(g);
    names.push_back(v.name() + "/grad");
  }
  for (const SparseGradient& s : sparse) {
    const Impl::VarInfo& vi = m.info(s.variable.impl());
    DISTSTRAT_CHECK(vi.row_sparse, kInvalidArgument, "apply_gradients: variable '",
                    s.variable.name(), "' is not row-sparse: pass a dense gradient");
    DISTSTRAT_CHECK(s.values.defined() && s.values.dtype() == DType::kFloat32, kInvalidArgument,
                    "apply_gradients: row gradient of '", s.variable.name(),
                    "' must be float32, got ",
                    s.values.defined() ? s.values.debug_string() : "an undefined tensor");
    std::vector<int64_t> want = s.variable.shape().dims();
    want[0] = s.ids.defined() && s.ids.shape().rank() == 1 ? s.ids.shape()[0] : -1;
    DISTSTRAT_CHECK(s.values.shape().dims() == want, kInvalidArgument,
                    "apply_gradients: row gradient ", s.values.debug_string(), " of '",
                    s.variable.name(), "' does not match ", want[0], " ids of rows ",
                    s.variable.shape().to_string());
  }
  // Inside the worker, replicas are synchronous: dense gradients are summed
  // over the local replicas, row gradients concatenated.
  const bool local_many = m.replicas->size() > 1;
  if (local_many && !grads.empty()) {
    for (Tensor& g : grads) g = g.clone();
    ctx.all_reduce(ReduceOp::kSum, grads, names);  // on the GPUs for GPU replicas
  }
  for (Tensor& g : grads) stage_to_host(g);     // pushed from host memory
  std::vector<std::pair<Tensor, Tensor>> rows;  // (ids, values) per sparse gradient
  for (const SparseGradient& s : sparse) {
    if (local_many) {
      rows.emplace_back(ctx.all_gather(s.ids, s.variable.name() + "/ids"),
                        ctx.all_gather(s.values, s.variable.name() + "/rows"));
    } else {
      rows.emplace_back(s.ids, s.values);
    }
    stage_to_host(rows.back().first);
    stage_to_host(rows.back().second);
  }
  ctx.merge_call([&](Strategy&) {
    Impl::StagedPush push;
    push.config = config;
    push.iterations = &m.info(optimizer.iterations().impl());
    for (size_t k = 0; k < grads.size(); ++k) {
      push.dense.emplace_back(&m.info(grads_and_vars[k].second.impl()),
                              local_many ? grads[k] : grads[k].clone());
    }
    for (size_t k = 0; k < sparse.size(); ++k) {
      const Impl::VarInfo& vi = m.info(sparse[k].variable.impl());
      const std::vector<int64_t> ids = m.checked_ids(vi, rows[k].first, "push");
      // Sum duplicate ids so each row is updated once.
      std::unordered_map<int64_t, size_t> first;
      Impl::StagedPush::Rows r{&vi, {}, {}};
      const int64_t re =
          rows[k].second.shape().num_elements() / std::max<int64_t>(1, rows[k].second.shape()[0]);
      std::vector<float> acc;
      const float* src = rows[k].second.data<float>();
      for (size_t i = 0; i < ids.size(); ++i) {
        auto [it, fresh] = first.emplace(ids[i], r.ids.size());
        if (fresh) {
          r.ids.push_back(ids[i]);
          acc.insert(acc.end(), src + i * re, src + (i + 1) * re);
        } else {
          float* dst = acc.data() + it->second * re;
          for (int64_t j = 0; j < re; ++j) dst[j] += src[i * re + j];
        }
      }
      std::vector<int64_t> d = sparse[k].variable.shape().dims();
      d[0] = static_cast<int64_t>(r.ids.size());
      r.values = Tensor(Shape(d), DType::kFloat32);
      if (!acc.empty()) std::memcpy(r.values.data(), acc.data(), acc.size() * sizeof(float));
      push.sparse.push_back(std::move(r));
    }
    std::lock_guard<std::mutex> lock(m.staged_mu);
    m.staged.push_back(std::move(push));
  });
}

Tensor ParameterServerStrategy::gather_rows(const Variable& var, const Tensor& ids) {
  Impl& m = *impl_;
  m.require_worker("gather_rows");
  std::lock_guard<std::mutex> lock(m.mu);
  const Impl::VarInfo& vi = m.info(var.impl());
  const std::vector<int64_t> id = m.checked_ids(vi, ids, "gather_rows");
  std::vector<int64_t> dims = var.shape().dims();
  dims[0] = static_cast<int64_t>(id.size());
  Tensor out{Shape(dims), var.dtype()};
  // Route each id to its shard; one pull per PS with one entry per shard.
  struct Part {
    std::vector<ps::Entry> entries;
    std::vector<int64_t> ids;
    std::vector<size_t> positions;  // where each returned row goes
    std::vector<char> buffer;
  };
  std::vector<Part> parts(m.ps_ranks.size());
  for (const Impl::ShardPlace& sp : vi.shards) {
    ps::Entry e = Impl::entry_of(vi, sp);
    e.sparse = 1;
    Part& part = parts[sp.ps];
    for (size_t k = 0; k < id.size(); ++k) {
      if (id[k] < sp.offset || id[k] >= sp.offset + sp.rows) continue;
      part.ids.push_back(id[k]);
      part.positions.push_back(k);
      ++e.num_ids;
    }
    if (e.num_ids) part.entries.push_back(e);
  }
  std::vector<ps::Client::CallPtr> calls;
  for (size_t p = 0; p < parts.size(); ++p) {
    Part& part = parts[p];
    if (part.entries.empty()) continue;
    ps::PullRequest req;
    req.entries = part.entries;
    part.buffer.resize(part.ids.size() * vi.row_bytes);
    calls.push_back(m.client->post(static_cast<int>(p), ps::Op::kPull, ps::encode(req), nullptr,
                                   part.ids.data(), part.ids.size() * sizeof(int64_t),
                                   part.buffer.data(), part.buffer.size(),
                                   "gather_rows of '" + var.name() + "'"));
  }
  m.wait_all(calls);
  char* dst = static_cast<char*>(out.data());
  for (Part& part : parts) {
    for (size_t k = 0; k < part.positions.size(); ++k) {
      std::memcpy(dst + part.positions[k] * vi.row_bytes, part.buffer.data() + k * vi.row_bytes,
                  vi.row_bytes);
    }
  }
  return out;
}

Tensor ParameterServerStrategy::read_variable(const Variable::Impl& var,
                                              const ReplicaContext& ctx) const {
  const Impl::VarInfo& vi = impl_->info(var);
  DISTSTRAT_CHECK(!vi.row_sparse, kFailedPrecondition, "read of row-sparse variable '", var.name,
                  "': it is not pulled whole; use gather_rows");
  return read_on_replica_device(var.copies[0], ctx.device());
}

Tensor ParameterServerStrategy::variable_value(const Variable::Impl& var) const {
  Impl& m = *impl_;
  m.require_worker("value");
  std::lock_guard<std::mutex> lock(m.mu);
  return m.pull_whole(m.info(var));
}

void ParameterServerStrategy::assign_variable(Variable::Impl& var, const Tensor& value) {
  Impl& m = *impl_;
  m.require_worker("assign");
  DISTSTRAT_CHECK(value.shape() == var.shape && value.dtype() == var.dtype, kInvalidArgument,
                  "assign to variable '", var.name, "' ", dtype_name(var.dtype),
                  var.shape.to_string(), " from ", value.debug_string());
  std::lock_guard<std::mutex> lock(m.mu);
  const Impl::VarInfo& vi = m.info(var);
  auto owner = std::make_shared<Tensor>(value.clone());
  std::vector<ps::Client::CallPtr> calls;
  for (const Impl::ShardPlace& sp : vi.shards) {
    ps::Entry e = Impl::entry_of(vi, sp);
    e.shape = Impl::shard_shape(vi, sp);
    ps::AssignRequest req;
    req.entries.push_back(e);
    calls.push_back(m.client->post(
        sp.ps, ps::Op::kAssign, ps::encode(req), owner,
        static_cast<const char*>(owner->data()) + sp.offset * vi.row_bytes,
        static_cast<size_t>(sp.rows) * vi.row_bytes, nullptr, 0, "assign to '" + var.name + "'"));
  }
  m.wait_all(calls);
  if (!vi.row_sparse) var.copies[0].copy_from(value);
  m.discard_dense_pull();  // the next run pulls what we just wrote
}

void ParameterServerStrategy::update(Variable& var, const std::function<void(Tensor&)>& fn) {
  Tensor v = var.value();
  fn(v);
  var.assign(v);
}

Tensor ParameterServerStrategy::reduce_tensors_across(ReduceOp op,
                                                      const std::vector<Tensor>& local) {
  impl_->require_worker("reduce");
  // As reduce_across: this worker's replicas, so kMean divides by their
  // number (the base class divides by every worker's replicas).
  const std::vector<Tensor> host = impl_->replicas->to_host(local);
  if (op != ReduceOp::kMean) return Strategy::reduce_tensors_across(op, host);
  Tensor out = Strategy::reduce_tensors_across(ReduceOp::kSum, host);
  kernels::scale_mean(out.data(), static_cast<size_t>(out.num_elements()), out.dtype(),
                      static_cast<int>(host.size()));
  return out;
}

Tensor ParameterServerStrategy::gather_across(const std::vector<Tensor>& local) {
  impl_->require_worker("gather");
  return Strategy::gather_across(impl_->replicas->to_host(local));
}

double ParameterServerStrategy::reduce_across(ReduceOp op, const std::vector<double>& local) {
  // Workers never meet: reduce over this worker's replicas only.
  if (op != ReduceOp::kMean) return Strategy::reduce_across(op, local);
  return Strategy::reduce_across(ReduceOp::kSum, local) / static_cast<double>(local.size());
}

}  // namespace diststrat
