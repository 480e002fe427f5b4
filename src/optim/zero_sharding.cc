// ZeRO-1 (sharded optimizer state): Optimizer::apply_sharded and the slot
// gathering / assignment checkpoints use. The replica's buffers and slot
// blocks live where its variable copies do: host memory, or its GPU (copies
// there are enqueued on the replica's stream; the strategy's collectives work
// on the device buffers).
#include <algorithm>
#include <cstring>

#include "runtime/variable_impl.h"
#include "core/device_scope.h"
#include "core/user_text.h"
#include "optim/optimizer_state.h"

namespace diststrat {

namespace {

// dst[dst_off ..) = src[src_off ..), `count` floats, both tensors in host
// memory or on one GPU (enqueued on the scope's stream there).
void copy_floats(Tensor& dst, int64_t dst_off, const Tensor& src, int64_t src_off, int64_t count) {
  if (count <= 0) return;
  if (dst.device().is_cpu() && src.device().is_cpu()) {
    std::memcpy(dst.data<float>() + dst_off, src.data<float>() + src_off,
                static_cast<size_t>(count) * sizeof(float));
    return;
  }
  const GpuExec e = gpu_exec(dst.device(), "sharded optimizer state");
  e.backend->memcpy_async(e.ordinal, dst.data<float>() + dst_off, src.data<float>() + src_off,
                          static_cast<size_t>(count) * sizeof(float), e.stream);
}

bool same_place(const Device& a, const Device& b) { return a.is_cpu() ? b.is_cpu() : a == b; }

}  // namespace

void Optimizer::apply_sharded(ReplicaContext& ctx,
                              const std::vector<std::pair<Tensor, Variable>>& grads_and_vars,
                              const ShardedCollectives& collectives) {
  const int local = ctx.local_replica_id();
  const std::string where =
      name() + ": sharded optimizer state (ZeRO-1), replica " + std::to_string(ctx.replica_id());
  DISTSTRAT_CHECK(clipping_.norm <= 0, kUnimplemented, where,
                  ": per-tensor clip_by_norm (each replica holds a piece of each gradient); use "
                  "clip_by_global_norm or clip_by_value");
  // Creation order: the same on every replica and worker whatever order the
  // caller passed.
  std::vector<size_t> order(grads_and_vars.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return grads_and_vars[a].second.impl().creation_index <
           grads_and_vars[b].second.impl().creation_index;
  });
  // A variable passed twice would be laid out twice: two pieces with their
  // own slots, the second overwriting the first in the all-gather.
  optim_detail::check_each_variable_once(where, grads_and_vars);
  // Where this replica's state lives: with its copies (host memory, or its
  // GPU); every gradient must be there too.
  Device home = Device::cpu();
  for (size_t n = 0; n < order.size(); ++n) {
    const auto& [g, v] = grads_and_vars[order[n]];
    const Tensor& copy = v.impl().copies.at(static_cast<size_t>(local));
    if (n == 0 && copy.device().is_gpu()) home = copy.device();
    DISTSTRAT_CHECK(same_place(copy.device(), home) && same_place(g.device(), home), kUnimplemented,
                    where, ": variable '", echo(v.name()), "' (copy on ", copy.device().to_string(),
                    ") and its gradient ", g.debug_string(), " are not all on ", home.to_string(),
                    "; sharded optimizer state needs every variable and gradient of a replica in "
                    "one place");
  }
  Zero& z = *zero_;
  {
    std::lock_guard<std::mutex> lock(z.mu);
    if (!z.planned) {
      // The first local replica to arrive lays the state out for all of them.
      for (size_t i : order) z.vars.push_back(grads_and_vars[i].second);
      for (size_t k = 0; k < z.vars.size(); ++k) {
        z.offsets.push_back(z.total);
        z.total += z.size(k);
      }
      z.replicas = ctx.num_replicas_in_sync();
      z.block = std::max<int64_t>(1, (z.total + z.replicas - 1) / z.replicas);
      z.slot_names = slot_names();
      const int first = ctx.replica_id() - local;
      const int num_local = strategy_->num_local_replicas();
      const int64_t B = z.block;
      z.locals.resize(static_cast<size_t>(num_local));
      for (int l = 0; l < num_local; ++l) {
        Zero::Local& L = z.locals[static_cast<size_t>(l)];
        const int64_t g = first + l;
        L.begin = std::min(z.total, g * B);
        L.end = std::min(z.total, (g + 1) * B);
      }
      z.planned = true;
    }
    DISTSTRAT_CHECK(z.replicas == ctx.num_replicas_in_sync(), kInternal, where,
                    ": replicas in sync changed");
    bool same = z.vars.size() == order.size();
    for (size_t k = 0; same && k < order.size(); ++k) {
      same = z.vars[k].impl_ptr() == grads_and_vars[order[k]].second.impl_ptr();
    }
    DISTSTRAT_CHECK(same, kUnimplemented, where, ": apply_gradients with other variables (",
                    order.size(), ") than this optimizer's first call (", z.vars.size(),
                    "); sharded state needs the same variables in every call (use one optimizer "
                    "per set of variables)");
  }
  Zero::Local& L = z.locals[static_cast<size_t>(local)];
  const int64_t R = z.replicas, B = z.block;
  if (!L.ready) {
    // This replica's buffers and slot blocks, where its copies live (in its
    // scope: zero-filled on its stream).
    L.device = home;
    L.flat = Tensor(Shape{R * B}, DType::kFloat32, home);
    L.gathered = Tensor(Shape{R * B}, DType::kFloat32, home);
    L.grads = Tensor(Shape{B}, DType::kFloat32, home);
    L.values = Tensor(Shape{B}, DType::kFloat32, home);
    L.slots.assign(z.vars.size(), {});
    for (size_t k = 0; k < z.vars.size(); ++k) {
      const auto [lo, hi] = z.piece(k, L);
      Variable::Impl& var = z.vars[k].impl();
      std::lock_guard<std::mutex> slots_lock(var.slots_mu);
      for (const std::string& s : z.slot_names) {
        Tensor t(Shape{hi - lo}, DType::kFloat32, home);  // zero-filled
        auto full = var.slots.find(s);
        if (full != var.slots.end() && static_cast<size_t>(local) < full->second.size() &&
            hi > lo) {
          // Full slots (restored from a checkpoint before the first step): keep the block.
          const Tensor& src = full->second[static_cast<size_t>(local)];
          DISTSTRAT_CHECK(same_place(src.device(), home), kUnimplemented, where, ": slot '", s,
                          "' of '", echo(var.name), "' is on ", src.device().to_string(), ", not ",
                          home.to_string());
          copy_floats(t, 0, src, lo - z.offsets[k], hi - lo);
        }
        L.slots[k].push_back(t);
      }
    }
    L.ready = true;
    std::lock_guard<std::mutex> lock(z.mu);
    if (++z.prepared == static_cast<int>(z.locals.size())) {
      // Every local replica took its block: the full copies are not needed.
      for (Variable& v : z.vars) {
        Variable::Impl& var = v.impl();
        std::lock_guard<std::mutex> slots_lock(var.slots_mu);
        for (const std::string& s : z.slot_names) var.slots.erase(s);
      }
    }
  }
  // Gradients laid end to end; the padding after N stays zero.
  for (size_t k = 0; k < order.size(); ++k) {
    copy_floats(L.flat, z.offsets[k], grads_and_vars[order[k]].first, 0, z.size(k));
  }
  // Determinism mode: every replica holds the exact sum of the step's
  // gradients already (runtime/determinism.h), so its block is a slice of
  // them, not a reduce-scatter (which would sum them again).
  const bool exact = strategy_->determinism().enabled();
  if (exact) {
    copy_floats(L.grads, 0, L.flat, L.begin, L.end - L.begin);
  } else {
    collectives.reduce_scatter(L.flat, L.grads);
  }
  for (size_t k = 0; k < z.vars.size(); ++k) {
    const auto [lo, hi] = z.piece(k, L);
    copy_floats(L.values, lo - L.begin, z.vars[k].impl().copies[static_cast<size_t>(local)],
                lo - z.offsets[k], hi - lo);
  }
  {
    std::lock_guard<std::mutex> lock(held_->mu);
    auto it = held_->batches.find(std::this_thread::get_id());
    if (it != held_->batches.end()) {
      if (exact) {
        for (size_t k : order) it->second.whole.push_back(grads_and_vars[k].first);
      } else {
        it->second.sum_across = collectives.sum;
      }
    }
  }
  Tensor iterations = iterations_.read(ctx);
  const int64_t step = iterations.data<int64_t>()[0] + 1;
  // The block's pieces, one list launch on a GPU replica.
  std::vector<Tensor> pieces(z.vars.size());
  std::vector<TensorUpdate> updates;
  for (size_t k = 0; k < z.vars.size(); ++k) {
    const auto [lo, hi] = z.piece(k, L);
    pieces[k] = L.values.slice_rows(lo - L.begin, hi - L.begin);
    TensorUpdate u{&pieces[k], L.grads.slice_rows(lo - L.begin, hi - L.begin), {}};
    for (Tensor& t : L.slots[k]) u.slots.push_back(&t);
    updates.push_back(std::move(u));
  }
  update_tensors(updates, step);
  collectives.all_gather(L.values, L.gathered);
  for (size_t k = 0; k < z.vars.size(); ++k) {
    copy_floats(z.vars[k].impl().copies[static_cast<size_t>(local)], 0, L.gathered, z.offsets[k],
                z.size(k));
  }
  iterations.data<int64_t>()[0] = step;
}

