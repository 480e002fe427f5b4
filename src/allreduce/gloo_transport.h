// A Transport over Gloo's TCP transport (libgloo): the transport of elastic
// groups (diststrat/elastic.h), one per group, made when the group forms and
// thrown away when it breaks. Built only with DISTSTRAT_HAVE_GLOO; no Gloo
// header is included here.
//
// Rules (beyond transport.h's):
//  - make_gloo_transport is collective over the group: every rank binds a
//    TCP socket, publishes its addresses through an AddressExchange under
//    options.group, and connects to every other rank (full mesh), within the
//    deadline (DeadlineExceededError naming this rank and the key it waited
//    for, or UnavailableError for a connection refused or reset).
//  - A peer that goes away (its process killed: the kernel closes its
//    sockets) fails the waits on it at once with UnavailableError naming
//    this rank and the peer; a wait that reaches its deadline fails with
//    DeadlineExceededError and, as Gloo does, closes every connection of
//    this rank, so its peers learn at once too. Every rank that leaves a
//    broken group closes its connections (abort or destruction), so a failure
//    reaches every member within a few hops, not at each one's deadline.
//  - After any failed wait, abort, or a request dropped before completing,
//    the transport is broken: every later wait throws AbortedError. Build the
//    next group's transport instead.
//  - A dropped incomplete request: Gloo holds only a non-owning pointer to
//    the request's buffer, so the buffer is never touched once the request
//    is gone.
//  - Not supported: probe_any and Request::test (UnimplementedError): the
//    parameter server does not run over this transport.
//  - A recv whose byte count differs from the matching send makes Gloo's
//    network thread fail an internal check (the process ends): the
//    communicators' call comparison (transport_communicator.h) runs before
//    every collective so that ranks never post mismatched transfers.
//  - One thread at a time per transport; transports of different ranks may
//    live in one process (tests run ranks as threads).
#pragma once

#include <memory>
#include <string>

#include "allreduce/transport.h"

namespace diststrat {

// Where the ranks of one group publish and find each other's connection
// addresses. Values are text (hex).
class AddressExchange {
 public:
  virtual ~AddressExchange() = default;
  virtual void publish(const std::string& key, const std::string& value,
                       Clock::time_point deadline) = 0;
  // Blocks until `key` is published, or throws DeadlineExceededError naming it.
  virtual std::string wait_for(const std::string& key, Clock::time_point deadline) = 0;
};

// An exchange for ranks that are threads of one process (tests).
std::shared_ptr<AddressExchange> make_in_memory_address_exchange();

struct GlooTransportOptions {
  // Key prefix unique to this group (e.g. "g7"). Required.
  std::string group;
  // Host name or address to bind and advertise; empty: this host's name.
  std::string listen_host;
  // Or a network interface to bind (e.g. "eth0"); at most one of the two.
  std::string interface;
};

// Rank `rank` of `size` (see the rules above). InvalidArgumentError for bad
// options or ranks.
std::unique_ptr<Transport> make_gloo_transport(int rank, int size, AddressExchange& exchange,
                                               const GlooTransportOptions& options,
                                               Clock::time_point deadline);

}  // namespace diststrat
