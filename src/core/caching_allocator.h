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
//
// Streams: a block belongs to the stream it was allocated for. Freeing it
// records an event on that stream; the same stream may reuse the block at
// once (stream order protects the work still queued on it), another stream
// only once that event has completed. So no stream can get memory that queued
// work of another stream still reads or writes, whatever the default-stream
// mode of the build. A tensor used on a stream other than its allocation
// stream must either have that use ordered before its free by the caller (the
// legacy default stream is ordered with every blocking stream) or be
// recorded with record_stream (PyTorch's Tensor.record_stream): freeing such
// a block also records an event on every stream recorded, and the block (or
// any part of it) is reusable, by its own stream too, only once all of those
// events have passed.
// "The same stream" means the same GpuBackend::stream_id, never the same
// handle value: CUDA gives a destroyed stream's handle to the next stream
// created, and that stream must not inherit the old one's blocks without
// the wait. A block whose stream is gone when it is freed is marked on the
// default stream; a handle the backend did not create never counts as the
// same stream (its blocks are reused only after their event).
//
// Chunks go back to the backend (cudaFree, which waits for the whole device
// without a deadline) only after synchronize_device returned within
// `wait_timeout`; past it the chunks stay cached (and the call that needed
// them reports DeadlineExceededError), or, in the destructor, are leaked with
// a message rather than blocking.
// Thread-safe.
#pragma once

#include <chrono>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "core/gpu_backend.h"
#include "diststrat/device_manager.h"

namespace diststrat {

class CachingAllocator {
 public:
  static constexpr size_t kAlignment = 256;      // what cudaMalloc guarantees
  static constexpr size_t kMinChunk = 2u << 20;  // growth granularity

  // `limit` 0 = none. Reserves up front when !growth (may throw).
  CachingAllocator(std::shared_ptr<GpuBackend> backend, int ordinal, size_t limit, bool growth,
                   std::string name,
                   std::chrono::milliseconds wait_timeout = std::chrono::seconds(300));
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // Null for 0 bytes; otherwise kAlignment-aligned memory of at least `bytes`
  // for work on `stream` (null: the default stream).
  void* allocate(size_t bytes, void* stream = nullptr);
  // Never throws (called from tensor deleters).
  void deallocate(void* ptr);
  // The allocated block holding `ptr` (any address inside it) is also used
  // by work enqueued on `stream`: when it is freed, an event is recorded on
  // `stream` too, and the block is not handed out again (to any stream)
  // before that event has passed. A no-op for the block's own stream, a
  // stream already recorded, and a null `ptr`; InvalidArgumentError for a
  // pointer this allocator did not hand out. Thread-safe; only enqueues
  // (at the free).
  void record_stream(const void* ptr, void* stream);
  // Returns wholly free chunks to the backend (growth mode only), after the
  // device drained; DeadlineExceededError past wait_timeout.
  void empty_cache();
  MemoryStats stats() const;
  int ordinal() const { return ordinal_; }

 private:
  struct Block {
    size_t size = 0;
    bool free = true;
    char* chunk = nullptr;   // base of the chunk the block belongs to
    void* stream = nullptr;  // the stream it was allocated for
    void* event = nullptr;   // recorded on `stream` when freed; null once known complete
    uint64_t stream_id = 0;  // `stream`'s identity (GpuBackend::stream_id) at allocation
    // While allocated: the other streams record_stream named (stream,
    // identity). Once freed: an event recorded on each of them, all of
    // which must pass before any stream, its own included, reuses it.
    std::vector<std::pair<void*, uint64_t>> used_on;
    std::vector<void*> cross_events;
  };
  bool add_chunk_locked(size_t bytes);
  void* take_locked(size_t bytes, void* stream, uint64_t stream_id);
  void* grow_locked(size_t bytes, void* stream, uint64_t stream_id);
  // Whether another stream may use free block `b` now (its event completed).
  bool ready_locked(Block& b);
  // Whether the events of the other streams that used free block `b` have
  // all passed (releasing them); true when there are none.
  bool cross_ready_locked(Block& b);
  void release_event_locked(Block& b);
  // Detaches wholly free chunks, drops the lock while the device drains and
  // the chunks are freed, and retakes it. Returns the bytes released.
  size_t release_free_chunks(std::unique_lock<std::mutex>& lock);

  std::shared_ptr<GpuBackend> backend_;  // outlives every block (tensors may outlive the manager)
  int ordinal_;
  size_t limit_;
  bool growth_;
  std::string name_;
  std::chrono::milliseconds wait_timeout_;
  mutable std::mutex mu_;
  std::map<char*, Block> blocks_;            // by address
  std::set<std::pair<size_t, char*>> free_;  // free blocks by (size, address)
  std::map<char*, size_t> chunks_;           // base -> size
  std::vector<void*> idle_events_;           // for reuse
  MemoryStats stats_;
};

}  // namespace diststrat
