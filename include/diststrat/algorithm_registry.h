// Custom all-reduce algorithms. A user registers a function under a name in an
// AlgorithmRegistry, points CommunicationOptions::algorithm_registry at it and
// selects it with algorithm = Algorithm::kCustom, custom_algorithm = "name".
// Communicators built over a point-to-point transport (MPI, the in-process
// transport) then call the function for every all_reduce.
//
//   ```cpp fragment
//   auto registry = std::make_shared<diststrat::AlgorithmRegistry>();
//   registry->add("naive", [](diststrat::PeerChannel& ch, void* data, size_t count,
//                             diststrat::DType dtype, diststrat::ReduceOp op) { /* ... */ });
//   diststrat::CommunicationOptions opts;
//   opts.algorithm = diststrat::Algorithm::kCustom;
//   opts.custom_algorithm = "naive";
//   opts.algorithm_registry = registry;
//   ```
//
// A registry is an ordinary object (no process-wide state): add() all
// algorithms before communicators use it; find() is then safe from any thread.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "diststrat/collective.h"

namespace diststrat {

// What a custom algorithm may use: blocking point-to-point messages between
// the ranks of the communicator and the reduction kernel of the call's op.
// Every call honours the communicator's timeout (DeadlineExceededError naming
// this rank and the peer). Messages between two ranks arrive in send order;
// a recv must name the byte count of the matching send.
class PeerChannel {
 public:
  virtual ~PeerChannel() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Blocks until the peer has the bytes (or they are buffered).
  virtual void send(int peer, const void* data, size_t bytes) = 0;
  // Blocks until `bytes` bytes from `peer` are in `data`.
  virtual void recv(int peer, void* data, size_t bytes) = 0;
  // Sends to one peer while receiving from another (no deadlock in a ring).
  virtual void send_recv(int send_peer, const void* send_data, size_t send_bytes, int recv_peer,
                         void* recv_data, size_t recv_bytes) = 0;
  // dst[i] = op(dst[i], src[i]) for i < count elements of the call's dtype.
  // kMean adds; the communicator divides once the algorithm returns.
  virtual void reduce_into(void* dst, const void* src, size_t count) = 0;
};

// In-place all-reduce of `count` elements at `data` on every rank.
using CustomAllReduce =
    std::function<void(PeerChannel& channel, void* data, size_t count, DType dtype, ReduceOp op)>;

class AlgorithmRegistry {
 public:
  // Registers `fn` as `name`; InvalidArgumentError if the name is taken or empty.
  void add(const std::string& name, CustomAllReduce fn);
  // The algorithm registered as `name`, or nullptr.
  const CustomAllReduce* find(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  std::map<std::string, CustomAllReduce> algorithms_;
};

}  // namespace diststrat
