// MultiWorkerMirroredStrategy::apply_gradients: the gradients all-reduced
// in one fused call (in reverse creation order, the order backprop makes
// them) and applied to every local copy, or, with shard_optimizer_state,
// ZeRO-1 through the fusion engine's reduce_scatter / all_gather.
#include <algorithm>
#include <sstream>

#include "runtime/variable_impl.h"
#include "core/fnv1a.h"
#include "diststrat/optimizer.h"
#include "multiworker/multi_worker_impl.h"

namespace diststrat {

namespace {
using Clock = Timeline::Clock;
}  // namespace

void MultiWorkerMirroredStrategy::apply_gradients(
    ReplicaContext& ctx, Optimizer& optimizer,
    const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) {
  Impl& m = *impl_;
  const int local = ctx.local_replica_id();
  if (m.options.shard_optimizer_state) {
    // ZeRO-1 through the fusion engine (Optimizer::apply_sharded). The
    // flat vector's layout (the variables in creation order, their names and
    // sizes) is in the collective's name, which the call signature checks:
    // workers passing other variables of the same total size (or creating
    // them in another order) fail alike instead of mixing their state.
    std::vector<const Variable*> layout;
    for (const auto& gv : grads_and_vars) layout.push_back(&gv.second);
    std::stable_sort(layout.begin(), layout.end(), [](const Variable* a, const Variable* b) {
      return a->impl().creation_index < b->impl().creation_index;
    });
    Fnv1a h;
    for (const Variable* v : layout) {
      h.text(v->name());
      h.value<int64_t>(v->shape().num_elements());
    }
    std::ostringstream what;
    what << "sharded gradients of " << layout.size() << " variable(s)";
    if (!layout.empty())
      what << " '" << layout.front()->name() << "'..'" << layout.back()->name() << "'";
    what << " (layout " << std::hex << h.get() << ")";
    const std::string scatter_name = what.str();
    ShardedCollectives c;
    // GPU replicas' buffers go through NCCL when the strategy has it
    // (device_reduction.h), else they are staged through the host, as their
    // all-reduce is.
    const auto on_device = [&](const Tensor& in, const Tensor& out) {
      return m.device && in.device() == ctx.device() && out.device() == ctx.device();
    };
    const auto staged = [&](const Tensor& in, Tensor& out,
                            const std::function<void(const Tensor&, Tensor&)>& op) {
      if (in.device().is_cpu() && out.device().is_cpu()) {
        op(in, out);
        return;
      }
      Tensor host_in(in.shape(), in.dtype()), host_out(out.shape(), out.dtype());
      host_in.copy_from(in);
      op(host_in, host_out);
      out.copy_from(host_out);
    };
    c.reduce_scatter = [&](const Tensor& in, Tensor& out) {
      if (on_device(in, out)) {
        m.device
            ->reduce_scatter_async(*m.engine, ReduceOp::kSum, in, out, scatter_name, ctx.stream())
            .wait();
        return;
      }
      staged(in, out, [&](const Tensor& i, Tensor& o) {
        m.engine->reduce_scatter_async(local, ReduceOp::kSum, i, o, scatter_name).wait();
      });
    };
    c.all_gather = [&](const Tensor& in, Tensor& out) {
      if (on_device(in, out)) {
        m.device->all_gather_async(*m.engine, in, out, "sharded variables", ctx.stream()).wait();
        return;
      }
      staged(in, out, [&](const Tensor& i, Tensor& o) {
        m.engine->all_gather_async(local, i, o, "sharded variables").wait();
      });
    };
    c.sum = [&](double v) {
      Tensor host(Shape{1}, DType::kFloat64);
      host.data<double>()[0] = v;
      // The replica's all-reduce takes tensors on its device.
      std::vector<Tensor> t{ctx.device().is_gpu() ? Tensor(Shape{1}, DType::kFloat64, ctx.device())
                                                  : host};
      if (ctx.device().is_gpu()) t[0].copy_from(host);
      ctx.all_reduce(ReduceOp::kSum, t, {"sharded gradient norm"});
      if (ctx.device().is_gpu()) host.copy_from(t[0]);
      return host.data<double>()[0];
    };
    optimizer.apply_sharded(ctx, grads_and_vars, c);
    return;
  }
  // Reverse creation order: the order backprop produces gradients in, so the
  // enqueue order (and the packs) is the same whatever order the caller used.
  std::vector<size_t> order(grads_and_vars.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return grads_and_vars[a].second.impl().creation_index >
           grads_and_vars[b].second.impl().creation_index;
  });
  std::vector<Tensor> grads;
  std::vector<std::string> names;
  for (size_t k : order) {
    grads.push_back(grads_and_vars[k].first);  // reduced in place, as under MirroredStrategy
    names.push_back(grads_and_vars[k].second.name() + "/grad");
  }
  const auto t0 = Clock::now();
  Work work = ctx.all_reduce_async(ReduceOp::kSum, grads, names);
  work.wait();
  update_local_copies(m, ctx, optimizer, grads_and_vars, order, grads, t0);
}

void MultiWorkerMirroredStrategy::apply_reduced_gradients(
    ReplicaContext& ctx, Optimizer& optimizer,
    const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) {
  Impl& m = *impl_;
  DISTSTRAT_CHECK(!m.options.shard_optimizer_state, kUnimplemented, "rank ", m.rank(),
                  ": apply_reduced_gradients with shard_optimizer_state (ZeRO-1 reduce-scatters "
                  "the gradients itself): use apply_gradients");
  std::vector<size_t> order(grads_and_vars.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::vector<Tensor> grads;
  for (const auto& gv : grads_and_vars) grads.push_back(gv.first);
  update_local_copies(m, ctx, optimizer, grads_and_vars, order, grads, Clock::now());
}

void update_local_copies(MultiWorkerMirroredStrategy::Impl& m, ReplicaContext& ctx,
                         Optimizer& optimizer,
                         const std::vector<std::pair<Tensor, Variable>>& grads_and_vars,
                         const std::vector<size_t>& order, const std::vector<Tensor>& grads,
                         Timeline::Clock::time_point t0) {
  const int local = ctx.local_replica_id();
  const auto t1 = Clock::now();
  Tensor iterations = optimizer.iterations().read(ctx);
  const int64_t step = iterations.data<int64_t>()[0] + 1;
  const std::vector<std::string> slot_names = optimizer.slot_names();
  std::vector<Optimizer::TensorUpdate> updates;  // one launch on a GPU replica
  for (size_t j = 0; j < order.size(); ++j) {
    Variable::Impl& var = grads_and_vars[order[j]].second.impl();
    Optimizer::TensorUpdate u{&var.copies[local], grads[j], {}};
    for (const std::string& s : slot_names) u.slots.push_back(&var.slot(s)[local]);
    updates.push_back(std::move(u));
  }
  optimizer.update_tensors(updates, step);
  iterations.data<int64_t>()[0] = step;
  if (m.timeline) {
    m.timeline->complete("wait for gradients", "replica", 1 + local, t0, t1);
    m.timeline->complete("apply", "replica", 1 + local, t1, Clock::now());
  }
}

}  // namespace diststrat