bool Optimizer::sharded() const {
  std::lock_guard<std::mutex> lock(zero_->mu);
  return zero_->planned;
}

bool Optimizer::sharded_slot(const Variable::Impl& var, const std::string& slot_name) const {
  std::lock_guard<std::mutex> lock(zero_->mu);
  return zero_->planned && zero_->find(&var) >= 0 && zero_->find_slot(slot_name) >= 0;
}

std::vector<Tensor> Optimizer::gather_sharded_slots(
    const std::vector<std::pair<const Variable::Impl*, std::string>>& slots) const {
  const Zero& z = *zero_;
  std::vector<Tensor> out(slots.size());
  if (slots.empty()) return out;
  std::vector<int> var_index, slot_index;
  for (const auto& [v, s] : slots) {
    var_index.push_back(z.find(v));
    slot_index.push_back(z.find_slot(s));
    DISTSTRAT_CHECK(var_index.back() >= 0 && slot_index.back() >= 0, kInvalidArgument, name(),
                    ": slot '", echo(s), "' of '", echo(v->name),
                    "' is not sharded by this optimizer");
  }
  // One gather per slot name: every replica's block of it, in replica
  // order, is the slot of all variables laid end to end.
  std::vector<Tensor> full(z.slot_names.size());
  strategy_->run_between_steps([&](ReplicaContext& ctx) {
    const Zero::Local& L = z.locals[static_cast<size_t>(ctx.local_replica_id())];
    DISTSTRAT_CHECK(L.ready, kFailedPrecondition, name(), ": sharded slots of local replica ",
                    ctx.local_replica_id(), " were never laid out (no step ran there)");
    for (size_t si = 0; si < z.slot_names.size(); ++si) {
      if (std::find(slot_index.begin(), slot_index.end(), static_cast<int>(si)) == slot_index.end())
        continue;
      Tensor mine(Shape{L.end - L.begin}, DType::kFloat32, L.device);
      for (size_t k = 0; k < z.vars.size(); ++k) {
        const auto [lo, hi] = z.piece(k, L);
        copy_floats(mine, lo - L.begin, L.slots[k][si], 0, hi - lo);
      }
      Tensor gathered = ctx.all_gather(mine, name() + " sharded slot '" + z.slot_names[si] + "'");
      if (ctx.local_replica_id() != 0) continue;
      if (gathered.device().is_gpu()) {
        Tensor host(gathered.shape(), DType::kFloat32);
        host.copy_from(gathered);
        gathered = host;
      }
      full[si] = gathered;
    }
  });
  for (size_t i = 0; i < slots.size(); ++i) {
    const size_t k = static_cast<size_t>(var_index[i]);
    const Tensor& f = full[static_cast<size_t>(slot_index[i])];
    DISTSTRAT_CHECK(f.num_elements() == z.total, kInternal, name(), ": gathered slot has ",
                    f.num_elements(), " elements, expected ", z.total);
    Tensor t(z.vars[k].shape(), DType::kFloat32);
    if (z.size(k)) std::memcpy(t.data(), f.data<float>() + z.offsets[k], t.nbytes());
    out[i] = t;
  }
  return out;
}

