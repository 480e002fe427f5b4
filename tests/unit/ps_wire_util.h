// Test helpers for the parameter-server wire: request builders, a raw
// worker that sends any bytes, and a fixture running one PS Service on a
// thread (rank 1) for one worker (rank 0). Shared by ps_wire_test and
// ps_trust_test.
#pragma once

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
#include "parameter_server/shard_updater.h"
#include "parameter_server/wire.h"

namespace ds = diststrat;
namespace ps = diststrat::ps;
using std::chrono::milliseconds;

namespace ps_test {

constexpr int kWorkerRank = 0, kPsRank = 1;
constexpr uint64_t kIncarnation = 1000;  // the raw worker's

inline ps::RequestHeader header(ps::Op op, int64_t seq, int64_t payload_bytes = 0,
                                int64_t reply_bytes = 0) {
  ps::RequestHeader h;
  h.op = static_cast<uint16_t>(op);
  h.worker = 0;
  h.seq = seq;
  h.payload_bytes = payload_bytes;
  h.reply_bytes = reply_bytes;
  h.incarnation = kIncarnation;
  return h;
}

// The body of a create of a whole (one-shard) variable.
inline std::vector<char> create_body(int64_t id, const std::string& name, const ds::Shape& shape,
                                     bool has_value, ds::DType dtype = ds::DType::kFloat32) {
  ps::Writer w;
  w.put<int64_t>(id).put_string(name).put<int32_t>(static_cast<int32_t>(dtype)).put_shape(shape);
  w.put<int64_t>(0).put<int64_t>(1).put<int64_t>(0).put<int64_t>(shape.rank() ? shape[0] : 1);
  w.put<uint8_t>(has_value ? 1 : 0);
  return w.bytes();
}

inline ps::Entry entry(int64_t id, const std::string& name, ds::Shape shape = {},
                       bool sparse = false, int64_t num_ids = 0) {
  ps::Entry e;
  e.var_id = id;
  e.name = name;
  e.dtype = static_cast<int32_t>(ds::DType::kFloat32);
  e.shape = std::move(shape);
  e.sparse = sparse ? 1 : 0;
  e.num_ids = num_ids;
  return e;
}

inline std::vector<char> pull_body(const std::vector<ps::Entry>& entries, int64_t clock = -1) {
  ps::Writer w;
  w.put<int64_t>(clock).put<int64_t>(static_cast<int64_t>(entries.size()));
  for (const ps::Entry& e : entries) ps::write_entry(w, e);
  return w.bytes();
}

inline std::vector<char> push_body(const std::vector<ps::Entry>& entries, int64_t steps_after = 1) {
  ps::Writer w;
  w.put<int64_t>(steps_after).put<int64_t>(-1);
  w.put<int64_t>(-1).put_string("");
  w.put<int64_t>(static_cast<int64_t>(entries.size()));
  for (const ps::Entry& e : entries) ps::write_entry(w, e);
  return w.bytes();
}

// A kRule: `config` as the update rule of `entries` (replace: the chief's update).
inline std::vector<char> rule_body(const ps::OptimizerConfig& config,
                                   const std::vector<ps::Entry>& entries, bool replace = false) {
  ps::Writer w;
  w.put<uint8_t>(replace ? 1 : 0);
  ps::write_config(w, config);
  w.put<int64_t>(static_cast<int64_t>(entries.size()));
  for (const ps::Entry& e : entries) ps::write_entry(w, e);
  return w.bytes();
}

inline ps::OptimizerConfig sgd(double lr) { return {"sgd", {lr, 0, 0}}; }

inline std::vector<char> floats(std::initializer_list<float> v) {
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
  // A header without a PS incarnation gets the one the PS's replies told
  // (as the Client does), unless stamp_ps_incarnation is off.
  void send(ps::RequestHeader h, const std::vector<char>& body,
            const std::vector<char>* payload = nullptr) {
    if (h.ps_incarnation == 0 && stamp_ps_incarnation) h.ps_incarnation = ps_incarnation;
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
  // Sends one more payload message (a part).
  void send_payload(const std::vector<char>& payload) {
    auto p = std::make_shared<std::vector<char>>(payload);
    keep_.push_back(p);
    sends_.push_back(t_.send(peer_, p->data(), p->size(), ps::kRequestPayloadTag));
  }
  // Receives the next reply (header, error text, payload of the size the
  // header announces); throws DeadlineExceededError when none comes `within`.
  Reply reply(milliseconds within) {
    auto r = std::make_shared<Reply>();
    replies_.push_back(r);
    const auto deadline = ds::Clock::now() + within;
    t_.recv(peer_, &r->header, sizeof r->header, ps::kReplyTag).wait(deadline);
    if (r->header.incarnation != 0) ps_incarnation = r->header.incarnation;
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
  Reply call(const ps::RequestHeader& h, const std::vector<char>& body,
             const std::vector<char>* payload = nullptr, milliseconds within = milliseconds(5000)) {
    send(h, body, payload);
    return reply(within);
  }
  uint64_t ps_incarnation = 0;  // from the PS's last reply
  bool stamp_ps_incarnation = true;

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
      returned_ = true;
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
    auto r = peer_.call(header(ps::Op::kCreate, seq_++, 16),
                        create_body(0, "w", ds::Shape{4}, true), &w);
    ASSERT_EQ(r.header.status, -1) << r.error;
    std::vector<char> emb(10 * 2 * sizeof(float));
    for (int i = 0; i < 20; ++i) {
      const float v = static_cast<float>(i / 2);
      std::memcpy(emb.data() + i * sizeof(float), &v, sizeof v);
    }
    r = peer_.call(header(ps::Op::kCreate, seq_++, static_cast<int64_t>(emb.size())),
                   create_body(1, "emb", ds::Shape{10, 2}, true), &emb);
    ASSERT_EQ(r.header.status, -1) << r.error;
    // The chief's rule for both: SGD, learning rate 0.5.
    r = peer_.call(header(ps::Op::kRule, seq_++),
                   rule_body(sgd(0.5), {entry(0, "w"), entry(1, "emb")}));
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
  static void expect_rejected(const RawPeer::Reply& r, ds::ErrorCode code,
                              const std::string& text) {
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
  std::atomic<bool> returned_{false};
  int64_t seq_ = 1;
};

}  // namespace ps_test
