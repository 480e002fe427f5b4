// A job started without a launcher (TF_CONFIG, a ClusterSpec): the chief's
// store, the TCP mesh (allreduce/tcp_transport.h), the library's algorithms over it
// (process_group.h's make_tcp_process_communicators).
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "allreduce/flight_recording.h"
#include "allreduce/tcp_transport.h"
#include "allreduce/transport_communicator.h"
#include "core/flight_recorder.h"
#include "core/random_id.h"
#include "core/user_text.h"
#include "diststrat/error.h"
#include "runtime/process_group.h"
#include "runtime/tcp_store.h"

namespace diststrat {

namespace {

struct HostPort {
  std::string host;
  int port = 0;
};

// "host:port" (validated by ClusterSpec already; checked again here, since
// a port is needed, not only text).
HostPort split_address(const std::string& address, const std::string& what) {
  const size_t colon = address.rfind(':');
  HostPort hp;
  if (colon != std::string::npos && colon > 0) {
    hp.host = address.substr(0, colon);
    const std::string port = address.substr(colon + 1);
    char* end = nullptr;
    const long v = std::strtol(port.c_str(), &end, 10);
    if (!port.empty() && end && *end == '\0' && v > 0 && v <= 65535) hp.port = static_cast<int>(v);
  }
  DISTSTRAT_CHECK(hp.port > 0, kInvalidArgument, what, " '", echo(address),
                  "' is not host:port with a port 1-65535");
  return hp;
}

// "worker[1] (host1:2222)".
std::string task_text(const ClusterSpec& spec, int rank) {
  const auto [type, index] = spec.task_of_rank(rank);
  return type + "[" + std::to_string(index) + "] (" + spec.jobs.at(type).at(index) + ")";
}

std::string address_of_rank(const ClusterSpec& spec, int rank) {
  const auto [type, index] = spec.task_of_rank(rank);
  return spec.jobs.at(type).at(index);
}

// The chief's store of this process, shared by its groups (a strategy and a
// ProcessGroup of one job use one port): alive while any group holds it.
std::shared_ptr<TcpStoreServer> chief_store(const HostPort& at, const std::string& who) {
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<TcpStoreServer>> servers;
  std::lock_guard<std::mutex> lock(mu);
  const std::string key = at.host + ":" + std::to_string(at.port);
  if (auto s = servers[key].lock()) return s;
  auto s = std::make_shared<TcpStoreServer>(at.host, at.port, who);
  servers[key] = s;
  return s;
}

// The exchange the mesh is set up through: the chief's store, and the
// group's failure key. A rank whose set-up fails publishes why under
// "<group>/failed" (the first one stays), so the others stop waiting for it
// at once and say why, instead of waiting out the deadline and blaming a
// connection.
class SetUpExchange : public AddressExchange {
 public:
  SetUpExchange(TcpStoreClient& client, std::string failed_key)
      : client_(client), failed_key_(std::move(failed_key)) {}
  std::string seen_key(int rank) const { return failed_key_ + "-seen/" + std::to_string(rank); }

