#include "parameter_server/wire.h"

namespace diststrat {
namespace ps {

const char* op_name(Op op) {
  switch (op) {
    case Op::kCreate: return "create";
    case Op::kPull: return "pull";
    case Op::kPush: return "push";
    case Op::kAssign: return "assign";
    case Op::kBarrier: return "barrier";
    case Op::kStats: return "stats";
    case Op::kDone: return "done";
    case Op::kBroadcast: return "broadcast";
    case Op::kStopCheck: return "preemption check";
    case Op::kSave: return "checkpoint save";
    case Op::kReadSlots: return "slot read";
    case Op::kRestore: return "checkpoint restore";
    case Op::kMetric: return "metric";
  }
  return "unknown op";
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
  DISTSTRAT_CHECK(n >= 0 && n <= (1 << 20), kInvalidArgument, what_, ": malformed string length ", n);
  need(static_cast<size_t>(n));
  std::string s(p_, static_cast<size_t>(n));
  p_ += n;
  return s;
}

Shape Reader::get_shape() {
  const int64_t rank = get<int64_t>();
  DISTSTRAT_CHECK(rank >= 0 && rank <= 32, kInvalidArgument, what_, ": malformed shape rank ", rank);
  std::vector<int64_t> dims(static_cast<size_t>(rank));
  for (auto& d : dims) {
    d = get<int64_t>();
    DISTSTRAT_CHECK(d >= 0, kInvalidArgument, what_, ": negative dimension ", d);
  }
  return Shape(dims);
}

void write_entry(Writer& w, const Entry& e) {
  w.put(e.var_id).put(e.shard_index).put_string(e.name).put(e.dtype).put_shape(e.shape);
  w.put(e.sparse).put(e.num_ids);
}

Entry read_entry(Reader& r) {
  Entry e;
  e.var_id = r.get<int64_t>();
  e.shard_index = r.get<int64_t>();
  e.name = r.get_string();
  e.dtype = r.get<int32_t>();
  e.shape = r.get_shape();
  e.sparse = r.get<uint8_t>();
  e.num_ids = r.get<int64_t>();
  return e;
}

}  // namespace ps
}  // namespace diststrat
