// The Gloo TCP transport (gloo_transport.h): a gloo::rendezvous::Context
// connected in full mesh through an AddressExchange, one UnboundBuffer per
// send or recv, the tag as Gloo's slot. Every Gloo exception is translated
// into a diststrat::Error here.
#include "allreduce/gloo_transport.h"

#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>

#include "diststrat/error.h"

namespace diststrat {

namespace {

std::chrono::milliseconds left_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

std::string hex(const std::vector<char>& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (char c : bytes) {
    const unsigned char u = static_cast<unsigned char>(c);
    out += digits[u >> 4];
    out += digits[u & 15];
  }
  return out;
}

std::vector<char> unhex(const std::string& text, const std::string& key) {
  auto digit = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw DataLossError("gloo transport: the value of '" + key + "' is not hex");
  };
  DISTSTRAT_CHECK(text.size() % 2 == 0 && text.size() <= (1u << 20), kDataLoss,
                  "gloo transport: the value of '", key, "' has ", text.size(), " characters");
  std::vector<char> out(text.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<char>(digit(text[2 * i]) * 16 + digit(text[2 * i + 1]));
  }
  return out;
}

// Gloo's store interface over an AddressExchange, under "<group>/".
class ExchangeStore : public gloo::rendezvous::Store {
 public:
  ExchangeStore(AddressExchange& exchange, std::string group, Clock::time_point deadline)
      : exchange_(exchange), group_(std::move(group)), deadline_(deadline) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    exchange_.publish(group_ + "/" + key, hex(data), deadline_);
  }
  std::vector<char> get(const std::string& key) override {
    return unhex(exchange_.wait_for(group_ + "/" + key, deadline_), key);
  }
  void wait(const std::vector<std::string>& keys) override {
    for (const std::string& k : keys) exchange_.wait_for(group_ + "/" + k, deadline_);
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    wait(keys);
  }

 private:
  AddressExchange& exchange_;
  std::string group_;
  Clock::time_point deadline_;
};

class InMemoryExchange : public AddressExchange {
 public:
  void publish(const std::string& key, const std::string& value, Clock::time_point) override {
    std::lock_guard<std::mutex> lock(mu_);
    values_[key] = value;
    cv_.notify_all();
  }
  std::string wait_for(const std::string& key, Clock::time_point deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, deadline, [&] { return values_.count(key) > 0; })) {
      throw DeadlineExceededError("gloo transport: '" + key + "' was not published in time");
    }
    return values_[key];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> values_;
};

// What the requests of one transport share: whether the group is broken.
struct Health {
  std::mutex mu;
  bool broken = false;
  std::string reason;
  void mark(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu);
    if (!broken) {
      broken = true;
      reason = why;
    }
  }
  void throw_if_broken(int rank) {
    std::lock_guard<std::mutex> lock(mu);
    if (broken) {
      throw AbortedError("rank " + std::to_string(rank) + ": this group's transport is broken (" +
                         reason + ")");
    }
  }
};

class GlooRequest : public Request::State {
 public:
  GlooRequest(std::shared_ptr<gloo::rendezvous::Context> context, std::shared_ptr<Health> health,
              bool send, int rank, int peer, int tag, void* data, size_t bytes)
      : context_(std::move(context)),
        health_(std::move(health)),
        send_(send),
        rank_(rank),
        peer_(peer),
        tag_(tag),
        bytes_(bytes) {
    try {
      buf_ = context_->createUnboundBuffer(bytes ? data : &dummy_, bytes);
      if (send_) {
        buf_->send(peer, static_cast<uint64_t>(tag), 0, bytes);
      } else {
        buf_->recv(peer, static_cast<uint64_t>(tag), 0, bytes);
      }
    } catch (const std::exception& e) {
      fail(e.what());
    }
  }

  ~GlooRequest() override {
    // Gloo holds a non-owning pointer to buf_: once it is gone the buffer is
    // never touched. A transfer left half-done leaves its pair unusable.
    if (!done_ && !failed_) health_->mark("a request was dropped before it completed");
  }

  bool test() override {
    throw UnimplementedError("rank " + std::to_string(rank_) +
                             ": the Gloo transport has no non-blocking test (" + describe() + ")");
  }

  void wait(Clock::time_point deadline) override {
    if (done_) return;
    health_->throw_if_broken(rank_);
    if (failed_) fail(error_);
    try {
      const bool ok = send_ ? buf_->waitSend(nullptr, left_ms(deadline))
                            : buf_->waitRecv(nullptr, left_ms(deadline));
      if (!ok) fail("the wait was aborted");
      done_ = true;
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      const std::string what = e.what();
      if (what.find("Timed out") != std::string::npos) {
        failed_ = true;
        health_->mark("a wait reached its deadline");
        throw DeadlineExceededError("rank " + std::to_string(rank_) + ": " + describe() +
                                    ": rank " + std::to_string(peer_) +
                                    " did not complete it before the deadline");
      }
      fail(what);
    }
  }

