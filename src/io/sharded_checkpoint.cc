// The parameter server's sharded checkpoint format (see checkpoint_internal.h):
// writing a PS rank's shard file and the chief's index, and reading both back
// into whole variables with every cross-check between them.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "core/file_util.h"
#include "core/user_text.h"
#include "io/checkpoint_internal.h"

namespace diststrat {
namespace ckpt {

using json = nlohmann::json;

namespace {

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string value_name(const std::string& var, int64_t shard) {
  return var + "/shard-" + std::to_string(shard);
}

// A file's path as messages quote it: a shard file's name comes from the
// index, so from the file, and is escaped like every such string.
std::string shown_path(const std::string& path) { return echo(path, 4 * kMaxEchoedChars); }

// Reads a required JSON field; a missing or mistyped one is a DataLossError
// naming the file.
template <typename T>
T field(const json& j, const char* key, const std::string& file) {
  try {
    return j.at(key).get<T>();
  } catch (const json::exception& e) {
    throw DataLossError("checkpoint file '" + shown_path(file) +
                        "': malformed parameter-server metadata (field '" + key +
                        "': " + echo(e.what()) + ")");
  }
}

json parse_json(const std::string& text, const std::string& file, const char* key) {
  try {
    json j = json::parse(text);
    if (!j.is_object())
      throw DataLossError("checkpoint file '" + shown_path(file) + "': '" + key +
                          "' is not a JSON object");
    return j;
  } catch (const json::exception& e) {
    throw DataLossError("checkpoint file '" + shown_path(file) + "': '" + key +
                        "' is not valid JSON: " + echo(e.what()));
  }
}

// A required integer field within [lo, hi]: not a float, a string or a number
// that only fits after wrapping (nlohmann's get<int> would truncate 2^32 to 0).
int64_t int_field(const json& j, const char* key, const std::string& file, int64_t lo, int64_t hi) {
  const json* v = nullptr;
  if (j.is_object()) {
    auto it = j.find(key);
    if (it != j.end()) v = &*it;
  }
  bool ok = v && v->is_number_integer();
  int64_t x = 0;
  if (ok && v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    ok = u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    x = static_cast<int64_t>(u);
  } else if (ok) {
    x = v->get<int64_t>();
  }
  if (!ok || x < lo || x > hi) {
    throw DataLossError("checkpoint file '" + shown_path(file) +
                        "': malformed parameter-server metadata (field '" + key + "' is " +
                        (v ? echo(v->dump()) : std::string("missing")) + ", not an integer in [" +
                        std::to_string(lo) + ", " + std::to_string(hi) + "])");
  }
  return x;
}
constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();
constexpr int64_t kMaxPs = 1 << 20;

// A shape whose element count fits: every dim a natural number, the product
// (in bytes of `dtype`) without overflow.
Shape shape_of(const json& j, const char* key, const std::string& file, DType dtype) {
  auto bad = [&](const std::string& why) {
    return DataLossError("checkpoint file '" + shown_path(file) +
                         "': malformed parameter-server metadata (field '" + key + "': " + why +
                         ")");
  };
  if (!j.contains(key) || !j[key].is_array()) throw bad("not an array");
  std::vector<int64_t> dims;
  uint64_t bytes = dtype_size(dtype);
  bool overflow = false, zero = false;
  for (const json& d : j[key]) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(kMaxInt)) {
      throw bad(echo(d.dump()) + " is not a dimension");
    }
    const uint64_t v = d.get<uint64_t>();
    if (v == 0) {
      zero = true;
    } else if (!overflow && bytes > static_cast<uint64_t>(kMaxInt) / v) {
      overflow = true;
    } else if (!overflow) {
      bytes *= v;
    }
    dims.push_back(static_cast<int64_t>(v));
  }
  if (overflow && !zero) throw bad(echo(j[key].dump()) + " is too large");
  return Shape(dims);
}

size_t row_bytes_of(const Shape& full, DType dtype) {
  int64_t n = 1;
  for (size_t i = 1; i < full.rank(); ++i) n *= full[i];
  return static_cast<size_t>(n) * dtype_size(dtype);
}
Shape rows_shape(const Shape& full, int64_t rows) {
  std::vector<int64_t> d = full.dims();
  if (!d.empty()) d[0] = rows;
  return Shape(d);
}

}  // namespace

