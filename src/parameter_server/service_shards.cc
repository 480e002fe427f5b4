// The PS service's shard store: creating shards, pulls (dense and rows),
// pushes through the update rule, assignments and the update rule's
// hyperparameters.
#include "parameter_server/service.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>

#include "core/user_text.h"
#include "parameter_server/shard_updater.h"

namespace diststrat {
namespace ps {

namespace {

int64_t row_elems(const Shape& s) {
  int64_t n = 1;
  for (size_t i = 1; i < s.rank(); ++i) n *= s[i];
  return n;
}

}  // namespace

Service::Shard& Service::find_shard(const Entry& e, const std::string& what) {
  auto it = shards_.find({e.var_id, e.shard_index});
  if (it == shards_.end()) {
    throw NotFoundError(what + ": unknown variable '" + echo(e.name) + "' (id " +
                        std::to_string(e.var_id) + ", shard " + std::to_string(e.shard_index) +
                        ") on this PS");
  }
  DISTSTRAT_CHECK(it->second.name == e.name, kInvalidArgument, what, ": variable id ", e.var_id,
                  " is '", echo(it->second.name), "' here, not '", echo(e.name), "'");
  return it->second;
}

Service::Outcome Service::handle_create(WorkerState& w, Pending& p) {
  const CreateRequest& c = p.request.create;  // dtype, shard and rows checked by decode_request
  Shard spec;
  const int64_t var_id = c.var_id;
  spec.name = c.name;
  const std::string name = spec.name;
  spec.dtype = static_cast<DType>(c.dtype);
  spec.full_shape = c.full_shape;
  const int64_t shard_index = c.shard_index;
  spec.num_shards = c.num_shards;
  spec.row_offset = c.row_offset;
  spec.rows = c.rows;
  const bool has_value = c.has_value;
  const Shape shard_shape = c.shard_shape;
  const size_t bytes = static_cast<size_t>(shard_shape.num_elements()) * dtype_size(spec.dtype);
  DISTSTRAT_CHECK(!has_value || p.payload.size() == bytes, kInvalidArgument, "variable '",
                  echo(spec.name), "' shard ", shard_index, ": initial value has ",
                  p.payload.size(), " bytes, expected ", bytes);

  auto it = shards_.find({var_id, shard_index});
  if (it == shards_.end()) {
    spec.value = Tensor(shard_shape, spec.dtype);
    auto restored = restored_.find({spec.name, shard_index});
    if (restored != restored_.end()) {
      ShardSnapshot& s = restored->second;
      DISTSTRAT_CHECK(s.value.shape() == shard_shape && s.value.dtype() == spec.dtype &&
                          s.row_offset == spec.row_offset,
                      kInvalidArgument, "variable '", echo(spec.name), "' shard ", shard_index,
                      ": the restored shard ", s.value.debug_string(), " at row ", s.row_offset,
                      " does not match ", dtype_name(spec.dtype), shard_shape.to_string(),
                      " at row ", spec.row_offset);
      spec.value.copy_from(s.value);
      spec.slots = s.slots;
      spec.step = s.step;
      spec.initialized = true;
      restored_.erase(restored);
    }
    it = shards_.emplace(std::make_pair(var_id, shard_index), std::move(spec)).first;
  } else {
    const Shard& have = it->second;
    DISTSTRAT_CHECK(have.name == spec.name && have.dtype == spec.dtype &&
                        have.full_shape == spec.full_shape && have.num_shards == spec.num_shards &&
                        have.row_offset == spec.row_offset && have.rows == spec.rows,
                    kInvalidArgument, "variable id ", var_id, " shard ", shard_index, " is '",
                    echo(have.name), "' ", dtype_name(have.dtype), have.full_shape.to_string(),
                    " (rows ", have.row_offset, "+", have.rows, " of ", have.num_shards,
                    " shards) here, but worker ", w.index, " declares '", echo(spec.name), "' ",
                    dtype_name(spec.dtype), spec.full_shape.to_string(), " (rows ", spec.row_offset,
                    "+", spec.rows, " of ", spec.num_shards,
                    " shards): workers must create the same variables in the same order");
  }
  Shard& shard = it->second;
  if (has_value && !shard.initialized) {
    if (bytes) std::memcpy(shard.value.data(), p.payload.data(), bytes);
    shard.initialized = true;
  }
  if (!shard.initialized) {
    if (Clock::now() - p.arrived > options_.timeout) {
      throw DeadlineExceededError("variable '" + name +
                                  "': the chief (worker 0) never sent its "
                                  "initial value");
    }
    return Outcome::kDeferred;
  }
  return Outcome::kServed;
}

Service::Outcome Service::handle_pull(WorkerState& w, Pending& p, Reply& reply) {
  const int64_t clock = p.request.pull.clock;
  if (clock >= 0 && options_.max_staleness >= 0) {
    const int slowest = slowest_other(w.index);
    if (slowest >= 0 && clock - workers_[slowest].steps > options_.max_staleness) {
      if (Clock::now() - p.arrived > options_.timeout) {
        throw DeadlineExceededError(
            "worker " + std::to_string(w.index) + " at step " + std::to_string(clock) +
            " waited past the deadline for worker " + std::to_string(slowest) + " (at step " +
            std::to_string(workers_[slowest].steps) + ", max_staleness " +
            std::to_string(options_.max_staleness) + ")");
      }
      return Outcome::kDeferred;
    }
  }
  const std::vector<Entry>& entries = p.request.entries();
  std::vector<Shard*> shards;
  int64_t ids_bytes = 0,
          out_bytes = 0;  // overflow-checked (the decoder and the arrival check agree)
  for (const Entry& e : entries) {
    Shard& s = find_shard(e, "pull");
    shards.push_back(&s);
    const int64_t row_bytes = checked_mul(row_elems(s.value.shape()), dtype_size(s.dtype), "pull");
    if (e.sparse) {
      DISTSTRAT_CHECK(s.value.shape().rank() >= 1, kInvalidArgument, "row pull of scalar '",
                      echo(e.name), "'");
      ids_bytes =
          checked_add(ids_bytes, checked_mul(e.num_ids, int64_t{sizeof(int64_t)}, "pull"), "pull");
      out_bytes = checked_add(out_bytes, checked_mul(e.num_ids, row_bytes, "pull"), "pull");
    } else {
      out_bytes = checked_add(out_bytes, static_cast<int64_t>(s.value.nbytes()), "pull");
    }
  }
  DISTSTRAT_CHECK(static_cast<int64_t>(p.payload.size()) == ids_bytes, kInvalidArgument,
                  "pull: payload has ", p.payload.size(), " bytes of row ids, the entries declare ",
                  ids_bytes);
  DISTSTRAT_CHECK(out_bytes == p.header.reply_bytes, kInvalidArgument, "pull: the reply is ",
                  out_bytes, " bytes, the request expects ", p.header.reply_bytes);
  // Validate every id before producing anything.
  const int64_t* ids = reinterpret_cast<const int64_t*>(p.payload.data());
  for (size_t i = 0, k = 0; i < entries.size(); ++i) {
    if (!entries[i].sparse) continue;
    const Shard& s = *shards[i];
    for (int64_t j = 0; j < entries[i].num_ids; ++j, ++k) {
      DISTSTRAT_CHECK(ids[k] >= s.row_offset && ids[k] < s.row_offset + s.rows, kInvalidArgument,
                      "pull of '", echo(s.name), "': row id ", ids[k], " is out of range [",
                      s.row_offset, ", ", s.row_offset + s.rows, ") of shard ",
                      entries[i].shard_index, " (the variable has ", s.full_shape[0], " rows)");
    }
  }
  reply.payload.resize(static_cast<size_t>(out_bytes));
  char* out = reply.payload.data();
  for (size_t i = 0, k = 0; i < entries.size(); ++i) {
    const Shard& s = *shards[i];
    const char* src = static_cast<const char*>(s.value.data());
    if (!entries[i].sparse) {
      if (s.value.nbytes()) std::memcpy(out, src, s.value.nbytes());
      out += s.value.nbytes();
      continue;
    }
    const size_t row_bytes = static_cast<size_t>(row_elems(s.value.shape())) * dtype_size(s.dtype);
    for (int64_t j = 0; j < entries[i].num_ids; ++j, ++k) {
      std::memcpy(out, src + static_cast<size_t>(ids[k] - s.row_offset) * row_bytes, row_bytes);
      out += row_bytes;
    }
  }
  return Outcome::kServed;
}

void Service::handle_push(WorkerState& w, Pending& p) {
  const DecodedRequest& q = p.request;  // sizes checked on arrival, without overflow
  const int64_t steps_after = q.push.steps_after;
  const int64_t pulled_version = q.push.pulled_version;
  const int64_t iter_var = q.push.iter_var;
  const std::string& iter_name = q.push.iter_name;

  // Validate the whole push before changing anything.
  struct Item {
    const Entry* e;
    Shard* s;
    const int64_t* ids;
    const float* values;
    // The row ids, copied out of the payload: they follow float data there, so
    // they are only 4-byte aligned (reading them in place is undefined
    // behaviour; found by UBSan).
    std::shared_ptr<std::vector<int64_t>> id_storage;
  };
  std::vector<Item> items;
  size_t offset = 0;
  for (const Entry& e : q.entries()) {
    Shard& s = find_shard(e, "push");
    DISTSTRAT_CHECK(e.dtype == static_cast<int32_t>(DType::kFloat32) && s.dtype == DType::kFloat32,
                    kInvalidArgument, "push to '", echo(e.name), "': gradient dtype ",
                    valid_dtype(e.dtype) ? dtype_name(static_cast<DType>(e.dtype)) : "invalid",
                    ", variable dtype ", dtype_name(s.dtype), "; optimizers update float32");
    Item it{&e, &s, nullptr, nullptr, nullptr};
    if (e.sparse) {
      std::vector<int64_t> want = s.value.shape().dims();
      DISTSTRAT_CHECK(!want.empty(), kInvalidArgument, "row push to scalar '", echo(e.name), "'");
      want[0] = e.num_ids;
      DISTSTRAT_CHECK(e.num_ids >= 0 && e.shape == Shape(want), kInvalidArgument, "push to '",
                      echo(e.name), "' shard ", e.shard_index, ": row gradient ",
                      e.shape.to_string(), " for ", e.num_ids, " ids does not match the rows ",
                      Shape(want).to_string());
      const size_t id_bytes = static_cast<size_t>(e.num_ids) * sizeof(int64_t);
      DISTSTRAT_CHECK(offset + id_bytes <= p.payload.size(), kInvalidArgument, "push to '",
                      echo(e.name), "': payload too short for its row ids");
      it.id_storage = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(e.num_ids));
      if (id_bytes) std::memcpy(it.id_storage->data(), p.payload.data() + offset, id_bytes);
      it.ids = it.id_storage->data();
      offset += id_bytes;
      for (int64_t j = 0; j < e.num_ids; ++j) {
        DISTSTRAT_CHECK(it.ids[j] >= s.row_offset && it.ids[j] < s.row_offset + s.rows,
                        kInvalidArgument, "push to '", echo(e.name), "': row id ", it.ids[j],
                        " is out of range [", s.row_offset, ", ", s.row_offset + s.rows,
                        ") of shard ", e.shard_index, " (the variable has ", s.full_shape[0],
                        " rows)");
      }
    } else {
      DISTSTRAT_CHECK(e.shape == s.value.shape(), kInvalidArgument, "push to '", echo(e.name),
                      "' shard ", e.shard_index, ": gradient shape ", e.shape.to_string(),
                      " does not match the shard's ", s.value.shape().to_string());
    }
    const size_t value_bytes = static_cast<size_t>(e.shape.num_elements()) * sizeof(float);
    DISTSTRAT_CHECK(offset + value_bytes <= p.payload.size(), kInvalidArgument, "push to '",
                    echo(e.name), "': payload too short for its gradient");
    it.values = reinterpret_cast<const float*>(p.payload.data() + offset);
    offset += value_bytes;
    items.push_back(it);
  }
  DISTSTRAT_CHECK(offset == p.payload.size(), kInvalidArgument, "push: payload has ",
                  p.payload.size(), " bytes, the entries declare ", offset);
  for (const Item& it : items) {
    // The rule is the shard's own (kRule), never the push's.
    DISTSTRAT_CHECK(it.s->rule != nullptr, kFailedPrecondition, "push to '", echo(it.e->name),
                    "' shard ", it.e->shard_index,
                    ": no update rule was declared for it (the chief declares it before its "
                    "first push)");
    // A non-finite gradient never reaches a variable.
    const int64_t n = it.e->shape.num_elements();
    for (int64_t k = 0; k < n; ++k) {
      if (std::isfinite(it.values[k])) continue;
      if (options_.skip_nonfinite_gradients) {
        ++stats_.pushes_nonfinite;
        logger_.warning(who(), ": push from worker ", w.index, " skipped: gradient of '",
                        echo(it.e->name), "' has ", it.values[k], " at element ", k, " (",
                        stats_.pushes_nonfinite, " pushes skipped so far)");
        w.steps = std::max(w.steps, steps_after);  // its step is done, with nothing applied
        return;
      }
      std::ostringstream v;
      v << it.values[k];
      throw InvalidArgumentError("push to '" + echo(it.e->name) + "': gradient element " +
                                 std::to_string(k) + " is " + v.str() +
                                 " (not finite); nothing of the push was applied");
    }
  }
  Shard* iterations = nullptr;
  if (iter_var >= 0) {
    Entry e;
    e.var_id = iter_var;
    e.name = iter_name;
    iterations = &find_shard(e, "push");
    DISTSTRAT_CHECK(iterations->dtype == DType::kInt64 && iterations->value.num_elements() == 1,
                    kInvalidArgument, "push: step counter '", iter_name, "' is ",
                    iterations->value.debug_string(), ", not an int64 scalar");
  }

