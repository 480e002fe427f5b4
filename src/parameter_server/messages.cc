// Each message's encode, decode and equality, one message after the other
// (messages.h), requests then replies. decode_request, which checks the header
// and calls these, is in wire.cc.
#include "parameter_server/messages.h"

#include <cmath>
#include <cstring>

#include "core/user_text.h"
#include "parameter_server/shard_updater.h"

namespace diststrat {
namespace ps {

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

void put_entries(Writer& w, const std::vector<Entry>& entries) {
  w.put<int64_t>(static_cast<int64_t>(entries.size()));
  for (const Entry& e : entries) write_entry(w, e);
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

}  // namespace

bool operator==(const Entry& a, const Entry& b) {
  return a.var_id == b.var_id && a.shard_index == b.shard_index && a.name == b.name &&
         a.dtype == b.dtype && a.shape == b.shape && a.sparse == b.sparse && a.num_ids == b.num_ids;
}

bool operator==(const OptimizerConfig& a, const OptimizerConfig& b) {
  return a.name == b.name && a.params == b.params;
}

// kCreate

std::vector<char> encode(const CreateRequest& m) {
  Writer w;
  w.put<int64_t>(m.var_id).put_string(m.name).put<int32_t>(m.dtype).put_shape(m.full_shape);
  w.put<int64_t>(m.shard_index).put<int64_t>(m.num_shards).put<int64_t>(m.row_offset);
  w.put<int64_t>(m.rows).put<uint8_t>(m.has_value ? 1 : 0);
  return std::move(w.bytes());
}

void decode(Reader& r, CreateRequest& c, Declared& d) {
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
  d.payload = c.has_value
                  ? checked_bytes(c.shard_shape, dtype_size(static_cast<DType>(c.dtype)), r.what())
                  : 0;
  d.reply = 0;
}

bool operator==(const CreateRequest& a, const CreateRequest& b) {
  return a.var_id == b.var_id && a.name == b.name && a.dtype == b.dtype &&
         a.full_shape == b.full_shape && a.shard_index == b.shard_index &&
         a.num_shards == b.num_shards && a.row_offset == b.row_offset && a.rows == b.rows &&
         a.has_value == b.has_value && a.shard_shape == b.shard_shape;
}

// kPull

std::vector<char> encode(const PullRequest& m) {
  Writer w;
  w.put<int64_t>(m.clock);
  put_entries(w, m.entries);
  return std::move(w.bytes());
}

void decode(Reader& r, PullRequest& m, Declared& d) {
  const std::string& what = r.what();
  m.clock = r.get<int64_t>();
  const int64_t n = read_count(r, kMinEntryBytes);
  for (int64_t i = 0; i < n; ++i) {
    m.entries.push_back(read_entry(r));
    const Entry& e = m.entries.back();
    d.payload = checked_add(d.payload, id_bytes(e, what + " of '" + echo(e.name) + "'"), what);
  }
}

bool operator==(const PullRequest& a, const PullRequest& b) {
  return a.clock == b.clock && a.entries == b.entries;
}

// kPush

std::vector<char> encode(const PushRequest& m) {
  Writer w;
  w.put<int64_t>(m.steps_after).put<int64_t>(m.pulled_version);
  w.put<int64_t>(m.iter_var).put_string(m.iter_name);
  put_entries(w, m.entries);
  return std::move(w.bytes());
}

void decode(Reader& r, PushRequest& m, Declared& d) {
  const std::string& what = r.what();
  m.steps_after = r.get<int64_t>();
  m.pulled_version = r.get<int64_t>();
  m.iter_var = r.get<int64_t>();
  m.iter_name = r.get_string();
  DISTSTRAT_CHECK(m.steps_after >= 0 && m.pulled_version >= -1 && m.iter_var >= -1,
                  kInvalidArgument, what, ": step ", m.steps_after, ", version ", m.pulled_version,
                  ", step counter ", m.iter_var);
  const int64_t n = read_count(r, kMinEntryBytes);
  for (int64_t i = 0; i < n; ++i) {
    m.entries.push_back(read_entry(r));
    const Entry& e = m.entries.back();
    const std::string ew = what + " to '" + echo(e.name) + "'";
    if (e.sparse) {
      DISTSTRAT_CHECK(e.shape.rank() >= 1 && e.shape[0] == e.num_ids, kInvalidArgument, ew,
                      ": row gradient ", e.shape.to_string(), " for ", e.num_ids, " ids");
    }
    d.payload = checked_add(d.payload, id_bytes(e, ew), what);
    d.payload = checked_add(d.payload, value_bytes(e, ew), what);
  }
  d.reply = 0;
}

bool operator==(const PushRequest& a, const PushRequest& b) {
  return a.steps_after == b.steps_after && a.pulled_version == b.pulled_version &&
         a.iter_var == b.iter_var && a.iter_name == b.iter_name && a.entries == b.entries;
}

// kAssign

std::vector<char> encode(const AssignRequest& m) {
  Writer w;
  put_entries(w, m.entries);
  return std::move(w.bytes());
}

void decode(Reader& r, AssignRequest& m, Declared& d) {
  const std::string& what = r.what();
  const int64_t n = read_count(r, kMinEntryBytes);
  for (int64_t i = 0; i < n; ++i) {
    m.entries.push_back(read_entry(r));
    const Entry& e = m.entries.back();
    DISTSTRAT_CHECK(!e.sparse, kInvalidArgument, what, " to '", echo(e.name), "': a row entry");
    d.payload = checked_add(d.payload, value_bytes(e, what + " to '" + echo(e.name) + "'"), what);
  }
  d.reply = 0;
}

bool operator==(const AssignRequest& a, const AssignRequest& b) { return a.entries == b.entries; }

// kBarrier

std::vector<char> encode(const BarrierRequest& m) {
  Writer w;
  w.put<int64_t>(m.count);
  return std::move(w.bytes());
}

void decode(Reader& r, BarrierRequest& m, Declared& d) {
  m.count = r.get<int64_t>();
  d.reply = 0;
}

bool operator==(const BarrierRequest& a, const BarrierRequest& b) { return a.count == b.count; }

// kBroadcast

std::vector<char> encode(const BroadcastRequest& m) {
  Writer w;
  w.put<int64_t>(m.count).put<uint8_t>(m.root ? 1 : 0).put<int64_t>(m.bytes);
  return std::move(w.bytes());
}

void decode(Reader& r, BroadcastRequest& m, Declared& d) {
  // Root and receivers declare the size; the PS checks it against its
  // limit and the other side's before it allocates anything.
  m.count = r.get<int64_t>();
  m.root = r.get_bool("root");
  m.bytes = r.get<int64_t>();
  DISTSTRAT_CHECK(m.count >= 1 && m.bytes >= 0 && m.bytes <= kMaxMessageBytes, kInvalidArgument,
                  r.what(), " ", m.count, ": ", m.bytes, " bytes");
  d.payload = m.root ? m.bytes : 0;
  d.reply = m.root ? 0 : m.bytes;
}

bool operator==(const BroadcastRequest& a, const BroadcastRequest& b) {
  return a.count == b.count && a.root == b.root && a.bytes == b.bytes;
}

// kStopCheck

std::vector<char> encode(const StopCheckRequest& m) {
  Writer w;
  w.put<int64_t>(m.step).put<uint8_t>(m.signalled ? 1 : 0);
  return std::move(w.bytes());
}

void decode(Reader& r, StopCheckRequest& m, Declared& d) {
  m.step = r.get<int64_t>();
  m.signalled = r.get_bool("signalled");
  d.reply = kStopCheckReplyBytes;
}

bool operator==(const StopCheckRequest& a, const StopCheckRequest& b) {
  return a.step == b.step && a.signalled == b.signalled;
}

// kSave

std::vector<char> encode(const SaveRequest& m) {
  Writer w;
  w.put_string(m.stem).put<uint64_t>(m.save_id).put_string(m.dir);
  return std::move(w.bytes());
}

void decode(Reader& r, SaveRequest& m, Declared& d) {
  // A stem, not a path: the PS writes into its own checkpoint directory
  // under a name it derives (see Service::handle_save).
  m.stem = r.get_string();
  m.save_id = r.get<uint64_t>();
  m.dir = r.get_string();
  DISTSTRAT_CHECK(m.dir.find('\0') == std::string::npos, kInvalidArgument, r.what(),
                  ": a directory with a NUL");
  const std::string shown = echo(m.stem);
  DISTSTRAT_CHECK(valid_file_stem(m.stem), kInvalidArgument, r.what(), ": '", shown,
                  "' is not a checkpoint name (1 to 200 of [A-Za-z0-9._-], not starting with '.')");
  d.reply = kSaveReplyBytes;
}

bool operator==(const SaveRequest& a, const SaveRequest& b) {
  return a.stem == b.stem && a.save_id == b.save_id && a.dir == b.dir;
}

// kReadSlots

std::vector<char> encode(const ReadSlotsRequest& m) {
  DISTSTRAT_CHECK_EQ(m.entries.size(), m.slot_of.size(), "slot read request");
  Writer w;
  w.put<int64_t>(static_cast<int64_t>(m.entries.size()));
  for (size_t i = 0; i < m.entries.size(); ++i) {
    write_entry(w, m.entries[i]);
    w.put_string(m.slot_of[i]);
  }
  return std::move(w.bytes());
}

void decode(Reader& r, ReadSlotsRequest& m, Declared&) {
  const int64_t n = read_count(r, kMinEntryBytes + 8);
  for (int64_t i = 0; i < n; ++i) {
    m.entries.push_back(read_entry(r));
    m.slot_of.push_back(r.get_string());
    DISTSTRAT_CHECK(!m.entries.back().sparse, kInvalidArgument, r.what(), " of '",
                    m.entries.back().name, "': a row entry");
  }
}

bool operator==(const ReadSlotsRequest& a, const ReadSlotsRequest& b) {
  return a.entries == b.entries && a.slot_of == b.slot_of;
}

// kRestore

std::vector<char> encode(const RestoreRequest& m) {
  DISTSTRAT_CHECK_EQ(m.entries.size(), m.specs.size(), "restore request");
  Writer w;
  w.put<int64_t>(static_cast<int64_t>(m.entries.size()));
  for (size_t i = 0; i < m.entries.size(); ++i) {
    const RestoreSpec& s = m.specs[i];
    write_entry(w, m.entries[i]);
    w.put<uint8_t>(s.has_value ? 1 : 0)
        .put<int64_t>(s.step)
        .put<int64_t>(static_cast<int64_t>(s.slots.size()));
    for (const std::string& slot : s.slots) w.put_string(slot);
  }
  return std::move(w.bytes());
}

void decode(Reader& r, RestoreRequest& m, Declared& d) {
  const std::string& what = r.what();
  const int64_t n = read_count(r, kMinEntryBytes + 1 + 8 + 8);
  for (int64_t i = 0; i < n; ++i) {
    m.entries.push_back(read_entry(r));
    const Entry& e = m.entries.back();
    const std::string ew = what + " of '" + echo(e.name) + "'";
    DISTSTRAT_CHECK(!e.sparse, kInvalidArgument, ew, ": a row entry");
    RestoreSpec s;
    s.has_value = r.get_bool("has_value");
    s.step = r.get<int64_t>();
    const int64_t nslots = r.get<int64_t>();
    DISTSTRAT_CHECK(s.step >= -1 && nslots >= 0 && nslots <= kMaxSlots, kInvalidArgument, ew,
                    ": step ", s.step, ", ", nslots, " slots");
    for (int64_t k = 0; k < nslots; ++k) s.slots.push_back(r.get_string());
    if (s.has_value) d.payload = checked_add(d.payload, value_bytes(e, ew), what);
    if (nslots) {
      const int64_t slot_bytes = checked_bytes(e.shape, sizeof(float), ew);
      d.payload = checked_add(d.payload, checked_mul(slot_bytes, nslots, ew), what);
    }
    m.specs.push_back(std::move(s));
  }
  d.reply = 0;
}

bool operator==(const RestoreSpec& a, const RestoreSpec& b) {
  return a.has_value == b.has_value && a.step == b.step && a.slots == b.slots;
}

bool operator==(const RestoreRequest& a, const RestoreRequest& b) {
  return a.entries == b.entries && a.specs == b.specs;
}

// kMetric

std::vector<char> encode(const MetricRequest& m) {
  Writer w;
  w.put_string(m.name).put<double>(m.sum).put<double>(m.count);
  return std::move(w.bytes());
}

void decode(Reader& r, MetricRequest& m, Declared& d) {
  const std::string& what = r.what();
  m.name = r.get_string();
  m.sum = r.get<double>();
  m.count = r.get<double>();
  const std::string& name = m.name;
  const std::string shown = echo(name);
  DISTSTRAT_CHECK(!name.empty() && name.size() <= kMaxMetricNameBytes, kInvalidArgument, what, " '",
                  shown, "': a name of ", name.size(), " characters (1 to ", kMaxMetricNameBytes,
                  ")");
  DISTSTRAT_CHECK(std::isfinite(m.count) && m.count >= 0, kInvalidArgument, what, " '", shown,
                  "': count ", m.count, " is not a finite number >= 0");
  DISTSTRAT_CHECK(d.header_reply == 0 || d.header_reply == kMetricReplyBytes, kInvalidArgument,
                  what, " '", shown, "': a reply of ", d.header_reply, " bytes asked (0 or 16)");
}

bool operator==(const MetricRequest& a, const MetricRequest& b) {
  return a.name == b.name && a.sum == b.sum && a.count == b.count;
}

// kRule

std::vector<char> encode(const RuleRequest& m) {
  Writer w;
  w.put<uint8_t>(m.replace ? 1 : 0);
  write_config(w, m.config);
  put_entries(w, m.entries);
  return std::move(w.bytes());
}

void decode(Reader& r, RuleRequest& m, Declared& d) {
  m.replace = r.get_bool("replace");
  m.config = read_config(r);
  const int64_t n = read_count(r, kMinEntryBytes);
  DISTSTRAT_CHECK(n >= 1, kInvalidArgument, r.what(), ": no shards");
  for (int64_t i = 0; i < n; ++i) m.entries.push_back(read_entry(r));
  d.reply = 0;
}

bool operator==(const RuleRequest& a, const RuleRequest& b) {
  return a.replace == b.replace && a.config == b.config && a.entries == b.entries;
}

// kAbort

std::vector<char> encode(const AbortRequest& m) {
  Writer w;
  w.put_string(m.reason);
  return std::move(w.bytes());
}

void decode(Reader& r, AbortRequest& m, Declared& d) {
  m.reason = r.get_string();
  DISTSTRAT_CHECK(!m.reason.empty(), kInvalidArgument, r.what(), ": no reason");
  d.reply = 0;
}

bool operator==(const AbortRequest& a, const AbortRequest& b) { return a.reason == b.reason; }

// Replies

namespace {

void check_reply_end(const Reader& r) {
  DISTSTRAT_CHECK(r.at_end(), kInvalidArgument, r.what(), ": ", r.remaining(),
                  " bytes after the last field");
}

}  // namespace

std::vector<char> encode(const StopCheckReply& m) {
  Writer w;
  w.put<int64_t>(m.stop ? 1 : 0);
  return std::move(w.bytes());
}

StopCheckReply decode_stop_check_reply(const char* data, size_t size, const std::string& what) {
  Reader r(data, size, what);
  StopCheckReply m;
  m.stop = r.get<int64_t>() != 0;
  check_reply_end(r);
  return m;
}

bool operator==(const StopCheckReply& a, const StopCheckReply& b) { return a.stop == b.stop; }

std::vector<char> encode(const SaveReply& m) {
  Writer w;
  w.put<int64_t>(m.shards);
  return std::move(w.bytes());
}

SaveReply decode_save_reply(const char* data, size_t size, const std::string& what) {
  Reader r(data, size, what);
  SaveReply m;
  m.shards = r.get<int64_t>();
  check_reply_end(r);
  return m;
}

bool operator==(const SaveReply& a, const SaveReply& b) { return a.shards == b.shards; }

std::vector<char> encode(const MetricReply& m) {
  Writer w;
  w.put<double>(m.sum).put<double>(m.count);
  return std::move(w.bytes());
}

MetricReply decode_metric_reply(const char* data, size_t size, const std::string& what) {
  Reader r(data, size, what);
  MetricReply m;
  m.sum = r.get<double>();
  m.count = r.get<double>();
  check_reply_end(r);
  return m;
}

bool operator==(const MetricReply& a, const MetricReply& b) {
  return a.sum == b.sum && a.count == b.count;
}

int64_t stats_reply_bytes(size_t workers) {
  return static_cast<int64_t>((7 + workers) * sizeof(int64_t));
}

std::vector<char> encode(const StatsReply& m) {
  Writer w;
  w.put<int64_t>(m.version).put<int64_t>(m.pushes_rejected).put<int64_t>(m.staleness_sum);
  w.put<int64_t>(m.staleness_max).put<int64_t>(m.max_step_gap).put<int64_t>(m.pushes_nonfinite);
  w.put<int64_t>(static_cast<int64_t>(m.worker_steps.size()));
  for (int64_t s : m.worker_steps) w.put<int64_t>(s);
  return std::move(w.bytes());
}

StatsReply decode_stats_reply(const char* data, size_t size, size_t workers,
                              const std::string& what) {
  Reader r(data, size, what);
  StatsReply m;
  m.version = r.get<int64_t>();
  m.pushes_rejected = r.get<int64_t>();
  m.staleness_sum = r.get<int64_t>();
  m.staleness_max = r.get<int64_t>();
  m.max_step_gap = r.get<int64_t>();
  m.pushes_nonfinite = r.get<int64_t>();
  const int64_t n = r.get<int64_t>();
  // Checked before it sizes anything: the reply must count our workers.
  DISTSTRAT_CHECK(n == static_cast<int64_t>(workers), kInternal, what, ": protocol error: ", n,
                  " workers, this job has ", workers);
  m.worker_steps.resize(static_cast<size_t>(n));
  for (int64_t& s : m.worker_steps) s = r.get<int64_t>();
  check_reply_end(r);
  return m;
}

bool operator==(const StatsReply& a, const StatsReply& b) {
  return a.version == b.version && a.pushes_rejected == b.pushes_rejected &&
         a.staleness_sum == b.staleness_sum && a.staleness_max == b.staleness_max &&
         a.max_step_gap == b.max_step_gap && a.pushes_nonfinite == b.pushes_nonfinite &&
         a.worker_steps == b.worker_steps;
}

}  // namespace ps
}  // namespace diststrat
