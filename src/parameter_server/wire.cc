#include "parameter_server/wire.h"

#include <climits>
#include <cmath>
#include <cstring>

#include "core/user_text.h"
#include "parameter_server/shard_updater.h"

namespace diststrat {
namespace ps {

const char* op_name(Op op) {
  switch (op) {
    case Op::kCreate:
      return "create";
    case Op::kPull:
      return "pull";
    case Op::kPush:
      return "push";
    case Op::kAssign:
      return "assign";
    case Op::kBarrier:
      return "barrier";
    case Op::kStats:
      return "stats";
    case Op::kDone:
      return "done";
    case Op::kBroadcast:
      return "broadcast";
    case Op::kStopCheck:
      return "preemption check";
    case Op::kSave:
      return "checkpoint save";
    case Op::kReadSlots:
      return "slot read";
    case Op::kRestore:
      return "checkpoint restore";
    case Op::kMetric:
      return "metric";
    case Op::kRule:
      return "update rule";
    case Op::kAbort:
      return "abort";
    case Op::kAlive:
      return "heartbeat";
  }
  return "unknown op";
}

bool valid_op(uint16_t op) {
  return op >= static_cast<uint16_t>(Op::kCreate) && op <= static_cast<uint16_t>(Op::kAlive);
}

Writer& Writer::put_string(const std::string& s) {
  put<int64_t>(static_cast<int64_t>(s.size()));
  bytes_.insert(bytes_.end(), s.begin(), s.end());
  return *this;
}

Writer& Writer::put_shape(const Shape& s) {
  put<int64_t>(static_cast<int64_t>(s.rank()));
  for (int64_t d : s.dims()) put<int64_t>(d);
  return *this;
}

void Reader::need(size_t n) const {
  DISTSTRAT_CHECK(static_cast<size_t>(end_ - p_) >= n, kInvalidArgument, what_,
                  ": malformed message (needs ", n, " more bytes, has ", end_ - p_, ")");
}

std::string Reader::get_string() {
  const int64_t n = get<int64_t>();
  DISTSTRAT_CHECK(n >= 0 && n <= kMaxStringBytes, kInvalidArgument, what_,
                  ": malformed string length ", n);
  need(static_cast<size_t>(n));
  std::string s(p_, static_cast<size_t>(n));
  p_ += n;
  return s;
}

Shape Reader::get_shape() {
  const int64_t rank = get<int64_t>();
  DISTSTRAT_CHECK(rank >= 0 && rank <= kMaxShapeRank, kInvalidArgument, what_,
                  ": malformed shape rank ", rank);
  need(static_cast<size_t>(rank) * sizeof(int64_t));
  std::vector<int64_t> dims(static_cast<size_t>(rank));
  int64_t elements = 1;
  for (auto& d : dims) {
    d = get<int64_t>();
    DISTSTRAT_CHECK(d >= 0, kInvalidArgument, what_, ": negative dimension ", d);
    DISTSTRAT_CHECK(!__builtin_mul_overflow(elements, d, &elements), kInvalidArgument, what_,
                    ": malformed shape (its element count overflows int64)");
  }
  return Shape(dims);
}

bool Reader::get_bool(const char* field) {
  const uint8_t v = get<uint8_t>();
  DISTSTRAT_CHECK(v <= 1, kInvalidArgument, what_, ": ", field, " is ", static_cast<int>(v),
                  ", not 0 or 1");
  return v != 0;
}

int64_t checked_mul(int64_t a, int64_t b, const std::string& what) {
  int64_t r = 0;
  DISTSTRAT_CHECK(a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, &r) && r <= kMaxMessageBytes,
                  kInvalidArgument, what, ": ", a, " x ", b,
                  " bytes is more than a message may carry (", kMaxMessageBytes, ")");
  return r;
}

int64_t checked_add(int64_t a, int64_t b, const std::string& what) {
  int64_t r = 0;
  DISTSTRAT_CHECK(a >= 0 && b >= 0 && !__builtin_add_overflow(a, b, &r) && r <= kMaxMessageBytes,
                  kInvalidArgument, what, ": ", a, " + ", b,
                  " bytes is more than a message may carry (", kMaxMessageBytes, ")");
  return r;
}

int64_t checked_bytes(const Shape& shape, int64_t elem_bytes, const std::string& what) {
  int64_t n = elem_bytes;
  for (int64_t d : shape.dims()) {
    // A zero dim makes the whole product 0, whatever the other dims.
    if (d == 0) return 0;
  }
  for (int64_t d : shape.dims()) n = checked_mul(n, d, what + " " + shape.to_string());
  return n;
}
void write_entry(Writer& w, const Entry& e) {
  w.put(e.var_id).put(e.shard_index).put_string(e.name).put(e.dtype).put_shape(e.shape);
  w.put(e.sparse).put(e.num_ids);
}

bool valid_dtype(int32_t d) { return d >= 0 && d <= static_cast<int32_t>(DType::kInt64); }

Entry read_entry(Reader& r) {
  Entry e;
  e.var_id = r.get<int64_t>();
  e.shard_index = r.get<int64_t>();
  e.name = r.get_string();
  e.dtype = r.get<int32_t>();
  e.shape = r.get_shape();
  e.sparse = r.get<uint8_t>();
  e.num_ids = r.get<int64_t>();
  const std::string what = r.what() + " of '" + echo(e.name) + "'";
  DISTSTRAT_CHECK(e.var_id >= 0 && e.shard_index >= 0, kInvalidArgument, what, ": variable id ",
                  e.var_id, ", shard ", e.shard_index);
  DISTSTRAT_CHECK(valid_dtype(e.dtype), kInvalidArgument, what, ": bad dtype ", e.dtype);
  DISTSTRAT_CHECK(e.sparse <= 1, kInvalidArgument, what, ": sparse flag ",
                  static_cast<int>(e.sparse));
  DISTSTRAT_CHECK(e.num_ids >= 0 && (e.sparse || e.num_ids == 0), kInvalidArgument, what, ": ",
                  e.num_ids, " ids for a ", e.sparse ? "row" : "whole-shard", " entry");
  checked_bytes(e.shape, dtype_size(static_cast<DType>(e.dtype)), what);
  return e;
}

namespace {

// Smallest encoding of an entry: ids, name length, dtype, rank, flag, ids.
constexpr size_t kMinEntryBytes = 8 + 8 + 8 + 4 + 8 + 1 + 8;

int64_t read_count(Reader& r, size_t min_item_bytes) {
  const int64_t n = r.get<int64_t>();
  DISTSTRAT_CHECK(n >= 0 && n <= kMaxEntries, kInvalidArgument, r.what(), ": ", n, " entries");
  // Each entry takes bytes of the message: a count the message cannot hold
  // is a lie (and must not size an allocation).
  DISTSTRAT_CHECK(static_cast<size_t>(n) <= r.remaining() / min_item_bytes, kInvalidArgument,
                  r.what(), ": ", n, " entries in ", r.remaining(), " bytes");
  return n;
}

// The row ids a row entry carries in the payload.
int64_t id_bytes(const Entry& e, const std::string& what) {
  return e.sparse ? checked_mul(e.num_ids, int64_t{sizeof(int64_t)},
                                what + ": " + std::to_string(e.num_ids) + " ids")
                  : 0;
}

int64_t value_bytes(const Entry& e, const std::string& what) {
  return checked_bytes(e.shape, dtype_size(static_cast<DType>(e.dtype)), what);
}

void decode_create(Reader& r, DecodedRequest& q) {
  CreateSpec& c = q.create;
  c.var_id = r.get<int64_t>();
  c.name = r.get_string();
  c.dtype = r.get<int32_t>();
  const std::string what = "create of '" + echo(c.name) + "'";
  DISTSTRAT_CHECK(c.var_id >= 0, kInvalidArgument, what, ": variable id ", c.var_id);
  DISTSTRAT_CHECK(valid_dtype(c.dtype), kInvalidArgument, what, ": bad dtype ", c.dtype);
  c.full_shape = r.get_shape();
  c.shard_index = r.get<int64_t>();
  c.num_shards = r.get<int64_t>();
  c.row_offset = r.get<int64_t>();
  c.rows = r.get<int64_t>();
  c.has_value = r.get_bool("has_value");
  DISTSTRAT_CHECK(c.num_shards >= 1 && c.shard_index >= 0 && c.shard_index < c.num_shards,
                  kInvalidArgument, what, ": shard ", c.shard_index, " of ", c.num_shards);
  std::vector<int64_t> dims = c.full_shape.dims();
  if (!dims.empty()) {
    DISTSTRAT_CHECK(c.row_offset >= 0 && c.rows >= 0 && c.row_offset <= dims[0] &&
                        c.rows <= dims[0] - c.row_offset,
                    kInvalidArgument, what, " shard ", c.shard_index, ": rows ", c.row_offset,
                    " + ", c.rows, " outside ", c.full_shape.to_string());
    dims[0] = c.rows;
  }
  c.shard_shape = Shape(dims);
  checked_bytes(c.full_shape, dtype_size(static_cast<DType>(c.dtype)), what);
}

}  // namespace

bool valid_file_stem(const std::string& s) {
  if (s.empty() || s.size() > 200 || s[0] == '.') return false;
  for (char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

DecodedRequest decode_request(const char* data, size_t size) {
  DecodedRequest q;
  DISTSTRAT_CHECK(size >= sizeof(RequestHeader), kInvalidArgument, "malformed request of ", size,
                  " bytes");
  DISTSTRAT_CHECK(size <= kMaxControlBytes, kInvalidArgument, "request of ", size,
                  " bytes (at most ", kMaxControlBytes, ")");
  std::memcpy(&q.header, data, sizeof(RequestHeader));
  const RequestHeader& h = q.header;
  DISTSTRAT_CHECK(h.magic == kMagic, kInvalidArgument, "malformed request header (magic ", h.magic,
                  ")");
  DISTSTRAT_CHECK(valid_op(h.op), kInvalidArgument, "malformed request header (op ", h.op, ")");
  q.op = static_cast<Op>(h.op);
  const std::string what = op_name(q.op);
  DISTSTRAT_CHECK(h.seq >= 1, kInvalidArgument, what, ": sequence number ", h.seq,
                  " (they start at 1)");
  DISTSTRAT_CHECK(h.incarnation != 0, kInvalidArgument, what, ": no worker incarnation");
  DISTSTRAT_CHECK(h.payload_bytes >= 0 && h.payload_bytes <= kMaxMessageBytes, kInvalidArgument,
                  what, ": the header claims a payload of ", h.payload_bytes, " bytes (at most ",
                  kMaxMessageBytes, ")");
  DISTSTRAT_CHECK(h.reply_bytes >= 0 && h.reply_bytes <= kMaxMessageBytes, kInvalidArgument, what,
                  ": the header expects a reply of ", h.reply_bytes, " bytes (at most ",
                  kMaxMessageBytes, ")");
  Reader r(data + sizeof(RequestHeader), size - sizeof(RequestHeader), what);
  int64_t payload = 0;  // what the fields declare
  int64_t reply = -1;   // what the fields fix (-1: the PS computes it)
  switch (q.op) {
    case Op::kCreate:
      decode_create(r, q);
      payload = q.create.has_value
                    ? checked_bytes(q.create.shard_shape,
                                    dtype_size(static_cast<DType>(q.create.dtype)), what)
                    : 0;
      reply = 0;
      break;
    case Op::kPull: {
      q.clock = r.get<int64_t>();
      const int64_t n = read_count(r, kMinEntryBytes);
      for (int64_t i = 0; i < n; ++i) {
        q.entries.push_back(read_entry(r));
        const Entry& e = q.entries.back();
        payload = checked_add(payload, id_bytes(e, what + " of '" + echo(e.name) + "'"), what);
      }
      break;
    }
    case Op::kPush: {
      q.steps_after = r.get<int64_t>();
      q.pulled_version = r.get<int64_t>();
      q.iter_var = r.get<int64_t>();
      q.iter_name = r.get_string();
      DISTSTRAT_CHECK(q.steps_after >= 0 && q.pulled_version >= -1 && q.iter_var >= -1,
                      kInvalidArgument, what, ": step ", q.steps_after, ", version ",
                      q.pulled_version, ", step counter ", q.iter_var);
      const int64_t n = read_count(r, kMinEntryBytes);
      for (int64_t i = 0; i < n; ++i) {
        q.entries.push_back(read_entry(r));
        const Entry& e = q.entries.back();
        const std::string ew = what + " to '" + echo(e.name) + "'";
        if (e.sparse) {
          DISTSTRAT_CHECK(e.shape.rank() >= 1 && e.shape[0] == e.num_ids, kInvalidArgument, ew,
                          ": row gradient ", e.shape.to_string(), " for ", e.num_ids, " ids");
        }
        payload = checked_add(payload, id_bytes(e, ew), what);
        payload = checked_add(payload, value_bytes(e, ew), what);
      }
      reply = 0;
      break;
    }
    case Op::kAssign: {
      const int64_t n = read_count(r, kMinEntryBytes);
      for (int64_t i = 0; i < n; ++i) {
        q.entries.push_back(read_entry(r));
        const Entry& e = q.entries.back();
        DISTSTRAT_CHECK(!e.sparse, kInvalidArgument, what, " to '", echo(e.name), "': a row entry");
        payload = checked_add(payload, value_bytes(e, what + " to '" + echo(e.name) + "'"), what);
      }
      reply = 0;
      break;
    }
    case Op::kBarrier:
      q.count = r.get<int64_t>();
      reply = 0;
      break;
    case Op::kStats:
    case Op::kDone:
    case Op::kAlive:
      if (q.op != Op::kStats) reply = 0;
      break;
    case Op::kAbort:
      q.reason = r.get_string();
      DISTSTRAT_CHECK(!q.reason.empty(), kInvalidArgument, what, ": no reason");
      reply = 0;
      break;
    case Op::kBroadcast:
      // Root and receivers declare the size; the PS checks it against its
      // limit and the other side's before it allocates anything.
      q.count = r.get<int64_t>();
      q.root = r.get_bool("root");
      q.bytes = r.get<int64_t>();
      DISTSTRAT_CHECK(q.count >= 1 && q.bytes >= 0 && q.bytes <= kMaxMessageBytes, kInvalidArgument,
                      what, " ", q.count, ": ", q.bytes, " bytes");
      payload = q.root ? q.bytes : 0;
      reply = q.root ? 0 : q.bytes;
      break;
    case Op::kStopCheck:
      q.step = r.get<int64_t>();
      q.signalled = r.get_bool("signalled");
      reply = sizeof(int64_t);
      break;
    case Op::kSave: {
      // A stem, not a path: the PS writes into its own checkpoint directory
      // under a name it derives (see Service::handle_save).
      q.stem = r.get_string();
      q.save_id = r.get<uint64_t>();
      q.dir = r.get_string();
      DISTSTRAT_CHECK(q.dir.find('\0') == std::string::npos, kInvalidArgument, what,
                      ": a directory with a NUL");
      const std::string shown = echo(q.stem);
      DISTSTRAT_CHECK(
          valid_file_stem(q.stem), kInvalidArgument, what, ": '", shown,
          "' is not a checkpoint name (1 to 200 of [A-Za-z0-9._-], not starting with '.')");
      reply = sizeof(int64_t);
      break;
    }
    case Op::kReadSlots: {
      const int64_t n = read_count(r, kMinEntryBytes + 8);
      for (int64_t i = 0; i < n; ++i) {
        q.entries.push_back(read_entry(r));
        q.slot_of.push_back(r.get_string());
        DISTSTRAT_CHECK(!q.entries.back().sparse, kInvalidArgument, what, " of '",
                        q.entries.back().name, "': a row entry");
      }
      break;
    }
    case Op::kRestore: {
      const int64_t n = read_count(r, kMinEntryBytes + 1 + 8 + 8);
      for (int64_t i = 0; i < n; ++i) {
        q.entries.push_back(read_entry(r));
        const Entry& e = q.entries.back();
        const std::string ew = what + " of '" + echo(e.name) + "'";
        DISTSTRAT_CHECK(!e.sparse, kInvalidArgument, ew, ": a row entry");
        RestoreSpec s;
        s.has_value = r.get_bool("has_value");
        s.step = r.get<int64_t>();
        const int64_t nslots = r.get<int64_t>();
        DISTSTRAT_CHECK(s.step >= -1 && nslots >= 0 && nslots <= kMaxSlots, kInvalidArgument, ew,
                        ": step ", s.step, ", ", nslots, " slots");
        for (int64_t k = 0; k < nslots; ++k) s.slots.push_back(r.get_string());
        if (s.has_value) payload = checked_add(payload, value_bytes(e, ew), what);
        if (nslots) {
          const int64_t slot_bytes = checked_bytes(e.shape, sizeof(float), ew);
          payload = checked_add(payload, checked_mul(slot_bytes, nslots, ew), what);
        }
        q.restore.push_back(std::move(s));
      }
      reply = 0;
      break;
    }
    case Op::kMetric: {
      q.metric_name = r.get_string();
      q.metric_sum = r.get<double>();
      q.metric_count = r.get<double>();
      const std::string& name = q.metric_name;
      const std::string shown = echo(name);
      DISTSTRAT_CHECK(!name.empty() && name.size() <= kMaxMetricNameBytes, kInvalidArgument, what,
                      " '", shown, "': a name of ", name.size(), " characters (1 to ",
                      kMaxMetricNameBytes, ")");
      DISTSTRAT_CHECK(std::isfinite(q.metric_count) && q.metric_count >= 0, kInvalidArgument, what,
                      " '", shown, "': count ", q.metric_count, " is not a finite number >= 0");
      DISTSTRAT_CHECK(h.reply_bytes == 0 || h.reply_bytes == 2 * int64_t{sizeof(double)},
                      kInvalidArgument, what, " '", shown, "': a reply of ", h.reply_bytes,
                      " bytes asked (0 or 16)");
      break;
    }
    case Op::kRule: {
      q.replace = r.get_bool("replace");
      q.config = read_config(r);
      const int64_t n = read_count(r, kMinEntryBytes);
      DISTSTRAT_CHECK(n >= 1, kInvalidArgument, what, ": no shards");
      for (int64_t i = 0; i < n; ++i) q.entries.push_back(read_entry(r));
      reply = 0;
      break;
    }
  }
  DISTSTRAT_CHECK(r.at_end(), kInvalidArgument, what, ": ", r.remaining(),
                  " bytes after the last field");
  DISTSTRAT_CHECK(h.payload_bytes == payload, kInvalidArgument, what,
                  ": the header claims a payload of ", h.payload_bytes,
                  " bytes, the request declares ", payload);
  DISTSTRAT_CHECK(reply < 0 || h.reply_bytes == reply, kInvalidArgument, what,
                  ": the header expects a reply of ", h.reply_bytes, " bytes, the request's is ",
                  reply);
  return q;
}

std::string check_reply(const ReplyHeader& h, int64_t reply_bytes) {
  if (h.magic != kMagic) return "reply header with magic " + std::to_string(h.magic);
  if (h.status < -1 || h.status > static_cast<int32_t>(ErrorCode::kInternal)) {
    return "reply with status " + std::to_string(h.status);
  }
  if (h.error_bytes < 0 || h.error_bytes > kMaxStringBytes) {
    return "reply with an error text of " + std::to_string(h.error_bytes) + " bytes";
  }
  if ((h.status != -1) != (h.error_bytes > 0)) {
    return "reply with status " + std::to_string(h.status) + " and an error text of " +
           std::to_string(h.error_bytes) + " bytes";
  }
  if (h.version < 0) return "reply with version " + std::to_string(h.version);
  if (h.payload_bytes != reply_bytes) {
    return "the reply carries " + std::to_string(h.payload_bytes) + " bytes, expected " +
           std::to_string(reply_bytes);
  }
  return "";
}

}  // namespace ps
}  // namespace diststrat
