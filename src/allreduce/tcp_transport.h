// TCP transport: the Transport of transport.h over plain TCP sockets, one
// connection per pair of ranks, for jobs started without a launcher
// (TF_CONFIG, a ClusterSpec: runtime/tcp_group.cc). No thread of its own:
// the thread that waits (or tests, or probes) reads and writes the sockets
// itself, as MPI's TCP path does.
//
// Why not Gloo's TCP pairs (gloo_transport.h, which elastic training keeps):
// Gloo reads every socket on its device thread, which sleeps in epoll_wait,
// and hands each completion to the waiting thread, which sleeps on a
// condition variable. On a busy host a thread woken by a socket or a futex
// gets the CPU back only at the scheduler's next tick: measured with
// allreduce_bench (8-byte ring all-reduce, 2 ranks on one host), 3.9 ms p50
// over Gloo against 45 us over MPI, and 3.7-8 ms over this transport too
// while its waits slept in poll(2) until data came. Waits here poll, as
// MPI's do (see the rules): 30-45 us, MPI's own figure.
//
// Set-up (make_tcp_transport) works as follows:
//  1. Each rank binds a listening socket on listen_host (port chosen by the
//     kernel) and publishes "ds-tcp/1 <size> <host> <port>" under
//     "<group>/tcp/<rank>" through the AddressExchange.
//  2. It reads every peer's address, connects to each higher rank and says
//     hello (magic, group size, its rank, a hash of the group name); then
//     accepts the lower ranks' connections (a connect needs no accept, so no
//     order can deadlock).
// Every step is bounded by `deadline`: DeadlineExceededError naming the
// ranks that never published their addresses, or never connected; a peer
// that refused the connection is an UnavailableError. Bad options are an
// InvalidArgumentError (rank out of range, size < 1, empty group, a host
// name that does not resolve, ranks that disagree on the group size).
//
// Wire: each message is a 16-byte header (kind, tag, byte count) and the
// payload. A recv meets the oldest message of its (peer, tag); a message
// that arrives before its recv is posted is kept in memory (copied once
// when the recv comes). A byte count that differs from the recv's fails the
// recv (InvalidArgumentError at the receiver, as transport.h says) and the
// message is dropped.
//
// Rules (on top of transport.h's):
//  - send/recv only enqueue (a send also writes what the socket takes at
//    once). Progress happens in wait, test and probe_any of any request, on
//    every connection. wait(deadline) polls the sockets: a few hundred
//    times without sleeping (a peer on the same host answers within
//    microseconds), then every 50 us, then (after 50 ms without progress)
//    every 1 ms; never past the deadline: DeadlineExceededError naming this
//    rank, the peer, the byte count and the tag.
//  - test() never blocks.
//  - probe_any is supported: the oldest message (any peer, any tag) that no
//    posted recv claims.
//  - A peer that goes away: when its transport is destroyed it sends a
//    goodbye after everything it queued. Transfers with it that completed
//    stay complete; one that still needed it fails (UnavailableError "rank
//    P (host:port) left the group"). A connection that ends without a
//    goodbye (the process died, it aborted) breaks the transport: every
//    pending and later wait, whatever its peer, throws UnavailableError
//    naming the ranks whose connections failed and their addresses.
//  - abort(reason): every pending and later wait throws AbortedError(reason);
//    the connections are shut down, so the peers' waits fail at once. May be
//    called from any thread.
//  - Dropping a Request before it completed: a recv not yet met is
//    withdrawn (its message stays for a later recv); a send not yet started
//    is withdrawn; a send partly written has its rest copied and finished
//    (the stream stays whole); a recv whose message was partly read into
//    the buffer has the rest discarded and the transport is finished
//    (AbortedError "a recv was dropped mid-message"): algorithms drop
//    requests only while they unwind from an error.
//  - Thread-safe: every call takes the transport's lock (a blocked wait
//    does not hold it).
//  - Destruction never throws and is bounded: with nothing pending it
//    flushes what was queued, says goodbye, and waits up to 1 s for each
//    peer's end of the stream (so that no reset loses bytes the peer has
//    not read); with requests pending it shuts the connections down.
//  - SIGPIPE is never raised (writes use MSG_NOSIGNAL).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "allreduce/address_exchange.h"
#include "allreduce/transport.h"

namespace diststrat {

struct TcpTransportOptions {
  // Key prefix unique to this group, e.g. "job/tf-config-0": keys are
  // "<group>/tcp/<rank>". Required.
  std::string group;
  // Host name or IP address to bind and advertise. Empty: this host's name
  // (gethostname), which must resolve to an address of this host.
  std::string listen_host;
  // What a connection that ends without a goodbye (its process died) does:
  // true (default) breaks the whole transport, as the rules above say (a
  // collective cannot go on without a rank). false: only the transfers with
  // that peer fail (UnavailableError naming it and why its connection
  // ended), as with a peer that left; the others go on. Parameter-server
  // jobs that outlive a lost worker (ParameterServerOptions::
  // survive_worker_loss) use false.
  bool peer_failure_breaks_group = true;
};

// Rank `rank` of `size`: binds, publishes, connects the full mesh. Blocks;
// collective over the group; bounded by `deadline` (see above for errors).
// size == 1 needs no exchange and opens no socket.
std::unique_ptr<Transport> make_tcp_transport(int rank, int size, AddressExchange& exchange,
                                              const TcpTransportOptions& options,
                                              Clock::time_point deadline);

// Which ranks of a TCP transport share a host (the same advertised IP
// address), numbered 0, 1, ... in the order of their lowest rank, as
// TransportCommunicator takes it. {} for any other transport.
std::vector<int> tcp_node_of(const Transport& transport);

}  // namespace diststrat
