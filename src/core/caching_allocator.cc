#include "core/caching_allocator.h"

#include <iterator>

#include "diststrat/error.h"

namespace diststrat {

namespace {
size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
}  // namespace

CachingAllocator::CachingAllocator(std::shared_ptr<GpuBackend> backend, int ordinal, size_t limit, bool growth,
                                   std::string name)
    : backend_(std::move(backend)), ordinal_(ordinal), limit_(limit), growth_(growth), name_(std::move(name)) {
  stats_.limit_bytes = limit_;
  if (!growth_) {
    size_t bytes = limit_;
    if (bytes == 0) bytes = backend_->info(ordinal_).free_bytes / 10 * 9;
    bytes = bytes / kMinChunk * kMinChunk;
    DISTSTRAT_CHECK(bytes > 0, kResourceExhausted, name_, ": nothing to reserve up front (limit ",
                    limit_, " bytes)");
    std::lock_guard<std::mutex> lock(mu_);
    DISTSTRAT_CHECK(add_chunk_locked(bytes), kResourceExhausted, name_, ": reserving ", bytes,
                    " bytes up front (memory growth off) failed: the device is out of memory");
    if (limit_ == 0) stats_.limit_bytes = bytes;
  }
}

CachingAllocator::~CachingAllocator() {
  for (const auto& [base, size] : chunks_) backend_->raw_free(ordinal_, base);
}

bool CachingAllocator::add_chunk_locked(size_t bytes) {
  char* base = static_cast<char*>(backend_->raw_malloc(ordinal_, bytes));
  if (!base) return false;
  ++stats_.num_backend_allocs;
  chunks_[base] = bytes;
  blocks_[base] = Block{bytes, true, base};
  free_.insert({bytes, base});
  stats_.reserved_bytes += bytes;
  return true;
}

// Best fit: the smallest free block that holds `bytes`; the rest is split off.
void* CachingAllocator::take_locked(size_t bytes) {
  auto it = free_.lower_bound({bytes, nullptr});
  if (it == free_.end()) return nullptr;
  char* p = it->second;
  free_.erase(it);
  Block& b = blocks_[p];
  if (b.size - bytes >= kAlignment) {
    char* rest = p + bytes;
    blocks_[rest] = Block{b.size - bytes, true, b.chunk};
    free_.insert({b.size - bytes, rest});
    b.size = bytes;
  }
  b.free = false;
  stats_.in_use_bytes += b.size;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  ++stats_.num_allocs;
  return p;
}

void* CachingAllocator::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t need = round_up(bytes, kAlignment);
  std::lock_guard<std::mutex> lock(mu_);
  if (void* p = take_locked(need)) return p;
  if (growth_) {
    // A new chunk: at least kMinChunk, within the limit.
    size_t chunk = round_up(need, kMinChunk);
    if (limit_ && stats_.reserved_bytes + chunk > limit_) {
      if (stats_.reserved_bytes + need <= limit_) chunk = limit_ - stats_.reserved_bytes;
      else if (release_free_chunks_locked() && stats_.reserved_bytes + need <= limit_) {
        chunk = std::min(round_up(need, kMinChunk), limit_ - stats_.reserved_bytes);
      } else {
        chunk = 0;
      }
    }
    if (chunk && (add_chunk_locked(chunk) ||
                  (release_free_chunks_locked() && add_chunk_locked(chunk)))) {
      if (void* p = take_locked(need)) return p;
    }
  }
  size_t cached = 0;
  for (const auto& f : free_) cached += f.first;
  throw ResourceExhaustedError(detail::str_cat(
      name_, ": out of memory allocating ", bytes, " bytes (limit ",
      limit_ ? std::to_string(limit_) + " bytes" : std::string("none"), ", in use ",
      stats_.in_use_bytes, ", cached free ", cached, " in pieces, reserved ",
      stats_.reserved_bytes, ", growth ", growth_ ? "on" : "off", ")"));
}

void CachingAllocator::deallocate(void* ptr) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.find(static_cast<char*>(ptr));
  DISTSTRAT_CHECK(it != blocks_.end() && !it->second.free, kInternal, name_,
                  ": deallocate of a pointer this allocator does not hold");
  it->second.free = true;
  stats_.in_use_bytes -= it->second.size;
  // Merge with the next block, then with the previous one, inside one chunk.
  auto next = std::next(it);
  if (next != blocks_.end() && next->second.free && next->second.chunk == it->second.chunk &&
      it->first + it->second.size == next->first) {
    free_.erase({next->second.size, next->first});
    it->second.size += next->second.size;
    blocks_.erase(next);
  }
  if (it != blocks_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.free && prev->second.chunk == it->second.chunk &&
        prev->first + prev->second.size == it->first) {
      free_.erase({prev->second.size, prev->first});
      prev->second.size += it->second.size;
      blocks_.erase(it);
      it = prev;
    }
  }
  free_.insert({it->second.size, it->first});
}

size_t CachingAllocator::release_free_chunks_locked() {
  if (!growth_) return 0;
  size_t released = 0;
  for (auto c = chunks_.begin(); c != chunks_.end();) {
    auto b = blocks_.find(c->first);
    if (b != blocks_.end() && b->second.free && b->second.size == c->second) {
      free_.erase({b->second.size, b->first});
      blocks_.erase(b);
      backend_->raw_free(ordinal_, c->first);
      stats_.reserved_bytes -= c->second;
      released += c->second;
      c = chunks_.erase(c);
    } else {
      ++c;
    }
  }
  return released;
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  release_free_chunks_locked();
}

MemoryStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace diststrat
