// Checkpoint's save and restore (restore of a subset: expect_partial) and the
// default CheckpointParticipant (one file written by the chief, read by the
// chief and broadcast). What a Checkpoint saves (its entries, named objects):
// checkpoint_objects.cc; CheckpointManager: checkpoint_manager.cc;
// PreemptionHandler: preemption.cc.
#include <atomic>
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <cstring>
#include <functional>
#include <map>
#include <new>
#include <set>
#include <sstream>

#include "runtime/variable_impl.h"
#include "core/file_util.h"
#include "core/user_text.h"
#include "diststrat/checkpoint.h"
#include "diststrat/data.h"
#include "diststrat/data_position.h"
#include "diststrat/optimizer.h"
#include "io/checkpoint_identity.h"
#include "io/checkpoint_internal.h"

namespace diststrat {

namespace ckpt {

bool is_multi_process(const Strategy& s) { return s.cluster().world_size > 1; }
bool is_writer(const Strategy& s) {
  const ClusterInfo c = s.cluster();
  return c.world_size == 1 || c.is_chief();
}

// Broadcasts from the chief (worker 0). Every process calls these in the same order.
int64_t broadcast_int(Strategy& s, int64_t v, const std::string& name) {
  Tensor t(Shape{1}, DType::kInt64);
  t.data<int64_t>()[0] = v;
  s.broadcast(t, 0, name);
  return t.data<int64_t>()[0];
}
std::string broadcast_string(Strategy& s, const std::string& v, const std::string& name) {
  const int64_t n = broadcast_int(s, static_cast<int64_t>(v.size()), name + " length");
  Tensor t(Shape{(n + 7) / 8}, DType::kInt64);
  if (is_writer(s) && n > 0) std::memcpy(t.data(), v.data(), v.size());
  s.broadcast(t, 0, name);
  return std::string(static_cast<const char*>(t.data()), static_cast<size_t>(n));
}

// Runs fn on the chief only and re-raises its error (same code) everywhere.
void on_chief_then_agree(Strategy& s, const std::string& what, const std::function<void()>& fn) {
  int64_t code = -1;
  std::string message;
  std::exception_ptr local;
  if (is_writer(s)) {
    try {
      fn();
    } catch (const Error& e) {
      code = static_cast<int64_t>(e.code());
      message = e.message();
      local = std::current_exception();
    } catch (const std::bad_alloc&) {
      // Only diststrat::Error leaves a public call, on the chief as elsewhere.
      code = static_cast<int64_t>(ErrorCode::kResourceExhausted);
      message = what + ": out of memory";
    } catch (const std::exception& e) {
      code = static_cast<int64_t>(ErrorCode::kInternal);
      message = what + ": " + e.what();
    }
  }
  if (is_multi_process(s)) {
    code = broadcast_int(s, code, what + " status");
    if (code >= 0) message = broadcast_string(s, message, what + " error");
  }
  if (local) std::rethrow_exception(local);
  if (code >= 0 && is_writer(s)) throw_error(static_cast<ErrorCode>(code), message);
  if (code >= 0) {
    throw_error(static_cast<ErrorCode>(code), "rank " + std::to_string(s.cluster().rank) +
                                                  ": the chief failed " + what + ": " + message);
  }
}

std::string encode_metadata(const CheckpointMetadata& md) {
  // Length-prefixed "<n>:<key><n>:<value>" pairs.
  std::ostringstream os;
  for (const auto& [k, v] : md) os << k.size() << ':' << k << v.size() << ':' << v;
  return os.str();
}
CheckpointMetadata decode_metadata(const std::string& s) {
  // Bytes from the wire: every length is checked before it is used.
  CheckpointMetadata md;
  size_t i = 0;
  auto next = [&] {
    const size_t colon = s.find(':', i);
    int64_t n = 0;
    if (colon == std::string::npos ||
        !parse_int(s.substr(i, colon - i), 0, static_cast<int64_t>(s.size() - colon - 1), &n)) {
      throw DataLossError("checkpoint metadata broadcast by the chief is malformed at byte " +
                          std::to_string(i) + " of " + std::to_string(s.size()));
    }
    std::string out = s.substr(colon + 1, static_cast<size_t>(n));
    i = colon + 1 + static_cast<size_t>(n);
    return out;
  };
  while (i < s.size()) {
    std::string k = next();
    md[k] = next();
  }
  return md;
}

bool parse_int(const std::string& text, int64_t lo, int64_t hi, int64_t* out) {
  size_t i = 0;
  const bool negative = !text.empty() && text[0] == '-';
  if (negative) i = 1;
  if (i == text.size() || text.size() - i > 19) return false;
  uint64_t v = 0;
  for (; i < text.size(); ++i) {
    if (text[i] < '0' || text[i] > '9') return false;
    v = v * 10 + static_cast<uint64_t>(text[i] - '0');  // 19 digits cannot wrap a uint64
  }
  const uint64_t max_magnitude =
      static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) + (negative ? 1 : 0);
  if (v > max_magnitude) return false;
  const int64_t x = negative ? static_cast<int64_t>(0 - v) : static_cast<int64_t>(v);
  if (x < lo || x > hi) return false;
  *out = x;
  return true;
}

}  // namespace ckpt

