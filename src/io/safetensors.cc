// The safetensors format, written and read with full validation.
//
// A file is:  [8 bytes: N, little-endian u64] [N bytes: JSON header] [data]
// The header maps each tensor name to {"dtype": "F32", "shape": [..],
// "data_offsets": [begin, end]} (offsets relative to the start of the data
// region) plus an optional "__metadata__" string-to-string map. We pad the
// header with spaces to a multiple of 8 bytes, as the reference writer does,
// so the data is aligned.
//
// Integrity: the reference format has no checksums, so we keep ours in
// __metadata__, where every reader carries them along untouched:
//   "diststrat.crc32/<tensor>"  CRC-32 of the tensor's bytes (hex)
//   "diststrat.header_crc32"    CRC-32 of the header re-serialized canonically
//                               (sorted keys, no spaces) without this key
// A flipped byte in the data fails its tensor's CRC; one in the header either
// breaks the JSON or the offsets, or changes its canonical form and fails the
// header CRC (whitespace flips change nothing that is read, and pass).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <new>
#include <optional>
#include <nlohmann/json.hpp>
#include <set>

#include "diststrat/safetensors.h"
#include "core/file_util.h"
#include "core/user_text.h"
#include "io/checkpoint_internal.h"
#include "io/non_finite.h"

namespace diststrat {

namespace {

using json = nlohmann::json;

using ckpt::kReservedPrefix;
constexpr const char* kTensorCrcPrefix = "diststrat.crc32/";
constexpr const char* kHeaderCrcKey = "diststrat.header_crc32";
// The reference implementation's limit: a larger header is an attack or a corrupt length.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

bool host_is_little_endian() {
  const uint16_t one = 1;
  uint8_t b;
  std::memcpy(&b, &one, 1);
  return b == 1;
}

uint32_t crc32_of(const void* data, size_t size) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const Bytef* p = static_cast<const Bytef*>(data);
  while (size > 0) {  // zlib takes uInt lengths
    const uInt n = static_cast<uInt>(std::min<size_t>(size, 1u << 30));
    crc = crc32(crc, p, n);
    p += n;
    size -= n;
  }
  return static_cast<uint32_t>(crc);
}

std::string hex32(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

// Strict safetensors dtype names; other valid names are "not supported" rather than corrupt.
std::optional<DType> parse_dtype(const std::string& s) {
  for (DType d : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                  DType::kInt32, DType::kInt64}) {
    if (s == dtype_safetensors_name(d)) return d;
  }
  return std::nullopt;
}
bool known_unsupported_dtype(const std::string& s) {
  static const char* const kOthers[] = {"BOOL", "U8",      "I8",      "U16",     "I16",
                                        "U32",  "U64",     "F8_E5M2", "F8_E4M3", "F8_E8M0",
                                        "F4",   "F6_E2M3", "F6_E3M2", "C64"};
  for (const char* o : kOthers) {
    if (s == o) return true;
  }
  return false;
}

std::string canonical_header(json header) {
  if (header.contains("__metadata__")) {
    header["__metadata__"].erase(kHeaderCrcKey);
  }
  return header.dump();  // nlohmann::json objects are std::map: keys sorted, no spaces
}

// The header's __metadata__: a string-to-string map, else DataLossError.
CheckpointMetadata metadata_of(const json& header, const std::string& what) {
  CheckpointMetadata out;
  auto it = header.find("__metadata__");
  if (it == header.end()) return out;
  if (!it->is_object())
    throw DataLossError("checkpoint '" + what + "': __metadata__ is not an object");
  for (auto m = it->begin(); m != it->end(); ++m) {
    if (!m.value().is_string()) {
      throw DataLossError("checkpoint '" + what + "': __metadata__ value of '" + echo(m.key()) +
                          "' is not a string");
    }
    out[m.key()] = m.value().get<std::string>();
  }
  return out;
}

}  // namespace

const Tensor* SafetensorsFile::find(const std::string& name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return &t;
  }
  return nullptr;
}

// ---- writing ------------------------------------------------------------------

