#include "core/caching_allocator.h"

#include <cstdio>
#include <iterator>

#include "diststrat/error.h"

namespace diststrat {

namespace {
size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
// Whether two uses are on one stream, so stream order alone protects the
// second: the same identity, and one the backend knows.
bool same_stream(uint64_t a, uint64_t b) { return a == b && a != GpuBackend::kUnknownStream; }
}  // namespace

CachingAllocator::CachingAllocator(std::shared_ptr<GpuBackend> backend, int ordinal, size_t limit,
                                   bool growth, std::string name,
                                   std::chrono::milliseconds wait_timeout)
    : backend_(std::move(backend)),
      ordinal_(ordinal),
      limit_(limit),
      growth_(growth),
      name_(std::move(name)),
      wait_timeout_(wait_timeout) {
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
  std::vector<void*> events = idle_events_;
  for (auto& [p, b] : blocks_) {
    if (b.event) events.push_back(b.event);
    events.insert(events.end(), b.cross_events.begin(), b.cross_events.end());
  }
  try {
    if (!chunks_.empty()) {
      backend_->synchronize_device(ordinal_, DeadlineClock::now() + wait_timeout_,
                                   name_ + ": draining the device before freeing its memory");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "diststrat: %s; leaking %zu bytes of device memory rather than block\n",
                 e.what(), stats_.reserved_bytes);
    return;
  }
  for (void* e : events) backend_->destroy_event(ordinal_, e);
  for (const auto& [base, size] : chunks_) backend_->raw_free(ordinal_, base);
}

bool CachingAllocator::add_chunk_locked(size_t bytes) {
  char* base = static_cast<char*>(backend_->raw_malloc(ordinal_, bytes));
  if (!base) return false;
  ++stats_.num_backend_allocs;
  chunks_[base] = bytes;
  blocks_[base] = Block{bytes, true, base, nullptr, nullptr, 0, {}, {}};
  free_.insert({bytes, base});
  stats_.reserved_bytes += bytes;
  return true;
}

void CachingAllocator::release_event_locked(Block& b) {
  if (b.event) idle_events_.push_back(b.event);
  b.event = nullptr;
}

bool CachingAllocator::ready_locked(Block& b) {
  if (!b.event) return true;
  if (!backend_->event_done(ordinal_, b.event)) return false;
  release_event_locked(b);
  return true;
}

bool CachingAllocator::cross_ready_locked(Block& b) {
  while (!b.cross_events.empty()) {
    if (!backend_->event_done(ordinal_, b.cross_events.back())) return false;
    idle_events_.push_back(b.cross_events.back());
    b.cross_events.pop_back();
  }
  return true;
}

// Best fit: the smallest free block that holds `bytes` and that `stream` may
// use now (every other stream that used it is past it; its own stream, or
// its event passed); the rest is split off and keeps the block's stream and
// event.
void* CachingAllocator::take_locked(size_t bytes, void* stream, uint64_t stream_id) {
  for (auto it = free_.lower_bound({bytes, nullptr}); it != free_.end(); ++it) {
    char* p = it->second;
    Block& b = blocks_[p];
    if (!cross_ready_locked(b)) continue;
    if (!same_stream(b.stream_id, stream_id) && !ready_locked(b)) continue;
    free_.erase(it);
    if (b.size - bytes >= kAlignment) {
      char* rest = p + bytes;
      blocks_[rest] = Block{b.size - bytes, true, b.chunk, b.stream, b.event, b.stream_id, {}, {}};
      free_.insert({b.size - bytes, rest});
      b.size = bytes;
      b.event = nullptr;  // moved to the rest; this block is used in `stream` order
    } else {
      release_event_locked(b);
    }
    b.free = false;
    b.stream = stream;
    b.stream_id = stream_id;
    stats_.in_use_bytes += b.size;
    stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
    ++stats_.num_allocs;
    return p;
  }
  return nullptr;
}

// A new chunk: at least kMinChunk, within the limit.
void* CachingAllocator::grow_locked(size_t bytes, void* stream, uint64_t stream_id) {
  size_t chunk = round_up(bytes, kMinChunk);
  if (limit_) {
    if (stats_.reserved_bytes + bytes > limit_) return nullptr;
    chunk = std::min(chunk, limit_ - stats_.reserved_bytes);
  }
  if (!add_chunk_locked(chunk)) return nullptr;
  return take_locked(bytes, stream, stream_id);
}

void* CachingAllocator::allocate(size_t bytes, void* stream) {
  if (bytes == 0) return nullptr;
  const size_t need = round_up(bytes, kAlignment);
  const uint64_t id = backend_->stream_id(ordinal_, stream);
  std::unique_lock<std::mutex> lock(mu_);
  if (void* p = take_locked(need, stream, id)) return p;
  if (growth_) {
    if (void* p = grow_locked(need, stream, id)) return p;
    if (release_free_chunks(lock) > 0) {
      if (void* p = take_locked(need, stream, id)) return p;
      if (void* p = grow_locked(need, stream, id)) return p;
    }
  }
  size_t cached = 0;
  for (const auto& f : free_) cached += f.first;
  throw ResourceExhaustedError(
      detail::str_cat(name_, ": out of memory allocating ", bytes, " bytes (limit ",
                      limit_ ? std::to_string(limit_) + " bytes" : std::string("none"), ", in use ",
                      stats_.in_use_bytes, ", cached free ", cached, " in pieces, reserved ",
                      stats_.reserved_bytes, ", growth ", growth_ ? "on" : "off", ")"));
}

void CachingAllocator::record_stream(const void* ptr, void* stream) {
  if (!ptr) return;
  const uint64_t id = backend_->stream_id(ordinal_, stream);
  std::lock_guard<std::mutex> lock(mu_);
  const char* p = static_cast<const char*>(ptr);
  auto it = blocks_.upper_bound(const_cast<char*>(p));
  DISTSTRAT_CHECK(it != blocks_.begin(), kInvalidArgument, name_,
                  ": record_stream of a pointer this allocator does not hold");
  --it;
  Block& b = it->second;
  DISTSTRAT_CHECK(!b.free && p < it->first + b.size, kInvalidArgument, name_,
                  ": record_stream of a pointer this allocator does not hold");
  if (same_stream(b.stream_id, id)) return;
  for (const auto& [s, sid] : b.used_on) {
    if (s == stream && sid == id) return;
  }
  b.used_on.emplace_back(stream, id);
}

void CachingAllocator::deallocate(void* ptr) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.find(static_cast<char*>(ptr));
  if (it == blocks_.end() || it->second.free) {
    std::fprintf(stderr, "diststrat: %s: deallocate of a pointer this allocator does not hold\n",
                 name_.c_str());
    return;
  }
  Block& b = it->second;
  b.free = true;
  stats_.in_use_bytes -= b.size;
  // A tensor may outlive its stream (a replica's result kept after the
  // strategy): the default stream, which is ordered with every blocking
  // stream, then marks the point after the work the stream queued. "Gone"
  // by identity: the handle may name a newer stream by now, whose order
  // says nothing about the old one's work. (stream_id never throws.)
  if (b.stream && (b.stream_id == GpuBackend::kUnknownStream ||
                   backend_->stream_id(ordinal_, b.stream) != b.stream_id)) {
    b.stream = nullptr;
    b.stream_id = 0;
  }
  // The mark after the work queued on the block's stream so far, and one on
  // every other stream record_stream named (a gone one: the default stream,
  // as above).
  std::vector<std::pair<void*, uint64_t>> used_on;
  used_on.swap(b.used_on);
  auto mark = [&](void* stream) {
    void* ev = nullptr;
    if (!idle_events_.empty()) {
      ev = idle_events_.back();
      idle_events_.pop_back();
    } else {
      ev = backend_->create_event(ordinal_);
    }
    try {
      backend_->record_event(ordinal_, ev, stream);
    } catch (...) {
      idle_events_.push_back(ev);
      throw;
    }
    return ev;
  };
  try {
    b.event = mark(b.stream);
    for (const auto& [s, sid] : used_on) {
      const bool gone =
          sid == GpuBackend::kUnknownStream || backend_->stream_id(ordinal_, s) != sid;
      b.cross_events.push_back(mark(gone ? nullptr : s));
    }
  } catch (const std::exception& e) {
    // Nothing marks the block's queued work: keep it out of circulation.
    std::fprintf(stderr, "diststrat: %s: %s; the freed block is not reused\n", name_.c_str(),
                 e.what());
    release_event_locked(b);
    for (void* ev : b.cross_events) idle_events_.push_back(ev);
    b.cross_events.clear();
    return;
  }
  // A block other streams may still use is not merged now (that would keep
  // its neighbours from every stream until they are past it); a neighbour
  // freed later merges with it once they are.
  if (!b.cross_events.empty()) {
    free_.insert({b.size, it->first});
    return;
  }
  // Merge with free neighbours of the same chunk that the same stream may use:
  // same stream (the new event covers the neighbour's older one) or a
  // neighbour whose event has completed.
  auto mergeable = [&](Block& n) {
    if (!n.free || n.chunk != b.chunk) return false;
    try {
      if (!cross_ready_locked(n)) return false;  // other streams may still use it
    } catch (const std::exception&) {
      return false;
    }
    if (same_stream(n.stream_id, b.stream_id)) {
      release_event_locked(n);
      return true;
    }
    try {
      return ready_locked(n);
    } catch (const std::exception&) {
      return false;  // deallocate never throws: leave the neighbour as it is
    }
  };
  auto next = std::next(it);
  if (next != blocks_.end() && it->first + b.size == next->first && mergeable(next->second)) {
    free_.erase({next->second.size, next->first});
    b.size += next->second.size;
    blocks_.erase(next);
  }
  if (it != blocks_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second.size == it->first && mergeable(prev->second)) {
      free_.erase({prev->second.size, prev->first});
      prev->second.size += b.size;
      prev->second.stream = b.stream;
      prev->second.stream_id = b.stream_id;
      prev->second.event = b.event;
      prev->second.cross_events = std::move(b.cross_events);
      blocks_.erase(it);
      it = prev;
    }
  }
  free_.insert({it->second.size, it->first});
}