void Optimizer::assign_sharded_slots(
    const std::vector<std::pair<const Variable::Impl*, std::string>>& slots,
    const std::vector<Tensor>& values) const {
  DISTSTRAT_CHECK_EQ(slots.size(), values.size(), "assign_sharded_slots");
  Zero& z = *zero_;
  std::vector<std::pair<int, int>> index;
  for (size_t i = 0; i < slots.size(); ++i) {
    const int k = z.find(slots[i].first);
    const int si = z.find_slot(slots[i].second);
    DISTSTRAT_CHECK(k >= 0 && si >= 0, kInvalidArgument, name(), ": slot '", echo(slots[i].second),
                    "' of '", echo(slots[i].first->name), "' is not sharded by this optimizer");
    const Tensor& v = values[i];
    DISTSTRAT_CHECK(v.dtype() == DType::kFloat32 && v.device().is_cpu() &&
                        v.num_elements() == z.size(static_cast<size_t>(k)),
                    kInvalidArgument, name(), ": value ", v.debug_string(), " for slot '",
                    echo(slots[i].second), "' of '", echo(slots[i].first->name), "'");
    index.emplace_back(k, si);
  }
  // Each local replica keeps its block (on a GPU: written in its scope).
  const auto write = [&](Zero::Local& L) {
    for (size_t i = 0; i < slots.size(); ++i) {
      const auto [k, si] = index[i];
      const auto [lo, hi] = z.piece(static_cast<size_t>(k), L);
      if (hi <= lo) continue;
      Tensor& block = L.slots[static_cast<size_t>(k)][static_cast<size_t>(si)];
      const Tensor src = Tensor::wrap(
          const_cast<float*>(values[i].data<float>()) + (lo - z.offsets[static_cast<size_t>(k)]),
          Shape{hi - lo}, DType::kFloat32);
      block.copy_from(src);
    }
  };
  bool on_gpu = false;
  for (const Zero::Local& L : z.locals) on_gpu = on_gpu || (L.ready && L.device.is_gpu());
  if (!on_gpu) {
    for (Zero::Local& L : z.locals) {
      if (L.ready) write(L);
    }
    return;
  }
  strategy_->run_between_steps([&](ReplicaContext& ctx) {
    Zero::Local& L = z.locals[static_cast<size_t>(ctx.local_replica_id())];
    if (L.ready) write(L);
  });
}

