// Checkpoint's contents: the entries it saves (every variable of the
// strategy and its optimizers' slots, or the named objects chosen:
// CheckpointObject), their host values (state) and their decoding on
// restore (data positions). Saving and restoring: checkpoint.cc.
#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/user_text.h"
#include "diststrat/checkpoint.h"
#include "diststrat/data.h"
#include "diststrat/data_position.h"
#include "diststrat/optimizer.h"
#include "runtime/variable_impl.h"

namespace diststrat {

// ---- named objects ----------------------------------------------------------

CheckpointObject::CheckpointObject(std::vector<Variable> variables)
    : kind_(Kind::kVariables), variables_(std::move(variables)) {}
CheckpointObject::CheckpointObject(const Variable& variable)
    : kind_(Kind::kVariables), variables_{variable} {}
CheckpointObject::CheckpointObject(const Optimizer& optimizer)
    : kind_(Kind::kOptimizer), optimizer_(&optimizer) {}
CheckpointObject::CheckpointObject(DataPosition& position)
    : kind_(Kind::kPosition), position_(&position) {}
CheckpointObject::CheckpointObject(DataPosition& position, const DistributedDataset& data)
    : kind_(Kind::kPosition), position_(&position), data_(&data) {}

namespace {
// A data position's tensors: where it stands, then (with its dataset) what
// fixes the order of the rows; the keys of data_position_metadata.
const std::vector<std::string>& position_fields(bool with_data) {
  static const std::vector<std::string> plain = {"epoch", "batch", "step"};
  static const std::vector<std::string> full = {"epoch", "batch", "step",    "global_batch",
                                                "seed",  "rows",  "shuffle", "drop_remainder"};
  return with_data ? full : plain;
}

Tensor int64_scalar(int64_t v) {
  Tensor t(Shape{1}, DType::kInt64);
  t.data<int64_t>()[0] = v;
  return t;
}
}  // namespace

Checkpoint::Checkpoint(CheckpointObjects objects)
    : strategy_(nullptr), objects_(std::move(objects)) {
  DISTSTRAT_CHECK(!objects_.empty(), kInvalidArgument, "Checkpoint: no objects to save");
  std::set<std::string> names;
  for (const auto& [name, o] : objects_) {
    DISTSTRAT_CHECK(!name.empty() && name.find('/') == std::string::npos, kInvalidArgument,
                    "Checkpoint: object name '", echo(name),
                    "' must be non-empty and contain no '/'");
    DISTSTRAT_CHECK(names.insert(name).second, kInvalidArgument, "Checkpoint: two objects named '",
                    echo(name), "'");
    std::vector<Strategy*> owners;
    if (o.kind_ == CheckpointObject::Kind::kVariables) {
      for (const Variable& v : o.variables_) {
        DISTSTRAT_CHECK(v.defined(), kInvalidArgument, "Checkpoint: object '", echo(name),
                        "' holds an empty Variable handle");
        owners.push_back(v.impl().owner);
      }
    } else if (o.kind_ == CheckpointObject::Kind::kOptimizer) {
      owners.push_back(&o.optimizer_->strategy());
      optimizers_.push_back(o.optimizer_);
    }
    for (Strategy* s : owners) {
      if (!strategy_) strategy_ = s;
      DISTSTRAT_CHECK(s != nullptr && s == strategy_, kInvalidArgument, "Checkpoint: object '",
                      echo(name), "' belongs to another strategy than the objects before it");
    }
  }
  DISTSTRAT_CHECK(strategy_ != nullptr, kInvalidArgument,
                  "Checkpoint: none of the objects is a variable or an optimizer (the checkpoint "
                  "saves through their strategy)");
  DISTSTRAT_CHECK(dynamic_cast<CheckpointParticipant*>(strategy_) == nullptr, kUnimplemented,
                  "Checkpoint of named objects: not supported under ParameterServerStrategy yet "
                  "(its PS ranks save shards by variable name); use Checkpoint(strategy, "
                  "optimizers)");
}

std::vector<Checkpoint::Entry> Checkpoint::entries() const {
  std::vector<Entry> out;
  std::set<std::string> names;
  auto add = [&](Entry e) {
    DISTSTRAT_CHECK(names.insert(e.name).second, kInvalidArgument, "Checkpoint: the name '", e.name,
                    "' is both a variable and an optimizer slot");
    out.push_back(std::move(e));
  };
  // A variable (slot empty) or one of its slots.
  auto var = [](std::string name, const Variable& v, std::string slot, bool optimizer_state) {
    Entry e;
    e.name = std::move(name);
    e.var = v;
    e.slot = std::move(slot);
    e.optimizer_state = optimizer_state;
    return e;
  };
  if (!objects_.empty()) {
    // Named objects: only what was chosen, each under its object's name.
    for (size_t k = 0; k < objects_.size(); ++k) {
      const std::string pre = objects_[k].first + "/";
      const CheckpointObject& o = objects_[k].second;
      switch (o.kind_) {
        case CheckpointObject::Kind::kVariables:
          for (const Variable& v : o.variables_) add(var(pre + v.name(), v, "", false));
          break;
        case CheckpointObject::Kind::kOptimizer: {
          add(var(pre + "iterations", o.optimizer_->iterations(), "", true));
          const std::vector<std::string> slots = o.optimizer_->slot_names();
          for (const Variable& v : strategy_->variables()) {
            if (!v.options().trainable || v.dtype() != DType::kFloat32) continue;
            for (const std::string& sl : slots) add(var(pre + v.name() + "/" + sl, v, sl, true));
          }
          break;
        }
        case CheckpointObject::Kind::kPosition:
          for (const std::string& f : position_fields(o.data_ != nullptr)) {
            Entry e;
            e.name = pre + f;
            e.position_object = static_cast<int>(k);
            e.field = f;
            add(std::move(e));
          }
          break;
      }
    }
    return out;
  }
  std::vector<std::string> slot_names;
  std::set<std::string> iteration_vars;
  for (const Optimizer* o : optimizers_) {
    for (const std::string& s : o->slot_names()) {
      if (std::find(slot_names.begin(), slot_names.end(), s) == slot_names.end())
        slot_names.push_back(s);
    }
    iteration_vars.insert(o->iterations().name());
  }
  for (const Variable& v : strategy_->variables()) {
    // Step counters of optimizers are optimizer state; other variables are the model.
    const bool is_counter = iteration_vars.count(v.name()) > 0 ||
                            (v.name().rfind("optimizer", 0) == 0 && v.name().size() > 11 &&
                             v.name().substr(v.name().size() - 11) == "/iterations");
    add(var(v.name(), v, "", is_counter));
    if (!v.options().trainable || v.dtype() != DType::kFloat32) continue;
    for (const std::string& s : slot_names) add(var(v.name() + "/" + s, v, s, true));
  }
  return out;
}

std::pair<std::string, Tensor> Checkpoint::expected_of(const Entry& e) {
  // Only names, dtypes and shapes matter here: no need to read the values.
  return {e.name, e.position_object >= 0 ? Tensor(Shape{1}, DType::kInt64)
                                         : Tensor(e.var.shape(), e.var.dtype())};
}

std::vector<std::pair<std::string, Tensor>> Checkpoint::expected_state() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const Entry& e : entries()) out.push_back(expected_of(e));
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