using ckpt::broadcast_int;
using ckpt::broadcast_string;
using ckpt::decode_metadata;
using ckpt::encode_metadata;
using ckpt::is_multi_process;
using ckpt::is_writer;
using ckpt::kReservedPrefix;
using ckpt::on_chief_then_agree;

int64_t metadata_int(const CheckpointMetadata& md, const std::string& key, int64_t min, int64_t max,
                     const std::string& source) {
  // Inverted bounds are the caller's mistake, not the file's.
  DISTSTRAT_CHECK(min <= max, kInvalidArgument, "metadata_int('", echo(key), "', checkpoint '",
                  source, "'): min ", min, " is greater than max ", max);
  auto it = md.find(key);
  DISTSTRAT_CHECK(it != md.end(), kInvalidArgument, "checkpoint '", source, "' has no metadata '",
                  echo(key), "'");
  int64_t v = 0;
  if (!ckpt::parse_int(it->second, min, max, &v)) {
    throw DataLossError("checkpoint '" + source + "': metadata '" + echo(key) + "' is '" +
                        echo(it->second, 64) + "', not an integer in [" + std::to_string(min) +
                        ", " + std::to_string(max) + "]");
  }
  return v;
}

// ---- matching a file against a model ----------------------------------------

CheckpointContents match_checkpoint(const SafetensorsFile& file, const std::string& path,
                                    const std::vector<std::pair<std::string, Tensor>>& expected,
                                    const std::vector<std::string>& optional, bool allow_unused) {
  const std::set<std::string> opt(optional.begin(), optional.end());
  std::set<std::string> expected_names;
  std::vector<std::string> problems;
  CheckpointContents out;
  for (const auto& [name, want] : expected) {
    expected_names.insert(name);
    const Tensor* got = file.find(name);
    if (!got) {
      if (!opt.count(name)) {
        problems.push_back("tensor '" + echo(name) + "' (" + dtype_name(want.dtype()) +
                           want.shape().to_string() + ") is missing");
      }
      continue;
    }
    if (got->dtype() != want.dtype() || got->shape() != want.shape()) {
      problems.push_back("tensor '" + echo(name) + "' is " + dtype_name(got->dtype()) +
                         got->shape().to_string() + " in the file but " + dtype_name(want.dtype()) +
                         want.shape().to_string() + " in the model");
      continue;
    }
    out.tensors.emplace_back(name, *got);
  }
  for (const auto& [name, t] : file.tensors) {
    if (!expected_names.count(name) && allow_unused) {
      out.unused.push_back(name);
    } else if (!expected_names.count(name)) {
      problems.push_back("tensor '" + echo(name) + "' (" + dtype_name(t.dtype()) +
                         t.shape().to_string() + ") is not in the model");
    }
  }
  if (!problems.empty()) {
    std::string msg = "checkpoint '" + path + "' does not match the model: ";
    const size_t shown = std::min<size_t>(problems.size(), 5);
    for (size_t i = 0; i < shown; ++i) msg += (i ? "; " : "") + problems[i];
    if (problems.size() > shown)
      msg += "; and " + std::to_string(problems.size() - shown) + " more";
    throw InvalidArgumentError(msg);
  }
  for (const auto& [k, v] : file.metadata) {
    if (k.rfind(kReservedPrefix, 0) != 0) out.metadata[k] = v;
  }
  std::sort(out.unused.begin(), out.unused.end());
  return out;
}