void Optimizer::reset_sharding() const {
  Zero& z = *zero_;
  std::lock_guard<std::mutex> lock(z.mu);
  z.planned = false;
  z.prepared = 0;
  z.vars.clear();
  z.offsets.clear();
  z.total = 0;
  z.block = 1;
  z.replicas = 1;
  z.slot_names.clear();
  z.locals.clear();
}

int64_t Optimizer::slot_bytes_per_replica() const {
  const Zero& z = *zero_;
  std::vector<int64_t> per(static_cast<size_t>(std::max(1, strategy_->num_local_replicas())), 0);
  std::lock_guard<std::mutex> lock(z.mu);
  const std::vector<std::string> names = slot_names();
  for (const Variable& v : strategy_->variables()) {
    if (!v.options().trainable || v.dtype() != DType::kFloat32) continue;
    if (z.planned && z.find(&v.impl()) >= 0) continue;  // counted below
    Variable::Impl& impl = v.impl();
    std::lock_guard<std::mutex> slots_lock(impl.slots_mu);
    for (const std::string& s : names) {
      auto it = impl.slots.find(s);
      if (it == impl.slots.end()) continue;
      for (size_t l = 0; l < it->second.size() && l < per.size(); ++l) {
        per[l] += static_cast<int64_t>(it->second[l].nbytes());
      }
      // A single host copy (central storage) is every replica's.
      if (it->second.size() == 1) {
        for (size_t l = 1; l < per.size(); ++l)
          per[l] += static_cast<int64_t>(it->second[0].nbytes());
      }
    }
  }
  if (z.planned) {
    for (size_t l = 0; l < z.locals.size() && l < per.size(); ++l) {
      for (const auto& slots : z.locals[l].slots) {
        for (const Tensor& t : slots) per[l] += static_cast<int64_t>(t.nbytes());
      }
    }
  }
  return *std::max_element(per.begin(), per.end());
}

}  // namespace diststrat
