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
#include "diststrat/error.h"
#include "diststrat/logging.h"
#include "parameter_server/client.h"
#include "parameter_server/service.h"
#include "parameter_server/update_rule.h"
#include "parameter_server/wire.h"

namespace ds = diststrat;
namespace ps = diststrat::ps;
using std::chrono::milliseconds;

namespace {

constexpr int kWorkerRank = 0, kPsRank = 1;

ps::RequestHeader header(ps::Op op, int64_t seq, int64_t payload_bytes = 0, int64_t reply_bytes = 0) {
  ps::RequestHeader h;
  h.op = static_cast<uint16_t>(op);
  h.worker = 0;
  h.seq = seq;
  h.payload_bytes = payload_bytes;
  h.reply_bytes = reply_bytes;
  return h;
}

// The body of a create of a whole (one-shard) variable.
std::vector<char> create_body(int64_t id, const std::string& name, const ds::Shape& shape, bool has_value,
                              ds::DType dtype = ds::DType::kFloat32) {
  ps::Writer w;
  w.put<int64_t>(id).put_string(name).put<int32_t>(static_cast<int32_t>(dtype)).put_shape(shape);
  w.put<int64_t>(0).put<int64_t>(1).put<int64_t>(0).put<int64_t>(shape.rank() ? shape[0] : 1);
  w.put<uint8_t>(has_value ? 1 : 0);
  return w.bytes();
}

ps::Entry entry(int64_t id, const std::string& name, ds::Shape shape = {}, bool sparse = false,
                int64_t num_ids = 0) {
  ps::Entry e;
  e.var_id = id;
  e.name = name;
  e.dtype = static_cast<int32_t>(ds::DType::kFloat32);
  e.shape = std::move(shape);
  e.sparse = sparse ? 1 : 0;
  e.num_ids = num_ids;
  return e;
}

std::vector<char> pull_body(const std::vector<ps::Entry>& entries, int64_t clock = -1) {
  ps::Writer w;
  w.put<int64_t>(clock).put<int64_t>(static_cast<int64_t>(entries.size()));
  for (const ps::Entry& e : entries) ps::write_entry(w, e);
  return w.bytes();
}

std::vector<char> push_body(const std::vector<ps::Entry>& entries) {
  ps::Writer w;
  w.put<int64_t>(1).put<int64_t>(-1);
  ps::write_config(w, {"sgd", {0.5, 0, 0}});
  w.put<int64_t>(-1).put_string("");
  w.put<int64_t>(static_cast<int64_t>(entries.size()));
  for (const ps::Entry& e : entries) ps::write_entry(w, e);
  return w.bytes();
}

std::vector<char> floats(std::initializer_list<float> v) {
  std::vector<char> out(v.size() * sizeof(float));
  std::memcpy(out.data(), v.begin(), out.size());
  return out;
}

// A worker that speaks raw bytes to the PS, so it can send what the strategy
// and the Client would never let through. Every buffer it hands the transport
// lives as long as the peer (the in-process transport keeps pointers).
class RawPeer {
 public:
  RawPeer(ds::Transport& t, int peer) : t_(t), peer_(peer) {}
  struct Reply {
    ps::ReplyHeader header;
    std::string error;
    std::vector<char> payload;
  };
  // Sends `h` + `body` as the control message, then `payload` unless null.
  void send(const ps::RequestHeader& h, const std::vector<char>& body, const std::vector<char>* payload = nullptr) {
    auto control = std::make_shared<std::vector<char>>(sizeof h + body.size());
    std::memcpy(control->data(), &h, sizeof h);
    if (!body.empty()) std::memcpy(control->data() + sizeof h, body.data(), body.size());
    keep_.push_back(control);
    sends_.push_back(t_.send(peer_, control->data(), control->size(), ps::kRequestTag));
    if (payload) {
      auto p = std::make_shared<std::vector<char>>(*payload);
      keep_.push_back(p);
      sends_.push_back(t_.send(peer_, p->data(), p->size(), ps::kRequestPayloadTag));
    }
  }
  // Receives the next reply (header, error text, payload of the size the
  // header announces); throws DeadlineExceededError when none comes `within`.
  Reply reply(milliseconds within) {
    auto r = std::make_shared<Reply>();
    replies_.push_back(r);
    const auto deadline = ds::Clock::now() + within;
    t_.recv(peer_, &r->header, sizeof r->header, ps::kReplyTag).wait(deadline);
    if (r->header.error_bytes > 0) {
      EXPECT_LE(r->header.error_bytes, 1 << 20);
      r->error.resize(static_cast<size_t>(std::min<int64_t>(r->header.error_bytes, 1 << 20)));
      t_.recv(peer_, &r->error[0], r->error.size(), ps::kReplyErrorTag).wait(deadline);
    }
    if (r->header.payload_bytes > 0) {
      EXPECT_LE(r->header.payload_bytes, 1 << 26);
      r->payload.resize(static_cast<size_t>(std::min<int64_t>(r->header.payload_bytes, 1 << 26)));
      t_.recv(peer_, r->payload.data(), r->payload.size(), ps::kReplyPayloadTag).wait(deadline);
    }
    return *r;
  }
  Reply call(const ps::RequestHeader& h, const std::vector<char>& body, const std::vector<char>* payload = nullptr,
             milliseconds within = milliseconds(5000)) {
    send(h, body, payload);
    return reply(within);
  }