// ---- the default participant ------------------------------------------------

void CheckpointParticipant::check_checkpoint_supported(Strategy&, const std::string&) {}

bool CheckpointParticipant::needs_state_to_write() const { return true; }

bool CheckpointParticipant::agree_to_stop(Strategy& strategy, int64_t, bool signalled) {
  // A max-reduction over every replica: 1 anywhere means everyone stops here.
  std::vector<double> local(static_cast<size_t>(strategy.num_local_replicas()),
                            signalled ? 1.0 : 0.0);
  return strategy.reduce(ReduceOp::kMax, PerReplica<double>(local)) > 0.5;
}

std::vector<Tensor> CheckpointParticipant::read_slots(Strategy& strategy,
                                                      const std::vector<SlotRef>& slots) {
  std::vector<Tensor> out(slots.size());
  if (slots.empty()) return out;
  strategy.run_between_steps([&](ReplicaContext& ctx) {
    if (ctx.local_replica_id() != 0) return;
    for (size_t k = 0; k < slots.size(); ++k) {
      const Tensor& src = slots[k].var->slot(slots[k].slot).at(0);
      Tensor host(src.shape(), src.dtype());
      host.copy_from(src);
      out[k] = host;
    }
  });
  return out;
}

void CheckpointParticipant::assign_slots(Strategy& strategy, const std::vector<SlotRef>& slots,
                                         const std::vector<Tensor>& values) {
  DISTSTRAT_CHECK_EQ(slots.size(), values.size(), "checkpoint: assign_slots");
  if (slots.empty()) return;
  strategy.run_between_steps([&](ReplicaContext& ctx) {
    const size_t i = static_cast<size_t>(ctx.local_replica_id());
    for (size_t k = 0; k < slots.size(); ++k) {
      std::vector<Tensor>& copies = slots[k].var->slot(slots[k].slot);
      if (i < copies.size()) copies[i].copy_from(values[k]);
    }
  });
}

void CheckpointParticipant::write_checkpoint(
    Strategy& strategy, const std::string& path,
    const std::vector<std::pair<std::string, Tensor>>& state, const CheckpointMetadata& metadata) {
  on_chief_then_agree(strategy, "to write checkpoint '" + path + "'",
                      [&] { ckpt::save_safetensors_reserved(path, state, metadata); });
}

