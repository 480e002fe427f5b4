// Where the ranks of one group publish and find each other's connection
// addresses, one key per rank ("<group>/<transport>/<rank>"): the set-up
// step shared by the transports that connect their own mesh (the TCP
// transport, tcp_transport.h; Gloo's, gloo_transport.h). Implemented over
// the chief's TCP store (runtime/tcp_store.h), the elastic membership store
// (multiworker/elastic.cc), and in memory for threads of one process (below).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "allreduce/transport.h"

namespace diststrat {

class AddressExchange {
 public:
  virtual ~AddressExchange() = default;
  // Makes `value` the value of `key`, visible to every rank of the group.
  virtual void publish(const std::string& key, const std::string& value,
                       Clock::time_point deadline) = 0;
  // Blocks until `key` is published or `deadline`: DeadlineExceededError
  // naming the key. A key already published is returned even when the
  // deadline has passed (set-up asks again for every key it lacks, to name
  // them all).
  virtual std::string wait_for(const std::string& key, Clock::time_point deadline) = 0;
};

// Keys and values in memory, for transports on threads of one process
// (tests). Thread-safe. Publishing a key again with another value is an
// InvalidArgumentError (two ranks claiming one rank number).
std::shared_ptr<AddressExchange> make_in_memory_address_exchange();

// One rank's part of the exchange: publishes `value` under "<prefix><rank>",
// then reads every other rank's value. Returns them by rank (this rank's
// entry is `value`); a rank that had not published by `deadline` has none
// and is listed in `missing` (the caller checks what it can about them,
// then calls throw_if_unpublished). Any other failure of the exchange is
// rethrown with its code, prefixed with `who` and the key.
std::vector<std::optional<std::string>> exchange_addresses(AddressExchange& exchange,
                                                           const std::string& prefix, int rank,
                                                           int size, const std::string& value,
                                                           Clock::time_point deadline,
                                                           const std::string& who,
                                                           std::vector<int>* missing);

// DeadlineExceededError "<who>: ranks 1 and 3 never published their
// addresses (keys '<prefix><rank>') before the deadline" unless `missing`
// is empty.
void throw_if_unpublished(const std::vector<int>& missing, const std::string& prefix,
                          const std::string& who);

}  // namespace diststrat