std::map<int, DataPosition> Checkpoint::read_positions(
    const std::vector<std::pair<std::string, Tensor>>& tensors, const std::string& path) const {
  std::map<int, DataPosition> out;
  const std::map<std::string, Tensor> by_name(tensors.begin(), tensors.end());
  for (size_t k = 0; k < objects_.size(); ++k) {
    const CheckpointObject& o = objects_[k].second;
    if (o.kind_ != CheckpointObject::Kind::kPosition) continue;
    const std::string pre = objects_[k].first + "/";
    CheckpointMetadata md;
    std::vector<std::string> absent;
    for (const std::string& f : position_fields(o.data_ != nullptr)) {
      auto it = by_name.find(pre + f);
      if (it == by_name.end()) {
        absent.push_back(pre + f);
        continue;
      }
      const int64_t v = it->second.data<int64_t>()[0];
      md[f] = f == "seed" ? std::to_string(static_cast<uint64_t>(v)) : std::to_string(v);
    }
    if (md.empty()) continue;  // not in the file (expect_partial): unchanged
    if (!absent.empty()) {
      std::string list;
      for (const std::string& a : absent) list += (list.empty() ? "'" : ", '") + a + "'";
      throw DataLossError("checkpoint '" + path + "': the data position '" + objects_[k].first +
                          "' is incomplete: " + list + " missing");
    }
    DataPosition p;
    if (o.data_) {
      p = restore_data_position(*o.data_, md, path);
    } else {
      constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
      p.epoch = metadata_int(md, "epoch", 0, kMax, path);
      p.batch = metadata_int(md, "batch", 0, kMax, path);
      p.step = metadata_int(md, "step", 0, kMax, path);
    }
    out[static_cast<int>(k)] = p;
  }
  return out;
}

