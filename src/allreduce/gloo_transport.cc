// GlooTransport (gloo_transport.h over gloo_transport_impl.h): set-up (the
// device, the address exchange, the full mesh of connections and the control
// receives), the goodbye and shutdown at destruction, and the functions the
// header declares. What Gloo does and how it is used: gloo_transport_impl.h.

#include "allreduce/gloo_transport.h"

#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>
#include <limits.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "allreduce/gloo_transport_impl.h"
#include "core/user_text.h"

namespace diststrat {
namespace gloo_impl {
namespace {

// The names next to `group` in the sequence "world", "world.1", "world.2", ...
// (process_group.cc names a process's TCP groups so, by a per-process count).
std::vector<std::string> neighbour_groups(const std::string& group) {
  std::string base = group;
  int k = 0;
  const size_t dot = group.rfind('.');
  if (dot != std::string::npos && dot + 1 < group.size() && group.size() - dot <= 6 &&
      std::all_of(group.begin() + dot + 1, group.end(),
                  [](char ch) { return ch >= '0' && ch <= '9'; })) {
    base = group.substr(0, dot);
    k = std::stoi(group.substr(dot + 1));
  }
  const auto name = [&](int i) { return i == 0 ? base : base + "." + std::to_string(i); };
  std::vector<std::string> out;
  if (k > 0) out.push_back(name(k - 1));
  out.push_back(name(k + 1));
  return out;
}

class GlooTransport : public Transport {
 public:
  explicit GlooTransport(std::shared_ptr<GlooCore> core) : core_(std::move(core)) {
    watcher_ = std::thread([c = core_.get()] { c->watch(); });
  }

  ~GlooTransport() override {
    // The goodbyes are written here, on the owner's thread, maybe to a peer
    // that is gone (a worker that finished was killed by SIGPIPE at exit).
    GlooSigpipeBlock no_sigpipe;
    try {
      shutdown();
    } catch (...) {
    }
    stop_threads();  // again, in case shutdown() threw before it got there
  }

  int rank() const override { return core_->rank; }
  int size() const override { return core_->size; }

  // Ranks that advertised the same address share a node; nodes are numbered
  // in the order of their lowest rank. An address not known ("") is a node
  // of its own.
  std::vector<int> node_of() const {
    std::vector<int> node(core_->size);
    std::map<std::string, int> seen;
    int next = 0;
    for (int r = 0; r < core_->size; ++r) {
      const std::string& h = core_->hosts[r];
      if (h.empty()) {
        node[r] = next++;
        continue;
      }
      auto it = seen.find(h);
      node[r] = it != seen.end() ? it->second : (seen[h] = next++);
    }
    return node;
  }

  Request send(int peer, const void* data, size_t bytes, int tag) override {
    check_peer(peer, "send to");
    return post(false, peer, const_cast<void*>(data), bytes, tag);
  }

  Request recv(int peer, void* data, size_t bytes, int tag) override {
    check_peer(peer, "recv from");
    return post(true, peer, data, bytes, tag);
  }

  bool probe_any(Envelope*) override {
    throw UnimplementedError(core_->rank_text() +
                             ": probe_any is not supported by the Gloo transport (Gloo's TCP "
                             "pairs cannot show a message no recv has claimed); run the "
                             "parameter server over the MPI or the in-process transport");
  }

  void abort(const std::string& reason) override {
    GlooSigpipeBlock no_sigpipe;
    core_->abort(reason);
  }

  // Steps 1-3 of the header's set-up.
  void connect(AddressExchange& exchange, const GlooTransportOptions& options,
               Clock::time_point deadline);

 private:
  // A recv is posted at once. A send is posted at the transport's next
  // wait or test, after the recvs posted meanwhile: Gloo writes a recv's
  // go-ahead to the peer in the same queue as our data, so a go-ahead posted
  // after a large send waits until that send has gone out, and the peer's
  // data cannot flow our way meanwhile (a ring step ran at half the link
  // rate, each direction in turn). The data of a send cannot leave before
  // the peer's go-ahead anyway, so the deferral costs nothing.
  Request post(bool is_recv, int peer, void* data, size_t bytes, int tag) {
    auto req = std::make_shared<GlooRequest>(core_, is_recv, peer, tag, bytes);
    if (is_recv) {
      if (!core_->should_stop(peer)) req->post(data, gloo_slot(tag, bytes));
    } else {
      req->defer(data, gloo_slot(tag, bytes));
      std::lock_guard<std::mutex> lock(core_->deferred_mu);
      core_->deferred_sends.push_back(req);
    }
    return Request(std::move(req));
  }

