// ParameterServerStrategy's checkpoints: every PS rank writes its own shard
// file and the chief the index (docs/parameter_server.md, "Checkpoints");
// restore reads either format and sends each PS its shards.
#include "parameter_server/worker.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "allreduce/reduce_kernels.h"
#include "core/random_id.h"
#include "diststrat/optimizer.h"
#include "io/checkpoint_internal.h"
#include "parameter_server/client.h"
#include "parameter_server/messages.h"
#include "parameter_server/shard_updater.h"

namespace diststrat {

// ---- checkpoints -------------------------------------------------------------------
//
// Save: every worker flushes its pushes and meets the others at a barrier
// (through PS 0), so the PS ranks hold exactly the pushes every worker made
// before the save and receive none until it ends; the chief asks each PS to
// write its shard file, waits until every one is durable, then writes the
// index; the others wait for the chief's status (a broadcast through PS 0).
// Restore: the same quiescence; the chief reads and verifies the index and
// every shard file, matches the reassembled state against the model, re-splits
// it onto the current PS ranks and writes each PS's shards (values, slots,
// step counters) at once.

namespace {
uint64_t new_save_id() { return random_id() | 1; }
}  // namespace

void ParameterServerStrategy::check_checkpoint_supported(Strategy&, const std::string& what) {
  DISTSTRAT_CHECK(
      !impl_->is_ps, kFailedPrecondition, "rank ", impl_->rank, " (ps ", impl_->index, "): ", what,
      ": the workers save and restore checkpoints (every worker calls it); a PS rank only "
      "serves (join()) and writes its shards when the chief asks");
}

bool ParameterServerStrategy::needs_state_to_write() const { return false; }

std::vector<Tensor> ParameterServerStrategy::read_slots(Strategy&,
                                                        const std::vector<SlotRef>& slots) {
  Impl& m = *impl_;
  m.require_worker("read_slots");
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<Tensor> out;
  std::vector<ps::ReadSlotsRequest> requests(m.ps_ranks.size());
  struct Dest {
    char* dst;
    size_t bytes;
  };
  std::vector<std::vector<Dest>> dests(m.ps_ranks.size());
  std::vector<size_t> bytes(m.ps_ranks.size(), 0);
  for (const SlotRef& ref : slots) {
    const Impl::VarInfo& vi = m.info(*ref.var);
    DISTSTRAT_CHECK(vi.var->dtype == DType::kFloat32, kInvalidArgument, "read_slots: variable '",
                    vi.var->name, "' is ", dtype_name(vi.var->dtype),
                    "; only float32 variables have slots");
    out.emplace_back(vi.var->shape, DType::kFloat32);
    for (const Impl::ShardPlace& sp : vi.shards) {
      requests[sp.ps].entries.push_back(Impl::entry_of(vi, sp));
      requests[sp.ps].slot_of.push_back(ref.slot);
      const size_t n = static_cast<size_t>(sp.rows) * vi.row_bytes;
      dests[sp.ps].push_back({static_cast<char*>(out.back().data()) + sp.offset * vi.row_bytes, n});
      bytes[sp.ps] += n;
    }
  }
  std::vector<std::vector<char>> replies(m.ps_ranks.size());
  std::vector<ps::Client::CallPtr> calls;
  for (size_t p = 0; p < m.ps_ranks.size(); ++p) {
    if (requests[p].entries.empty()) continue;
    replies[p].resize(bytes[p]);
    calls.push_back(m.client->post(static_cast<int>(p), ps::Op::kReadSlots, ps::encode(requests[p]),
                                   nullptr, nullptr, 0, replies[p].data(), bytes[p],
                                   "read of optimizer slots"));
  }
  m.wait_all(calls);
  for (size_t p = 0; p < m.ps_ranks.size(); ++p) {
    const char* src = replies[p].data();
    for (const Dest& d : dests[p]) {
      if (d.bytes) std::memcpy(d.dst, src, d.bytes);
      src += d.bytes;
    }
  }
  return out;
}

void ParameterServerStrategy::assign_slots(Strategy&, const std::vector<SlotRef>& slots,
                                           const std::vector<Tensor>& values) {
  Impl& m = *impl_;
  m.require_worker("assign_slots");
  DISTSTRAT_CHECK_EQ(slots.size(), values.size(), "assign_slots");
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<std::vector<ps::RestoreItem>> per_ps(m.ps_ranks.size());
  for (size_t k = 0; k < slots.size(); ++k) {
    const Impl::VarInfo& vi = m.info(*slots[k].var);
    DISTSTRAT_CHECK(values[k].dtype() == DType::kFloat32 && values[k].shape() == vi.var->shape,
                    kInvalidArgument, "assign_slots: slot '", slots[k].slot, "' of '", vi.var->name,
                    "' from ", values[k].debug_string());
    for (const Impl::ShardPlace& sp : vi.shards) {
      ps::RestoreItem it;
      it.entry = Impl::entry_of(vi, sp);
      it.entry.shape = Impl::shard_shape(vi, sp);
      it.slots.emplace_back(slots[k].slot,
                            static_cast<const char*>(values[k].data()) + sp.offset * vi.row_bytes);
      it.slot_bytes = static_cast<size_t>(sp.rows) * vi.row_bytes;
      per_ps[sp.ps].push_back(std::move(it));
    }
  }
  m.post_restore(per_ps, "restore of optimizer slots");
}

void ParameterServerStrategy::Impl::post_restore(
    const std::vector<std::vector<ps::RestoreItem>>& per_ps, const std::string& what) {
  std::vector<ps::Client::CallPtr> calls;
  for (size_t p = 0; p < per_ps.size(); ++p) {
    if (per_ps[p].empty()) continue;
    ps::RestoreRequest req;
    auto payload = std::make_shared<std::vector<char>>();
    for (const ps::RestoreItem& it : per_ps[p]) {
      ps::RestoreSpec spec;
      spec.has_value = it.value != nullptr;
      spec.step = it.step;
      for (const auto& sl : it.slots) spec.slots.push_back(sl.first);
      req.entries.push_back(it.entry);
      req.specs.push_back(std::move(spec));
      if (it.value) payload->insert(payload->end(), it.value, it.value + it.value_bytes);
      for (const auto& sl : it.slots)
        payload->insert(payload->end(), sl.second, sl.second + it.slot_bytes);
    }
    calls.push_back(client->post(static_cast<int>(p), ps::Op::kRestore, ps::encode(req), payload,
                                 payload->data(), payload->size(), nullptr, 0, what));
  }
  wait_all(calls);
  discard_dense_pull();  // the next run pulls what was just written
}

void ParameterServerStrategy::write_checkpoint(Strategy&, const std::string& path,
                                               const std::vector<std::pair<std::string, Tensor>>&,
                                               const CheckpointMetadata& metadata) {
  Impl& m = *impl_;
  m.require_worker("checkpoint save");
  // Quiesce: this worker's pushes are applied, then every live worker's.
  flush();
  barrier("checkpoint save '" + path + "'");
  ckpt::on_chief_then_agree(*this, "to write checkpoint '" + path + "'", [&] {
    const uint64_t save_id = new_save_id();
    const int num_ps = static_cast<int>(m.ps_ranks.size());
    // The PS ranks write into their own checkpoint directory under names
    // they derive from the stem (never a path from a request): the index
    // must be in that directory.
    const size_t slash = path.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "."
                            : slash == 0               ? "/"
                                                       : path.substr(0, slash);
    std::string stem = path.substr(slash == std::string::npos ? 0 : slash + 1);
    static const std::string kSuffix = ".safetensors";
    if (stem.size() > kSuffix.size() &&
        stem.compare(stem.size() - kSuffix.size(), kSuffix.size(), kSuffix) == 0) {
      stem.resize(stem.size() - kSuffix.size());
    }
    DISTSTRAT_CHECK(ps::valid_file_stem(stem), kInvalidArgument, "checkpoint '", path,
                    "': the file name '", stem,
                    "' is not a checkpoint name for the PS ranks (1 to 200 of [A-Za-z0-9._-], not "
                    "starting with '.')");
    if (m.own_group) {
      // One process: its PS threads write where this program saves.
      for (auto& sr : m.services) sr->service().set_checkpoint_dir(dir);
    } else {
      const std::string configured = m.checkpoint_dir();
      DISTSTRAT_CHECK(configured.empty() || configured == dir, kInvalidArgument, "checkpoint '",
                      path,
                      "' is not in the PS ranks' "
                      "checkpoint directory '",
                      configured, "' (ParameterServerOptions::checkpoint_dir)");
    }
    std::vector<std::string> files;
    std::vector<ckpt::IndexVariable> index;
    {
      std::lock_guard<std::mutex> lock(m.mu);
      std::vector<int64_t> expect(m.ps_ranks.size(), 0);
      for (const auto& vi : m.vars) {
        ckpt::IndexVariable iv{vi->var->name, vi->var->dtype, vi->var->shape, {}};
        for (const Impl::ShardPlace& sp : vi->shards) {
          iv.shards.push_back({sp.index, sp.ps, sp.offset, sp.rows});
          ++expect[sp.ps];
        }
        index.push_back(std::move(iv));
      }
      std::vector<std::vector<char>> replies(m.ps_ranks.size(),
                                             std::vector<char>(ps::kSaveReplyBytes));
      std::vector<ps::Client::CallPtr> calls;
      for (int p = 0; p < num_ps; ++p) {
        files.push_back(ckpt::shard_file_path(path, p, num_ps, save_id));
        const ps::SaveRequest req{stem, save_id, dir};
        calls.push_back(m.client->post(p, ps::Op::kSave, ps::encode(req), nullptr, nullptr, 0,
                                       replies[p].data(), replies[p].size(),
                                       "save of shard file '" + files.back() + "'"));
      }
      m.wait_all(calls);  // every shard file is durable (or the error names the PS and file)
      for (int p = 0; p < num_ps; ++p) {
        const int64_t n =
            ps::decode_save_reply(replies[p].data(), replies[p].size(), "save reply").shards;
        DISTSTRAT_CHECK(n == expect[p], kInternal, "checkpoint '", path, "': PS rank ",
                        m.ps_ranks[p], " saved ", n, " shards to '", files[p],
                        "', the chief placed ", expect[p], " there");
      }
    }
    // Last: the index. A crash before this leaves the previous checkpoint the loadable one.
    ckpt::write_index(path, save_id, files, index, metadata);
  });
}

CheckpointContents ParameterServerStrategy::read_checkpoint(
    Strategy&, const std::string& path, const std::vector<std::pair<std::string, Tensor>>& expected,
    const std::vector<std::string>& optional, const RestoreOptions& options) {
  Impl& m = *impl_;
  m.require_worker("checkpoint restore");
  flush();
  barrier("checkpoint restore '" + path + "'");
  CheckpointContents out;
  ckpt::on_chief_then_agree(*this, "to restore checkpoint '" + path + "'", [&] {
    out.metadata = m.restore_from(path, expected, optional, options);
  });
  if (ckpt::is_multi_process(*this)) {
    out.metadata = ckpt::decode_metadata(
        ckpt::broadcast_string(*this, ckpt::encode_metadata(out.metadata), "checkpoint metadata"));
    std::lock_guard<std::mutex> lock(m.mu);
    m.discard_dense_pull();  // a prefetch from before the restore
  }
  return out;  // no tensors: the PS ranks hold the restored state already
}

CheckpointMetadata ParameterServerStrategy::Impl::restore_from(
    const std::string& path, const std::vector<std::pair<std::string, Tensor>>& expected,
    const std::vector<std::string>& optional, const RestoreOptions& options) {
  // Everything is read, verified and matched against the model before the
  // first write to a PS.
  SafetensorsLoadOptions lo;
  lo.require_checksums = options.require_checksums;
  lo.allow_non_finite = options.allow_non_finite;
  const ckpt::LoadedCheckpoint lc = ckpt::load_any(path, lo);
  const CheckpointContents c = match_checkpoint(lc.file, path, expected, optional);
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : c.tensors) by_name[name] = &t;
  // A single-file checkpoint (another strategy's) has no per-shard step
  // counters: the optimizer's iterations stand in for them.
  int64_t fallback_step = -1;
  if (!lc.sharded) {
    for (const auto& [name, t] : c.tensors) {
      const std::string suffix = "/iterations";
      if (name.size() > suffix.size() &&
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
          t.dtype() == DType::kInt64 && t.num_elements() == 1) {
        fallback_step = std::max(fallback_step, t.data<int64_t>()[0]);
      }
    }
  }
  std::lock_guard<std::mutex> lock(mu);
  // Slot names: checkpoint names that are not variables, under their longest variable prefix.
  std::map<std::string, std::vector<std::pair<std::string, const Tensor*>>> slots_of;
  std::set<std::string> var_names;
  for (const auto& vi : vars) var_names.insert(vi->var->name);
  for (const auto& [name, t] : by_name) {
    if (var_names.count(name)) continue;
    std::string owner;
    for (const std::string& v : var_names) {
      if (name.size() > v.size() + 1 && name.compare(0, v.size() + 1, v + "/") == 0 &&
          v.size() > owner.size())
        owner = v;
    }
    DISTSTRAT_CHECK(!owner.empty(), kInvalidArgument, "checkpoint '", path, "': tensor '", name,
                    "' is neither a variable nor a slot of one");
    slots_of[owner].emplace_back(name.substr(owner.size() + 1), t);
  }
  std::vector<std::vector<ps::RestoreItem>> per_ps(ps_ranks.size());
  for (const auto& vi : vars) {
    auto it = by_name.find(vi->var->name);
    const auto& slots = slots_of[vi->var->name];
    if (it == by_name.end() && slots.empty()) continue;  // optional and absent: keeps its state
    auto steps = lc.steps.find(vi->var->name);
    for (const ShardPlace& sp : vi->shards) {
      ps::RestoreItem item;
      item.entry = entry_of(*vi, sp);
      item.entry.shape = shard_shape(*vi, sp);
      const size_t bytes = static_cast<size_t>(sp.rows) * vi->row_bytes;
      if (it != by_name.end()) {
        item.value = static_cast<const char*>(it->second->data()) + sp.offset * vi->row_bytes;
        item.value_bytes = bytes;
      }
      for (const auto& [slot, t] : slots) {
        item.slots.emplace_back(slot,
                                static_cast<const char*>(t->data()) + sp.offset * vi->row_bytes);
      }
      item.slot_bytes = bytes;
      // A re-split shard takes the largest step of the saved shards it
      // overlaps (equal for dense training: every push updates every shard).
      item.step = fallback_step;
      if (steps != lc.steps.end()) {
        item.step = 0;
        for (const auto& [rows, step] : steps->second) {
          const bool overlaps =
              sp.rows == 0 || rows.second == 0 ||
              (rows.first < sp.offset + sp.rows && sp.offset < rows.first + rows.second);
          if (overlaps) item.step = std::max(item.step, step);
        }
      }
      per_ps[sp.ps].push_back(std::move(item));
    }
  }
  post_restore(per_ps, "restore of checkpoint '" + path + "'");
  return c.metadata;
}

}  // namespace diststrat