  // Apply: one step of the rule per shard, over the shard or just its rows.
  for (const Item& it : items) {
    Shard& s = *it.s;
    const ShardUpdater* rule = s.rule.get();
    const std::vector<std::string> slot_names = rule->slot_names();
    std::vector<float*> slots;
    for (const std::string& name : slot_names) {
      auto sl = s.slots.find(name);
      if (sl == s.slots.end())
        sl = s.slots.emplace(name, Tensor(s.value.shape(), DType::kFloat32)).first;
      slots.push_back(sl->second.data<float>());
    }
    const int64_t step = ++s.step;
    float* var = s.value.data<float>();
    if (!it.e->sparse) {
      rule->update(var, it.values, slots.data(), static_cast<size_t>(s.value.num_elements()), step);
      continue;
    }
    const int64_t re = row_elems(s.value.shape());
    std::vector<float*> row_slots(slots.size());
    for (int64_t j = 0; j < it.e->num_ids; ++j) {
      const int64_t row = it.ids[j] - s.row_offset;
      for (size_t k = 0; k < slots.size(); ++k) row_slots[k] = slots[k] + row * re;
      rule->update(var + row * re, it.values + j * re, row_slots.data(), static_cast<size_t>(re),
                   step);
    }
  }
  if (iterations) ++iterations->value.data<int64_t>()[0];