std::vector<char> ckpt::encode_safetensors(
    const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
    const CheckpointMetadata& metadata, bool allow_reserved, bool allow_non_finite) {
  DISTSTRAT_CHECK(host_is_little_endian(), kUnimplemented,
                  "save_safetensors: big-endian hosts are not supported");
  std::vector<const std::pair<std::string, Tensor>*> sorted;
  for (const auto& nt : tensors) {
    DISTSTRAT_CHECK(!nt.first.empty() && nt.first != "__metadata__", kInvalidArgument,
                    "save_safetensors '", path, "': invalid tensor name '", nt.first, "'");
    DISTSTRAT_CHECK(nt.second.defined(), kInvalidArgument, "save_safetensors '", path,
                    "': tensor '", nt.first, "' is undefined");
    DISTSTRAT_CHECK(nt.second.device().is_cpu(), kInvalidArgument, "save_safetensors '", path,
                    "': tensor '", nt.first, "' is on ", nt.second.device().to_string(),
                    "; copy it to the host first");
    sorted.push_back(&nt);
  }
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->first < b->first; });
  for (size_t i = 1; i < sorted.size(); ++i) {
    DISTSTRAT_CHECK(sorted[i]->first != sorted[i - 1]->first, kInvalidArgument,
                    "save_safetensors '", path, "': tensor '", sorted[i]->first, "' appears twice");
  }

  json header = json::object();
  json md = json::object();
  for (const auto& [k, v] : metadata) {
    DISTSTRAT_CHECK(allow_reserved || k.rfind(kReservedPrefix, 0) != 0, kInvalidArgument,
                    "save_safetensors '", path, "': metadata key '", k,
                    "' uses the reserved prefix 'diststrat.'");
    md[k] = v;
  }
  uint64_t offset = 0;
  std::vector<std::string> non_finite;  // "'<tensor>' holds ..."
  for (const auto* nt : sorted) {
    const Tensor& t = nt->second;
    json entry;
    entry["dtype"] = dtype_safetensors_name(t.dtype());
    entry["shape"] = t.shape().dims();
    entry["data_offsets"] = {offset, offset + t.nbytes()};
    header[nt->first] = entry;
    // The non-finite scan rides on the CRC's pass over the same bytes.
    ckpt::NonFinite nf;
    md[kTensorCrcPrefix + nt->first] =
        hex32(ckpt::crc32_and_scan(t.data(), t.nbytes(), t.dtype(), !allow_non_finite, &nf));
    if (nf)
      non_finite.push_back("tensor '" + echo(nt->first) + "' " + ckpt::describe_non_finite(nf));
    offset += t.nbytes();
  }
  if (!non_finite.empty()) {
    // A diverged model must never replace good checkpoints: nothing is written.
    std::string msg = "refusing to save '" + path + "': ";
    const size_t shown = std::min<size_t>(non_finite.size(), 5);
    for (size_t i = 0; i < shown; ++i) msg += (i ? "; " : "") + non_finite[i];
    if (non_finite.size() > shown)
      msg += "; and " + std::to_string(non_finite.size() - shown) + " more tensors";
    throw DataLossError(
        msg +
        ". The training diverged? Nothing was written; allow_non_finite = true saves it anyway");
  }
  md["diststrat.format"] = "1";
  header["__metadata__"] = md;
  const std::string canon = canonical_header(header);
  header["__metadata__"][kHeaderCrcKey] = hex32(crc32_of(canon.data(), canon.size()));
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  std::vector<char> file(8 + text.size() + offset);
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  std::memcpy(file.data() + 8, text.data(), text.size());
  char* data = file.data() + 8 + text.size();
  for (const auto* nt : sorted) {
    if (nt->second.nbytes()) std::memcpy(data, nt->second.data(), nt->second.nbytes());
    data += nt->second.nbytes();
  }
  return file;
}

namespace {
void save_safetensors_impl(const std::string& path,
                           const std::vector<std::pair<std::string, Tensor>>& tensors,
                           const CheckpointMetadata& metadata, bool allow_reserved,
                           bool allow_non_finite) {
  const std::vector<char> file =
      ckpt::encode_safetensors(path, tensors, metadata, allow_reserved, allow_non_finite);
  write_file_atomically(path, file.data(), file.size());
}
}  // namespace

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const CheckpointMetadata& metadata, const SafetensorsSaveOptions& options) {
  save_safetensors_impl(path, tensors, metadata, false, options.allow_non_finite);
}

