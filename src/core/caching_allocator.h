// A caching allocator over a GpuBackend's raw device memory (cudaMalloc;
// never managed memory), one per logical device.
//
// Memory comes from the backend in chunks; a chunk is cut into blocks, a freed
// block is merged with its free neighbours of the same chunk and kept for
// reuse (best fit by size), so steady-state training makes no cudaMalloc
// calls. Two modes:
//  - growth: chunks are taken on demand (at least kMinChunk bytes) while the
//    reserved total stays within the limit; when the limit or the device is
//    reached, wholly free chunks are returned first and the request retried.
//  - no growth: one chunk of the limit (or, without a limit, 90% of the free
//    memory) is reserved at construction and never grows.
// A request that cannot be served throws ResourceExhaustedError naming the
// device, the request, the limit and what is in use and cached.
// Thread-safe.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "core/gpu_backend.h"
#include "diststrat/device_manager.h"

namespace diststrat {

class CachingAllocator {
 public:
  static constexpr size_t kAlignment = 256;       // what cudaMalloc guarantees
  static constexpr size_t kMinChunk = 2u << 20;   // growth granularity

  // `limit` 0 = none. Reserves up front when !growth (may throw).
  CachingAllocator(std::shared_ptr<GpuBackend> backend, int ordinal, size_t limit, bool growth, std::string name);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // Null for 0 bytes; otherwise kAlignment-aligned memory of at least `bytes`.
  void* allocate(size_t bytes);
  void deallocate(void* ptr);
  // Returns wholly free chunks to the backend (growth mode only).
  void empty_cache();
  MemoryStats stats() const;
  int ordinal() const { return ordinal_; }

 private:
  struct Block {
    size_t size = 0;
    bool free = true;
    char* chunk = nullptr;  // base of the chunk the block belongs to
  };
  bool add_chunk_locked(size_t bytes);
  void* take_locked(size_t bytes);
  size_t release_free_chunks_locked();

  std::shared_ptr<GpuBackend> backend_;  // outlives every block (tensors may outlive the manager)
  int ordinal_;
  size_t limit_;
  bool growth_;
  std::string name_;
  mutable std::mutex mu_;
  std::map<char*, Block> blocks_;              // by address
  std::set<std::pair<size_t, char*>> free_;    // free blocks by (size, address)
  std::map<char*, size_t> chunks_;             // base -> size
  MemoryStats stats_;
};

}  // namespace diststrat
