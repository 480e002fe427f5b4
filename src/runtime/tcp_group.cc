// A job started without a launcher (TF_CONFIG, a ClusterSpec): the chief's
// store, the Gloo TCP mesh, the library's algorithms over it
// (process_group.h's make_tcp_process_communicators).
#include <cstdlib>
#include <map>
#include <mutex>

#include "allreduce/flight_recording.h"
#include "allreduce/gloo_transport.h"
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

}  // namespace

ProcessCommunicators make_tcp_process_communicators(const ResolvedCluster& cluster,
                                                    const CommunicationOptions& options,
                                                    const std::string& group) {
  const ClusterSpec& spec = cluster.spec;
  const int rank = cluster.placement.rank;
  const int size = cluster.placement.world_size;
  const Clock::time_point deadline = Clock::now() + options.timeout;
  const std::string who = "rank " + std::to_string(rank) + " " + task_text(spec, rank);
  const HostPort chief = split_address(address_of_rank(spec, 0), "the chief's address");
  const HostPort mine = split_address(address_of_rank(spec, rank), "this task's address");
  const std::string server = "the chief's store (" + task_text(spec, 0) + ")";

  ProcessCommunicators out;
  std::shared_ptr<TcpStoreServer> store;
  if (rank == 0) {
    try {
      store = chief_store(chief, "the chief's store");
    } catch (const Error& e) {
      throw_error(e.code(), who + ": " + e.message() +
                                " (the chief serves the job's store at its address in the "
                                "cluster spec)");
    }
  }
  TcpStoreClient client(chief.host, chief.port, who, server);
  // The group's flight-record nonce (flight::set_nonce): rank 0's, published
  // before it connects, so it is there once the group is.
  const std::string nonce_key = group + "/flight-nonce";
  if (rank == 0) client.publish(nonce_key, std::to_string(random_id()), deadline);
  GlooTransportOptions go;
  go.group = group;
  go.listen_host = mine.host;
  std::unique_ptr<Transport> t;
  try {
    t = make_gloo_transport(rank, size, client, go, deadline);
  } catch (const Error& e) {
    // Gloo names ranks; the user knows tasks.
    std::string tasks;
    for (int r = 0; r < size; ++r) {
      tasks += (r ? ", " : "") + std::to_string(r) + " = " + task_text(spec, r);
    }
    throw_error(e.code(), e.message() + " [ranks: " + tasks + "]");
  }
  Transport& ref = *t;
  std::vector<int> node_of = gloo_node_of(ref);
  out.cross = wrap_recorded(
      std::make_unique<TransportCommunicator>(ref, options, std::move(node_of), std::move(t)),
      group);
  flight::set_job("tcp://" + chief.host + ":" + std::to_string(chief.port));
  flight::set_nonce(std::strtoull(client.wait_for(nonce_key, deadline).c_str(), nullptr, 10));
  flight::set_process(rank, size);
  out.store = store;
  return out;
}

}  // namespace diststrat
