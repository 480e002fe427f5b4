// The parameter-server wire, attacked from both ends:
//  - a PS Service fed malformed or lying requests by a raw peer (rank 0) over
//    the in-process transport: each gets an error reply naming the worker,
//    quickly, without the PS allocating what the message claims; the PS keeps
//    serving and its state does not change;
//  - a payload that never arrives, and a PS that was itself not running
//    (silence is counted only while the PS loop runs);
//  - a worker's Client fed malformed replies by a raw PS;
//  - the request decoder on its own (bytes in -> validated request or error).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "allreduce/transport.h"
#include "core/user_text.h"
#include "diststrat/error.h"
#include "diststrat/logging.h"
#include "parameter_server/client.h"
#include "parameter_server/service.h"
#include "parameter_server/shard_updater.h"
#include "parameter_server/wire.h"
#include "ps_wire_util.h"

namespace ds = diststrat;
namespace ps = diststrat::ps;
using std::chrono::milliseconds;
using namespace ps_test;

namespace {

// Issue 14.7: a row-sparse pull entry claiming 2^61 ids (num_ids * 8
// overflows to 0, matching an empty payload) segfaulted the PS.
TEST_F(PsWire, PullClaiming2To61IdsIsRejectedAndThePsKeepsServing) {
  start();
  create_variables();
  const auto before = service_->snapshot();
  auto r = peer_.call(header(ps::Op::kPull, seq_++, 0, 8),
                      pull_body({entry(1, "emb", {}, true, int64_t{1} << 61)}));
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "2305843009213693952 ids");
  expect_serves();
  const auto after = service_->snapshot();
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(0,
              std::memcmp(before[i].value.data(), after[i].value.data(), before[i].value.nbytes()));
  }
}

// Issue 14.7: payload_bytes 2^40 or reply_bytes 2^50 ended in std::bad_alloc
// -> terminate; a 2 GB claim made the PS allocate 2 GB and then wait for it.
// Now each is answered at once, before anything is allocated.
TEST_F(PsWire, HeaderClaimingHugePayloadOrReplyIsRejectedWithoutAllocating) {
  start();
  create_variables();
  auto r =
      peer_.call(header(ps::Op::kPull, seq_++, int64_t{1} << 40, 16), pull_body({entry(0, "w")}));
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "payload");
  r = peer_.call(header(ps::Op::kPull, seq_++, 0, int64_t{1} << 50), pull_body({entry(0, "w")}));
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "reply");
  EXPECT_EQ(r.header.payload_bytes, 0) << "no padding of an untrusted reply size";
  // 2 GB of row ids claimed by the header, none declared by the body.
  r = peer_.call(header(ps::Op::kPull, seq_++, int64_t{2} << 30, 16), pull_body({entry(0, "w")}),
                 nullptr, milliseconds(3000));
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "2147483648");
  // Sizes that agree with each other but exceed the message limit: 2^38 ids
  // of 'emb' are 2 TiB of ids.
  r = peer_.call(header(ps::Op::kPull, seq_++, int64_t{1} << 41, int64_t{1} << 41),
                 pull_body({entry(1, "emb", {}, true, int64_t{1} << 38)}));
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "");
  expect_serves();
}

