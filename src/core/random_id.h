// A 64-bit id that differs between processes and between starts of one
// process (never 0): randomness for two starts at once, and the clock in
// case the random device is a fixed generator. For incarnations, save ids
// and claim tokens; not for secrets.
#pragma once

#include <chrono>
#include <cstdint>
#include <random>

namespace diststrat {

inline uint64_t random_id() {
  std::random_device rd;
  const uint64_t t =
      static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  const uint64_t id = ((static_cast<uint64_t>(rd()) << 32) ^ rd()) ^ (t * 0x9e3779b97f4a7c15ULL);
  return id == 0 ? 1 : id;
}

}  // namespace diststrat
