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
// Both ends run on the same kind of host (byte order and struct layout are
// the sender's); fields are fixed-width.
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
constexpr uint32_t kMagic = 0x50534d31;  // "PSM1"

enum class Op : uint16_t {
  kCreate = 1,   // declare a shard (the chief also sends its initial value)
  kPull = 2,     // read whole shards and/or rows of shards
  kPush = 3,     // apply gradients with an optimizer rule
  kAssign = 4,   // overwrite whole shards
  kBarrier = 5,  // answered when every live worker has reached this count
  kStats = 6,    // counters
  kDone = 7,     // the worker leaves
  // Checkpoints and agreement among workers (PS 0 meets the workers):
  kBroadcast = 8,  // the root deposits bytes; the others' requests wait for them
  kStopCheck = 9,  // preemption: has any worker (or this PS process) been signalled?
  kSave = 10,      // write this PS's shard file (value, slots, step of every shard)
  kReadSlots = 11, // read optimizer slots of shards
  kRestore = 12,   // overwrite shards' values, slots and step counters
  kMetric = 13,    // PS 0: add (sum, count) to a job-wide metric; reply its totals if asked
};
const char* op_name(Op op);

struct RequestHeader {
  uint32_t magic = kMagic;
  uint16_t op = 0;
  uint16_t reserved = 0;
  int32_t worker = 0;
  int32_t reserved2 = 0;
  int64_t seq = 0;
  int64_t payload_bytes = 0;
  int64_t reply_bytes = 0;  // the reply payload the worker expects
};

struct ReplyHeader {
  uint32_t magic = kMagic;
  int32_t status = -1;  // -1 = OK, else an ErrorCode
  int64_t seq = 0;
  int64_t version = 0;  // pushes this PS had applied when it answered
  int64_t payload_bytes = 0;
  int64_t error_bytes = 0;
};

// Appends fixed-width fields to a byte vector.
class Writer {
 public:
  Writer() { bytes_.reserve(256); }
  template <typename T> Writer& put(const T& v) {
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
// InvalidArgumentError naming `what`.
class Reader {
 public:
  Reader(const char* data, size_t size, std::string what)
      : p_(data), end_(data + size), what_(std::move(what)) {}
  template <typename T> T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  std::string get_string();
  Shape get_shape();
  bool at_end() const { return p_ == end_; }

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
  Shape shape;       // of the data this entry carries (push/assign), or rows x ... (sparse)
  uint8_t sparse = 0;
  int64_t num_ids = 0;  // sparse: row ids (global, int64) precede the values in the payload
};
void write_entry(Writer& w, const Entry& e);
Entry read_entry(Reader& r);

}  // namespace ps
}  // namespace diststrat
