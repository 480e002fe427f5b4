// The parameter-server messages (src/parameter_server/messages.h): every
// request and reply survives encode then decode field for field, the bytes
// are the wire format the workers wrote inline before the typed messages
// existed (the fuzz corpora and other versions' peers rely on it), and a
// truncated, overlong or garbage body is a diststrat::Error, never a crash or
// another exception.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "diststrat/error.h"
#include "parameter_server/messages.h"
#include "parameter_server/shard_updater.h"
#include "parameter_server/wire.h"

namespace ds = diststrat;
namespace ps = diststrat::ps;

namespace {

ps::Entry msg_entry(int64_t id, const std::string& name, ds::Shape shape, bool sparse = false,
                    int64_t num_ids = 0, ds::DType dtype = ds::DType::kFloat32) {
  ps::Entry e;
  e.var_id = id;
  e.shard_index = id % 3;
  e.name = name;
  e.dtype = static_cast<int32_t>(dtype);
  e.shape = std::move(shape);
  e.sparse = sparse ? 1 : 0;
  e.num_ids = num_ids;
  return e;
}

ps::CreateRequest msg_create() {
  ps::CreateRequest m;
  m.var_id = 7;
  m.name = "dense/kernel";
  m.dtype = static_cast<int32_t>(ds::DType::kFloat32);
  m.full_shape = ds::Shape{10, 4};
  m.shard_index = 1;
  m.num_shards = 3;
  m.row_offset = 4;
  m.rows = 3;
  m.has_value = true;
  m.shard_shape = ds::Shape{3, 4};  // what decode derives
  return m;
}

ps::PullRequest msg_pull() {
  ps::PullRequest m;
  m.clock = 12;
  m.entries = {msg_entry(0, "w", ds::Shape{4}), msg_entry(1, "emb", ds::Shape{}, true, 3)};
  return m;
}

ps::PushRequest msg_push() {
  ps::PushRequest m;
  m.steps_after = 5;
  m.pulled_version = 41;
  m.iter_var = 9;
  m.iter_name = "iterations";
  m.entries = {msg_entry(0, "w", ds::Shape{4}), msg_entry(1, "emb", ds::Shape{2, 3}, true, 2)};
  return m;
}

ps::AssignRequest msg_assign() {
  ps::AssignRequest m;
  m.entries = {msg_entry(2, "b", ds::Shape{3}, false, 0, ds::DType::kFloat64)};
  return m;
}

ps::ReadSlotsRequest msg_read_slots() {
  ps::ReadSlotsRequest m;
  m.entries = {msg_entry(0, "w", ds::Shape{4}), msg_entry(3, "v", ds::Shape{2, 2})};
  m.slot_of = {"momentum", "m"};
  return m;
}

ps::RestoreRequest msg_restore() {
  ps::RestoreRequest m;
  m.entries = {msg_entry(0, "w", ds::Shape{4}), msg_entry(3, "v", ds::Shape{2, 2})};
  ps::RestoreSpec a;
  a.has_value = true;
  a.step = 17;
  a.slots = {"m", "v"};
  ps::RestoreSpec b;
  b.has_value = false;
  b.step = -1;
  b.slots = {"momentum"};
  m.specs = {a, b};
  return m;
}

ps::RuleRequest msg_rule() {
  ps::RuleRequest m;
  m.replace = true;
  m.config = {"adam", {0.001, 0.9, 0.999, 1e-7, 0, 0}};
  m.entries = {msg_entry(0, "w", ds::Shape{4}), msg_entry(3, "v", ds::Shape{2, 2})};
  return m;
}

// One request of every op that has a body, as (op, body, the typed value's
// check after decode_request).
struct MsgSample {
  ps::Op op;
  std::vector<char> body;
  std::function<bool(const ps::DecodedRequest&)> equal;  // decoded == the original
  int64_t reply_bytes;  // what the header asks (the fields fix it for most ops)
};

std::vector<MsgSample> msg_samples() {
  std::vector<MsgSample> s;
  const auto create = msg_create();
  s.push_back({ps::Op::kCreate, ps::encode(create),
               [create](const ps::DecodedRequest& q) { return q.create == create; }, 0});
  const auto pull = msg_pull();
  s.push_back({ps::Op::kPull, ps::encode(pull),
               [pull](const ps::DecodedRequest& q) { return q.pull == pull; }, 64});
  const auto push = msg_push();
  s.push_back({ps::Op::kPush, ps::encode(push),
               [push](const ps::DecodedRequest& q) { return q.push == push; }, 0});
  const auto assign = msg_assign();
  s.push_back({ps::Op::kAssign, ps::encode(assign),
               [assign](const ps::DecodedRequest& q) { return q.assign == assign; }, 0});
  const ps::BarrierRequest barrier{3};
  s.push_back({ps::Op::kBarrier, ps::encode(barrier),
               [barrier](const ps::DecodedRequest& q) { return q.barrier == barrier; }, 0});
  const ps::BroadcastRequest root{2, true, 24};
  s.push_back({ps::Op::kBroadcast, ps::encode(root),
               [root](const ps::DecodedRequest& q) { return q.broadcast == root; }, 0});
  const ps::BroadcastRequest receiver{2, false, 24};
  s.push_back({ps::Op::kBroadcast, ps::encode(receiver),
               [receiver](const ps::DecodedRequest& q) { return q.broadcast == receiver; }, 24});
  const ps::StopCheckRequest stop{99, true};
  s.push_back({ps::Op::kStopCheck, ps::encode(stop),
               [stop](const ps::DecodedRequest& q) { return q.stop_check == stop; },
               ps::kStopCheckReplyBytes});
  const ps::SaveRequest save{"ckpt-3", 0x1234567890abcdefULL, "/tmp/job/ckpt"};
  s.push_back({ps::Op::kSave, ps::encode(save),
               [save](const ps::DecodedRequest& q) { return q.save == save; },
               ps::kSaveReplyBytes});
  const auto slots = msg_read_slots();
  s.push_back({ps::Op::kReadSlots, ps::encode(slots),
               [slots](const ps::DecodedRequest& q) { return q.read_slots == slots; }, 32});
  const auto restore = msg_restore();
  s.push_back({ps::Op::kRestore, ps::encode(restore),
               [restore](const ps::DecodedRequest& q) { return q.restore == restore; }, 0});
  const ps::MetricRequest metric{"accuracy", 12.5, 16};
  s.push_back({ps::Op::kMetric, ps::encode(metric),
               [metric](const ps::DecodedRequest& q) { return q.metric == metric; },
               ps::kMetricReplyBytes});
  const auto rule = msg_rule();
  s.push_back({ps::Op::kRule, ps::encode(rule),
               [rule](const ps::DecodedRequest& q) { return q.rule == rule; }, 0});
  const ps::AbortRequest abort{"worker 1: out of memory"};
  s.push_back({ps::Op::kAbort, ps::encode(abort),
               [abort](const ps::DecodedRequest& q) { return q.abort == abort; }, 0});
  return s;
}

// The payload the body declares, from the typed decoder on its own.
int64_t msg_declared_payload(ps::Op op, const std::vector<char>& body, int64_t reply_bytes) {
  ps::Reader r(body.data(), body.size(), ps::op_name(op));
  ps::Declared d;
  d.header_reply = reply_bytes;
  ps::DecodedRequest q;
  switch (op) {
    case ps::Op::kCreate:
      ps::decode(r, q.create, d);
      break;
    case ps::Op::kPull:
      ps::decode(r, q.pull, d);
      break;
    case ps::Op::kPush:
      ps::decode(r, q.push, d);
      break;
    case ps::Op::kAssign:
      ps::decode(r, q.assign, d);
      break;
    case ps::Op::kBarrier:
      ps::decode(r, q.barrier, d);
      break;
    case ps::Op::kBroadcast:
      ps::decode(r, q.broadcast, d);
      break;
    case ps::Op::kStopCheck:
      ps::decode(r, q.stop_check, d);
      break;
    case ps::Op::kSave:
      ps::decode(r, q.save, d);
      break;
    case ps::Op::kReadSlots:
      ps::decode(r, q.read_slots, d);
      break;
    case ps::Op::kRestore:
      ps::decode(r, q.restore, d);
      break;
    case ps::Op::kMetric:
      ps::decode(r, q.metric, d);
      break;
    case ps::Op::kRule:
      ps::decode(r, q.rule, d);
      break;
    case ps::Op::kAbort:
      ps::decode(r, q.abort, d);
      break;
    default:
      ADD_FAILURE() << "no body for " << ps::op_name(op);
  }
  EXPECT_TRUE(r.at_end()) << ps::op_name(op) << ": " << r.remaining() << " bytes left";
  return d.payload;
}

std::vector<char> msg_message(ps::Op op, const std::vector<char>& body, int64_t payload_bytes,
                              int64_t reply_bytes) {
  ps::RequestHeader h;
  h.op = static_cast<uint16_t>(op);
  h.seq = 1;
  h.incarnation = 77;
  h.payload_bytes = payload_bytes;
  h.reply_bytes = reply_bytes;
  std::vector<char> m(sizeof h + body.size());
  std::memcpy(m.data(), &h, sizeof h);
  if (!body.empty()) std::memcpy(m.data() + sizeof h, body.data(), body.size());
  return m;
}

}  // namespace

