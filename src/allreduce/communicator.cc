// Communicator's default members.
#include <algorithm>
#include <cstdlib>
#include <new>

#include "diststrat/collective.h"

namespace diststrat {

std::shared_ptr<void> Communicator::allocate_buffer(size_t bytes) {
  // Ordinary host memory, 64-byte aligned (aligned_alloc wants a multiple of
  // the alignment); nothing to register.
  const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  if (!p) throw std::bad_alloc();
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

}  // namespace diststrat