std::string shard_file_path(const std::string& index_path, int ps, int num_ps, uint64_t save_id) {
  static const std::string suffix = ".safetensors";
  std::string stem = index_path;
  if (stem.size() > suffix.size() &&
      stem.compare(stem.size() - suffix.size(), suffix.size(), suffix) == 0) {
    stem.resize(stem.size() - suffix.size());
  }
  return stem + ".ps-" + std::to_string(ps) + "-of-" + std::to_string(num_ps) + "." +
         hex64(save_id) + suffix;
}

void write_shard_file(const std::string& path, uint64_t save_id, int ps, int num_ps,
                      const std::vector<ShardSnapshot>& shards) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  json list = json::array();
  for (const ShardSnapshot& s : shards) {
    json j;
    j["variable"] = s.variable;
    j["index"] = s.shard_index;
    j["num_shards"] = s.num_shards;
    j["row_offset"] = s.row_offset;
    j["rows"] = s.value.shape().rank() ? s.value.shape()[0] : int64_t{1};
    j["full_shape"] = s.full_shape.dims();
    j["step"] = s.step;
    const std::string vname = value_name(s.variable, s.shard_index);
    j["value"] = vname;
    tensors.emplace_back(vname, s.value);
    json slots = json::object();
    for (const auto& [slot, t] : s.slots) {
      slots[slot] = vname + "/" + slot;
      tensors.emplace_back(vname + "/" + slot, t);
    }
    j["slots"] = slots;
    list.push_back(j);
  }
  json meta;
  meta["format"] = 1;
  meta["save_id"] = hex64(save_id);
  meta["ps"] = ps;
  meta["num_ps"] = num_ps;
  meta["shards"] = list;
  save_safetensors_reserved(path, tensors, {{kShardKey, meta.dump()}});
}

void write_index(const std::string& path, uint64_t save_id,
                 const std::vector<std::string>& shard_files,
                 const std::vector<IndexVariable>& variables,
                 const CheckpointMetadata& user_metadata) {
  json meta;
  meta["format"] = 1;
  meta["save_id"] = hex64(save_id);
  json files = json::array();
  for (const std::string& f : shard_files) files.push_back(fs::file_name_of(f));
  meta["files"] = files;
  json vars = json::array();
  for (const IndexVariable& v : variables) {
    json j;
    j["name"] = v.name;
    j["dtype"] = dtype_name(v.dtype);
    j["shape"] = v.shape.dims();
    json shards = json::array();
    for (const IndexShard& s : v.shards) {
      shards.push_back(
          {{"index", s.index}, {"ps", s.ps}, {"row_offset", s.row_offset}, {"rows", s.rows}});
    }
    j["shards"] = shards;
    vars.push_back(j);
  }
  meta["variables"] = vars;
  CheckpointMetadata md = user_metadata;
  md[kIndexKey] = meta.dump();
  save_safetensors_reserved(path, {}, md);
}

std::optional<ShardFileName> parse_shard_file_name(const std::string& name) {
  // ckpt-<N>.ps-<i>-of-<n>.<16 hex>.safetensors
  static const std::string suffix = ".safetensors";
  if (name.rfind("ckpt-", 0) != 0 || name.size() <= suffix.size() ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return std::nullopt;
  }
  const std::string body = name.substr(0, name.size() - suffix.size());
  const size_t ps_at = body.find(".ps-");
  if (ps_at == std::string::npos) return std::nullopt;
  const std::string stem = body.substr(0, ps_at), rest = body.substr(ps_at + 4);
  const size_t of = rest.find("-of-"), dot = rest.find('.');
  if (of == std::string::npos || dot == std::string::npos || dot < of) return std::nullopt;
  const std::string ps = rest.substr(0, of), num = rest.substr(of + 4, dot - of - 4),
                    hex = rest.substr(dot + 1);
  int64_t step = 0, p = 0, n = 0;
  if (stem.size() <= 5 || !parse_int(stem.substr(5), 0, kMaxInt, &step) ||
      stem != "ckpt-" + std::to_string(step) || !parse_int(ps, 0, kMaxPs, &p) ||
      !parse_int(num, 1, kMaxPs, &n) || p >= n || std::to_string(p) != ps ||
      std::to_string(n) != num || hex.size() != 16 ||
      hex.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return std::nullopt;
  }
  ShardFileName out;
  out.index_name = stem + suffix;
  out.ps = static_cast<int>(p);
  out.num_ps = static_cast<int>(n);
  for (char c : hex)
    out.save_id = (out.save_id << 4) | static_cast<uint64_t>(c <= '9' ? c - '0' : c - 'a' + 10);
  return out;
}