TEST(PsMessages, EveryRequestRoundTrips) {
  const std::vector<MsgSample> all = msg_samples();
  // Every op with a body is here (kStats, kDone and kAlive have none).
  std::vector<bool> seen(17, false);
  for (const MsgSample& s : all) seen[static_cast<int>(s.op)] = true;
  for (int op = 1; op <= 16; ++op) {
    const auto o = static_cast<ps::Op>(op);
    EXPECT_EQ(seen[op], o != ps::Op::kStats && o != ps::Op::kDone && o != ps::Op::kAlive)
        << ps::op_name(o);
  }
  for (const MsgSample& s : all) {
    SCOPED_TRACE(ps::op_name(s.op));
    const int64_t payload = msg_declared_payload(s.op, s.body, s.reply_bytes);
    const ps::DecodedRequest q =
        ps::decode_request(msg_message(s.op, s.body, payload, s.reply_bytes).data(),
                           sizeof(ps::RequestHeader) + s.body.size());
    EXPECT_EQ(q.op, s.op);
    EXPECT_TRUE(s.equal(q));
  }
  // What each body declares as payload.
  EXPECT_EQ(msg_declared_payload(ps::Op::kCreate, ps::encode(msg_create()), 0), 3 * 4 * 4);
  EXPECT_EQ(msg_declared_payload(ps::Op::kPull, ps::encode(msg_pull()), 64), 3 * 8);
  EXPECT_EQ(msg_declared_payload(ps::Op::kPush, ps::encode(msg_push()), 0), 4 * 4 + 2 * 8 + 6 * 4);
  EXPECT_EQ(msg_declared_payload(ps::Op::kRestore, ps::encode(msg_restore()), 0),
            4 * 4 + 2 * 4 * 4 + 4 * 4);
  // A field that differs is seen by the comparison the round trip uses.
  ps::PushRequest other = msg_push();
  other.iter_name = "steps";
  EXPECT_FALSE(other == msg_push());
  ps::CreateRequest bigger = msg_create();
  bigger.rows = 4;
  EXPECT_FALSE(bigger == msg_create());
}

