// Fuzz target: the parameter server's request decoder (ps::decode_request),
// the first thing a PS does with bytes a worker sent, and the worker's
// reply-header check (ps::check_reply). Any input must either decode into a
// request whose every declared size is in range and adds up -- recomputed
// here with exact 128-bit arithmetic, so an overflow the decoder missed is a
// finding -- or throw a diststrat::Error; a crash, a sanitizer report, a
// huge allocation (libFuzzer's -rss_limit_mb / -malloc_limit_mb) or another
// exception type is a finding.
#include <cstdint>
#include <cstring>
#include <string>

#include "diststrat/error.h"
#include "parameter_server/messages.h"
#include "parameter_server/wire.h"

namespace ps = diststrat::ps;
using i128 = __int128;

namespace {

void check(bool ok) {
  if (!ok) __builtin_trap();
}

i128 elements(const diststrat::Shape& s) {
  // Exact up to 2^80, then saturated: far above any limit compared with.
  const i128 cap = i128{1} << 80;
  i128 n = 1;
  for (int64_t d : s.dims()) {
    check(d >= 0);
    n = (d != 0 && n > cap / d) ? cap : n * d;
  }
  return n;
}

i128 bytes_of(const ps::Entry& e) {
  check(e.dtype >= 0 && e.dtype <= static_cast<int32_t>(diststrat::DType::kInt64));
  return elements(e.shape) *
         static_cast<i128>(diststrat::dtype_size(static_cast<diststrat::DType>(e.dtype)));
}

// The invariants of a request decode_request accepted.
void check_request(const ps::DecodedRequest& q) {
  const ps::RequestHeader& h = q.header;
  check(h.magic == ps::kMagic && ps::valid_op(h.op) && static_cast<uint16_t>(q.op) == h.op);
  check(h.payload_bytes >= 0 && h.payload_bytes <= ps::kMaxMessageBytes);
  check(h.reply_bytes >= 0 && h.reply_bytes <= ps::kMaxMessageBytes);
  check(h.seq >= 1 && h.incarnation != 0);
  check(static_cast<int64_t>(q.entries().size()) <= ps::kMaxEntries);
  i128 payload = 0;
  for (size_t i = 0; i < q.entries().size(); ++i) {
    const ps::Entry& e = q.entries()[i];
    check(e.var_id >= 0 && e.shard_index >= 0 && e.sparse <= 1 && e.num_ids >= 0);
    check(e.sparse || e.num_ids == 0);
    check(e.shape.rank() <= static_cast<size_t>(ps::kMaxShapeRank));
    check(e.name.size() <= static_cast<size_t>(ps::kMaxStringBytes));
    check(bytes_of(e) <= ps::kMaxMessageBytes);
    const i128 ids = e.sparse ? i128{e.num_ids} * 8 : 0;
    switch (q.op) {
      case ps::Op::kPull:
        payload += ids;
        break;
      case ps::Op::kPush:
        if (e.sparse) check(e.shape.rank() >= 1 && e.shape[0] == e.num_ids);
        payload += ids + bytes_of(e);
        break;
      case ps::Op::kAssign:
        check(!e.sparse);
        payload += bytes_of(e);
        break;
      case ps::Op::kRestore: {
        check(!e.sparse && q.restore.specs.size() == q.entries().size());
        const ps::RestoreSpec& r = q.restore.specs[i];
        check(r.step >= -1 && r.slots.size() <= static_cast<size_t>(ps::kMaxSlots));
        payload += (r.has_value ? bytes_of(e) : 0) +
                   elements(e.shape) * 4 * static_cast<i128>(r.slots.size());
        break;
      }
      case ps::Op::kReadSlots:
        check(!e.sparse && q.read_slots.slot_of.size() == q.entries().size());
        break;
      case ps::Op::kRule:
        break;  // names shards, no payload
      default:
        check(false);  // no other op has entries
    }
  }
  switch (q.op) {
    case ps::Op::kCreate: {
      const ps::CreateRequest& c = q.create;
      check(c.var_id >= 0 && c.num_shards >= 1 && c.shard_index >= 0 &&
            c.shard_index < c.num_shards);
      if (c.full_shape.rank() >= 1) {
        check(c.row_offset >= 0 && c.rows >= 0 && i128{c.row_offset} + c.rows <= c.full_shape[0]);
        check(c.shard_shape.rank() == c.full_shape.rank() && c.shard_shape[0] == c.rows);
      }
      const i128 value =
          elements(c.shard_shape) * diststrat::dtype_size(static_cast<diststrat::DType>(c.dtype));
      check(value <= ps::kMaxMessageBytes);
      payload = c.has_value ? value : 0;
      check(h.reply_bytes == 0);
      break;
    }
    case ps::Op::kBroadcast:
      // Both sides declare the size; it bounds the payload or the reply.
      check(q.broadcast.count >= 1 && q.broadcast.bytes >= 0 &&
            q.broadcast.bytes <= ps::kMaxMessageBytes);
      payload = q.broadcast.root ? q.broadcast.bytes : 0;
      check(h.reply_bytes == (q.broadcast.root ? 0 : q.broadcast.bytes));
      break;
    case ps::Op::kStopCheck:
    case ps::Op::kSave:
      check(h.reply_bytes == 8);
      if (q.op == ps::Op::kSave) {
        // A stem, never a path.
        check(ps::valid_file_stem(q.save.stem) && q.save.stem.find('/') == std::string::npos &&
              q.save.stem[0] != '.');
      }
      break;
    case ps::Op::kPush:
      check(q.push.steps_after >= 0 && q.push.pulled_version >= -1 && q.push.iter_var >= -1);
      check(h.reply_bytes == 0);
      break;
    case ps::Op::kRule:
      check(!q.rule.entries.empty() && q.rule.config.params.size() <= 64 + 2000 &&
            h.reply_bytes == 0);
      break;
    case ps::Op::kAssign:
    case ps::Op::kRestore:
    case ps::Op::kBarrier:
    case ps::Op::kDone:
    case ps::Op::kAlive:
      check(h.reply_bytes == 0);
      break;
    case ps::Op::kAbort:
      check(!q.abort.reason.empty() &&
            q.abort.reason.size() <= static_cast<size_t>(ps::kMaxStringBytes));
      check(h.reply_bytes == 0);
      break;
    default:
      break;
  }
  check(payload == h.payload_bytes);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* bytes = reinterpret_cast<const char*>(data);
  try {
    check_request(ps::decode_request(bytes, size));
  } catch (const diststrat::Error&) {
  }
  // The same bytes as a reply header (the worker's side).
  if (size >= sizeof(ps::ReplyHeader)) {
    ps::ReplyHeader h;
    std::memcpy(&h, data, sizeof h);
    int64_t expect = 0;
    if (size >= sizeof h + sizeof expect) std::memcpy(&expect, data + sizeof h, sizeof expect);
    const std::string problem = ps::check_reply(h, expect);
    if (problem.empty()) {
      check(h.magic == ps::kMagic && h.status >= -1 && h.error_bytes >= 0 &&
            h.error_bytes <= ps::kMaxStringBytes && h.version >= 0 && h.payload_bytes == expect);
      check((h.status == -1) == (h.error_bytes == 0));
    }
  }
  return 0;
}