// Issue 14.7: every field checked against the variable before anything is
// indexed or changed; each bad message gets an error naming the worker.
TEST_F(PsWire, RequestsThatDisagreeWithTheVariableAreRejectedAndChangeNothing) {
  start();
  create_variables();
  const auto before = service_->snapshot();
  // A dense pull whose reply size is not the shard's.
  auto r = peer_.call(header(ps::Op::kPull, seq_++, 0, 12), pull_body({entry(0, "w")}));
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "12");
  // A row pull with an id out of range.
  {
    std::vector<char> ids(8);
    const int64_t id = 10;
    std::memcpy(ids.data(), &id, 8);
    r = peer_.call(header(ps::Op::kPull, seq_++, 8, 8), pull_body({entry(1, "emb", {}, true, 1)}),
                   &ids);
    expect_rejected(r, ds::ErrorCode::kInvalidArgument, "row id 10 is out of range [0, 10)");
    const int64_t neg = -1;
    std::memcpy(ids.data(), &neg, 8);
    r = peer_.call(header(ps::Op::kPull, seq_++, 8, 8), pull_body({entry(1, "emb", {}, true, 1)}),
                   &ids);
    expect_rejected(r, ds::ErrorCode::kInvalidArgument, "row id -1 is out of range [0, 10)");
  }
  // A push whose header and entries disagree on the payload.
  {
    const std::vector<char> g = floats({1, 1, 1, 1});
    r = peer_.call(header(ps::Op::kPush, seq_++, (int64_t{1} << 30) + 16),
                   push_body({entry(0, "w", ds::Shape{4})}), &g);
    expect_rejected(r, ds::ErrorCode::kInvalidArgument, "payload");
  }
  // A row push claiming 2^61 ids with rows of 2 floats: the sizes overflow.
  r = peer_.call(
      header(ps::Op::kPush, seq_++, 0),
      push_body({entry(1, "emb", ds::Shape{int64_t{1} << 61, 2}, true, int64_t{1} << 61)}));
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "");
  // A push to an unknown variable, and one naming the wrong variable.
  const std::vector<char> g4 = floats({1, 1, 1, 1});
  r = peer_.call(header(ps::Op::kPush, seq_++, 16), push_body({entry(5, "nope", ds::Shape{4})}),
                 &g4);
  expect_rejected(r, ds::ErrorCode::kNotFound, "unknown variable 'nope'");
  r = peer_.call(header(ps::Op::kPush, seq_++, 16), push_body({entry(1, "w", ds::Shape{4})}), &g4);
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "");
  // A request whose header names another worker.
  {
    ps::RequestHeader h = header(ps::Op::kPull, seq_++, 0, 16);
    h.worker = 7;
    r = peer_.call(h, pull_body({entry(0, "w")}));
    expect_rejected(r, ds::ErrorCode::kInvalidArgument, "worker 7");
  }
  // Garbage after the body.
  {
    std::vector<char> body = pull_body({entry(0, "w")});
    body.push_back('x');
    r = peer_.call(header(ps::Op::kPull, seq_++, 0, 16), body);
    expect_rejected(r, ds::ErrorCode::kInvalidArgument, "");
  }
  const auto after = service_->snapshot();
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(before[i].step, after[i].step);
    EXPECT_EQ(0,
              std::memcmp(before[i].value.data(), after[i].value.data(), before[i].value.nbytes()));
  }
  // A good push after all that is applied once.
  {
    const std::vector<char> g = floats({2, 2, 2, 2});
    r = peer_.call(header(ps::Op::kPush, seq_++, 16), push_body({entry(0, "w", ds::Shape{4})}), &g);
    ASSERT_EQ(r.header.status, -1) << r.error;
  }
  expect_serves({0, 1, 2, 3});
}

// Issue 14.3: a request whose payload never comes (the worker stalled
// between its two messages, or lied about the size: the rest of a
// multi-part payload never arrives) is answered with DeadlineExceeded naming
// the worker within the PS's deadline, instead of holding its queue forever.
TEST_F(PsWire, PayloadThatNeverArrivesFailsTheRequestAtTheDeadline) {
  ps::ServiceOptions o;
  o.timeout = milliseconds(500);
  start(o);
  create_variables();
  const auto t0 = ds::Clock::now();
  // A create of 1000 floats with a value: the header announces 4000 bytes
  // of payload, which are never sent.
  peer_.send(header(ps::Op::kCreate, seq_++, 4000), create_body(2, "late", ds::Shape{1000}, true));
  auto r = peer_.reply(milliseconds(5000));
  const double secs = std::chrono::duration<double>(ds::Clock::now() - t0).count();
  expect_rejected(r, ds::ErrorCode::kDeadlineExceeded, "payload");
  EXPECT_NE(r.error.find("rank 0"), std::string::npos) << r.error;
  EXPECT_LT(secs, 3.0);
  expect_serves();
}