TEST(PsMessages, EveryReplyRoundTrips) {
  const ps::StopCheckReply stop{true};
  auto b = ps::encode(stop);
  EXPECT_EQ(static_cast<int64_t>(b.size()), ps::kStopCheckReplyBytes);
  EXPECT_TRUE(ps::decode_stop_check_reply(b.data(), b.size(), "stop") == stop);
  EXPECT_FALSE(
      ps::decode_stop_check_reply(ps::encode(ps::StopCheckReply{false}).data(), 8, "s").stop);

  const ps::SaveReply save{12};
  b = ps::encode(save);
  EXPECT_EQ(static_cast<int64_t>(b.size()), ps::kSaveReplyBytes);
  EXPECT_TRUE(ps::decode_save_reply(b.data(), b.size(), "save") == save);

  const ps::MetricReply metric{1.5, 3};
  b = ps::encode(metric);
  EXPECT_EQ(static_cast<int64_t>(b.size()), ps::kMetricReplyBytes);
  EXPECT_TRUE(ps::decode_metric_reply(b.data(), b.size(), "metric") == metric);

  ps::StatsReply stats;
  stats.version = 100;
  stats.pushes_rejected = 2;
  stats.staleness_sum = 30;
  stats.staleness_max = 4;
  stats.max_step_gap = 5;
  stats.pushes_nonfinite = 1;
  stats.worker_steps = {50, 48, 2};
  b = ps::encode(stats);
  EXPECT_EQ(static_cast<int64_t>(b.size()), ps::stats_reply_bytes(3));
  EXPECT_TRUE(ps::decode_stats_reply(b.data(), b.size(), 3, "stats") == stats);
}