 private:
  ds::Transport& t_;
  int peer_;
  std::vector<std::shared_ptr<std::vector<char>>> keep_;
  std::vector<ds::Request> sends_;
  std::vector<std::shared_ptr<Reply>> replies_;
};

// Rank 1 runs a PS Service for one worker (rank 0) on its own thread; the
// log lines are kept.
class PsWire : public ::testing::Test {
 protected:
  void start(ps::ServiceOptions o = {}) {
    if (o.worker_ranks.empty()) o.worker_ranks = {kWorkerRank};
    if (o.timeout == std::chrono::seconds(300)) o.timeout = milliseconds(1000);
    logger_.set_sink([this](ds::LogLevel, const std::string& line) {
      std::lock_guard<std::mutex> lock(log_mu_);
      log_ += line + "\n";
    });
    service_ = std::make_unique<ps::Service>(group_.at(kPsRank), o, logger_);
    thread_ = std::thread([this] {
      try {
        service_->run();
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(log_mu_);
        log_ += std::string("run() threw: ") + e.what() + "\n";
      }
    });
  }
  void TearDown() override {
    if (service_) service_->stop();
    if (thread_.joinable()) thread_.join();
  }
  std::string log() {
    std::lock_guard<std::mutex> lock(log_mu_);
    return log_;
  }
  // Creates "w" (id 0, 4 floats 1..4) and "emb" (id 1, 10 x 2 floats, row r = r).
  void create_variables() {
    const std::vector<char> w = floats({1, 2, 3, 4});
    auto r = peer_.call(header(ps::Op::kCreate, seq_++, 16), create_body(0, "w", ds::Shape{4}, true), &w);
    ASSERT_EQ(r.header.status, -1) << r.error;
    std::vector<char> emb(10 * 2 * sizeof(float));
    for (int i = 0; i < 20; ++i) {
      const float v = static_cast<float>(i / 2);
      std::memcpy(emb.data() + i * sizeof(float), &v, sizeof v);
    }
    r = peer_.call(header(ps::Op::kCreate, seq_++, static_cast<int64_t>(emb.size())),
                   create_body(1, "emb", ds::Shape{10, 2}, true), &emb);
    ASSERT_EQ(r.header.status, -1) << r.error;
  }
  // The PS still answers a good pull of "w" with its value.
  void expect_serves(const std::vector<float>& want = {1, 2, 3, 4}) {
    auto r = peer_.call(header(ps::Op::kPull, seq_++, 0, 16), pull_body({entry(0, "w")}));
    ASSERT_EQ(r.header.status, -1) << r.error;
    ASSERT_EQ(r.payload.size(), 16u);
    std::vector<float> got(4);
    std::memcpy(got.data(), r.payload.data(), 16);
    EXPECT_EQ(got, want);
  }
  // `r` is an error reply of `code` whose text contains `text` and names the worker.
  static void expect_rejected(const RawPeer::Reply& r, ds::ErrorCode code, const std::string& text) {
    EXPECT_EQ(r.header.status, static_cast<int>(code)) << r.error;
    EXPECT_NE(r.error.find(text), std::string::npos) << r.error;
    EXPECT_NE(r.error.find("worker 0"), std::string::npos) << r.error;
  }

  ds::InProcessTransportGroup group_{2};
  RawPeer peer_{group_.at(kWorkerRank), kPsRank};  // before the service: outlives its thread
  ds::Logger logger_{ds::LogLevel::kWarning};
  std::mutex log_mu_;
  std::string log_;
  std::unique_ptr<ps::Service> service_;
  std::thread thread_;
  int64_t seq_ = 1;
};

// Issue 14.7: a row-sparse pull entry claiming 2^61 ids (num_ids * 8
// overflows to 0, matching an empty payload) segfaulted the PS.
TEST_F(PsWire, PullClaiming2To61IdsIsRejectedAndThePsKeepsServing) {
  start();
  create_variables();
  const auto before = service_->snapshot();
  auto r = peer_.call(header(ps::Op::kPull, seq_++, 0, 8), pull_body({entry(1, "emb", {}, true, int64_t{1} << 61)}));
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "2305843009213693952 ids");
  expect_serves();
  const auto after = service_->snapshot();
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(before[i].value.data(), after[i].value.data(), before[i].value.nbytes()));
  }
}