void ckpt::save_safetensors_reserved(const std::string& path,
                                     const std::vector<std::pair<std::string, Tensor>>& tensors,
                                     const CheckpointMetadata& metadata) {
  auto allow = metadata.find(ckpt::kNonFiniteKey);
  save_safetensors_impl(path, tensors, metadata, true,
                        allow != metadata.end() && allow->second == ckpt::kNonFiniteAllowed);
}

// ---- reading ------------------------------------------------------------------

namespace {

struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

// A header parsed and checked against the size of the data region that
// follows it: what is left to read is exactly the tensors' bytes.
struct Layout {
  json header;
  SafetensorsFile file;  // metadata only, so far
  std::vector<Entry> entries;
  bool has_crcs = false;
};

// The 8-byte header length N of a `size`-byte file, checked: N > 0 (a file
// of zeros is damage), within the 100 MiB limit, within the file.
uint64_t checked_header_length(const uint8_t len[8], uint64_t size, const std::string& what) {
  auto corrupt = [&](const std::string& msg) {
    return DataLossError("checkpoint '" + what + "': " + msg);
  };
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  if (n == 0) throw corrupt("header length 0 (an empty or zeroed file?)");
  if (n > kMaxHeaderBytes)
    throw corrupt("header length " + std::to_string(n) + " exceeds the 100 MiB limit");
  if (n > size - 8) {
    throw corrupt("truncated: header length " + std::to_string(n) + " but only " +
                  std::to_string(size - 8) + " bytes follow");
  }
  return n;
}

// The header (n bytes of JSON) of a file whose data region has data_size
// bytes: parsed, every entry checked, the entries tiling the data region
// exactly, the header checksum verified. Reads no tensor data.
Layout parse_layout(const char* text, uint64_t n, uint64_t data_size, const std::string& what,
                    const SafetensorsLoadOptions& options) {
  auto corrupt = [&](const std::string& msg) -> DataLossError {
    return DataLossError("checkpoint '" + what + "': " + msg);
  };
  Layout out;
  json& header = out.header;
  try {
    header = json::parse(text, text + n);
  } catch (const json::exception& e) {
    throw corrupt(std::string("header is not valid JSON: ") + echo(e.what()));
  }
  if (!header.is_object()) throw corrupt("header is not a JSON object");
  out.file.metadata = metadata_of(header, what);
  std::vector<Entry>& entries = out.entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string& name = it.key();
    const json& e = it.value();
    auto bad = [&](const std::string& msg) {
      return corrupt("tensor '" + echo(name) + "': " + msg);
    };
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") ||
        !e.contains("data_offsets")) {
      throw bad("entry needs dtype, shape and data_offsets");
    }
    if (!e["dtype"].is_string()) throw bad("dtype is not a string");
    const std::string dt = e["dtype"].get<std::string>();
    const std::optional<DType> dtype = parse_dtype(dt);
    if (!dtype) {
      if (known_unsupported_dtype(dt)) {
        throw UnimplementedError(
            "checkpoint '" + what + "': tensor '" + echo(name) + "' has dtype " + echo(dt) +
            ", which diststrat does not support (F32, F64, F16, BF16, I32, I64)");
      }
      throw bad("unknown dtype '" + echo(dt) + "'");
    }
    const json& shape = e["shape"];
    if (!shape.is_array()) throw bad("shape is not an array");
    std::vector<int64_t> dims;
    // Element count with overflow checks: a lying shape must not wrap around.
    uint64_t elements = 1;
    bool overflow = false;
    for (const json& d : shape) {
      if (!d.is_number_unsigned())
        throw bad("shape " + echo(shape.dump()) + " has a non-natural dim");
      const uint64_t v = d.get<uint64_t>();
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        throw bad("dim too large");
      if (v != 0 && elements > std::numeric_limits<uint64_t>::max() / v) overflow = true;
      elements *= v;
      dims.push_back(static_cast<int64_t>(v));
    }
    const json& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned()) {
      throw bad("data_offsets is not a pair of naturals");
    }
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end)
      throw bad("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                "] run backwards");
    if (end > data_size) {
      throw bad("data_offsets end " + std::to_string(end) + " lies beyond the " +
                std::to_string(data_size) + "-byte data region (truncated file?)");
    }
    const size_t esize = dtype_size(*dtype);
    if (overflow || elements > std::numeric_limits<uint64_t>::max() / esize ||
        elements * esize != end - begin) {
      throw bad("shape " + echo(shape.dump()) + " of " + dt + " does not match data_offsets [" +
                std::to_string(begin) + ", " + std::to_string(end) + "]");
    }
    entries.push_back({name, *dtype, Shape(dims), begin, end});
  }
  // Tensors must tile the data region exactly: no overlap, no gap, no tail.
  std::vector<const Entry*> by_offset;
  for (const Entry& e : entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t expected = 0;
  for (const Entry* e : by_offset) {
    if (e->begin != expected) {
      throw corrupt("tensor '" + echo(e->name) + "': data_offsets begin " +
                    std::to_string(e->begin) +
                    (e->begin < expected ? " overlaps the previous tensor" : " leaves a gap") +
                    " (expected " + std::to_string(expected) + ")");
    }
    expected = e->end;
  }
  if (expected != data_size) {  // each end lies within data_size: the rest is a tail
    throw corrupt("the tensors cover " + std::to_string(expected) +
                  " bytes but the data region has " + std::to_string(data_size) + ": " +
                  std::to_string(data_size - expected) +
                  " trailing bytes (an extended or foreign file?)");
  }

  out.has_crcs = out.file.metadata.count(kHeaderCrcKey) > 0;
  if (options.require_checksums && !out.has_crcs) {
    throw corrupt(
        "has no diststrat checksums (written by another tool, or its header was damaged); "
        "load it with require_checksums = false to accept it unverified");
  }
  if (out.has_crcs) {
    const std::string canon = canonical_header(header);
    const std::string got = hex32(crc32_of(canon.data(), canon.size()));
    if (got != out.file.metadata[kHeaderCrcKey]) {
      throw corrupt("header checksum mismatch (stored " + echo(out.file.metadata[kHeaderCrcKey]) +
                    ", computed " + got + "): the header was modified");
    }
  }
  return out;
}

