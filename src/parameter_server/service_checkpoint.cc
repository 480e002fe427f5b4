// The PS service's part of checkpoints: writing this rank's shard file,
// reading slots, restoring shards, and snapshots of the shards.
#include "parameter_server/service.h"

#include <cstring>

#include "core/user_text.h"
#include "io/checkpoint_identity.h"
#include "io/checkpoint_internal.h"
#include "parameter_server/shard_updater.h"

namespace diststrat {
namespace ps {

void Service::handle_save(Pending& p, Reply& reply) {
  // The request names a stem only (decode_request: no '/', no ".."); the
  // directory, PS index and count are this PS's own.
  std::string dir = options_.checkpoint_dir;
  if (dir.empty()) {
    // Not configured: the worker's directory, still under a derived name
    // (so no file but a shard file of this PS is ever replaced).
    DISTSTRAT_CHECK(!p.request.save.dir.empty(), kFailedPrecondition, who(),
                    " has no checkpoint directory (ParameterServerOptions::checkpoint_dir, or "
                    "DISTSTRAT_PS_CHECKPOINT_DIR on the PS ranks) and the request names none");
    // The first save's directory becomes this PS's own (a directory this
    // user or root owns, not writable by others unless sticky: the checkpoint
    // manager's rules); a later request naming another is rejected, so a
    // crafted request cannot move the writes elsewhere once the job saved.
    if (adopted_dir_.empty()) {
      ckpt::check_directory_owner(p.request.save.dir);
      adopted_dir_ = p.request.save.dir;
      logger_.warning(who(), ": no checkpoint directory configured; writing shard files into '",
                      adopted_dir_,
                      "', the directory the first save named, and only there (set "
                      "ParameterServerOptions::checkpoint_dir to fix it in advance)");
    }
    DISTSTRAT_CHECK(p.request.save.dir == adopted_dir_, kInvalidArgument,
                    "the request names directory '", p.request.save.dir.substr(0, 200),
                    "', this PS writes only into '", adopted_dir_,
                    "', the directory of this job's first save");
    dir = adopted_dir_;
  } else {
    DISTSTRAT_CHECK(p.request.save.dir.empty() || p.request.save.dir == dir, kInvalidArgument,
                    "the request names directory '", p.request.save.dir.substr(0, 200),
                    "', this PS writes only into its own '", dir, "'");
  }
  const uint64_t save_id = p.request.save.save_id;
  const int32_t ps = options_.ps_index;
  const int32_t num_ps = options_.num_ps;
  const std::string path =
      ckpt::shard_file_path(dir + "/" + p.request.save.stem + ".safetensors", ps, num_ps, save_id);
  const std::vector<ShardSnapshot> shards = snapshot_locked();
  // Blocks this loop for the write: the workers are quiesced (a save is
  // collective), and the snapshot is the state after every push before it.
  ckpt::write_shard_file(path, save_id, ps, num_ps, shards);
  reply.payload = encode(SaveReply{static_cast<int64_t>(shards.size())});
}

void Service::handle_read_slots(Pending& p, Reply& reply) {
  std::vector<std::pair<const Shard*, std::string>> items;
  size_t bytes = 0;
  for (size_t i = 0; i < p.request.entries().size(); ++i) {
    const Entry& e = p.request.entries()[i];
    const std::string& slot = p.request.read_slots.slot_of[i];
    const Shard& s = find_shard(e, "slot read");
    DISTSTRAT_CHECK(s.dtype == DType::kFloat32, kInvalidArgument, "slot read of '", echo(e.name),
                    "': the variable is ", dtype_name(s.dtype),
                    ", only float32 variables have slots");
    items.emplace_back(&s, slot);
    bytes += static_cast<size_t>(s.value.num_elements()) * sizeof(float);
  }
  DISTSTRAT_CHECK(static_cast<int64_t>(bytes) == p.header.reply_bytes, kInvalidArgument,
                  "slot read: the reply is ", bytes, " bytes, the request expects ",
                  p.header.reply_bytes);
  reply.payload.assign(bytes, 0);  // a slot not created yet (no push) is zeros
  char* out = reply.payload.data();
  for (const auto& [s, slot] : items) {
    const size_t b = static_cast<size_t>(s->value.num_elements()) * sizeof(float);
    auto it = s->slots.find(slot);
    if (it != s->slots.end() && b) std::memcpy(out, it->second.data(), b);
    out += b;
  }
}

void Service::handle_restore(Pending& p) {
  struct Item {
    Shard* s;
    bool has_value;
    int64_t step;
    std::vector<std::string> slots;
    size_t offset;
  };
  std::vector<Item> items;
  size_t offset = 0;
  // Validate everything before writing anything.
  for (size_t i = 0; i < p.request.entries().size(); ++i) {
    const Entry& e = p.request.entries()[i];
    const RestoreSpec& spec = p.request.restore.specs[i];
    Shard* shard = &find_shard(e, "restore");
    Item it{shard, spec.has_value, spec.step, spec.slots, offset};
    const Shard& s = *it.s;
    DISTSTRAT_CHECK(e.dtype == static_cast<int32_t>(s.dtype) && e.shape == s.value.shape(),
                    kInvalidArgument, "restore of '", echo(e.name), "' shard ", e.shard_index,
                    ": value ",
                    valid_dtype(e.dtype) ? dtype_name(static_cast<DType>(e.dtype)) : "invalid",
                    e.shape.to_string(), " does not match ", s.value.debug_string());
    DISTSTRAT_CHECK(it.slots.empty() || s.dtype == DType::kFloat32, kInvalidArgument,
                    "restore of '", echo(e.name), "': slots for a ", dtype_name(s.dtype),
                    " variable");
    offset += (it.has_value ? s.value.nbytes() : 0) +
              it.slots.size() * static_cast<size_t>(s.value.num_elements()) * sizeof(float);
    items.push_back(std::move(it));
  }
  DISTSTRAT_CHECK(offset == p.payload.size(), kInvalidArgument, "restore: payload has ",
                  p.payload.size(), " bytes, the entries declare ", offset);
  for (Item& it : items) {
    Shard& s = *it.s;
    const char* src = p.payload.data() + it.offset;
    if (it.has_value) {
      if (s.value.nbytes()) std::memcpy(s.value.data(), src, s.value.nbytes());
      src += s.value.nbytes();
      s.initialized = true;
    }
    for (const std::string& slot : it.slots) {
      Tensor t(s.value.shape(), DType::kFloat32);
      if (t.nbytes()) std::memcpy(t.data(), src, t.nbytes());
      src += t.nbytes();
      s.slots[slot] = t;
    }
    if (it.step >= 0) s.step = it.step;
  }
}

std::vector<ShardSnapshot> Service::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return snapshot_locked();
}

std::vector<ShardSnapshot> Service::snapshot_locked() const {
  std::vector<ShardSnapshot> out;
  for (const auto& [key, s] : shards_) {
    ShardSnapshot snap;
    snap.variable = s.name;
    snap.shard_index = key.second;
    snap.num_shards = s.num_shards;
    snap.row_offset = s.row_offset;
    snap.full_shape = s.full_shape;
    snap.value = s.value.clone();
    for (const auto& [name, t] : s.slots) snap.slots.emplace(name, t.clone());
    snap.step = s.step;
    out.push_back(std::move(snap));
  }
  return out;
}

void Service::restore(const std::vector<ShardSnapshot>& shards) {
  std::lock_guard<std::mutex> lock(mu_);
  DISTSTRAT_CHECK(shards_.empty(), kFailedPrecondition, who(),
                  ": restore after workers created variables; restore before training starts");
  for (const ShardSnapshot& s : shards) {
    ShardSnapshot copy = s;
    copy.value = s.value.clone();
    for (auto& [name, t] : copy.slots) t = t.clone();
    restored_[{s.variable, s.shard_index}] = std::move(copy);
  }
}

}  // namespace ps
}  // namespace diststrat