CheckpointContents CheckpointParticipant::read_checkpoint(
    Strategy& strategy, const std::string& path,
    const std::vector<std::pair<std::string, Tensor>>& expected,
    const std::vector<std::string>& optional, const RestoreOptions& options) {
  CheckpointContents contents;
  on_chief_then_agree(strategy, "to read checkpoint '" + path + "'", [&] {
    SafetensorsLoadOptions lo;
    lo.require_checksums = options.require_checksums;
    lo.allow_non_finite = options.allow_non_finite;
    // A single file, or a parameter-server checkpoint reassembled from its shards.
    contents = match_checkpoint(load_checkpoint(path, lo), path, expected, optional,
                                options.expect_partial);
  });
  if (!is_multi_process(strategy)) return contents;
  // Every process gets the chief's validated tensors: which are present, then each.
  std::set<std::string> present;
  for (const auto& nt : contents.tensors) present.insert(nt.first);
  CheckpointContents out;
  for (const auto& [name, want] : expected) {
    const bool here =
        broadcast_int(strategy, present.count(name) ? 1 : 0, "checkpoint '" + name + "' present");
    if (!here) continue;
    Tensor t(want.shape(), want.dtype());
    if (is_writer(strategy)) {
      for (const auto& nt : contents.tensors) {
        if (nt.first == name) t.copy_from(nt.second);
      }
    }
    strategy.broadcast(t, 0, "checkpoint '" + name + "'");
    out.tensors.emplace_back(name, t);
  }
  out.metadata = decode_metadata(
      broadcast_string(strategy, encode_metadata(contents.metadata), "checkpoint metadata"));
  if (options.expect_partial) {
    CheckpointMetadata unused;
    for (const std::string& n : contents.unused) unused[n] = "";
    for (const auto& kv :
         decode_metadata(broadcast_string(strategy, encode_metadata(unused), "checkpoint unused")))
      out.unused.push_back(kv.first);
  }
  return out;
}

// ---- Checkpoint ---------------------------------------------------------------

Checkpoint::Checkpoint(Strategy& strategy, std::vector<const Optimizer*> optimizers)
    : strategy_(&strategy), optimizers_(std::move(optimizers)) {
  for (const Optimizer* o : optimizers_) {
    DISTSTRAT_CHECK(o != nullptr && &o->strategy() == &strategy, kInvalidArgument,
                    "Checkpoint: an optimizer belongs to another strategy");
  }
}

CheckpointParticipant& Checkpoint::participant() const {
  if (auto* p = dynamic_cast<CheckpointParticipant*>(strategy_)) return *p;
  return default_participant_;
}

void Checkpoint::save(const std::string& path, const CheckpointMetadata& metadata,
                      const SaveOptions& options) const {
  for (const auto& [k, v] : metadata) {
    DISTSTRAT_CHECK(k.rfind(kReservedPrefix, 0) != 0, kInvalidArgument, "Checkpoint::save '", path,
                    "': metadata key '", k, "' uses the reserved prefix 'diststrat.'");
  }
  write(path, metadata, options);
}

void Checkpoint::write(const std::string& path, const CheckpointMetadata& metadata,
                       const SaveOptions& options) const {
  participant().check_checkpoint_supported(*strategy_, "Checkpoint::save '" + path + "'");
  // The steps enqueued on GPU replicas finish first, and their device errors
  // (a label out of range) are thrown naming their step, not saved.
  strategy_->synchronize();
  CheckpointParticipant& p = participant();
  // The file writer (the chief's save_safetensors_reserved) scans every
  // tensor for NaN/Inf on its CRC pass unless the file says it may hold them;
  // its refusal reaches every process like any write error.
  CheckpointMetadata md = metadata;
  if (options.allow_non_finite) md[ckpt::kNonFiniteKey] = ckpt::kNonFiniteAllowed;
  p.write_checkpoint(
      *strategy_, path,
      p.needs_state_to_write() ? state() : std::vector<std::pair<std::string, Tensor>>{}, md);
}