// The tensors of a checked layout from its data region (exactly the bytes
// the header declares), each verified against its checksum.
SafetensorsFile build_tensors(Layout& layout, const uint8_t* data, const std::string& what,
                              bool allow_non_finite) {
  auto corrupt = [&](const std::string& msg) -> DataLossError {
    return DataLossError("checkpoint '" + what + "': " + msg);
  };
  SafetensorsFile& out = layout.file;
  const bool has_crcs = layout.has_crcs;
  const std::vector<Entry>& entries = layout.entries;
  std::vector<std::string> non_finite;
  for (const Entry& e : entries) {
    const uint8_t* p = data + e.begin;
    const size_t nbytes = static_cast<size_t>(e.end - e.begin);
    ckpt::NonFinite nf;
    if (has_crcs) {
      auto it = out.metadata.find(kTensorCrcPrefix + e.name);
      if (it == out.metadata.end()) throw corrupt("tensor '" + echo(e.name) + "' has no checksum");
      // The non-finite scan rides on the CRC's pass over the same bytes.
      const std::string got =
          hex32(ckpt::crc32_and_scan(p, nbytes, e.dtype, !allow_non_finite, &nf));
      if (got != it->second) {
        throw corrupt("tensor '" + echo(e.name) + "': checksum mismatch (stored " +
                      echo(it->second) + ", computed " + got + "): its data is corrupted");
      }
    } else if (!allow_non_finite && dtype_is_floating(e.dtype)) {
      ckpt::scan_non_finite(p, nbytes / dtype_size(e.dtype), e.dtype, 0, &nf);
    }
    if (nf) non_finite.push_back("tensor '" + echo(e.name) + "' " + ckpt::describe_non_finite(nf));
    Tensor t(e.shape, e.dtype);
    if (nbytes) std::memcpy(t.data(), p, nbytes);
    out.tensors.emplace_back(e.name, std::move(t));
  }
  if (has_crcs) {
    // A checksum for a tensor that is not there: the header lost an entry.
    for (const auto& [k, v] : out.metadata) {
      if (k.rfind(kTensorCrcPrefix, 0) == 0 && !out.find(k.substr(std::strlen(kTensorCrcPrefix)))) {
        throw corrupt("tensor '" + echo(k.substr(std::strlen(kTensorCrcPrefix))) +
                      "' has a checksum but no header entry");
      }
    }
  }
  if (!non_finite.empty()) {
    // Intact bytes (the CRCs match) of a model that had diverged when saved.
    std::string msg;
    const size_t shown = std::min<size_t>(non_finite.size(), 5);
    for (size_t i = 0; i < shown; ++i) msg += (i ? "; " : "") + non_finite[i];
    if (non_finite.size() > shown)
      msg += "; and " + std::to_string(non_finite.size() - shown) + " more tensors";
    throw corrupt(msg +
                  " (saved from a diverged model?); allow_non_finite = true restores it anyway");
  }
  std::sort(out.tensors.begin(), out.tensors.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  out.verified = has_crcs;
  return std::move(out);
}

}  // namespace