  void check_peer(int peer, const char* what) const {
    DISTSTRAT_CHECK(0 <= peer && peer < core_->size && peer != core_->rank, kInvalidArgument,
                    core_->rank_text(), ": Gloo ", what, " rank ", peer, " in a group of ",
                    core_->size);
  }

  void shutdown();
  void say_goodbye();
  void stop_threads() noexcept {
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      core_->destroyed = true;
      core_->watcher_stop = true;
      core_->changed_locked();
    }
    if (watcher_.joinable()) watcher_.join();
    if (core_->closer.joinable()) core_->closer.join();
  }

  std::shared_ptr<GlooCore> core_;
  std::thread watcher_;
};

void GlooTransport::shutdown() {
  // Sends still deferred are pending work: posted, they make the transport
  // abort below (as they did before deferral), not leave without them.
  GlooRequest::flush_deferred_sends(*core_);
  bool graceful = false;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (core_->ready && core_->stop == GlooStop::kNone) {
      if (core_->live_requests == 0) {
        graceful = true;
      } else {
        core_->stop = GlooStop::kAborted;
        core_->stop_reason = "the Gloo transport was destroyed with " +
                             std::to_string(core_->live_requests) + " requests pending";
        core_->close_requested = true;
        core_->changed_locked();
      }
    }
  }
  if (graceful) say_goodbye();
  stop_threads();
  bool close_all = false;
  std::vector<std::unique_ptr<GlooBuffer>> controls;
  std::shared_ptr<gloo::transport::Context> ctx;
  std::shared_ptr<gloo::transport::Device> device;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    close_all = core_->close_requested && !core_->pairs_closed && core_->ready;
    core_->pairs_closed = true;
    for (auto& peer : core_->peers) {
      controls.push_back(std::move(peer.goodbye));
      controls.push_back(std::move(peer.failure));
    }
  }
  if (close_all) core_->close_all_pairs();
  // The pairs first (a request still pending may keep the context, not its
  // pairs): then Gloo's device thread is done with the control receives.
  core_->destroy_pairs();
  for (auto& c : controls) gloo_destroy(c, true);
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    ctx = std::move(core_->ctx);
    device = std::move(core_->device);
  }
  // Unless requests still pending hold it, the context goes here, and
  // Gloo's device loop with it.
  ctx.reset();
  device.reset();
}

// A zero-byte message on the control slot to every peer still there, then
// the wait (bounded) until each is written, so that the FIN follows it.
void GlooTransport::say_goodbye() {
  std::vector<std::shared_ptr<GlooRequest>> goodbyes;
  for (int p = 0; p < core_->size; ++p) {
    if (p == core_->rank || core_->should_stop(p)) continue;
    auto g = std::make_shared<GlooRequest>(core_, false, p, 0, 0, /*control=*/true);
    g->post(nullptr, kGlooControlSlot);
    goodbyes.push_back(std::move(g));
  }
  const auto deadline = Clock::now() + kGlooGoodbyeGrace;
  for (auto& g : goodbyes) {
    try {
      g->wait(deadline);
    } catch (const Error&) {
      // That peer left or failed meanwhile, or does not take it: it will see
      // the connection close instead.
    }
  }
}