// The bytes are those the call sites wrote with Writer::put before the typed
// messages (copied here from them), so peers and corpora of before still read.
TEST(PsMessages, EncodingIsTheWireFormatTheWorkersWroteBefore) {
  {
    const ps::CreateRequest m = msg_create();
    ps::Writer w;
    w.put<int64_t>(m.var_id).put_string(m.name).put<int32_t>(m.dtype);
    w.put_shape(m.full_shape).put<int64_t>(m.shard_index).put<int64_t>(m.num_shards);
    w.put<int64_t>(m.row_offset).put<int64_t>(m.rows).put<uint8_t>(1);
    EXPECT_EQ(ps::encode(m), w.bytes());
  }
  {
    const ps::PullRequest m = msg_pull();
    ps::Writer w;
    w.put<int64_t>(m.clock).put<int64_t>(static_cast<int64_t>(m.entries.size()));
    for (const ps::Entry& e : m.entries) ps::write_entry(w, e);
    EXPECT_EQ(ps::encode(m), w.bytes());
  }
  {
    const ps::PushRequest m = msg_push();
    ps::Writer w;
    w.put<int64_t>(m.steps_after).put<int64_t>(m.pulled_version);
    w.put<int64_t>(m.iter_var);
    w.put_string(m.iter_name);
    w.put<int64_t>(static_cast<int64_t>(m.entries.size()));
    for (const ps::Entry& e : m.entries) ps::write_entry(w, e);
    EXPECT_EQ(ps::encode(m), w.bytes());
  }
  {
    const ps::AssignRequest m = msg_assign();
    ps::Writer w;
    w.put<int64_t>(1);
    ps::write_entry(w, m.entries[0]);
    EXPECT_EQ(ps::encode(m), w.bytes());
  }
  {
    ps::Writer w;
    w.put<int64_t>(3);
    EXPECT_EQ(ps::encode(ps::BarrierRequest{3}), w.bytes());
  }
  {
    ps::Writer w;
    w.put<int64_t>(2).put<uint8_t>(1).put<int64_t>(24);
    EXPECT_EQ(ps::encode(ps::BroadcastRequest{2, true, 24}), w.bytes());
  }
  {
    ps::Writer w;
    w.put<int64_t>(99).put<uint8_t>(1);
    EXPECT_EQ(ps::encode(ps::StopCheckRequest{99, true}), w.bytes());
  }
  {
    ps::Writer w;
    w.put_string("ckpt-3").put<uint64_t>(5).put_string("/d");
    EXPECT_EQ(ps::encode(ps::SaveRequest{"ckpt-3", 5, "/d"}), w.bytes());
  }
  {
    const ps::ReadSlotsRequest m = msg_read_slots();
    ps::Writer body;
    for (size_t i = 0; i < m.entries.size(); ++i) {
      ps::write_entry(body, m.entries[i]);
      body.put_string(m.slot_of[i]);
    }
    ps::Writer w;
    w.put<int64_t>(static_cast<int64_t>(m.entries.size()));
    w.bytes().insert(w.bytes().end(), body.bytes().begin(), body.bytes().end());
    EXPECT_EQ(ps::encode(m), w.bytes());
  }
  {
    const ps::RestoreRequest m = msg_restore();
    ps::Writer w;
    w.put<int64_t>(static_cast<int64_t>(m.entries.size()));
    for (size_t i = 0; i < m.entries.size(); ++i) {
      ps::write_entry(w, m.entries[i]);
      w.put<uint8_t>(m.specs[i].has_value ? 1 : 0)
          .put<int64_t>(m.specs[i].step)
          .put<int64_t>(static_cast<int64_t>(m.specs[i].slots.size()));
      for (const auto& s : m.specs[i].slots) w.put_string(s);
    }
    EXPECT_EQ(ps::encode(m), w.bytes());
  }
  {
    ps::Writer w;
    w.put_string("loss").put<double>(1.5).put<double>(2.0);
    EXPECT_EQ(ps::encode(ps::MetricRequest{"loss", 1.5, 2.0}), w.bytes());
  }
  {
    const ps::RuleRequest m = msg_rule();
    ps::Writer w;
    w.put<uint8_t>(1);
    ps::write_config(w, m.config);
    w.put<int64_t>(static_cast<int64_t>(m.entries.size()));
    for (const ps::Entry& e : m.entries) ps::write_entry(w, e);
    EXPECT_EQ(ps::encode(m), w.bytes());
  }
  {
    ps::Writer w;
    w.put_string("why");
    EXPECT_EQ(ps::encode(ps::AbortRequest{"why"}), w.bytes());
  }
  {  // The replies the service wrote.
    ps::Writer w;
    w.put<int64_t>(1);
    EXPECT_EQ(ps::encode(ps::StopCheckReply{true}), w.bytes());
    ps::Writer s;
    s.put<int64_t>(4);
    EXPECT_EQ(ps::encode(ps::SaveReply{4}), s.bytes());
    ps::Writer m;
    m.put(2.5).put(4.0);
    EXPECT_EQ(ps::encode(ps::MetricReply{2.5, 4.0}), m.bytes());
    ps::Writer st;
    st.put<int64_t>(1).put<int64_t>(2).put<int64_t>(3).put<int64_t>(4).put<int64_t>(5);
    st.put<int64_t>(6).put<int64_t>(2).put<int64_t>(7).put<int64_t>(8);
    ps::StatsReply r;
    r.version = 1;
    r.pushes_rejected = 2;
    r.staleness_sum = 3;
    r.staleness_max = 4;
    r.max_step_gap = 5;
    r.pushes_nonfinite = 6;
    r.worker_steps = {7, 8};
    EXPECT_EQ(ps::encode(r), st.bytes());
  }
}

