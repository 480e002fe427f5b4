// The parameter-server wire protocol, over Transport.
//
// A request is a control message (tag kRequestTag: a RequestHeader followed
// by the op's fields) and, when header.payload_bytes > 0, a payload message
// (tag kRequestPayloadTag: raw tensor bytes, sent straight from the worker's
// buffer). The PS answers every request, in the order it received the
// worker's requests, with a ReplyHeader (tag kReplyTag), then the error text
// (tag kReplyErrorTag) when error_bytes > 0, then the payload (tag
// kReplyPayloadTag) when the request's reply_bytes > 0 -- always exactly
// reply_bytes, zeros after an error -- so the worker posts the payload's
// receive together with the request and the bytes can land while it
// computes. Messages of one (sender, receiver, tag) keep their order, so
// neither side needs request ids to match replies; seq is checked anyway.
//
// Each worker's requests to one PS carry strictly increasing sequence
// numbers within the worker's incarnation (an id the worker's Client draws
// when it starts: a later start draws a larger one), and, once the worker
// has heard from that PS, the PS's incarnation (drawn when the Service
// starts, sent in every reply). The PS serves a request at most once and in
// order: a sequence number at or below the last one it took from that
// worker's incarnation, an earlier incarnation of the worker, or a request
// addressed to another incarnation of this PS (sent before it restarted) is
// rejected with an error naming the worker. A push must carry the PS's
// incarnation (the worker heard from the PS when its creates were answered).
//
// Both ends run on the same kind of host (byte order and struct layout are
// the sender's); fields are fixed-width.
//
// Nothing that arrives is trusted. The PS decodes each control message with
// decode_request (messages.h; a pure function: every count, length, shape, dtype and
// flag in range, byte sizes computed with overflow checks, and the header's
// payload_bytes equal to what the fields declare) and checks it against its
// variables before it allocates the payload or indexes anything; the worker
// checks each ReplyHeader (check_reply) before it receives the error text.
// Every receive, on both sides, has a deadline.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "diststrat/error.h"
#include "diststrat/tensor.h"

namespace diststrat {
namespace ps {

constexpr int kRequestTag = 0x5053000;
constexpr int kRequestPayloadTag = 0x5053001;
constexpr int kReplyTag = 0x5053002;
constexpr int kReplyErrorTag = 0x5053003;
constexpr int kReplyPayloadTag = 0x5053004;
constexpr uint32_t kMagic = 0x50534d32;  // "PSM2" (PSM1 had no incarnations)

enum class Op : uint16_t {
  kCreate = 1,   // declare a shard (the chief also sends its initial value)
  kPull = 2,     // read whole shards and/or rows of shards
  kPush = 3,     // apply gradients with an optimizer rule
  kAssign = 4,   // overwrite whole shards
  kBarrier = 5,  // answered when every live worker has reached this count
  kStats = 6,    // counters
  kDone = 7,     // the worker leaves
  // Checkpoints and agreement among workers (PS 0 meets the workers):
  kBroadcast = 8,   // the root deposits bytes; the others' requests wait for them
  kStopCheck = 9,   // preemption: has any worker (or this PS process) been signalled?
  kSave = 10,       // write this PS's shard file (value, slots, step of every shard)
  kReadSlots = 11,  // read optimizer slots of shards
  kRestore = 12,    // overwrite shards' values, slots and step counters
  kMetric = 13,     // PS 0: add (sum, count) to a job-wide metric; reply its totals if asked
  kRule = 14,       // declare (or, from the chief, replace) the update rule of shards
  kAbort = 15,      // the worker leaves because it failed: the PS fails the others' requests
  kAlive = 16,      // a heartbeat from a worker that has sent nothing for a while (changes nothing)
};
const char* op_name(Op op);
// Whether `op` (as it travels, uint16) is one of the ops above.
bool valid_op(uint16_t op);
// Whether `d` (an Entry's dtype as it travels, int32) is a DType.
bool valid_dtype(int32_t d);

// What one message may declare at most; anything larger is malformed.
constexpr int64_t kMaxMessageBytes = int64_t{1} << 40;  // a request's payload, a reply's payload
constexpr size_t kMaxControlBytes = size_t{64} << 20;   // a request's control message
constexpr int64_t kMaxEntries = int64_t{1} << 24;       // entries of one request
constexpr int64_t kMaxStringBytes = int64_t{1} << 20;   // a name, a path, an error text
constexpr int kMaxShapeRank = 32;
constexpr int kMaxSlots = 64;
constexpr size_t kMaxMetricNameBytes = 256;

struct RequestHeader {
  uint32_t magic = kMagic;
  uint16_t op = 0;
  uint16_t reserved = 0;
  int32_t worker = 0;
  int32_t reserved2 = 0;
  int64_t seq = 0;  // >= 1, strictly increasing per (worker incarnation, PS)
  int64_t payload_bytes = 0;
  int64_t reply_bytes = 0;      // the reply payload the worker expects
  uint64_t incarnation = 0;     // the worker's (non-zero)
  uint64_t ps_incarnation = 0;  // the PS's, as its replies told it (0: not heard yet)
};

struct ReplyHeader {
  uint32_t magic = kMagic;
  int32_t status = -1;  // -1 = OK, else an ErrorCode
  int64_t seq = 0;
  int64_t version = 0;  // pushes this PS had applied when it answered
  int64_t payload_bytes = 0;
  int64_t error_bytes = 0;
  uint64_t incarnation = 0;  // the PS's
};

// Appends fixed-width fields to a byte vector.
class Writer {
 public:
  Writer() { bytes_.reserve(256); }
  template <typename T>
  Writer& put(const T& v) {
    const char* p = reinterpret_cast<const char*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
    return *this;
  }
  Writer& put_string(const std::string& s);
  Writer& put_shape(const Shape& s);
  std::vector<char>& bytes() { return bytes_; }