bool is_own_shard_file(const std::string& path) {
  const auto parsed = parse_shard_file_name(fs::file_name_of(path));
  if (!parsed) return false;
  try {
    const SafetensorsHeader h = read_safetensors_header(path);
    auto it = h.metadata.find(kShardKey);
    if (!h.verified || it == h.metadata.end()) return false;
    const json j = parse_json(it->second, path, kShardKey);
    return field<std::string>(j, "save_id", path) == hex64(parsed->save_id) &&
           int_field(j, "ps", path, 0, kMaxPs) == parsed->ps &&
           int_field(j, "num_ps", path, 1, kMaxPs) == parsed->num_ps;
  } catch (const Error&) {
    return false;
  }
}

std::vector<std::string> shard_files_of(const std::string& index_path) {
  std::vector<std::string> out;
  try {
    // The header is enough (and cheap): the index holds no tensors.
    const SafetensorsHeader h = read_safetensors_header(index_path);
    auto it = h.metadata.find(kIndexKey);
    if (it == h.metadata.end()) return out;
    const json j = parse_json(it->second, index_path, kIndexKey);
    for (const std::string& name : field<std::vector<std::string>>(j, "files", index_path)) {
      if (!name.empty() && name.find('/') == std::string::npos)
        out.push_back(fs::directory_of(index_path) + "/" + name);
    }
  } catch (const Error&) {
    out.clear();
  }
  return out;
}