  if (pulled_version >= 0) {
    const int64_t staleness = std::max<int64_t>(0, stats_.version - pulled_version);
    stats_.staleness_sum += staleness;
    stats_.staleness_max = std::max(stats_.staleness_max, staleness);
  }
  ++stats_.version;
  w.steps = std::max(w.steps, steps_after);
  const int slowest = slowest_other(w.index);
  if (slowest >= 0) {
    stats_.max_step_gap = std::max(stats_.max_step_gap, w.steps - workers_[slowest].steps);
  }
}

void Service::handle_assign(WorkerState&, Pending& p) {
  std::vector<std::pair<Shard*, size_t>> items;
  size_t offset = 0;
  for (const Entry& e : p.request.entries()) {
    Shard& s = find_shard(e, "assign");
    DISTSTRAT_CHECK(
        !e.sparse && e.dtype == static_cast<int32_t>(s.dtype) && e.shape == s.value.shape(),
        kInvalidArgument, "assign to '", echo(e.name), "' shard ", e.shard_index, ": value ",
        valid_dtype(e.dtype) ? dtype_name(static_cast<DType>(e.dtype)) : "invalid",
        e.shape.to_string(), " does not match ", s.value.debug_string());
    items.emplace_back(&s, offset);
    offset += s.value.nbytes();
  }
  DISTSTRAT_CHECK(offset == p.payload.size(), kInvalidArgument, "assign: payload has ",
                  p.payload.size(), " bytes, the entries declare ", offset);
  for (auto& [s, off] : items) {
    if (s->value.nbytes()) std::memcpy(s->value.data(), p.payload.data() + off, s->value.nbytes());
    s->initialized = true;
  }
}

std::shared_ptr<const ShardUpdater> Service::updater_for(const DecodedRequest& q) {
  // A shard the request names that applies this very config already has
  // its updater (built, and so validated, from an equal config).
  for (const Entry& e : q.entries()) {
    auto it = shards_.find({e.var_id, e.shard_index});
    if (it != shards_.end() && it->second.rule && same_config(it->second.config, q.rule.config)) {
      return it->second.rule;
    }
  }
  std::shared_ptr<const ShardUpdater> rule =
      make_shard_updater(q.rule.config);  // validates every parameter
  ++updaters_built_;
  return rule;
}

int64_t Service::updaters_built() const {
  std::lock_guard<std::mutex> lock(mu_);
  return updaters_built_;
}

Service::Outcome Service::handle_rule(WorkerState& w, Pending& p) {
  const DecodedRequest& q = p.request;
  // Kept while the request is deferred, so a retry does not build it again.
  if (!p.updater) p.updater = updater_for(q);
  const std::shared_ptr<const ShardUpdater> rule = p.updater;
  // Validate every shard before changing any.
  std::vector<Shard*> shards;
  for (const Entry& e : q.entries()) {
    Shard& s = find_shard(e, "update rule");
    DISTSTRAT_CHECK(s.dtype == DType::kFloat32, kInvalidArgument, "update rule of '", echo(e.name),
                    "': the variable is ", dtype_name(s.dtype), "; optimizers update float32");
    if (q.rule.replace) {
      DISTSTRAT_CHECK(s.rule != nullptr, kFailedPrecondition, "update of the rule of '",
                      echo(e.name), "': none was declared yet");
      DISTSTRAT_CHECK(
          q.rule.config.name == s.config.name && rule->slot_names() == s.rule->slot_names(),
          kInvalidArgument, "update of the rule of '", echo(e.name), "': optimizer '",
          q.rule.config.name, "' with its slots cannot replace '", s.config.name,
          "' (update_hyperparameters changes hyper-parameters, not the optimizer)");
    } else if (s.rule) {
      const std::string diff = config_difference(s.declared, q.rule.config);
      DISTSTRAT_CHECK(diff.empty(), kInvalidArgument, "the optimizer of worker ", w.index, " for '",
                      echo(e.name), "' differs from the update rule the chief fixed: ", diff);
    } else if (w.index != 0) {
      // The chief fixes the rule; another worker's declaration waits for it.
      if (Clock::now() - p.arrived > options_.timeout) {
        throw DeadlineExceededError(
            "update rule of '" + echo(e.name) + "': worker " + std::to_string(w.index) +
            " waited past the deadline for the chief (worker 0) to declare it");
      }
      return Outcome::kDeferred;
    }
    shards.push_back(&s);
  }
  for (Shard* s : shards) {
    if (q.rule.replace) {
      s->rule = rule;
      s->config = q.rule.config;
    } else if (!s->rule) {
      s->rule = rule;
      s->declared = s->config = q.rule.config;
    }
  }
  if (q.rule.replace) {
    logger_.info(who(), ": the chief updated the rule of ", shards.size(), " shard(s): ",
                 config_difference(shards.empty() ? q.rule.config : shards.front()->declared,
                                   q.rule.config));
  }
  return Outcome::kServed;
}

}  // namespace ps
}  // namespace diststrat