SafetensorsFile parse_safetensors(const uint8_t* bytes, size_t size, const std::string& what,
                                  const SafetensorsLoadOptions& options) {
  DISTSTRAT_CHECK(host_is_little_endian(), kUnimplemented,
                  "load_safetensors: big-endian hosts are not supported");
  if (size < 8) {
    throw DataLossError("checkpoint '" + what + "': truncated: " + std::to_string(size) +
                        " bytes, shorter than the 8-byte header length");
  }
  const uint64_t n = checked_header_length(bytes, size, what);
  Layout layout =
      parse_layout(reinterpret_cast<const char*>(bytes + 8), n, size - 8 - n, what, options);
  return build_tensors(layout, bytes + 8 + n, what, options.allow_non_finite);
}

SafetensorsFile load_safetensors(const std::string& path, const SafetensorsLoadOptions& options) {
  DISTSTRAT_CHECK(host_is_little_endian(), kUnimplemented,
                  "load_safetensors: big-endian hosts are not supported");
  // Non-blocking open, a regular file only (a FIFO must not hang us). The
  // header first: only once it is consistent with the file's size is the
  // data it declares read, so a huge junk file is damage found at once, not
  // a huge allocation.
  const fs::ReadOnlyFile file(path, "checkpoint '" + path + "'");
  if (file.size() < 8) {
    throw DataLossError("checkpoint '" + path + "': truncated: " + std::to_string(file.size()) +
                        " bytes, shorter than the 8-byte header length");
  }
  uint8_t len[8];
  file.read_at(0, len, 8);
  const uint64_t n = checked_header_length(len, file.size(), path);
  std::string text(static_cast<size_t>(n), '\0');
  file.read_at(8, &text[0], text.size());
  const uint64_t data_size = file.size() - 8 - n;
  Layout layout = parse_layout(text.data(), n, data_size, path, options);
  std::vector<uint8_t> data;
  try {
    data.resize(static_cast<size_t>(data_size));
  } catch (const std::bad_alloc&) {
    throw ResourceExhaustedError("checkpoint '" + path + "': its " + std::to_string(data_size) +
                                 " bytes of tensor data do not fit in memory");
  }
  if (data_size > 0) file.read_at(8 + n, data.data(), data.size());
  return build_tensors(layout, data.data(), path, options.allow_non_finite);
}

ckpt::SafetensorsHeader ckpt::read_safetensors_header(const std::string& path) {
  const fs::ReadOnlyFile file(path, "checkpoint '" + path + "'");
  auto corrupt = [&](const std::string& msg) {
    return DataLossError("checkpoint '" + path + "': " + msg);
  };
  uint8_t len[8];
  if (file.size() < 8) throw corrupt("truncated: " + std::to_string(file.size()) + " bytes");
  file.read_at(0, len, 8);
  const uint64_t n = checked_header_length(len, file.size(), path);
  std::string text(static_cast<size_t>(n), '\0');
  if (n) file.read_at(8, &text[0], text.size());
  json header;
  try {
    header = json::parse(text);
  } catch (const json::exception& e) {
    throw corrupt(std::string("header is not valid JSON: ") + echo(e.what()));
  }
  if (!header.is_object()) throw corrupt("header is not a JSON object");
  SafetensorsHeader out;
  out.metadata = metadata_of(header, path);
  auto crc = out.metadata.find(kHeaderCrcKey);
  if (crc != out.metadata.end()) {
    const std::string canon = canonical_header(header);
    if (hex32(crc32_of(canon.data(), canon.size())) != crc->second)
      throw corrupt("header checksum mismatch");
    out.verified = true;
  }
  return out;
}

}  // namespace diststrat
