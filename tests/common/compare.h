// Comparisons the tests share: a message that mentions a part, two tensors
// equal byte for byte.
#pragma once

#include <cstring>
#include <string>

#include "diststrat/tensor.h"

namespace diststrat_test {

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Same dtype, same shape and the same bytes.
inline bool same_bytes(const diststrat::Tensor& a, const diststrat::Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         (a.nbytes() == 0 || std::memcmp(a.data(), b.data(), a.nbytes()) == 0);
}

}  // namespace diststrat_test
