// Gloo transport: the Transport of transport.h over Gloo's TCP transport
// (gloo::transport::tcp), for elastic training. One transport serves one
// membership generation's group: built when the membership settles, thrown
// away on any error, rebuilt (under a new group name) for the next one.
// Gloo stays behind the gloo_*.cc files (gloo_transport_impl.h); this
// header includes none of it.
//
// Set-up (make_gloo_transport) works as follows:
//  1. Each rank opens a Gloo TCP device on listen_host (or on the address of
//     `interface`) and one listening socket per peer (Gloo's pairs).
//  2. It publishes those addresses under "<group>/gloo/<rank>" through the
//     AddressExchange, then waits for every peer's.
//  3. It connects the full mesh, rank by rank (of each pair the side with
//     the larger address connects, the other accepts), and posts two
//     zero-byte control receives per peer: one completes when the peer says
//     goodbye, the other fails when its connection does.
// A watcher thread per transport then enforces wait deadlines and checks
// every 10 ms whether a peer's connection failed.
//
// Each send/recv is one Gloo unbound buffer on the pair to the peer, in the
// slot (tag << 32 | byte count), byte counts of 2 GiB and more folded into
// 31 bits: a recv meets only a send of the same tag and the same size.
//
// Rules (on top of transport.h's):
//  - make_gloo_transport is collective: every rank of the group calls it with
//    the same group and size. Bad options are an InvalidArgumentError (rank
//    out of range, size < 1, empty group, both listen_host and interface, a
//    host name that does not resolve, an interface that does not exist or
//    has no address, ranks that disagree on the group size). At `deadline` it
//    throws DeadlineExceededError naming this rank and the ranks that never
//    published their addresses, or that never connected; a peer that
//    published and then refused the connection is an UnavailableError.
//  - send/recv only enqueue. A recv is handed to Gloo at once, a send at the
//    transport's next wait or test (of any request), after the recvs posted
//    before that: Gloo writes a recv's go-ahead to its peer in the same queue
//    as our data, and a go-ahead behind a large send would hold the peer's
//    data back until ours had gone (both directions of a ring step then take
//    turns: half the link rate). wait(deadline) blocks until the transfer is done
//    and never past the deadline: DeadlineExceededError naming this rank, the
//    peer, the byte count and the tag. The request stays posted: wait again,
//    or drop it (see below).
//  - Byte counts: Gloo itself checks them on its device thread, where an
//    exception ends the process (std::terminate) when a send is longer than
//    the recv it meets, and a send shorter than its recv completes it with
//    the rest of the buffer left as it was. Here the count is part of the
//    slot, so a send and a recv of different sizes never meet: both wait
//    until their deadlines, whose error says so. (Counts of 2 GiB and more
//    share the slot's 31 bits, so two of those can still meet.)
//    TransportCommunicator compares every call across ranks first, so its
//    collectives never get there.
//  - A peer that goes away: when its transport is destroyed with nothing
//    pending it says goodbye first. A transfer with it that completed stays
//    complete, also when waited afterwards, and transfers among the others
//    go on: ranks that finish a collective and leave early do not fail the
//    ones still finishing it. A transfer that still needed it fails at once
//    (UnavailableError "rank P (host:port) left the group"), and since the
//    group's work cannot finish without that rank, this breaks the transport
//    as a failure does. A peer whose connection fails without a goodbye (its
//    process died, it aborted, its transport broke) breaks it at once.
//    Broken: every pending and later wait, whatever its peer, throws
//    UnavailableError naming the ranks whose connections are gone and their
//    addresses, and this transport resets its own connections so that the
//    rest of the group learns it too. The break is seen within about 10 ms;
//    both happen 50 ms after that, so that ranks leaving or failing
//    together are all named (a connection a transport reset itself tells
//    it nothing more).
//  - abort(reason): every pending and later wait throws AbortedError(reason)
//    at once; the connections are closed (reset), so the peers' waits fail
//    with UnavailableError within milliseconds. May be called from any
//    thread, also while another thread waits.
//  - Dropping the last copy of a Request that has not completed: Gloo cannot
//    cancel a posted transfer, and a message that arrives for a destroyed
//    buffer wedges its connection (Gloo's device thread spins on it and no
//    later message on that pair gets through). So the buffer is unregistered
//    from Gloo before the drop returns (Gloo never touches it again), and the
//    transport is finished: every later wait throws AbortedError "a request
//    was dropped before completion", and the connections are closed (the
//    peers see UnavailableError). Algorithms drop requests only while they
//    unwind from an error, when the group is lost anyway.
//  - test() waits up to about 2 ms when the transfer is still pending: Gloo's
//    API has no check that neither blocks nor consumes the completion.
//  - probe_any throws UnimplementedError: Gloo's pairs cannot show a message
//    that no recv has claimed. The parameter server, which needs it, runs
//    over the MPI, the TCP (tcp_transport.h) or the in-process transport;
//    elastic all-reduce does not need it.
//  - Destruction never throws, and is bounded: about 10 ms (a tick of Gloo's
//    device loop) to close the sockets, 16 at a time, plus up to 1 s for a
//    goodbye a peer does not take. With requests pending it aborts first
//    (their later waits throw AbortedError), otherwise it says goodbye to
//    every peer.
//  - SIGPIPE: Gloo writes with writev(2), which raises it on a connection
//    the peer reset. The transport blocks it (per thread) on Gloo's device
//    thread and around its own writes, so such a write fails as an error;
//    the process's signal dispositions are left as they are.
//  - One thread uses a transport at a time (abort() excepted); transports of
//    different ranks may live on different threads of one process. Each
//    transport runs two threads of its own, Gloo's device loop and the
//    watcher, and briefly up to 16 more to reset its connections.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "allreduce/address_exchange.h"
#include "allreduce/transport.h"

namespace diststrat {

struct GlooTransportOptions {
  // Key prefix unique to this group, e.g. "job/g7" (the generation): keys
  // are "<group>/gloo/<rank>". Required.
  std::string group;
  // Host name or IP address to bind and advertise. Empty: this host's name
  // (gethostname), which must resolve to an address of this host.
  std::string listen_host;
  // Or the name of a network interface (e.g. "veth1") whose first address to
  // bind and advertise. At most one of listen_host and interface.
  std::string interface;
};

// Rank `rank` of `size`: binds the listening sockets, publishes their
// addresses under options.group, connects to every other rank (full mesh).
// Blocks; collective over the group; bounded by `deadline` (see Rules above
// for its errors). size == 1 needs no exchange and opens no socket.
std::unique_ptr<Transport> make_gloo_transport(int rank, int size, AddressExchange& exchange,
                                               const GlooTransportOptions& options,
                                               Clock::time_point deadline);

// Which ranks of a Gloo transport share a host: node_of[r] for every rank r
// (ranks that advertised the same IP address share a node; nodes are numbered
// 0, 1, ... in the order of their lowest rank), as TransportCommunicator's
// hierarchical algorithm and kAuto take it. {} for any other transport.
std::vector<int> gloo_node_of(const Transport& transport);

}  // namespace diststrat
