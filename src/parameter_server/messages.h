// The parameter-server messages (the protocol is in wire.h): one struct per
// request body and per reply payload, and for each its encode and its decode
// beside each other in messages.cc, so that a field is added to both sides or
// to neither. A request body is what follows the RequestHeader in the control
// message; the payload message (raw tensor bytes) travels apart, as before.
//
// Workers encode with encode(...) and hand the bytes to Client::post. The PS
// decodes a whole control message with decode_request, which checks the
// header and calls the op's decode(...); the worker decodes a reply payload
// with decode_*_reply. Every decode checks what it reads (see wire.h: nothing
// that arrives is trusted) and throws InvalidArgumentError naming the message
// on a short, long or malformed one. The bytes are those the inline writers
// produced before this file existed (tests/fuzz replays old corpora).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "parameter_server/wire.h"

namespace diststrat {
namespace ps {

// What a request's fields declare, as its decode computes them; decode_request
// compares them with the header.
struct Declared {
  int64_t header_reply = 0;  // in: the header's reply_bytes (a metric's decode checks it)
  int64_t payload = 0;       // out: the bytes the payload message carries
  int64_t reply = -1;        // out: the reply payload the fields fix (-1: the PS computes it)
};

// kCreate: the shard a worker declares (and, from the chief, its value).
struct CreateRequest {
  int64_t var_id = 0;
  std::string name;
  int32_t dtype = 0;
  Shape full_shape;
  int64_t shard_index = 0, num_shards = 1, row_offset = 0, rows = 0;
  bool has_value = false;
  Shape shard_shape;  // decoded only: full_shape with rows in place of dim 0
};

// kPull: whole shards and/or rows of shards.
struct PullRequest {
  int64_t clock = -1;  // the worker's step (-1: no staleness check)
  std::vector<Entry> entries;
};

// kPush: gradients (the payload: each entry's row ids, then its values).
struct PushRequest {
  int64_t steps_after = 0;      // the worker's pushed steps after this one
  int64_t pulled_version = -1;  // the version its gradients were computed from
  int64_t iter_var = -1;        // the step counter to bump (-1: none)
  std::string iter_name;
  std::vector<Entry> entries;
};

// kAssign: whole shards' new values (the payload).
struct AssignRequest {
  std::vector<Entry> entries;
};

// kBarrier: answered when every live worker has reached `count`.
struct BarrierRequest {
  int64_t count = 0;
};

// kBroadcast: the root deposits `bytes`; the others' requests wait for them.
struct BroadcastRequest {
  int64_t count = 0;
  bool root = false;
  int64_t bytes = 0;  // the root's payload = each receiver's reply
};

// kStopCheck: has any worker (or the PS process) been signalled?
struct StopCheckRequest {
  int64_t step = 0;
  bool signalled = false;
};

// kSave: write this PS's shard file.
struct SaveRequest {
  std::string stem;      // a file-name stem (valid_file_stem); the PS derives the rest
  uint64_t save_id = 0;  // the save's id, in every file of it
  std::string dir;       // the worker's directory (used only by a PS configured with none)
};

// kReadSlots: an optimizer slot of each entry's shard.
struct ReadSlotsRequest {
  std::vector<Entry> entries;
  std::vector<std::string> slot_of;  // beside each entry
};

// A kRestore item, beside its entry.
struct RestoreSpec {
  bool has_value = false;
  int64_t step = -1;  // -1: keep the shard's step
  std::vector<std::string> slots;
};

// kRestore: shards' values, slots and step counters (the payload).
struct RestoreRequest {
  std::vector<Entry> entries;
  std::vector<RestoreSpec> specs;  // beside each entry
};

// kMetric: add (sum, count) to a job-wide metric; reply its totals if asked.
struct MetricRequest {
  std::string name;  // 1..kMaxMetricNameBytes
  double sum = 0;
  double count = 0;  // finite, >= 0
};

// kRule: declare (or, from the chief, replace) the update rule of shards.
struct RuleRequest {
  bool replace = false;  // the chief replaces a fixed rule (update_hyperparameters)
  OptimizerConfig config;
  std::vector<Entry> entries;  // at least one
};

// kAbort: the worker leaves because it failed.
struct AbortRequest {
  std::string reason;  // 1..kMaxStringBytes
};

// kStats, kDone and kAlive have no body.

std::vector<char> encode(const CreateRequest& m);
std::vector<char> encode(const PullRequest& m);
std::vector<char> encode(const PushRequest& m);
std::vector<char> encode(const AssignRequest& m);
std::vector<char> encode(const BarrierRequest& m);
std::vector<char> encode(const BroadcastRequest& m);
std::vector<char> encode(const StopCheckRequest& m);
std::vector<char> encode(const SaveRequest& m);
std::vector<char> encode(const ReadSlotsRequest& m);
std::vector<char> encode(const RestoreRequest& m);
std::vector<char> encode(const MetricRequest& m);
std::vector<char> encode(const RuleRequest& m);
std::vector<char> encode(const AbortRequest& m);

// Read one body from `r` (the caller checks that nothing is left) and check
// its fields' ranges; `d` gets the sizes they declare.
void decode(Reader& r, CreateRequest& m, Declared& d);
void decode(Reader& r, PullRequest& m, Declared& d);
void decode(Reader& r, PushRequest& m, Declared& d);
void decode(Reader& r, AssignRequest& m, Declared& d);
void decode(Reader& r, BarrierRequest& m, Declared& d);
void decode(Reader& r, BroadcastRequest& m, Declared& d);
void decode(Reader& r, StopCheckRequest& m, Declared& d);
void decode(Reader& r, SaveRequest& m, Declared& d);
void decode(Reader& r, ReadSlotsRequest& m, Declared& d);
void decode(Reader& r, RestoreRequest& m, Declared& d);
void decode(Reader& r, MetricRequest& m, Declared& d);
void decode(Reader& r, RuleRequest& m, Declared& d);
void decode(Reader& r, AbortRequest& m, Declared& d);

// Field-by-field equality of what travels (a create's shard_shape, derived,
// is compared too), beside encode and decode so that a round-trip test sees
// every field.
bool operator==(const Entry& a, const Entry& b);
bool operator==(const RestoreSpec& a, const RestoreSpec& b);
bool operator==(const OptimizerConfig& a, const OptimizerConfig& b);
bool operator==(const CreateRequest& a, const CreateRequest& b);
bool operator==(const PullRequest& a, const PullRequest& b);
bool operator==(const PushRequest& a, const PushRequest& b);
bool operator==(const AssignRequest& a, const AssignRequest& b);
bool operator==(const BarrierRequest& a, const BarrierRequest& b);
bool operator==(const BroadcastRequest& a, const BroadcastRequest& b);
bool operator==(const StopCheckRequest& a, const StopCheckRequest& b);
bool operator==(const SaveRequest& a, const SaveRequest& b);
bool operator==(const ReadSlotsRequest& a, const ReadSlotsRequest& b);
bool operator==(const RestoreRequest& a, const RestoreRequest& b);
bool operator==(const MetricRequest& a, const MetricRequest& b);
bool operator==(const RuleRequest& a, const RuleRequest& b);
bool operator==(const AbortRequest& a, const AbortRequest& b);

// A control message decoded and checked on its own (decode_request). Only
// the member of `op` is set.
struct DecodedRequest {
  RequestHeader header;
  Op op = Op::kDone;
  CreateRequest create;
  PullRequest pull;
  PushRequest push;
  AssignRequest assign;
  BarrierRequest barrier;
  BroadcastRequest broadcast;
  StopCheckRequest stop_check;
  SaveRequest save;
  ReadSlotsRequest read_slots;
  RestoreRequest restore;
  MetricRequest metric;
  RuleRequest rule;
  AbortRequest abort;
  // The entries of a pull, push, assign, slot read, restore or rule; none
  // for the other ops.
  const std::vector<Entry>& entries() const;
};

// Decodes one control message (RequestHeader + the op's body; in wire.cc,
// beside check_reply). Checks,
// without any state of the PS: size, magic, op, seq >= 1, a non-zero
// worker incarnation, payload_bytes and
// reply_bytes in [0, kMaxMessageBytes], every field as read_entry and the
// op's own ranges (entry counts <= kMaxEntries, create rows within the
// shape), no bytes left over, and payload_bytes equal to the bytes the
// fields declare (row ids x 8 plus values for a push, row ids x 8 for a
// pull, the value for a create with one, ...; computed with checked_*), and
// reply_bytes where the fields alone fix it (0, or 8 for a preemption check
// and a save). What needs the PS's variables (a pull's reply size, shapes
// against shards, row ids in range) is checked by the PS. Throws
// InvalidArgumentError; never allocates more than a small multiple of `size`.
// Pure and thread-safe.
DecodedRequest decode_request(const char* data, size_t size);

// Reply payloads. A reply's payload is exactly the request's reply_bytes
// (check_reply), so each reply has a fixed size, or one the worker knows.

// kStopCheck: whether to stop at this step.
struct StopCheckReply {
  bool stop = false;
};
constexpr int64_t kStopCheckReplyBytes = sizeof(int64_t);

// kSave: how many shards the PS wrote.
struct SaveReply {
  int64_t shards = 0;
};
constexpr int64_t kSaveReplyBytes = sizeof(int64_t);

// kMetric (when asked): the metric's totals after this request's addition.
struct MetricReply {
  double sum = 0;
  double count = 0;
};
constexpr int64_t kMetricReplyBytes = 2 * sizeof(double);

// kStats: this PS's counters and each worker's applied steps.
struct StatsReply {
  int64_t version = 0;  // pushes applied
  int64_t pushes_rejected = 0;
  int64_t staleness_sum = 0;
  int64_t staleness_max = 0;
  int64_t max_step_gap = 0;
  int64_t pushes_nonfinite = 0;
  std::vector<int64_t> worker_steps;
};
// The size of a stats reply in a job of `workers` workers.
int64_t stats_reply_bytes(size_t workers);

std::vector<char> encode(const StopCheckReply& m);
std::vector<char> encode(const SaveReply& m);
std::vector<char> encode(const MetricReply& m);
std::vector<char> encode(const StatsReply& m);

// Decode a whole reply payload (nothing may be left over); `what` names it
// in the error.
StopCheckReply decode_stop_check_reply(const char* data, size_t size, const std::string& what);
SaveReply decode_save_reply(const char* data, size_t size, const std::string& what);
MetricReply decode_metric_reply(const char* data, size_t size, const std::string& what);
// A stats reply must count `workers` workers (else an InternalError).
StatsReply decode_stats_reply(const char* data, size_t size, size_t workers,
                              const std::string& what);

bool operator==(const StopCheckReply& a, const StopCheckReply& b);
bool operator==(const SaveReply& a, const SaveReply& b);
bool operator==(const MetricReply& a, const MetricReply& b);
bool operator==(const StatsReply& a, const StatsReply& b);

}  // namespace ps
}  // namespace diststrat