  void publish(const std::string& key, const std::string& value,
               Clock::time_point deadline) override {
    client_.publish(key, value, deadline);
  }
  std::string wait_for(const std::string& key, Clock::time_point deadline) override {
    int look = 0;
    return client_.wait_for(key, deadline, [&] {
      // The failure key every 4th look (~20 ms): one request per look otherwise.
      if (look++ % 4 != 0) return;
      const Clock::time_point d = std::max(deadline, Clock::now() + std::chrono::milliseconds(200));
      if (std::optional<std::string> why = client_.get(failed_key_, d)) {
        // (The transport's set-up says which key it was waiting for.)
        throw AbortedError("the job's set-up failed on another process: " + echo(*why, 2000));
      }
    });
  }
  // Best effort, bounded (~0.5 s): this rank's reason for the others.
  void publish_failure(const std::string& why) {
    try {
      client_.publish(failed_key_, why.substr(0, 4000),
                      Clock::now() + std::chrono::milliseconds(500));
    } catch (const Error&) {
      // Another rank's reason is there already, or the store is gone.
    }
  }
  // Best effort: this rank knows of the failure (the chief's store may go).
  void acknowledge(int rank) {
    try {
      client_.publish(seen_key(rank), "1", Clock::now() + std::chrono::milliseconds(500));
    } catch (const Error&) {
    }
  }
  // The chief, whose store goes with it: until every other rank has learnt
  // of the failure, or the set-up deadline (processes may start in any order
  // within it, and one that comes after the store has gone could only wait
  // out its own deadline, blaming the chief's address).
  void linger_until_known(int size, Clock::time_point deadline) {
    for (int r = 1; r < size && Clock::now() < deadline;) {
      std::optional<std::string> seen;
      try {
        seen = client_.get(seen_key(r), Clock::now() + std::chrono::milliseconds(200));
      } catch (const Error&) {
        return;
      }
      if (seen) {
        ++r;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  }

 private:
  TcpStoreClient& client_;
  std::string failed_key_;
};

}  // namespace

namespace {

// The job's mesh; `store` is the chief's store (rank 0), kept while the
// group lives, since peers may still read addresses from it after the chief
// has connected to all of them.
struct TcpJob {
  std::unique_ptr<Transport> transport;
  std::shared_ptr<TcpStoreServer> store;
  std::string chief;  // "host:port"
  std::string nonce;  // rank 0's flight-record nonce
};

TcpJob make_tcp_job(const ResolvedCluster& cluster, std::chrono::milliseconds timeout,
                    const std::string& group, bool peer_failure_breaks_group = true) {
  const ClusterSpec& spec = cluster.spec;
  const int rank = cluster.placement.rank;
  const int size = cluster.placement.world_size;
  const Clock::time_point deadline = Clock::now() + timeout;
  const std::string who = "rank " + std::to_string(rank) + " " + task_text(spec, rank);
  const HostPort chief = split_address(address_of_rank(spec, 0), "the chief's address");
  const HostPort mine = split_address(address_of_rank(spec, rank), "this task's address");
  const std::string server = "the chief's store (" + task_text(spec, 0) + ")";

  TcpJob job;
  if (rank == 0) {
    try {
      job.store = chief_store(chief, "the chief's store");
    } catch (const Error& e) {
      throw_error(e.code(), who + ": " + e.message() +
                                " (the chief serves the job's store at its address in the "
                                "cluster spec)");
    }
  }
  TcpStoreClient client(chief.host, chief.port, who, server);
  SetUpExchange exchange(client, group + "/failed");
  // The group's flight-record nonce (flight::set_nonce): rank 0's, published
  // before it connects, so it is there once the group is.
  const std::string nonce_key = group + "/flight-nonce";
  TcpTransportOptions go;
  go.group = group;
  go.listen_host = mine.host;
  go.peer_failure_breaks_group = peer_failure_breaks_group;
  try {
    if (rank == 0) client.publish(nonce_key, std::to_string(random_id()), deadline);
    job.transport = make_tcp_transport(rank, size, exchange, go, deadline);
    job.nonce = exchange.wait_for(nonce_key, deadline);
  } catch (const Error& e) {
    // The transport names ranks; the user knows tasks.
    std::string tasks;
    for (int r = 0; r < size; ++r) {
      tasks += (r ? ", " : "") + std::to_string(r) + " = " + task_text(spec, r);
    }
    // (A deadline is every rank's own: each names the ranks it lacks.)
    if (e.code() != ErrorCode::kDeadlineExceeded) {
      exchange.publish_failure(e.message());  // (kept: the first reason published)
      exchange.acknowledge(rank);
      if (job.store) exchange.linger_until_known(size, deadline);
    }
    throw_error(e.code(), e.message() + " [ranks: " + tasks + "]");
  }
  job.chief = chief.host + ":" + std::to_string(chief.port);
  return job;
}

// The mesh as a Transport that also keeps the chief's store.
class TcpJobTransport : public Transport {
 public:
  explicit TcpJobTransport(TcpJob job) : job_(std::move(job)), t_(*job_.transport) {}
  int rank() const override { return t_.rank(); }
  int size() const override { return t_.size(); }
  Request send(int peer, const void* data, size_t bytes, int tag) override {
    return t_.send(peer, data, bytes, tag);
  }
  Request recv(int peer, void* data, size_t bytes, int tag) override {
    return t_.recv(peer, data, bytes, tag);
  }
  bool probe_any(Envelope* env) override { return t_.probe_any(env); }
  void abort(const std::string& reason) override { t_.abort(reason); }

 private:
  TcpJob job_;
  Transport& t_;
};

}  // namespace

ProcessCommunicators make_tcp_process_communicators(const ResolvedCluster& cluster,
                                                    const CommunicationOptions& options,
                                                    const std::string& group) {
  TcpJob job = make_tcp_job(cluster, options.timeout, group);
  ProcessCommunicators out;
  Transport& ref = *job.transport;
  std::vector<int> node_of = tcp_node_of(ref);
  out.cross = wrap_recorded(std::make_unique<TransportCommunicator>(
                                ref, options, std::move(node_of), std::move(job.transport)),
                            group);
  flight::set_job("tcp://" + job.chief);
  flight::set_nonce(std::strtoull(job.nonce.c_str(), nullptr, 10));
  flight::set_process(cluster.placement.rank, cluster.placement.world_size);
  out.store = job.store;
  return out;
}

std::unique_ptr<Transport> make_tcp_job_transport(const ResolvedCluster& cluster,
                                                  std::chrono::milliseconds timeout,
                                                  const std::string& group,
                                                  bool peer_failure_breaks_group) {
  return std::make_unique<TcpJobTransport>(
      make_tcp_job(cluster, timeout, group, peer_failure_breaks_group));
}

}  // namespace diststrat