// A payload may come in parts (the MPI transport splits at 1 GiB); each part
// is received at exactly its size, checked against what the request still
// expects: more than declared, or less before the worker's next request,
// fails the request, and changes nothing.
TEST_F(PsWire, PayloadPartsAreCheckedAgainstTheDeclaredSize) {
  start();
  create_variables();
  const std::vector<char> g = floats({1, 1, 1, 1});
  const std::vector<char> first(g.begin(), g.begin() + 8), second(g.begin() + 8, g.end());
  // Two parts of 8 bytes for a push that declares 16: applied.
  peer_.send(header(ps::Op::kPush, seq_++, 16), push_body({entry(0, "w", ds::Shape{4})}), &first);
  peer_.send_payload(second);
  auto r = peer_.reply(milliseconds(5000));
  ASSERT_EQ(r.header.status, -1) << r.error;
  expect_serves({0.5f, 1.5f, 2.5f, 3.5f});
  // 20 bytes for a push that declares 16.
  const std::vector<char> g5 = floats({1, 1, 1, 1, 1});
  r = peer_.call(header(ps::Op::kPush, seq_++, 16), push_body({entry(0, "w", ds::Shape{4})}), &g5);
  expect_rejected(r, ds::ErrorCode::kInvalidArgument,
                  "payload message of 20 bytes does not fit the 16 bytes");
  // 8 of 16 bytes, then the next request.
  peer_.send(header(ps::Op::kPush, seq_++, 16), push_body({entry(0, "w", ds::Shape{4})}), &first);
  r = peer_.call(header(ps::Op::kPull, seq_++, 0, 16), pull_body({entry(0, "w")}));
  auto r2 = peer_.reply(milliseconds(5000));
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "only 8 of the 16 payload bytes");
  ASSERT_EQ(r2.header.status, -1) << r2.error;
  expect_serves({0.5f, 1.5f, 2.5f, 3.5f});
}

// A reply the worker never takes (it left, or never posted the receive) is
// given up after the timeout: the PS loop still finishes.
TEST_F(PsWire, AReplyNobodyTakesDoesNotKeepThePsForever) {
  ps::ServiceOptions o;
  o.timeout = milliseconds(300);
  start(o);
  create_variables();
  peer_.send(header(ps::Op::kDone, seq_++), {});  // its reply is never received
  const auto t0 = ds::Clock::now();
  while (!returned_ && ds::Clock::now() - t0 < std::chrono::seconds(5))
    std::this_thread::sleep_for(milliseconds(10));
  EXPECT_TRUE(returned_) << log();
  EXPECT_NE(log().find("was not taken within 300 ms"), std::string::npos) << log();
}

// Issue 14.4: a PS that was itself not running (SIGSTOP, a long pause of its
// loop) must not count that time as its workers' silence. The clock seam
// jumps 10 s ahead between two polls of the loop, as a stopped and continued
// PS process sees it.
TEST_F(PsWire, APsThatWasNotRunningDoesNotDeclareItsWorkersGone) {
  std::atomic<int64_t> jump_ms{0};
  ps::ServiceOptions o;
  o.worker_timeout = milliseconds(1000);
  o.clock = [&] { return ds::Clock::now() + milliseconds(jump_ms.load()); };
  start(o);
  create_variables();
  expect_serves();
  // (Let the PS finish its bookkeeping of that reply before the jump.)
  std::this_thread::sleep_for(milliseconds(100));
  jump_ms = 10000;  // the PS "wakes up" 10 s later
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_TRUE(service_->gone_workers().empty()) << log();
  EXPECT_EQ(log().find("sent nothing"), std::string::npos) << log();
  expect_serves();
  // Silence while the PS does run still counts.
  const auto t0 = ds::Clock::now();
  while (service_->gone_workers().empty() && ds::Clock::now() - t0 < std::chrono::seconds(10)) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  const double secs = std::chrono::duration<double>(ds::Clock::now() - t0).count();
  EXPECT_EQ(service_->gone_workers(), std::vector<int>{0}) << log();
  EXPECT_GT(secs, 0.5);
  EXPECT_LT(secs, 5.0);
}