 private:
  std::vector<char> bytes_;
};

// Reads what a Writer wrote; a short or malformed message is an
// InvalidArgumentError naming `what`. Strings are at most kMaxStringBytes,
// shapes at most kMaxShapeRank dims, each >= 0.
class Reader {
 public:
  Reader(const char* data, size_t size, std::string what)
      : p_(data), end_(data + size), what_(std::move(what)) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  std::string get_string();
  Shape get_shape();
  // A uint8 that must be 0 or 1.
  bool get_bool(const char* field);
  bool at_end() const { return p_ == end_; }
  size_t remaining() const { return static_cast<size_t>(end_ - p_); }
  const std::string& what() const { return what_; }

 private:
  void need(size_t n) const;
  const char* p_;
  const char* end_;
  std::string what_;
};

// Where a shard lives and which rows it holds.
struct ShardRef {
  int64_t var_id = 0;
  int64_t shard_index = 0;
};

// One dense-or-sparse item of a pull, push or assign.
struct Entry {
  int64_t var_id = 0;
  int64_t shard_index = 0;
  std::string name;  // the variable's name, for error messages
  int32_t dtype = 0;
  Shape shape;  // of the data this entry carries (push/assign), or rows x ... (sparse)
  uint8_t sparse = 0;
  int64_t num_ids = 0;  // sparse: row ids (global, int64) precede the values in the payload
};
void write_entry(Writer& w, const Entry& e);
// Reads and checks an entry on its own: dtype valid, sparse 0 or 1, num_ids
// >= 0 (0 unless sparse), shape's element count representable.
Entry read_entry(Reader& r);

// Byte counts of declared sizes: a * b, a + b (a, b >= 0), and a shape's
// element count times `elem_bytes`. Throw InvalidArgumentError naming `what`
// when the result would exceed kMaxMessageBytes (so nothing overflows).
int64_t checked_mul(int64_t a, int64_t b, const std::string& what);
int64_t checked_add(int64_t a, int64_t b, const std::string& what);
int64_t checked_bytes(const Shape& shape, int64_t elem_bytes, const std::string& what);

// An update rule as data (see shard_updater.h): declared per shard (kRule),
// fixed by the chief's declaration, never carried by pushes.
struct OptimizerConfig {
  std::string name;            // "sgd", "adam"
  std::vector<double> params;  // the options, in a fixed order per name
};

// Whether `s` may name a checkpoint file's stem: 1..200 characters of
// [A-Za-z0-9._-], not starting with '.' (so no directory, no "..").
bool valid_file_stem(const std::string& s);

// The first problem with a reply header for a request that expects
// `reply_bytes` of payload (magic, status a known ErrorCode or -1, an error
// text of 1..kMaxStringBytes exactly when status is an error, version >= 0,
// payload_bytes == reply_bytes), or "" when there is none. Pure.
std::string check_reply(const ReplyHeader& h, int64_t reply_bytes);

}  // namespace ps
}  // namespace diststrat