void GlooTransport::connect(AddressExchange& exchange, const GlooTransportOptions& options,
                            Clock::time_point deadline) {
  GlooCore& c = *core_;
  const std::string who = "make_gloo_transport: rank " + std::to_string(c.rank) + " of " +
                          std::to_string(c.size) + " (group '" + echo(c.group) + "')";
  const std::string prefix = c.group + "/gloo/";

  // 1. The device and a listening socket per peer.
  gloo::transport::tcp::attr attr;
  if (!options.interface.empty()) {
    const std::string why = gloo_interface_error(options.interface);
    DISTSTRAT_CHECK(why.empty(), kInvalidArgument, who, ": interface '", echo(options.interface),
                    "': ", why);
    attr.iface = options.interface;
  } else {
    std::string host = options.listen_host;
    if (host.empty()) {
      char name[HOST_NAME_MAX + 1] = {};
      DISTSTRAT_CHECK(gethostname(name, sizeof name - 1) == 0, kUnavailable, who,
                      ": gethostname failed: ", std::strerror(errno));
      host = name;
    }
    const std::string why = gloo_resolve_error(host);
    DISTSTRAT_CHECK(why.empty(), kInvalidArgument, who, ": ",
                    options.listen_host.empty() ? "this host's name '" : "listen_host '",
                    echo(host), "' does not resolve (", why, ")",
                    options.listen_host.empty() ? "; set listen_host or interface" : "");
    attr.hostname = host;
  }
  const std::string where = options.interface.empty() ? "host '" + echo(attr.hostname) + "'"
                                                      : "interface '" + echo(attr.iface) + "'";
  std::vector<std::vector<char>> mine(c.size);
  try {
    GlooSigpipeBlock no_sigpipe;  // for good on Gloo's device thread
    {
      GlooDeviceThreadBatch batch;  // for good on Gloo's device thread
      c.device = gloo::transport::tcp::CreateDevice(attr);
    }
    c.ctx = c.device->createContext(c.rank, c.size);
    // Gloo's connect gives up after 5x this; the watcher ends it at the deadline.
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    c.ctx->setTimeout(
        std::clamp<std::chrono::milliseconds>(left, std::chrono::milliseconds(1), kGlooMaxWait));
    for (int p = 0; p < c.size; ++p) {
      if (p != c.rank) mine[p] = gloo_clean_address(c.ctx->createPair(p)->address().bytes());
    }
    if (c.size > 1) c.hosts[c.rank] = gloo_address_host(mine[c.rank == 0 ? 1 : 0]);
  } catch (const std::exception& e) {
    throw InvalidArgumentError(who + ": Gloo could not listen on " + where + ": " +
                               gloo_text(e.what()));
  }
  std::string value = "gloo-tcp/1 " + std::to_string(c.size);
  for (int p = 0; p < c.size; ++p)
    value += " " + (p == c.rank ? std::string("-") : gloo_hex(mine[p]));

  // 2. Publish, then every peer's addresses.
  std::vector<int> missing;
  const std::vector<std::optional<std::string>> values =
      exchange_addresses(exchange, prefix, c.rank, c.size, value, deadline, who, &missing);
  std::vector<std::vector<char>> theirs(c.size);
  for (int p = 0; p < c.size; ++p) {
    if (p == c.rank || !values[p]) continue;
    const std::string& v = *values[p];
    const std::string key = prefix + std::to_string(p);
    const std::vector<std::string> words = gloo_split(v);
    DISTSTRAT_CHECK(words.size() >= 2 && words[0] == "gloo-tcp/1", kInvalidArgument, who, ": rank ",
                    p, " published '", echo(v, 60), "' under '", echo(key),
                    "', not Gloo transport addresses");
    DISTSTRAT_CHECK(words[1] == std::to_string(c.size) && words.size() == size_t(c.size) + 2,
                    kInvalidArgument, who, ": rank ", p, " set up a group of ", echo(words[1]),
                    " ranks, this rank one of ", c.size);
    DISTSTRAT_CHECK(gloo_unhex(words[2 + c.rank], &theirs[p]) && theirs[p].size() == mine[p].size(),
                    kInvalidArgument, who, ": rank ", p, "'s address for this rank ('",
                    echo(words[2 + c.rank], 60), "') is not a Gloo TCP address");
    c.peers[p].address = gloo_address_text(theirs[p]);
    c.hosts[p] = gloo_address_host(theirs[p]);
  }
  // A missing rank that published under a neighbouring group name where
  // this rank did not: the processes counted their groups differently (one
  // threw before forming one and was retried). Asked once per neighbour, for
  // the first missing rank only (each look may take a round trip).
  if (!missing.empty()) {
    const int p = missing.front();
    for (const std::string& other : neighbour_groups(c.group)) {
      const auto has = [&](int r) {
        try {
          exchange.wait_for(other + "/gloo/" + std::to_string(r), Clock::now());
          return true;
        } catch (const Error&) {
          return false;
        }
      };
      DISTSTRAT_CHECK(!has(p) || has(c.rank), kFailedPrecondition, who, ": rank ", p,
                      " never published its addresses in group '", echo(c.group),
                      "' but did in group '", echo(other),
                      "': the processes made their groups in different orders (a process that "
                      "failed before forming a group and was retried counts its groups "
                      "differently; start every process afresh)");
    }
  }
  throw_if_unpublished(missing, prefix, who);

  // 3. Connect each pair, then post its control receives.
  std::vector<int> not_connected;
  for (int p = 0; p < c.size; ++p) {
    if (p == c.rank) continue;
    GlooWaiter w;
    w.kind = GlooWaiter::kConnect;
    w.peer = p;
    w.until = deadline;
    core_->add_waiter(&w);
    std::string what;
    try {
      c.ctx->getPair(p)->connect(theirs[p]);
    } catch (const std::exception& e) {
      what = e.what();
      if (what.empty()) what = "unknown Gloo error";
    }
    core_->remove_waiter(&w);
    if (w.interrupted) {
      not_connected.push_back(p);
    } else if (!what.empty()) {
      throw UnavailableError(who + ": connecting to " + c.peer_text(p) +
                             " failed: " + gloo_text(what));
    }
  }
  DISTSTRAT_CHECK(not_connected.empty(), kDeadlineExceeded, who, ": ", ranks_phrase(not_connected),
                  " did not connect before the deadline");
  GlooSigpipeBlock no_sigpipe;  // posting writes to the socket
  for (int p = 0; p < c.size; ++p) {
    if (p == c.rank) continue;
    GlooCore::Peer& peer = c.peers[p];
    try {
      peer.goodbye = c.ctx->createUnboundBuffer(&peer.byte, 0);
      peer.goodbye->recv(p, kGlooControlSlot, 0, 0);
      peer.failure = c.ctx->createUnboundBuffer(&peer.byte, 0);
      peer.failure->recv(p, kGlooControlSlot, 0, 0);
    } catch (const std::exception& e) {
      throw UnavailableError(who + ": the connection to " + c.peer_text(p) +
                             " failed during set-up: " + gloo_text(e.what()));
    }
  }
}

}  // namespace
}  // namespace gloo_impl