// Messages that are not requests, payload messages no accepted request
// declared, and control messages too short for a header are dropped (the
// last with an error reply); the worker's stream goes on.
TEST_F(PsWire, StrayAndOversizedMessagesAreDroppedAndTheStreamGoesOn) {
  start();
  create_variables();
  auto stray = std::make_shared<std::vector<char>>(100, 'x');
  ds::Request s1 = group_.at(kWorkerRank).send(kPsRank, stray->data(), stray->size(), 12345);
  ds::Request s2 =
      group_.at(kWorkerRank).send(kPsRank, stray->data(), stray->size(), ps::kRequestPayloadTag);
  expect_serves();
  EXPECT_NE(log().find("dropped a message of 100 bytes"), std::string::npos) << log();
  // A too-short control message gets an error reply.
  {
    auto tiny = std::make_shared<std::vector<char>>(5, 'x');
    ds::Request s3 =
        group_.at(kWorkerRank).send(kPsRank, tiny->data(), tiny->size(), ps::kRequestTag);
    auto r = peer_.reply(milliseconds(5000));
    EXPECT_EQ(r.header.status, static_cast<int>(ds::ErrorCode::kInvalidArgument));
    EXPECT_NE(r.error.find("malformed request of 5 bytes"), std::string::npos) << r.error;
    s3.wait(ds::Clock::now() + milliseconds(1000));
  }
  expect_serves();
}

// ---- the worker's side: replies are checked before use --------------------

// Rank 1 plays a PS that answers each request with a crafted reply header.
class BadReplies : public ::testing::Test {
 protected:
  // Receives one request on the fake PS; returns its header.
  ps::RequestHeader receive_request() {
    ds::Transport& t = group_.at(kPsRank);
    ds::Envelope env;
    const auto until = ds::Clock::now() + std::chrono::seconds(5);
    while (!t.probe_any(&env)) {
      if (ds::Clock::now() > until) throw ds::DeadlineExceededError("no request");
      std::this_thread::yield();
    }
    auto control = std::make_shared<std::vector<char>>(env.bytes);
    keep_.push_back(control);
    t.recv(env.source, control->data(), env.bytes, env.tag).wait(until);
    ps::RequestHeader h;
    std::memcpy(&h, control->data(), sizeof h);
    return h;
  }
  void reply(const ps::ReplyHeader& h) {
    auto copy = std::make_shared<ps::ReplyHeader>(h);
    keep_headers_.push_back(copy);
    sends_.push_back(group_.at(kPsRank).send(kWorkerRank, copy.get(), sizeof *copy, ps::kReplyTag));
  }
  ds::InProcessTransportGroup group_{2};
  std::vector<std::shared_ptr<std::vector<char>>> keep_;
  std::vector<std::shared_ptr<ps::ReplyHeader>> keep_headers_;
  std::vector<ds::Request> sends_;
};