size_t CachingAllocator::release_free_chunks(std::unique_lock<std::mutex>& lock) {
  if (!growth_) return 0;
  std::vector<Block> gone;  // the chunks' single free blocks
  for (auto c = chunks_.begin(); c != chunks_.end();) {
    auto b = blocks_.find(c->first);
    if (b != blocks_.end() && b->second.free && b->second.size == c->second) {
      free_.erase({b->second.size, b->first});
      gone.push_back(b->second);
      blocks_.erase(b);
      stats_.reserved_bytes -= c->second;
      c = chunks_.erase(c);
    } else {
      ++c;
    }
  }
  if (gone.empty()) return 0;
  lock.unlock();
  std::exception_ptr failed;
  try {
    backend_->synchronize_device(ordinal_, DeadlineClock::now() + wait_timeout_,
                                 name_ + ": draining the device before returning cached memory");
  } catch (...) {
    failed = std::current_exception();
  }
  size_t released = 0;
  if (!failed) {
    for (const Block& b : gone) {
      if (b.event) backend_->destroy_event(ordinal_, b.event);
      for (void* e : b.cross_events) backend_->destroy_event(ordinal_, e);
      backend_->raw_free(ordinal_, b.chunk);
      released += b.size;
    }
  }
  lock.lock();
  if (failed) {
    // The device did not drain: keep the chunks, each with its event.
    for (const Block& b : gone) {
      chunks_[b.chunk] = b.size;
      blocks_[b.chunk] = b;
      free_.insert({b.size, b.chunk});
      stats_.reserved_bytes += b.size;
    }
    std::rethrow_exception(failed);
  }
  return released;
}

void CachingAllocator::empty_cache() {
  std::unique_lock<std::mutex> lock(mu_);
  release_free_chunks(lock);
}

MemoryStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace diststrat