// Every prefix of every body (and the body with a byte more) is an
// InvalidArgumentError from decode_request: no read past the end, no crash.
TEST(PsMessages, TruncatedOrOverlongBodiesAreInvalidArgumentErrors) {
  for (const MsgSample& s : msg_samples()) {
    SCOPED_TRACE(ps::op_name(s.op));
    const int64_t payload = msg_declared_payload(s.op, s.body, s.reply_bytes);
    for (size_t n = 0; n < s.body.size(); ++n) {
      const std::vector<char> cut(s.body.begin(), s.body.begin() + n);
      const std::vector<char> m = msg_message(s.op, cut, payload, s.reply_bytes);
      EXPECT_THROW(ps::decode_request(m.data(), m.size()), ds::InvalidArgumentError)
          << n << " of " << s.body.size() << " bytes";
    }
    std::vector<char> longer = s.body;
    longer.push_back('\0');
    const std::vector<char> m = msg_message(s.op, longer, payload, s.reply_bytes);
    EXPECT_THROW(ps::decode_request(m.data(), m.size()), ds::InvalidArgumentError);
  }
  // Replies: short or long is an InvalidArgumentError, a stats reply for
  // another worker count an InternalError (a protocol error of the PS).
  const std::vector<char> stop = ps::encode(ps::StopCheckReply{true});
  EXPECT_THROW(ps::decode_stop_check_reply(stop.data(), 7, "stop"), ds::InvalidArgumentError);
  const std::vector<char> metric = ps::encode(ps::MetricReply{1, 2});
  EXPECT_THROW(ps::decode_metric_reply(metric.data(), 15, "metric"), ds::InvalidArgumentError);
  std::vector<char> save = ps::encode(ps::SaveReply{3});
  save.push_back(0);
  EXPECT_THROW(ps::decode_save_reply(save.data(), save.size(), "save"), ds::InvalidArgumentError);
  ps::StatsReply r;
  r.worker_steps = {1, 2};
  const std::vector<char> stats = ps::encode(r);
  EXPECT_THROW(ps::decode_stats_reply(stats.data(), stats.size() - 1, 2, "stats"),
               ds::InvalidArgumentError);
  try {
    ps::decode_stats_reply(stats.data(), stats.size(), 3, "stats reply");
    ADD_FAILURE() << "decoded a reply for 2 workers as one for 3";
  } catch (const ds::Error& e) {
    EXPECT_EQ(e.code(), ds::ErrorCode::kInternal);
    EXPECT_NE(e.message().find("2 workers, this job has 3"), std::string::npos) << e.message();
  }
}

// Garbage after a well-formed header, and bodies with random bytes changed:
// decode_request either accepts them or throws a diststrat::Error.
TEST(PsMessages, GarbageBodiesDecodeOrThrowDiststratErrors) {
  std::mt19937_64 rng(43);
  const std::vector<MsgSample> all = msg_samples();
  int rejected = 0, accepted = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const MsgSample& s = all[trial % all.size()];
    std::vector<char> body = s.body;
    if (trial % 2) {
      body.resize(rng() % 200);
      for (char& c : body) c = static_cast<char>(rng());
    } else {
      for (int k = 0; k < 1 + static_cast<int>(rng() % 4); ++k)
        body[rng() % body.size()] = static_cast<char>(rng());
    }
    const std::vector<char> m =
        msg_message(s.op, body, static_cast<int64_t>(rng() % 64), s.reply_bytes);
    try {
      ps::decode_request(m.data(), m.size());
      ++accepted;
    } catch (const ds::Error&) {
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << ps::op_name(s.op) << ": " << e.what();
    }
  }
  EXPECT_GT(rejected, 0);
  EXPECT_EQ(accepted + rejected, 4000);
}