  std::string describe() const override {
    return std::string(send_ ? "send of " : "recv of ") + std::to_string(bytes_) + " bytes " +
           (send_ ? "to" : "from") + " rank " + std::to_string(peer_) + " (tag " +
           std::to_string(tag_) + ")";
  }

 private:
  [[noreturn]] void fail(const std::string& why) {
    failed_ = true;
    error_ = why;
    health_->mark("rank " + std::to_string(peer_) + ": " + why);
    throw UnavailableError("rank " + std::to_string(rank_) + ": " + describe() +
                           " failed: the connection with rank " + std::to_string(peer_) +
                           " is lost (" + why + ")");
  }

  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::shared_ptr<Health> health_;
  std::unique_ptr<gloo::transport::UnboundBuffer> buf_;
  const bool send_;
  const int rank_, peer_, tag_;
  const size_t bytes_;
  char dummy_ = 0;
  bool done_ = false, failed_ = false;
  std::string error_;
};

class GlooTransport : public Transport {
 public:
  GlooTransport(std::shared_ptr<gloo::transport::Device> device,
                std::shared_ptr<gloo::rendezvous::Context> context, int rank, int size)
      : device_(std::move(device)),
        context_(std::move(context)),
        health_(std::make_shared<Health>()),
        rank_(rank),
        size_(size) {}

  ~GlooTransport() override {
    try {
      context_->closeConnections();
    } catch (...) {
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Request send(int peer, const void* data, size_t bytes, int tag) override {
    check_peer(peer, "send");
    health_->throw_if_broken(rank_);
    return Request(std::make_shared<GlooRequest>(context_, health_, true, rank_, peer, tag,
                                                 const_cast<void*>(data), bytes));
  }
  Request recv(int peer, void* data, size_t bytes, int tag) override {
    check_peer(peer, "recv");
    health_->throw_if_broken(rank_);
    return Request(
        std::make_shared<GlooRequest>(context_, health_, false, rank_, peer, tag, data, bytes));
  }
  bool probe_any(Envelope*) override {
    throw UnimplementedError("rank " + std::to_string(rank_) +
                             ": the Gloo transport has no any-source probe");
  }
  void abort(const std::string& reason) override {
    health_->mark("aborted: " + reason);
    try {
      context_->closeConnections();  // the peers learn at once
    } catch (...) {
    }
  }

 private:
  void check_peer(int peer, const char* what) const {
    DISTSTRAT_CHECK(peer >= 0 && peer < size_ && peer != rank_, kInvalidArgument, "rank ", rank_,
                    ": gloo ", what, " with peer ", peer, " of ", size_);
  }
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::shared_ptr<Health> health_;
  int rank_, size_;
};

}  // namespace

std::shared_ptr<AddressExchange> make_in_memory_address_exchange() {
  return std::make_shared<InMemoryExchange>();
}

std::unique_ptr<Transport> make_gloo_transport(int rank, int size, AddressExchange& exchange,
                                               const GlooTransportOptions& options,
                                               Clock::time_point deadline) {
  DISTSTRAT_CHECK(size >= 1 && rank >= 0 && rank < size, kInvalidArgument, "gloo transport: rank ",
                  rank, " of ", size);
  DISTSTRAT_CHECK(!options.group.empty(), kInvalidArgument,
                  "gloo transport: GlooTransportOptions::group is empty");
  DISTSTRAT_CHECK(options.listen_host.empty() || options.interface.empty(), kInvalidArgument,
                  "gloo transport: give listen_host or interface, not both");
  gloo::transport::tcp::attr attr;
  if (!options.interface.empty()) {
    attr.iface = options.interface;
  } else if (!options.listen_host.empty()) {
    attr.hostname = options.listen_host;
  } else {
    char host[256] = {};
    if (::gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "localhost");
    attr.hostname = host;
  }
  const std::string where = options.interface.empty() ? attr.hostname : options.interface;
  try {
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(left_ms(deadline));
    ExchangeStore store(exchange, options.group, deadline);
    context->connectFullMesh(store, device);
    return std::make_unique<GlooTransport>(device, context, rank, size);
  } catch (const Error& e) {
    throw_error(e.code(), "rank " + std::to_string(rank) + " of group " + options.group +
                              ": connecting (" + where + "): " + e.message());
  } catch (const std::exception& e) {
    throw UnavailableError("rank " + std::to_string(rank) + " of group " + options.group +
                           ": connecting over TCP (" + where + ") failed: " + e.what());
  }
}

}  // namespace diststrat