CheckpointMetadata Checkpoint::restore(const std::string& path,
                                       const RestoreOptions& options) const {
  participant().check_checkpoint_supported(*strategy_, "Checkpoint::restore '" + path + "'");
  const bool own_reader = &participant() == &default_participant_;
  DISTSTRAT_CHECK(own_reader || !options.expect_partial, kUnimplemented, "Checkpoint::restore '",
                  path,
                  "': RestoreOptions::expect_partial is not supported under "
                  "ParameterServerStrategy yet");
  const std::vector<Entry> es = entries();
  std::vector<std::pair<std::string, Tensor>> expected;  // in creation order, as errors list them
  for (const Entry& e : es) expected.push_back(expected_of(e));
  std::vector<std::string> optional;
  for (const Entry& e : es) {
    if (options.expect_partial || (e.optimizer_state && options.allow_missing_optimizer_state))
      optional.push_back(e.name);
  }
  CheckpointParticipant& p = participant();
  // Everything is read and validated before the first write into the model.
  CheckpointContents c = p.read_checkpoint(*strategy_, path, expected, optional, options);
  write_into_model(es, c.tensors, path);
  RestoreReport report;
  report.path = path;
  if (own_reader) {
    std::set<std::string> got;
    for (const auto& nt : c.tensors) got.insert(nt.first);
    for (const auto& nt : expected) {
      if (!got.count(nt.first)) report.missing.push_back(nt.first);
    }
    report.unused = c.unused;
  }
  if (options.expect_partial && (!report.missing.empty() || !report.unused.empty())) {
    auto list = [](const std::vector<std::string>& v) {
      std::string out;
      const size_t shown = std::min<size_t>(v.size(), 10);
      for (size_t i = 0; i < shown; ++i) out += (i ? ", '" : "'") + echo(v[i]) + "'";
      if (v.size() > shown) out += " and " + std::to_string(v.size() - shown) + " more";
      return out.empty() ? std::string("none") : out;
    };
    strategy_->logger().info(
        "Checkpoint::restore '", path,
        "' (expect_partial): not in the file, kept as they were: ", list(report.missing),
        "; in the file, not restored: ", list(report.unused));
  }
  last_restore_ = std::move(report);
  return c.metadata;
}

void Checkpoint::assign(const std::vector<std::pair<std::string, Tensor>>& state,
                        const std::string& what) const {
  const std::vector<Entry> es = entries();
  std::vector<std::pair<std::string, Tensor>> expected;
  for (const Entry& e : es) expected.push_back(expected_of(e));
  SafetensorsFile file;
  file.tensors = state;
  write_into_model(es, match_checkpoint(file, what, expected).tensors, what);
}

void Checkpoint::write_into_model(const std::vector<Entry>& es,
                                  const std::vector<std::pair<std::string, Tensor>>& tensors,
                                  const std::string& path) const {
  CheckpointParticipant& p = participant();
  // Data positions are checked (data order, consistency) before any write.
  const std::map<int, DataPosition> positions = read_positions(tensors, path);
  std::map<std::string, Tensor> by_name(tensors.begin(), tensors.end());
  std::vector<CheckpointParticipant::SlotRef> slots;
  std::vector<Tensor> slot_values;
  for (const Entry& e : es) {
    auto it = by_name.find(e.name);
    if (it == by_name.end() || e.position_object >= 0) continue;  // absent: keeps its value
    if (e.slot.empty()) {
      Variable v = e.var;
      v.assign(it->second);
    } else {
      slots.push_back({&e.var.impl(), e.slot});
      slot_values.push_back(it->second);
    }
  }
  std::vector<CheckpointParticipant::SlotRef> plain;
  std::vector<Tensor> plain_values;
  for (size_t k = 0; k < slots.size(); ++k) {
    const Optimizer* owner = nullptr;
    for (const Optimizer* o : optimizers_) {
      if (!owner && o->sharded_slot(*slots[k].var, slots[k].slot)) owner = o;
    }
    if (owner) {
      owner->assign_sharded_slots({{slots[k].var, slots[k].slot}}, {slot_values[k]});
    } else {
      plain.push_back(slots[k]);
      plain_values.push_back(slot_values[k]);
    }
  }
  p.assign_slots(*strategy_, plain, plain_values);
  for (const auto& [k, pos] : positions) *objects_[static_cast<size_t>(k)].second.position_ = pos;
}

}  // namespace diststrat
