// The parameter server's sharded checkpoint format (see checkpoint_internal.h):
// writing a PS rank's shard file and the chief's index, and reading both back
// into whole variables with every cross-check between them.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

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

std::string value_name(const std::string& var, int64_t shard) { return var + "/shard-" + std::to_string(shard); }

// Reads a required JSON field; a missing or mistyped one is a DataLossError
// naming the file.
template <typename T> T field(const json& j, const char* key, const std::string& file) {
  try {
    return j.at(key).get<T>();
  } catch (const json::exception& e) {
    throw DataLossError("checkpoint file '" + file + "': malformed parameter-server metadata (field '" +
                        key + "': " + e.what() + ")");
  }
}

json parse_json(const std::string& text, const std::string& file, const char* key) {
  try {
    json j = json::parse(text);
    if (!j.is_object()) throw DataLossError("checkpoint file '" + file + "': '" + key + "' is not a JSON object");
    return j;
  } catch (const json::exception& e) {
    throw DataLossError("checkpoint file '" + file + "': '" + key + "' is not valid JSON: " + e.what());
  }
}

Shape shape_of(const json& j, const char* key, const std::string& file) {
  const auto dims = field<std::vector<int64_t>>(j, key, file);
  for (int64_t d : dims) {
    if (d < 0) throw DataLossError("checkpoint file '" + file + "': negative dimension in '" + key + "'");
  }
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

std::string directory_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}
std::string file_name_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string shard_file_path(const std::string& index_path, int ps, int num_ps, uint64_t save_id) {
  static const std::string suffix = ".safetensors";
  std::string stem = index_path;
  if (stem.size() > suffix.size() && stem.compare(stem.size() - suffix.size(), suffix.size(), suffix) == 0) {
    stem.resize(stem.size() - suffix.size());
  }
  return stem + ".ps-" + std::to_string(ps) + "-of-" + std::to_string(num_ps) + "." + hex64(save_id) + suffix;
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

void write_index(const std::string& path, uint64_t save_id, const std::vector<std::string>& shard_files,
                 const std::vector<IndexVariable>& variables, const CheckpointMetadata& user_metadata) {
  json meta;
  meta["format"] = 1;
  meta["save_id"] = hex64(save_id);
  json files = json::array();
  for (const std::string& f : shard_files) files.push_back(file_name_of(f));
  meta["files"] = files;
  json vars = json::array();
  for (const IndexVariable& v : variables) {
    json j;
    j["name"] = v.name;
    j["dtype"] = dtype_name(v.dtype);
    j["shape"] = v.shape.dims();
    json shards = json::array();
    for (const IndexShard& s : v.shards) {
      shards.push_back({{"index", s.index}, {"ps", s.ps}, {"row_offset", s.row_offset}, {"rows", s.rows}});
    }
    j["shards"] = shards;
    vars.push_back(j);
  }
  meta["variables"] = vars;
  CheckpointMetadata md = user_metadata;
  md[kIndexKey] = meta.dump();
  save_safetensors_reserved(path, {}, md);
}

std::vector<std::string> shard_files_of(const std::string& index_path) {
  std::vector<std::string> out;
  try {
    const SafetensorsFile f = load_safetensors(index_path);
    auto it = f.metadata.find(kIndexKey);
    if (it == f.metadata.end()) return out;
    const json j = parse_json(it->second, index_path, kIndexKey);
    for (const std::string& name : field<std::vector<std::string>>(j, "files", index_path)) {
      out.push_back(directory_of(index_path) + "/" + name);
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
    return DataLossError("parameter-server checkpoint '" + path + "': " +
                         (file.empty() ? "" : "shard file '" + file + "': ") + msg);
  };
  if (!index.tensors.empty()) throw lost("", "the index holds tensors ('" + index.tensors[0].first + "')");
  const json ij = parse_json(idx_it->second, path, kIndexKey);
  if (field<int>(ij, "format", path) != 1) throw lost("", "unknown index format");
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
    if (files[i].empty() || files[i].find('/') != std::string::npos) throw lost("", "bad shard file name '" + files[i] + "'");
    const std::string fp = directory_of(path) + "/" + files[i];
    SafetensorsFile& sf = shard_files[i];
    try {
      sf = load_safetensors(fp, options);
    } catch (const NotFoundError& e) {
      throw NotFoundError("parameter-server checkpoint '" + path + "': shard file of PS " + std::to_string(i) +
                          " is missing: " + e.message());
    }
    auto it = sf.metadata.find(kShardKey);
    if (it == sf.metadata.end()) throw lost(fp, "not a parameter-server shard file (no '" + std::string(kShardKey) + "')");
    const json sj = parse_json(it->second, fp, kShardKey);
    if (field<std::string>(sj, "save_id", fp) != save_id) {
      throw lost(fp, "written by another save (save id " + field<std::string>(sj, "save_id", fp) +
                         ", the index has " + save_id + ")");
    }
    if (field<int>(sj, "ps", fp) != static_cast<int>(i) || field<int>(sj, "num_ps", fp) != static_cast<int>(files.size())) {
      throw lost(fp, "holds PS " + std::to_string(field<int>(sj, "ps", fp)) + " of " +
                         std::to_string(field<int>(sj, "num_ps", fp)) + ", the index lists it as PS " +
                         std::to_string(i) + " of " + std::to_string(files.size()));
    }
    if (!sj.contains("shards") || !sj["shards"].is_array()) throw lost(fp, "no shard list");
    std::set<std::string> named;
    for (const json& s : sj["shards"]) {
      Saved rec;
      rec.ps = static_cast<int>(i);
      rec.file = fp;
      const std::string var = field<std::string>(s, "variable", fp);
      const int64_t k = field<int64_t>(s, "index", fp);
      rec.row_offset = field<int64_t>(s, "row_offset", fp);
      rec.rows = field<int64_t>(s, "rows", fp);
      rec.step = field<int64_t>(s, "step", fp);
      const std::string vname = field<std::string>(s, "value", fp);
      rec.value = sf.find(vname);
      if (!rec.value) throw lost(fp, "tensor '" + vname + "' (shard " + std::to_string(k) + " of '" + var + "') is missing");
      named.insert(vname);
      for (const auto& [slot, tname] : field<std::map<std::string, std::string>>(s, "slots", fp)) {
        const Tensor* t = sf.find(tname);
        if (!t) throw lost(fp, "tensor '" + tname + "' (slot '" + slot + "' of '" + var + "') is missing");
        rec.slots[slot] = t;
        named.insert(tname);
      }
      if (!saved.emplace(std::make_pair(var, k), rec).second) {
        throw lost(fp, "shard " + std::to_string(k) + " of '" + var + "' is saved twice");
      }
    }
    for (const auto& [name, t] : sf.tensors) {
      if (!named.count(name)) throw lost(fp, "tensor '" + name + "' is not described by the file's shard list");
    }
  }

  // Every variable of the index, reassembled from its shards.
  if (!ij.contains("variables") || !ij["variables"].is_array()) throw lost("", "no variable list");
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const json& v : ij["variables"]) {
    const std::string name = field<std::string>(v, "name", path);
    const std::string dtype_text = field<std::string>(v, "dtype", path);
    std::optional<DType> dtype;
    for (DType d : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16, DType::kInt32, DType::kInt64}) {
      if (dtype_text == dtype_name(d)) dtype = d;
    }
    if (!dtype) throw lost("", "variable '" + name + "' has unknown dtype '" + dtype_text + "'");
    const Shape shape = shape_of(v, "shape", path);
    const int64_t rows = shape.rank() ? shape[0] : 1;
    const size_t rb = shape.rank() ? row_bytes_of(shape, *dtype) : dtype_size(*dtype);
    Tensor full(shape, *dtype);
    std::map<std::string, Tensor> slots;
    std::vector<std::pair<std::pair<int64_t, int64_t>, int64_t>> steps;
    std::vector<std::pair<int64_t, int64_t>> covered;
    std::vector<const Saved*> parts;
    if (!v.contains("shards") || !v["shards"].is_array() || v["shards"].empty()) {
      throw lost("", "variable '" + name + "' has no shards");
    }
    for (const json& s : v["shards"]) {
      const int64_t k = field<int64_t>(s, "index", path);
      const int ps = field<int>(s, "ps", path);
      const int64_t off = field<int64_t>(s, "row_offset", path), n = field<int64_t>(s, "rows", path);
      auto it = saved.find({name, k});
      if (ps < 0 || static_cast<size_t>(ps) >= files.size()) throw lost("", "shard " + std::to_string(k) + " of '" + name + "' on PS " + std::to_string(ps) + ", which has no file");
      const std::string fp = directory_of(path) + "/" + files[static_cast<size_t>(ps)];
      if (it == saved.end() || it->second.ps != ps) {
        throw lost(fp, "shard " + std::to_string(k) + " of '" + name + "' (tensor '" + value_name(name, k) +
                           "') is not in it, but the index places it there");
      }
      Saved& rec = it->second;
      rec.used = true;
      const Shape want = shape.rank() ? rows_shape(shape, n) : shape;
      if (rec.row_offset != off || rec.rows != n || rec.value->dtype() != *dtype || rec.value->shape() != want) {
        throw lost(fp, "tensor '" + value_name(name, k) + "' is " + dtype_name(rec.value->dtype()) +
                           rec.value->shape().to_string() + " at row " + std::to_string(rec.row_offset) +
                           ", the index says " + dtype_name(*dtype) + want.to_string() + " at row " + std::to_string(off));
      }
      if (off < 0 || n < 0 || off + n > rows) throw lost("", "shard " + std::to_string(k) + " of '" + name + "' has rows outside " + shape.to_string());
      covered.emplace_back(off, n);
      steps.push_back({{off, n}, rec.step});
      parts.push_back(&rec);
      if (n && rb) std::memcpy(static_cast<char*>(full.data()) + off * rb, rec.value->data(), static_cast<size_t>(n) * rb);
    }
    std::sort(covered.begin(), covered.end());
    int64_t next = 0;
    for (const auto& [off, n] : covered) {
      if (off != next) throw lost("", "the shards of '" + name + "' do not cover its rows exactly (gap or overlap at row " + std::to_string(next) + ")");
      next = off + n;
    }
    if (next != rows) throw lost("", "the shards of '" + name + "' cover " + std::to_string(next) + " of its " + std::to_string(rows) + " rows");
    // Slots: a shard that never received a push has none yet (the PS creates
    // them as zeros on the first push), so its rows are zeros.
    std::set<std::string> slot_names;
    for (const Saved* p : parts) for (const auto& sl : p->slots) slot_names.insert(sl.first);
    for (const std::string& slot : slot_names) {
      Tensor t(shape, DType::kFloat32);
      const size_t srb = shape.rank() ? row_bytes_of(shape, DType::kFloat32) : sizeof(float);
      for (const Saved* p : parts) {
        auto sl = p->slots.find(slot);
        if (sl == p->slots.end()) {
          if (p->step != 0) {
            throw lost(p->file, "shard at row " + std::to_string(p->row_offset) + " of '" + name + "' has " +
                                    std::to_string(p->step) + " updates but no slot '" + slot + "'");
          }
          continue;
        }
        const Shape want = shape.rank() ? rows_shape(shape, p->rows) : shape;
        if (sl->second->dtype() != DType::kFloat32 || sl->second->shape() != want) {
          throw lost(p->file, "slot tensor of '" + name + "/" + slot + "' is " + sl->second->debug_string() +
                                  ", expected float32" + want.to_string());
        }
        if (p->rows && srb) std::memcpy(static_cast<char*>(t.data()) + p->row_offset * srb, sl->second->data(), static_cast<size_t>(p->rows) * srb);
      }
      tensors.emplace_back(name + "/" + slot, t);
    }
    tensors.emplace_back(name, full);
    out.steps[name] = steps;
  }
  for (const auto& [key, rec] : saved) {
    if (!rec.used) throw lost(rec.file, "holds shard " + std::to_string(key.second) + " of '" + key.first + "', which the index does not list");
  }
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 1; i < tensors.size(); ++i) {
    if (tensors[i].first == tensors[i - 1].first) throw lost("", "tensor '" + tensors[i].first + "' appears twice");
  }
  out.file.tensors = std::move(tensors);
  out.file.metadata = index.metadata;
  out.file.verified = index.verified;
  for (const SafetensorsFile& sf : shard_files) out.file.verified = out.file.verified && sf.verified;
  return out;
}

}  // namespace ckpt

SafetensorsFile load_checkpoint(const std::string& path, const SafetensorsLoadOptions& options) {
  return ckpt::load_any(path, options).file;
}

}  // namespace diststrat