std::vector<std::pair<std::string, Tensor>> Checkpoint::state() const {
  std::vector<std::pair<std::string, Tensor>> out;
  std::vector<CheckpointParticipant::SlotRef> slots;
  std::vector<std::string> slot_names;
  for (const Entry& e : entries()) {
    if (e.position_object >= 0) {
      const CheckpointObject& o = objects_[static_cast<size_t>(e.position_object)].second;
      const DataPosition& p = *o.position_;
      int64_t v = 0;
      if (e.field == "epoch") v = p.epoch;
      if (e.field == "batch") v = p.batch;
      if (e.field == "step") v = p.step;
      if (o.data_) {
        if (e.field == "global_batch") v = o.data_->global_batch_size();
        if (e.field == "seed") v = static_cast<int64_t>(o.data_->options().seed);
        if (e.field == "rows") v = o.data_->num_rows();
        if (e.field == "shuffle") v = o.data_->options().shuffle ? 1 : 0;
        if (e.field == "drop_remainder") v = o.data_->options().drop_remainder ? 1 : 0;
      }
      out.emplace_back(e.name, int64_scalar(v));
    } else if (e.slot.empty()) {
      out.emplace_back(e.name, e.var.value());
    } else {
      slots.push_back({&e.var.impl(), e.slot});
      slot_names.push_back(e.name);
    }
  }
  // Slots an optimizer holds in blocks (ZeRO-1) are gathered whole by it, so
  // the file is the same as without sharding.
  std::vector<CheckpointParticipant::SlotRef> plain;
  std::vector<std::string> plain_names;
  std::vector<std::vector<std::pair<const Variable::Impl*, std::string>>> sharded(
      optimizers_.size());
  std::vector<std::vector<std::string>> sharded_names(optimizers_.size());
  for (size_t k = 0; k < slots.size(); ++k) {
    size_t o = 0;
    while (o < optimizers_.size() && !optimizers_[o]->sharded_slot(*slots[k].var, slots[k].slot))
      ++o;
    if (o < optimizers_.size()) {
      sharded[o].emplace_back(slots[k].var, slots[k].slot);
      sharded_names[o].push_back(slot_names[k]);
    } else {
      plain.push_back(slots[k]);
      plain_names.push_back(slot_names[k]);
    }
  }
  std::vector<Tensor> values = participant().read_slots(*strategy_, plain);
  for (size_t k = 0; k < plain.size(); ++k) out.emplace_back(plain_names[k], values[k]);
  for (size_t o = 0; o < optimizers_.size(); ++o) {
    if (sharded[o].empty()) continue;
    std::vector<Tensor> v = optimizers_[o]->gather_sharded_slots(sharded[o]);
    for (size_t k = 0; k < v.size(); ++k) out.emplace_back(sharded_names[o][k], v[k]);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

}  // namespace diststrat
