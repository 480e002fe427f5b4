// FNV-1a, 64 bit: a hash that is identical in every process and build
// (std::hash need not be), for the call signatures that ranks compare.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace diststrat {

class Fnv1a {
 public:
  void bytes(const void* p, size_t n) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h_ = (h_ ^ c[i]) * 1099511628211ull;
  }
  template <typename T>
  void value(T v) {
    bytes(&v, sizeof v);
  }
  // Length-prefixed, so that ("ab", "c") and ("a", "bc") differ.
  void text(const std::string& s) {
    value<uint64_t>(s.size());
    bytes(s.data(), s.size());
  }
  uint64_t get() const { return h_; }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

inline uint64_t fnv1a(const std::string& s) {
  Fnv1a h;
  h.bytes(s.data(), s.size());
  return h.get();
}

}  // namespace diststrat
