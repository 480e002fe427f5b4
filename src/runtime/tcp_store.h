// A small key-value store over TCP, served by the chief of a job started
// without MPI (TF_CONFIG or a ClusterSpec): the ranks publish their TCP
// transport's connection addresses in it and read each other's
// (allreduce/address_exchange.h). Debian's Gloo has file, hash, prefix and Redis stores
// but no TCP one, and a job started by hand has only the chief's listed
// address in common.
//
// Wire format (big-endian integers), one request and one answer at a time
// per connection:
//   request  "DSKV" op(1: 'P' put, 'G' get) key_len(u16) value_len(u32) key value
//   answer   "DSKV" status(1) len(u32) payload
//            status 'O' put stored, 'V' value follows, 'N' no such key,
//            'C' the key holds another value (put refused, connection kept),
//            'E' request refused, payload the reason; the server then closes,
//            'R' connection closed through no fault of the peer's (room for
//            a 257th, idle 5 minutes), payload the reason: the client
//            connects again (UnavailableError inside call(), retried until
//            the deadline).
// The server reads a connection's next request only once the answer to the
// last is sent: a peer that pipelines requests and reads nothing is held
// back by TCP flow control, not by the server's memory.
// Keys are 1-200 of [A-Za-z0-9._/-]; a get carries no value; values are at
// most 1 MiB, and at most 256 MiB of values in all: a rank publishes ~273
// bytes of Gloo address per peer under one key, so a job has at most about
// 990 ranks (the 256 MiB; the 1 MiB alone would allow ~3800). Nothing read from the
// network is trusted: the server checks
// every header as soon as it has it and refuses (an 'E' answer, then it
// closes that connection) a wrong magic, an unknown op, a bad key, a size
// over the limits; a connection silent mid-request for 10 s, or idle for 5
// minutes, is closed, as is one whose answer is left unread for 10 s; a
// 257th connection closes the one silent the longest ('R');
// over 4096 keys or 256 MiB of values are refused. A
// refused peer costs the job nothing: the server serves the others on.
// The client checks every answer the same way (DataLossError naming the
// server for bytes that are not this protocol, such as a wrong port).
//
// Thread safety: a server runs one thread of its own; its methods may be
// called from any thread. A client is used by one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "allreduce/address_exchange.h"

namespace diststrat {

class TcpStoreServer {
 public:
  // Binds `host` (a name or an IPv4 address; "" = every interface) at `port`
  // (0: a free port, see port()) and serves until destroyed. `who` names it in
  // messages ("the chief's store"). Throws UnavailableError naming host:port
  // when it cannot bind (in use, not this host's address), InvalidArgumentError
  // for a host that does not resolve.
  TcpStoreServer(const std::string& host, int port, const std::string& who);
  // Stops the thread and closes every connection (bounded: ~100 ms).
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const;
  // Connections refused so far for breaking the protocol or the limits, and
  // the last reason (what the refused peer was told).
  int refused() const;
  std::string last_refusal() const;
  // The server's own last trouble ("" if none): a poll or accept error, an
  // exception while serving (that connection is closed, the rest served on).
  std::string last_error() const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

class TcpStoreClient : public AddressExchange {
 public:
  // The store at host:port. `who` names this side in messages ("rank 1 (worker[0])"),
  // `server` the other ("the chief's store (chief[0] at host0:2222)").
  TcpStoreClient(std::string host, int port, std::string who, std::string server);
  ~TcpStoreClient() override;
  TcpStoreClient(const TcpStoreClient&) = delete;
  TcpStoreClient& operator=(const TcpStoreClient&) = delete;

  // Stores `value` under `key`. Publishing a key again with the same value is
  // fine; with another one it is an InvalidArgumentError (two processes that
  // claim one task). Connecting is retried until `deadline` (the server may
  // not be up yet): then DeadlineExceededError naming the server.
  void publish(const std::string& key, const std::string& value,
               Clock::time_point deadline) override;
  // The value of `key`, polled until `deadline` (DeadlineExceededError naming
  // the key). Asks once even when the deadline has passed.
  std::string wait_for(const std::string& key, Clock::time_point deadline) override;
  // The same, calling `between_looks` after each look that did not find the
  // key (it may throw to end the wait: e.g. when another key says to stop).
  std::string wait_for(const std::string& key, Clock::time_point deadline,
                       const std::function<void()>& between_looks);
  // One look: nullopt when the key is not there yet.
  std::optional<std::string> get(const std::string& key, Clock::time_point deadline);

 private:
  // One request, its answer's status and payload.
  char call(char op, const std::string& key, const std::string& value, Clock::time_point deadline,
            std::string* payload);
  char call_once(char op, const std::string& key, const std::string& value,
                 Clock::time_point deadline, std::string* payload);
  void connect(Clock::time_point deadline);
  void close_fd();
  std::string host_;
  int port_;
  std::string who_, server_;
  int fd_ = -1;
  // The server's address (network order) and when it may be looked up again.
  uint32_t addr_ = 0;
  bool resolved_ = false, stale_ = false;
  Clock::time_point next_lookup_{};
};

// Whether `key` is a store key (1-200 of [A-Za-z0-9._/-]).
bool is_tcp_store_key(const std::string& key);

}  // namespace diststrat