// Issue 14.7: payload_bytes 2^40 or reply_bytes 2^50 ended in std::bad_alloc
// -> terminate; a 2 GB claim made the PS allocate 2 GB and then wait for it.
// Now each is answered at once, before anything is allocated.
TEST_F(PsWire, HeaderClaimingHugePayloadOrReplyIsRejectedWithoutAllocating) {
  start();
  create_variables();
  auto r = peer_.call(header(ps::Op::kPull, seq_++, int64_t{1} << 40, 16), pull_body({entry(0, "w")}));
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
    r = peer_.call(header(ps::Op::kPull, seq_++, 8, 8), pull_body({entry(1, "emb", {}, true, 1)}), &ids);
    expect_rejected(r, ds::ErrorCode::kInvalidArgument, "row id 10 is out of range [0, 10)");
    const int64_t neg = -1;
    std::memcpy(ids.data(), &neg, 8);
    r = peer_.call(header(ps::Op::kPull, seq_++, 8, 8), pull_body({entry(1, "emb", {}, true, 1)}), &ids);
    expect_rejected(r, ds::ErrorCode::kInvalidArgument, "row id -1 is out of range [0, 10)");
  }
  // A push whose header and entries disagree on the payload.
  {
    const std::vector<char> g = floats({1, 1, 1, 1});
    r = peer_.call(header(ps::Op::kPush, seq_++, (int64_t{1} << 30) + 16), push_body({entry(0, "w", ds::Shape{4})}),
                   &g);
    expect_rejected(r, ds::ErrorCode::kInvalidArgument, "payload");
  }
  // A row push claiming 2^61 ids with rows of 2 floats: the sizes overflow.
  r = peer_.call(header(ps::Op::kPush, seq_++, 0),
                 push_body({entry(1, "emb", ds::Shape{int64_t{1} << 61, 2}, true, int64_t{1} << 61)}));
  expect_rejected(r, ds::ErrorCode::kInvalidArgument, "");
  // A push to an unknown variable, and one naming the wrong variable.
  const std::vector<char> g4 = floats({1, 1, 1, 1});
  r = peer_.call(header(ps::Op::kPush, seq_++, 16), push_body({entry(5, "nope", ds::Shape{4})}), &g4);
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
    EXPECT_EQ(0, std::memcmp(before[i].value.data(), after[i].value.data(), before[i].value.nbytes()));
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

// Messages that are not requests, or control messages larger than any
// request, are dropped without the PS allocating their size; the worker's
// stream goes on.
TEST_F(PsWire, StrayAndOversizedMessagesAreDroppedAndTheStreamGoesOn) {
  start();
  create_variables();
  auto stray = std::make_shared<std::vector<char>>(100, 'x');
  ds::Request s1 = group_.at(kWorkerRank).send(kPsRank, stray->data(), stray->size(), 12345);
  ds::Request s2 = group_.at(kWorkerRank).send(kPsRank, stray->data(), stray->size(), ps::kRequestPayloadTag);
  expect_serves();
  EXPECT_NE(log().find("dropped a message of 100 bytes"), std::string::npos) << log();
  // A too-short control message gets an error reply.
  {
    auto tiny = std::make_shared<std::vector<char>>(5, 'x');
    ds::Request s3 = group_.at(kWorkerRank).send(kPsRank, tiny->data(), tiny->size(), ps::kRequestTag);
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
      {"error text of 2^50 bytes", [](ps::ReplyHeader& h) { h.status = 3; h.error_bytes = int64_t{1} << 50; },
       "error text"},
      {"negative error size", [](ps::ReplyHeader& h) { h.status = 3; h.error_bytes = -5; }, "error text"},
      {"unknown status", [](ps::ReplyHeader& h) { h.status = 99; }, "status 99"},
      {"error status without text", [](ps::ReplyHeader& h) { h.status = 3; h.error_bytes = 0; }, "status 3"},
      {"negative version", [](ps::ReplyHeader& h) { h.version = -2; }, "version -2"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto client = std::make_unique<ps::Client>(group_.at(kWorkerRank), std::vector<int>{kPsRank}, 0, milliseconds(500));
    auto call = client->post(0, ps::Op::kBarrier, std::vector<char>(8, 0), nullptr, nullptr, 0, nullptr, 0, "barrier");
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

}  // namespace