LoadedCheckpoint load_any(const std::string& path, const SafetensorsLoadOptions& options) {
  LoadedCheckpoint out;
  SafetensorsFile index = load_safetensors(path, options);
  auto idx_it = index.metadata.find(kIndexKey);
  if (idx_it == index.metadata.end()) {
    out.file = std::move(index);
    return out;
  }
  out.sharded = true;
  auto lost = [&](const std::string& file, const std::string& msg) -> DataLossError {
    return DataLossError("parameter-server checkpoint '" + path +
                         "': " + (file.empty() ? "" : "shard file '" + shown_path(file) + "': ") +
                         echo(msg, 4 * kMaxEchoedChars));  // names and ids from the file, escaped
  };
  if (!index.tensors.empty())
    throw lost("", "the index holds tensors ('" + index.tensors[0].first + "')");
  const json ij = parse_json(idx_it->second, path, kIndexKey);
  if (int_field(ij, "format", path, 0, kMaxInt) != 1) throw lost("", "unknown index format");
  const std::string save_id = field<std::string>(ij, "save_id", path);
  const auto files = field<std::vector<std::string>>(ij, "files", path);

  // Every shard file: loaded and verified, from this save, its shards by (variable, index).
  struct Saved {
    const Tensor* value = nullptr;
    std::map<std::string, const Tensor*> slots;
    int ps = 0;
    int64_t row_offset = 0, rows = 0, step = 0;
    std::string file;
    bool used = false;
  };
  std::vector<SafetensorsFile> shard_files(files.size());
  std::map<std::pair<std::string, int64_t>, Saved> saved;
  for (size_t i = 0; i < files.size(); ++i) {
    if (files[i].empty() || files[i].find('/') != std::string::npos)
      throw lost("", "bad shard file name '" + files[i] + "'");
    const std::string fp = fs::directory_of(path) + "/" + files[i];
    SafetensorsFile& sf = shard_files[i];
    try {
      sf = load_safetensors(fp, options);
    } catch (const NotFoundError& e) {
      throw NotFoundError("parameter-server checkpoint '" + path + "': shard file of PS " +
                          std::to_string(i) + " is missing: " + e.message());
    }
    auto it = sf.metadata.find(kShardKey);
    if (it == sf.metadata.end())
      throw lost(fp, "not a parameter-server shard file (no '" + std::string(kShardKey) + "')");
    const json sj = parse_json(it->second, fp, kShardKey);
    if (field<std::string>(sj, "save_id", fp) != save_id) {
      throw lost(fp, "written by another save (save id " + field<std::string>(sj, "save_id", fp) +
                         ", the index has " + save_id + ")");
    }
    const int64_t file_ps = int_field(sj, "ps", fp, 0, kMaxPs),
                  file_num_ps = int_field(sj, "num_ps", fp, 1, kMaxPs);
    if (file_ps != static_cast<int64_t>(i) || file_num_ps != static_cast<int64_t>(files.size())) {
      throw lost(fp, "holds PS " + std::to_string(file_ps) + " of " + std::to_string(file_num_ps) +
                         ", the index lists it as PS " + std::to_string(i) + " of " +
                         std::to_string(files.size()));
    }
    if (!sj.contains("shards") || !sj["shards"].is_array()) throw lost(fp, "no shard list");
    std::set<std::string> named;
    for (const json& s : sj["shards"]) {
      Saved rec;
      rec.ps = static_cast<int>(i);
      rec.file = fp;
      const std::string var = field<std::string>(s, "variable", fp);
      const int64_t k = int_field(s, "index", fp, 0, kMaxInt);
      rec.row_offset = int_field(s, "row_offset", fp, 0, kMaxInt);
      rec.rows = int_field(s, "rows", fp, 0, kMaxInt);
      rec.step = int_field(s, "step", fp, 0, kMaxInt);
      const std::string vname = field<std::string>(s, "value", fp);
      rec.value = sf.find(vname);
      if (!rec.value)
        throw lost(fp, "tensor '" + vname + "' (shard " + std::to_string(k) + " of '" + var +
                           "') is missing");
      named.insert(vname);
      for (const auto& [slot, tname] : field<std::map<std::string, std::string>>(s, "slots", fp)) {
        const Tensor* t = sf.find(tname);
        if (!t)
          throw lost(fp,
                     "tensor '" + tname + "' (slot '" + slot + "' of '" + var + "') is missing");
        rec.slots[slot] = t;
        named.insert(tname);
      }
      if (!saved.emplace(std::make_pair(var, k), rec).second) {
        throw lost(fp, "shard " + std::to_string(k) + " of '" + var + "' is saved twice");
      }
    }
    for (const auto& [name, t] : sf.tensors) {
      if (!named.count(name))
        throw lost(fp, "tensor '" + name + "' is not described by the file's shard list");
    }
  }

  // Every variable of the index, reassembled from its shards.
  if (!ij.contains("variables") || !ij["variables"].is_array()) throw lost("", "no variable list");
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const json& v : ij["variables"]) {
    const std::string name = field<std::string>(v, "name", path);
    const std::string dtype_text = field<std::string>(v, "dtype", path);
    std::optional<DType> dtype;
    for (DType d : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                    DType::kInt32, DType::kInt64}) {
      if (dtype_text == dtype_name(d)) dtype = d;
    }
    if (!dtype) throw lost("", "variable '" + name + "' has unknown dtype '" + dtype_text + "'");
    const Shape shape = shape_of(v, "shape", path, *dtype);
    const int64_t rows = shape.rank() ? shape[0] : 1;
    const size_t rb = shape.rank() ? row_bytes_of(shape, *dtype) : dtype_size(*dtype);
    std::map<std::string, Tensor> slots;
    std::vector<std::pair<std::pair<int64_t, int64_t>, int64_t>> steps;
    std::vector<std::pair<int64_t, int64_t>> covered;
    std::vector<const Saved*> parts;
    if (!v.contains("shards") || !v["shards"].is_array() || v["shards"].empty()) {
      throw lost("", "variable '" + name + "' has no shards");
    }
    for (const json& s : v["shards"]) {
      const int64_t k = int_field(s, "index", path, 0, kMaxInt);
      const int ps = static_cast<int>(int_field(s, "ps", path, 0, kMaxPs));
      const int64_t off = int_field(s, "row_offset", path, 0, kMaxInt),
                    n = int_field(s, "rows", path, 0, kMaxInt);
      auto it = saved.find({name, k});
      if (ps < 0 || static_cast<size_t>(ps) >= files.size())
        throw lost("", "shard " + std::to_string(k) + " of '" + name + "' on PS " +
                           std::to_string(ps) + ", which has no file");
      const std::string fp = fs::directory_of(path) + "/" + files[static_cast<size_t>(ps)];
      if (it == saved.end() || it->second.ps != ps) {
        throw lost(fp, "shard " + std::to_string(k) + " of '" + name + "' (tensor '" +
                           value_name(name, k) + "') is not in it, but the index places it there");
      }
      Saved& rec = it->second;
      rec.used = true;
      const Shape want = shape.rank() ? rows_shape(shape, n) : shape;
      if (rec.row_offset != off || rec.rows != n || rec.value->dtype() != *dtype ||
          rec.value->shape() != want) {
        throw lost(fp, "tensor '" + value_name(name, k) + "' is " + dtype_name(rec.value->dtype()) +
                           rec.value->shape().to_string() + " at row " +
                           std::to_string(rec.row_offset) + ", the index says " +
                           dtype_name(*dtype) + want.to_string() + " at row " +
                           std::to_string(off));
      }
      if (off > rows || n > rows - off)
        throw lost("", "shard " + std::to_string(k) + " of '" + name + "' has rows outside " +
                           shape.to_string());
      covered.emplace_back(off, n);
      steps.push_back({{off, n}, rec.step});
      parts.push_back(&rec);
    }
    std::sort(covered.begin(), covered.end());
    int64_t next = 0;
    for (const auto& [off, n] : covered) {
      if (off != next)
        throw lost("", "the shards of '" + name +
                           "' do not cover its rows exactly (gap or overlap at row " +
                           std::to_string(next) + ")");
      next = off + n;
    }
    if (next != rows)
      throw lost("", "the shards of '" + name + "' cover " + std::to_string(next) + " of its " +
                         std::to_string(rows) + " rows");
    // Only now, with the shards' real rows covering the shape exactly, is
    // the whole variable allocated (a lying shape cannot make us allocate).
    Tensor full(shape, *dtype);
    for (const Saved* p : parts) {
      if (p->rows && rb)
        std::memcpy(static_cast<char*>(full.data()) + p->row_offset * rb, p->value->data(),
                    static_cast<size_t>(p->rows) * rb);
    }
    // Slots: a shard that never received a push has none yet (the PS creates
    // them as zeros on the first push), so its rows are zeros.
    std::set<std::string> slot_names;
    for (const Saved* p : parts)
      for (const auto& sl : p->slots) slot_names.insert(sl.first);
    for (const std::string& slot : slot_names) {
      Tensor t(shape, DType::kFloat32);
      const size_t srb = shape.rank() ? row_bytes_of(shape, DType::kFloat32) : sizeof(float);
      for (const Saved* p : parts) {
        auto sl = p->slots.find(slot);
        if (sl == p->slots.end()) {
          if (p->step != 0) {
            throw lost(p->file, "shard at row " + std::to_string(p->row_offset) + " of '" + name +
                                    "' has " + std::to_string(p->step) + " updates but no slot '" +
                                    slot + "'");
          }
          continue;
        }
        const Shape want = shape.rank() ? rows_shape(shape, p->rows) : shape;
        if (sl->second->dtype() != DType::kFloat32 || sl->second->shape() != want) {
          throw lost(p->file, "slot tensor of '" + name + "/" + slot + "' is " +
                                  sl->second->debug_string() + ", expected float32" +
                                  want.to_string());
        }
        if (p->rows && srb)
          std::memcpy(static_cast<char*>(t.data()) + p->row_offset * srb, sl->second->data(),
                      static_cast<size_t>(p->rows) * srb);
      }
      tensors.emplace_back(name + "/" + slot, t);
    }
    tensors.emplace_back(name, full);
    out.steps[name] = steps;
  }
  for (const auto& [key, rec] : saved) {
    if (!rec.used)
      throw lost(rec.file, "holds shard " + std::to_string(key.second) + " of '" + key.first +
                               "', which the index does not list");
  }
  std::sort(tensors.begin(), tensors.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 1; i < tensors.size(); ++i) {
    if (tensors[i].first == tensors[i - 1].first)
      throw lost("", "tensor '" + tensors[i].first + "' appears twice");
  }
  out.file.tensors = std::move(tensors);
  out.file.metadata = index.metadata;
  out.file.verified = index.verified;
  for (const SafetensorsFile& sf : shard_files)
    out.file.verified = out.file.verified && sf.verified;
  return out;
}

}  // namespace ckpt

SafetensorsFile load_checkpoint(const std::string& path, const SafetensorsLoadOptions& options) {
  try {
    return ckpt::load_any(path, options).file;
  } catch (const std::bad_alloc&) {
    // Sizes are validated against the files first; this is a real shortage.
    throw ResourceExhaustedError("checkpoint '" + path + "': out of memory while reading it");
  }
}

}  // namespace diststrat
