// The PS service's checks on a request's arrival, before it is queued: every
// entry against the shard it names (dtype, shape, byte counts), so that a
// handler only sees requests that fit.
#include "parameter_server/service.h"

#include "core/user_text.h"
#include "parameter_server/shard_updater.h"

namespace diststrat {
namespace ps {

namespace {

// What the PS knows of a shard when it checks a request on arrival: a
// created shard, or one the worker's own queued create declares.
struct ShardInfo {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;  // of the shard
  int64_t full_rows = 0;
};

int64_t shard_bytes(const ShardInfo& s, const std::string& what) {
  return checked_bytes(s.shape, dtype_size(s.dtype), what);
}

int64_t row_bytes_of(const ShardInfo& s, const std::string& what) {
  std::vector<int64_t> d = s.shape.dims();
  if (!d.empty()) d[0] = 1;
  return checked_bytes(Shape(d), dtype_size(s.dtype), what);
}

// The checks of one entry against its shard, shared by the arrival check
// and the handlers (so that both say the same).
void check_push_entry(const Entry& e, const ShardInfo& s) {
  DISTSTRAT_CHECK(e.dtype == static_cast<int32_t>(DType::kFloat32) && s.dtype == DType::kFloat32,
                  kInvalidArgument, "push to '", echo(e.name), "': gradient dtype ",
                  valid_dtype(e.dtype) ? dtype_name(static_cast<DType>(e.dtype)) : "invalid",
                  ", variable dtype ", dtype_name(s.dtype), "; optimizers update float32");
  if (e.sparse) {
    std::vector<int64_t> want = s.shape.dims();
    DISTSTRAT_CHECK(!want.empty(), kInvalidArgument, "row push to scalar '", echo(e.name), "'");
    want[0] = e.num_ids;
    DISTSTRAT_CHECK(e.num_ids >= 0 && e.shape == Shape(want), kInvalidArgument, "push to '",
                    echo(e.name), "' shard ", e.shard_index, ": row gradient ", e.shape.to_string(),
                    " for ", e.num_ids, " ids does not match the rows ", Shape(want).to_string());
  } else {
    DISTSTRAT_CHECK(e.shape == s.shape, kInvalidArgument, "push to '", echo(e.name), "' shard ",
                    e.shard_index, ": gradient shape ", e.shape.to_string(),
                    " does not match the shard's ", s.shape.to_string());
  }
}

void check_value_entry(const char* op, const Entry& e, const ShardInfo& s) {
  DISTSTRAT_CHECK(!e.sparse && e.dtype == static_cast<int32_t>(s.dtype) && e.shape == s.shape,
                  kInvalidArgument, op, " '", echo(e.name), "' shard ", e.shard_index, ": value ",
                  valid_dtype(e.dtype) ? dtype_name(static_cast<DType>(e.dtype)) : "invalid",
                  e.shape.to_string(), " does not match ", dtype_name(s.dtype),
                  s.shape.to_string());
}

}  // namespace

void Service::check_on_arrival(const WorkerState& w, const DecodedRequest& q) const {
  // The shard an entry names: a created one, or one this worker's queued
  // create declares (its requests are served after that create).
  auto info = [&](const Entry& e, const std::string& what) {
    ShardInfo s;
    auto it = shards_.find({e.var_id, e.shard_index});
    if (it != shards_.end()) {
      s.name = it->second.name;
      s.dtype = it->second.dtype;
      s.shape = it->second.value.shape();
      s.full_rows = it->second.full_shape.rank() ? it->second.full_shape[0] : 0;
    } else {
      const CreateRequest* spec = nullptr;
      for (const Pending& p : w.queue) {
        if (p.request.op == Op::kCreate && p.request.create.var_id == e.var_id &&
            p.request.create.shard_index == e.shard_index) {
          spec = &p.request.create;
        }
      }
      if (!spec) {
        throw NotFoundError(what + ": unknown variable '" + echo(e.name) + "' (id " +
                            std::to_string(e.var_id) + ", shard " + std::to_string(e.shard_index) +
                            ") on this PS");
      }
      s.name = spec->name;
      s.dtype = static_cast<DType>(spec->dtype);
      s.shape = spec->shard_shape;
      s.full_rows = spec->full_shape.rank() ? spec->full_shape[0] : 0;
    }
    DISTSTRAT_CHECK(s.name == e.name, kInvalidArgument, what, ": variable id ", e.var_id, " is '",
                    echo(s.name), "' here, not '", echo(e.name), "'");
    return s;
  };
  const std::string what = op_name(q.op);
  int64_t reply = -1;  // the reply size the shards fix (-1: the decoder checked it)
  switch (q.op) {
    case Op::kPull:
      reply = 0;
      for (const Entry& e : q.entries()) {
        const ShardInfo s = info(e, "pull");
        if (e.sparse) {
          DISTSTRAT_CHECK(s.shape.rank() >= 1, kInvalidArgument, "row pull of scalar '",
                          echo(e.name), "'");
          reply = checked_add(
              reply,
              checked_mul(e.num_ids, row_bytes_of(s, "pull"), "pull of '" + echo(e.name) + "'"),
              "pull");
        } else {
          reply = checked_add(reply, shard_bytes(s, "pull"), "pull");
        }
      }
      break;
    case Op::kPush:
      for (const Entry& e : q.entries()) check_push_entry(e, info(e, "push"));
      break;
    case Op::kAssign:
      for (const Entry& e : q.entries()) check_value_entry("assign to", e, info(e, "assign"));
      break;
    case Op::kReadSlots:
      reply = 0;
      for (const Entry& e : q.entries()) {
        const ShardInfo s = info(e, "slot read");
        DISTSTRAT_CHECK(s.dtype == DType::kFloat32, kInvalidArgument, "slot read of '",
                        echo(e.name), "': the variable is ", dtype_name(s.dtype),
                        ", only float32 variables have slots");
        reply = checked_add(reply, checked_bytes(s.shape, sizeof(float), "slot read"), "slot read");
      }
      break;
    case Op::kRestore:
      for (size_t i = 0; i < q.entries().size(); ++i) {
        const Entry& e = q.entries()[i];
        const ShardInfo s = info(e, "restore");
        check_value_entry("restore of", e, s);
        DISTSTRAT_CHECK(q.restore.specs[i].slots.empty() || s.dtype == DType::kFloat32,
                        kInvalidArgument, "restore of '", echo(e.name), "': slots for a ",
                        dtype_name(s.dtype), " variable");
      }
      break;
    case Op::kStats:
      reply = stats_reply_bytes(workers_.size());
      break;
    case Op::kCreate:
      // Only the chief defines a variable's value (and so its memory here).
      DISTSTRAT_CHECK(!q.create.has_value || w.index == 0, kInvalidArgument, "create of '",
                      echo(q.create.name), "' with an initial value from worker ", w.index,
                      ": only the chief (worker 0) sends one");
      break;
    case Op::kRule:
      DISTSTRAT_CHECK(
          !q.rule.replace || w.index == 0, kFailedPrecondition, "worker ", w.index,
          " changes an update rule: only the chief (worker 0) may (update_hyperparameters)");
      for (const Entry& e : q.entries()) {
        const ShardInfo s = info(e, "update rule");
        DISTSTRAT_CHECK(s.dtype == DType::kFloat32, kInvalidArgument, "update rule of '",
                        echo(e.name), "': the variable is ", dtype_name(s.dtype),
                        "; optimizers update float32");
      }
      break;
    case Op::kBroadcast: {
      const std::string b = "broadcast " + std::to_string(q.broadcast.count);
      DISTSTRAT_CHECK(q.broadcast.count == w.broadcast_arrived + 1, kInvalidArgument, b,
                      " from worker ", w.index, ": its last broadcast was ", w.broadcast_arrived,
                      " (they count up by one)");
      if (q.broadcast.root) {
        DISTSTRAT_CHECK(q.broadcast.bytes <= options_.max_broadcast_bytes - broadcast_bytes_held(),
                        kResourceExhausted, b, ": the root (worker ", w.index, ") sends ",
                        q.broadcast.bytes, " bytes; this PS holds at most ",
                        options_.max_broadcast_bytes, " broadcast bytes (max_broadcast_bytes), ",
                        broadcast_bytes_held(), " are held");
      } else {
        DISTSTRAT_CHECK(q.broadcast.bytes <= options_.max_broadcast_bytes, kResourceExhausted, b,
                        ": worker ", w.index, " expects ", q.broadcast.bytes,
                        " bytes, more than a broadcast may carry (max_broadcast_bytes ",
                        options_.max_broadcast_bytes, ")");
        auto it = broadcasts_.find(q.broadcast.count);
        DISTSTRAT_CHECK(
            it == broadcasts_.end() || static_cast<int64_t>(it->second.size()) == q.broadcast.bytes,
            kInvalidArgument, b, ": worker ", w.index, " expects ", q.broadcast.bytes,
            " bytes, the root sent ", it == broadcasts_.end() ? 0 : it->second.size());
      }
      // Against the other side's requests of this broadcast that are queued.
      for (const WorkerState& o : workers_) {
        for (const Pending& p : o.queue) {
          if (&o == &w || p.request.op != Op::kBroadcast ||
              p.request.broadcast.count != q.broadcast.count)
            continue;
          DISTSTRAT_CHECK(p.request.broadcast.root != q.broadcast.root || !q.broadcast.root,
                          kInvalidArgument, b, ": worker ", w.index, " and worker ", o.index,
                          " both send as its root");
          DISTSTRAT_CHECK(p.request.broadcast.root == q.broadcast.root ||
                              p.request.broadcast.bytes == q.broadcast.bytes,
                          kInvalidArgument, b, ": worker ", w.index,
                          q.broadcast.root ? " (the root) sends " : " expects ", q.broadcast.bytes,
                          " bytes, worker ", o.index,
                          p.request.broadcast.root ? " (the root) sends " : " expects ",
                          p.request.broadcast.bytes);
        }
      }
      break;
    }
    default:
      break;
  }
  DISTSTRAT_CHECK(reply < 0 || q.header.reply_bytes == reply, kInvalidArgument, what,
                  ": the header expects a reply of ", q.header.reply_bytes,
                  " bytes, the request's is ", reply);
}

}  // namespace ps
}  // namespace diststrat
