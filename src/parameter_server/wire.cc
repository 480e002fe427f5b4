#include "parameter_server/wire.h"

#include <cstring>

#include "core/user_text.h"
#include "parameter_server/messages.h"

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

bool valid_file_stem(const std::string& s) {
  if (s.empty() || s.size() > 200 || s[0] == '.') return false;
  for (char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

const std::vector<Entry>& DecodedRequest::entries() const {
  static const std::vector<Entry> kNone;
  switch (op) {
    case Op::kPull:
      return pull.entries;
    case Op::kPush:
      return push.entries;
    case Op::kAssign:
      return assign.entries;
    case Op::kReadSlots:
      return read_slots.entries;
    case Op::kRestore:
      return restore.entries;
    case Op::kRule:
      return rule.entries;
    default:
      return kNone;
  }
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
  Declared d;  // what the fields declare
  d.header_reply = h.reply_bytes;
  switch (q.op) {
    case Op::kCreate:
      decode(r, q.create, d);
      break;
    case Op::kPull:
      decode(r, q.pull, d);
      break;
    case Op::kPush:
      decode(r, q.push, d);
      break;
    case Op::kAssign:
      decode(r, q.assign, d);
      break;
    case Op::kBarrier:
      decode(r, q.barrier, d);
      break;
    case Op::kStats:
      break;
    case Op::kDone:
    case Op::kAlive:
      d.reply = 0;
      break;
    case Op::kAbort:
      decode(r, q.abort, d);
      break;
    case Op::kBroadcast:
      decode(r, q.broadcast, d);
      break;
    case Op::kStopCheck:
      decode(r, q.stop_check, d);
      break;
    case Op::kSave:
      decode(r, q.save, d);
      break;
    case Op::kReadSlots:
      decode(r, q.read_slots, d);
      break;
    case Op::kRestore:
      decode(r, q.restore, d);
      break;
    case Op::kMetric:
      decode(r, q.metric, d);
      break;
    case Op::kRule:
      decode(r, q.rule, d);
      break;
  }
  DISTSTRAT_CHECK(r.at_end(), kInvalidArgument, what, ": ", r.remaining(),
                  " bytes after the last field");
  DISTSTRAT_CHECK(h.payload_bytes == d.payload, kInvalidArgument, what,
                  ": the header claims a payload of ", h.payload_bytes,
                  " bytes, the request declares ", d.payload);
  DISTSTRAT_CHECK(d.reply < 0 || h.reply_bytes == d.reply, kInvalidArgument, what,
                  ": the header expects a reply of ", h.reply_bytes, " bytes, the request's is ",
                  d.reply);
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