TEST_F(BadReplies, AreProtocolErrorsNotCrashes) {
  struct Case {
    const char* name;
    std::function<void(ps::ReplyHeader&)> damage;
    std::string text;
  };
  const std::vector<Case> cases = {
      {"error text of 2^50 bytes",
       [](ps::ReplyHeader& h) {
         h.status = 3;
         h.error_bytes = int64_t{1} << 50;
       },
       "error text"},
      {"negative error size",
       [](ps::ReplyHeader& h) {
         h.status = 3;
         h.error_bytes = -5;
       },
       "error text"},
      {"unknown status", [](ps::ReplyHeader& h) { h.status = 99; }, "status 99"},
      {"error status without text",
       [](ps::ReplyHeader& h) {
         h.status = 3;
         h.error_bytes = 0;
       },
       "status 3"},
      {"negative version", [](ps::ReplyHeader& h) { h.version = -2; }, "version -2"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto client = std::make_unique<ps::Client>(group_.at(kWorkerRank), std::vector<int>{kPsRank}, 0,
                                               milliseconds(500));
    auto call = client->post(0, ps::Op::kBarrier, std::vector<char>(8, 0), nullptr, nullptr, 0,
                             nullptr, 0, "barrier");
    const ps::RequestHeader req = receive_request();
    ps::ReplyHeader h;
    h.seq = req.seq;
    h.status = -1;
    c.damage(h);
    reply(h);
    try {
      client->wait(call);
      ADD_FAILURE() << "no error";
    } catch (const ds::Error& e) {
      EXPECT_EQ(e.code(), ds::ErrorCode::kInternal) << e.what();
      EXPECT_NE(e.message().find("protocol error"), std::string::npos) << e.message();
      EXPECT_NE(e.message().find(c.text), std::string::npos) << e.message();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a diststrat::Error: " << e.what();
    }
  }
}

// ---- the decoder on its own ---------------------------------------------------

std::vector<char> message(const ps::RequestHeader& h, const std::vector<char>& body) {
  std::vector<char> m(sizeof h + body.size());
  std::memcpy(m.data(), &h, sizeof h);
  if (!body.empty()) std::memcpy(m.data() + sizeof h, body.data(), body.size());
  return m;
}

ps::DecodedRequest decode(const std::vector<char>& m) {
  return ps::decode_request(m.data(), m.size());
}

TEST(PsRequestDecoder, DecodesWhatTheWorkersSend) {
  {
    const auto q =
        decode(message(header(ps::Op::kCreate, 1, 40), create_body(3, "b", ds::Shape{10}, true)));
    EXPECT_EQ(q.op, ps::Op::kCreate);
    EXPECT_EQ(q.create.var_id, 3);
    EXPECT_EQ(q.create.name, "b");
    EXPECT_EQ(q.create.shard_shape, ds::Shape({10}));
    EXPECT_TRUE(q.create.has_value);
  }
  {
    const auto q = decode(message(header(ps::Op::kPull, 2, 24, 16 + 3 * 8),
                                  pull_body({entry(0, "w"), entry(1, "emb", {}, true, 3)}, 7)));
    EXPECT_EQ(q.pull.clock, 7);
    ASSERT_EQ(q.pull.entries.size(), 2u);
    EXPECT_EQ(q.pull.entries[1].num_ids, 3);
  }
  {
    const auto q = decode(message(
        header(ps::Op::kPush, 3, 16 + 8 + 8),
        push_body({entry(0, "w", ds::Shape{4}), entry(1, "emb", ds::Shape{1, 2}, true, 1)})));
    EXPECT_EQ(q.push.steps_after, 1);
    ASSERT_EQ(q.push.entries.size(), 2u);
  }
  {
    ps::Writer w;
    w.put<int64_t>(5).put<uint8_t>(1);
    EXPECT_TRUE(
        decode(message(header(ps::Op::kStopCheck, 4, 0, 8), w.bytes())).stop_check.signalled);
  }
  {
    const auto q = decode(message(header(ps::Op::kRule, 6), rule_body(sgd(0.1), {entry(0, "w")})));
    EXPECT_EQ(q.rule.config.name, "sgd");
    EXPECT_FALSE(q.rule.replace);
    ASSERT_EQ(q.rule.entries.size(), 1u);
  }
  EXPECT_EQ(decode(message(header(ps::Op::kDone, 5), {})).op, ps::Op::kDone);
}

// Each malformed message is an InvalidArgumentError saying what is wrong.
TEST(PsRequestDecoder, RejectsEveryMalformedField) {
  const int64_t big = int64_t{1} << 61;
  struct Case {
    const char* name;
    std::vector<char> bytes;
    std::string text;
  };
  std::vector<Case> cases;
  auto add = [&](const char* name, std::vector<char> bytes, std::string text) {
    cases.push_back({name, std::move(bytes), std::move(text)});
  };
  const std::vector<char> good_pull = pull_body({entry(0, "w")});
  add("shorter than a header", std::vector<char>(5), "malformed request of 5 bytes");
  {
    ps::RequestHeader h = header(ps::Op::kPull, 1, 0, 16);
    h.magic = ~ps::kMagic;
    add("bad magic", message(h, good_pull), "magic");
    h = header(ps::Op::kPull, 1, 0, 16);
    h.op = 0;
    add("op 0", message(h, good_pull), "op 0");
    h.op = 17;  // one past the last op (kAlive)
    add("op 17", message(h, good_pull), "op 17");
  }
  {
    auto metric = [](const std::string& name, double sum, double count) {
      ps::Writer w;
      w.put_string(name).put<double>(sum).put<double>(count);
      return w.bytes();
    };
    add("metric without a name", message(header(ps::Op::kMetric, 1), metric("", 1, 1)),
        "a name of 0 characters");
    add("metric name of 257",
        message(header(ps::Op::kMetric, 1), metric(std::string(257, 'm'), 1, 1)),
        "a name of 257 characters");
    add("metric count -1", message(header(ps::Op::kMetric, 1), metric("loss", 1, -1)), "count -1");
    add("metric reply of 8", message(header(ps::Op::kMetric, 1, 0, 8), metric("loss", 1, 1)),
        "a reply of 8 bytes");
  }
  add("negative payload", message(header(ps::Op::kPull, 1, -1, 16), good_pull),
      "payload of -1 bytes");
  add("payload 2^40 + 1", message(header(ps::Op::kPull, 1, (int64_t{1} << 40) + 1, 16), good_pull),
      "payload of 1099511627777 bytes");
  add("reply 2^50", message(header(ps::Op::kPull, 1, 0, int64_t{1} << 50), good_pull),
      "reply of 1125899906842624");
  add("pull of 2^61 ids (x 8 overflows to 0)",
      message(header(ps::Op::kPull, 1, 0, 8), pull_body({entry(1, "emb", {}, true, big)})),
      "2305843009213693952 ids");
  add("payload claimed, none declared",
      message(header(ps::Op::kPull, 1, int64_t{2} << 30, 16), good_pull),
      "the header claims a payload of 2147483648 bytes, the request declares 0");
  {
    ps::Writer w;
    w.put<int64_t>(-1).put<int64_t>(int64_t{1} << 24);  // 2^24 entries in 0 bytes
    add("entry count the message cannot hold", message(header(ps::Op::kPull, 1), w.bytes()),
        "16777216 entries in 0 bytes");
    ps::Writer w2;
    w2.put<int64_t>(-1).put<int64_t>((int64_t{1} << 24) + 1);
    add("too many entries", message(header(ps::Op::kPull, 1), w2.bytes()), "16777217 entries");
    ps::Writer w3;
    w3.put<int64_t>(-1).put<int64_t>(-3);
    add("negative entry count", message(header(ps::Op::kPull, 1), w3.bytes()), "-3 entries");
  }
  {
    ps::Entry e = entry(0, "w", ds::Shape{4});
    e.dtype = 17;
    add("bad dtype", message(header(ps::Op::kPush, 1, 16), push_body({e})), "bad dtype 17");
    e = entry(0, "w", ds::Shape{4});
    e.sparse = 2;
    add("sparse flag 2", message(header(ps::Op::kPush, 1, 16), push_body({e})), "sparse flag 2");
    e = entry(0, "w", ds::Shape{4}, false, 3);
    add("ids on a dense entry", message(header(ps::Op::kPush, 1, 16), push_body({e})),
        "3 ids for a whole-shard entry");
    e = entry(0, "w", ds::Shape{4});
    e.var_id = -1;
    add("negative variable id", message(header(ps::Op::kPush, 1, 16), push_body({e})),
        "variable id -1");
  }
  add("row push whose rows disagree with its ids",
      message(header(ps::Op::kPush, 1, 16 + 16),
              push_body({entry(1, "emb", ds::Shape{2, 2}, true, 1)})),
      "row gradient [2, 2] for 1 ids");
  // (A shape whose element count overflows int64 cannot be built, nor
  // decoded: Shape refuses it; this one's bytes do not fit a message.)
  add("shape whose byte count overflows",
      message(header(ps::Op::kPush, 1, 0),
              push_body({entry(0, "w", ds::Shape{int64_t{1} << 31, int64_t{1} << 31})})),
      "more than a message may carry");
  add("row push of 2^61 ids",
      message(header(ps::Op::kPush, 1, 0),
              push_body({entry(1, "emb", ds::Shape{big, 2}, true, big)})),
      "more than a message may carry");
  {
    std::vector<char> body = pull_body({entry(0, "w")});
    // The name's length field (after the clock, count, var id and shard).
    const int64_t huge_len = int64_t{1} << 40;
    std::memcpy(body.data() + 32, &huge_len, 8);
    add("string longer than allowed", message(header(ps::Op::kPull, 1, 0, 16), body),
        "malformed string length");
    body = pull_body({entry(0, "w")});
    const int64_t past_end = 1000;
    std::memcpy(body.data() + 32, &past_end, 8);
    add("string past the end", message(header(ps::Op::kPull, 1, 0, 16), body),
        "needs 1000 more bytes");
  }
  {
    ps::Writer w;
    w.put<int64_t>(-1).put<int64_t>(1).put<int64_t>(0).put<int64_t>(0).put_string("w").put<int32_t>(
        0);
    w.put<int64_t>(33);
    w.bytes().resize(w.bytes().size() + 64);  // room for an entry's other fields
    add("shape of rank 33", message(header(ps::Op::kPull, 1), w.bytes()), "shape rank 33");
    ps::Writer w2;
    w2.put<int64_t>(-1)
        .put<int64_t>(1)
        .put<int64_t>(0)
        .put<int64_t>(0)
        .put_string("w")
        .put<int32_t>(0);
    w2.put<int64_t>(1).put<int64_t>(-4);
    add("negative dimension", message(header(ps::Op::kPull, 1), w2.bytes()),
        "negative dimension -4");
  }
  {
    std::vector<char> body = good_pull;
    body.push_back(0);
    add("bytes after the last field", message(header(ps::Op::kPull, 1, 0, 16), body),
        "1 bytes after the last field");
    body = good_pull;
    body.pop_back();
    add("truncated", message(header(ps::Op::kPull, 1, 0, 16), body), "malformed message");
  }
  {
    ps::Writer w;
    w.put<int64_t>(0).put_string("w").put<int32_t>(0).put_shape(ds::Shape{10});
    w.put<int64_t>(0).put<int64_t>(1).put<int64_t>(8).put<int64_t>(5).put<uint8_t>(0);
    add("create rows outside the shape", message(header(ps::Op::kCreate, 1), w.bytes()),
        "rows 8 + 5 outside [10]");
    ps::Writer w2;
    w2.put<int64_t>(0).put_string("w").put<int32_t>(0).put_shape(ds::Shape{10});
    w2.put<int64_t>(0).put<int64_t>(1).put<int64_t>(INT64_MAX).put<int64_t>(INT64_MAX).put<uint8_t>(
        0);
    add("create rows that overflow", message(header(ps::Op::kCreate, 1), w2.bytes()),
        "outside [10]");
    ps::Writer w3;
    w3.put<int64_t>(0).put_string("w").put<int32_t>(0).put_shape(ds::Shape{10});
    w3.put<int64_t>(3).put<int64_t>(2).put<int64_t>(0).put<int64_t>(5).put<uint8_t>(0);
    add("create shard index past the count", message(header(ps::Op::kCreate, 1), w3.bytes()),
        "shard 3 of 2");
    add("create value of the wrong size",
        message(header(ps::Op::kCreate, 1, 12), create_body(0, "w", ds::Shape{4}, true)),
        "the header claims a payload of 12 bytes, the request declares 16");
  }
  {
    ps::Writer w;
    w.put<int64_t>(1).put<uint8_t>(2).put<int64_t>(0);
    add("flag that is not 0 or 1", message(header(ps::Op::kBroadcast, 1), w.bytes()), "root is 2");
    ps::Writer w2;
    w2.put<int64_t>(1).put<uint8_t>(0).put<int64_t>(8);
    add("payload from a broadcast receiver",
        message(header(ps::Op::kBroadcast, 1, 8, 8), w2.bytes()),
        "the header claims a payload of 8 bytes");
    ps::Writer w3;
    w3.put<int64_t>(1).put<uint8_t>(0);
    add("preemption check expecting 16 bytes",
        message(header(ps::Op::kStopCheck, 1, 0, 16), w3.bytes()),
        "reply of 16 bytes, the request's is 8");
  }
  {
    ps::Writer w;
    w.put<int64_t>(1);
    ps::write_entry(w, entry(0, "w", ds::Shape{4}));
    w.put<uint8_t>(1).put<int64_t>(-1).put<int64_t>(65);
    add("restore with 65 slots", message(header(ps::Op::kRestore, 1, 16), w.bytes()), "65 slots");
  }
  {
    ps::Writer w;
    w.put_string("");
    add("abort without a reason", message(header(ps::Op::kAbort, 1), w.bytes()),
        "abort: no reason");
    ps::Writer w2;
    w2.put_string("x");
    add("abort with a reply", message(header(ps::Op::kAbort, 1, 0, 8), w2.bytes()), "reply");
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    try {
      ps::decode_request(c.bytes.data(), c.bytes.size());
      ADD_FAILURE() << "decoded";
    } catch (const ds::InvalidArgumentError& e) {
      EXPECT_NE(e.message().find(c.text), std::string::npos) << e.message();
    }
  }
}

// Names in a request come from another process: an error quotes them as
// core/user_text.h's echo() does (issue 43: raw bytes made a message that
// is not one readable line). Each message below holds no control byte and
// no byte outside ASCII (every quoted byte here is a control or a stray).
TEST(PsRequestDecoder, NamesFromTheWireAreQuotedEscaped) {
  auto metric = [](const std::string& name, double sum, double count) {
    ps::Writer w;
    w.put_string(name).put<double>(sum).put<double>(count);
    return w.bytes();
  };
  auto save = [](const std::string& stem) {
    ps::Writer w;
    w.put_string(stem).put<uint64_t>(0xabc).put_string("");
    return w.bytes();
  };
  const std::pair<std::vector<char>, std::string> cases[] = {
      {message(header(ps::Op::kMetric, 1), metric("m\x01\xc3", 1, -1)), "'m\\x01\\xc3': count -1"},
      {message(header(ps::Op::kSave, 1, 0, 8), save("a\x01"
                                                    "b\xff")),
       "'a\\x01b\\xff' is not a checkpoint name"},
      {message(header(ps::Op::kPull, 1, 0, 16), pull_body({entry(-1, "w\n\x02")})),
       "of 'w\\n\\x02': variable id -1"},
  };
  for (const auto& [bytes, text] : cases) {
    SCOPED_TRACE(text);
    try {
      ps::decode_request(bytes.data(), bytes.size());
      ADD_FAILURE() << "decoded";
    } catch (const ds::InvalidArgumentError& e) {
      const std::string m = e.message();
      EXPECT_NE(m.find(text), std::string::npos) << m;
      EXPECT_TRUE(std::all_of(m.begin(), m.end(), [](char c) {
        const auto b = static_cast<unsigned char>(c);
        return b >= 0x20 && b < 0x7f;
      })) << ds::echo(m);
    }
  }
}

TEST(PsRequestDecoder, CheckedSizesNeverOverflow) {
  EXPECT_EQ(ps::checked_mul(int64_t{1} << 20, 1 << 20, "x"), int64_t{1} << 40);
  EXPECT_THROW(ps::checked_mul(int64_t{1} << 61, 8, "x"), ds::InvalidArgumentError);
  EXPECT_THROW(ps::checked_mul(INT64_MAX, INT64_MAX, "x"), ds::InvalidArgumentError);
  EXPECT_THROW(ps::checked_add(ps::kMaxMessageBytes, 1, "x"), ds::InvalidArgumentError);
  EXPECT_THROW(ps::checked_add(INT64_MAX, INT64_MAX, "x"), ds::InvalidArgumentError);
  EXPECT_EQ(ps::checked_bytes(ds::Shape{int64_t{1} << 62, 0}, 4, "x"), 0);
  EXPECT_THROW(ps::checked_bytes(ds::Shape{int64_t{1} << 31, int64_t{1} << 31, 4}, 4, "x"),
               ds::InvalidArgumentError);
}

TEST(PsReplyCheck, AcceptsGoodRepliesAndNamesTheProblemOfBadOnes) {
  ps::ReplyHeader ok;
  ok.status = -1;
  ok.payload_bytes = 8;
  EXPECT_EQ(ps::check_reply(ok, 8), "");
  ps::ReplyHeader err = ok;
  err.status = static_cast<int32_t>(ds::ErrorCode::kNotFound);
  err.error_bytes = 20;
  EXPECT_EQ(ps::check_reply(err, 8), "");
  EXPECT_NE(ps::check_reply(ok, 16).find("carries 8 bytes, expected 16"), std::string::npos);
  ps::ReplyHeader bad = ok;
  bad.magic = 0;
  EXPECT_NE(ps::check_reply(bad, 8).find("magic"), std::string::npos);
}

}  // namespace