std::vector<int> gloo_node_of(const Transport& transport) {
  const auto* t = dynamic_cast<const gloo_impl::GlooTransport*>(&transport);
  if (!t) return {};
  return t->node_of();
}

std::unique_ptr<Transport> make_gloo_transport(int rank, int size, AddressExchange& exchange,
                                               const GlooTransportOptions& options,
                                               Clock::time_point deadline) {
  DISTSTRAT_CHECK(size >= 1, kInvalidArgument, "make_gloo_transport: size ", size,
                  " (a group has at least one rank)");
  DISTSTRAT_CHECK(0 <= rank && rank < size, kInvalidArgument, "make_gloo_transport: rank ", rank,
                  " in a group of ", size);
  DISTSTRAT_CHECK(!options.group.empty(), kInvalidArgument, "make_gloo_transport: rank ", rank,
                  ": options.group is empty (it names the group's keys, e.g. \"job/g7\")");
  DISTSTRAT_CHECK(options.listen_host.empty() || options.interface.empty(), kInvalidArgument,
                  "make_gloo_transport: rank ", rank, ": both listen_host '",
                  echo(options.listen_host), "' and interface '", echo(options.interface),
                  "' are set; give one");
  auto core = std::make_shared<gloo_impl::GlooCore>(rank, size, options.group);
  auto transport = std::make_unique<gloo_impl::GlooTransport>(core);
  if (size > 1) transport->connect(exchange, options, deadline);
  {
    std::lock_guard<std::mutex> lock(core->mu);
    core->ready = true;
  }
  return transport;
}

}  // namespace diststrat
