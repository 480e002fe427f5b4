// Streams are told apart by identity, never by handle value: CUDA hands a
// destroyed stream's handle to the next stream created, so anything keyed by
// the raw handle takes the new stream for the old one. The fake backend
// reuses handles the same way (FakeGpuBackend::Options::reuse_stream_handles).
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <vector>

#include "core/caching_allocator.h"
#include "fake_gpu_backend.h"

namespace ds = diststrat;
using diststrat_test::FakeGpuBackend;

namespace {

ds::DeadlineClock::time_point soon() { return ds::DeadlineClock::now() + std::chrono::seconds(5); }

}  // namespace

TEST(FakeGpuBackend, ADestroyedStreamsHandleGoesToTheNextStreamWithANewIdentity) {
  FakeGpuBackend b(1);
  void* s1 = b.create_stream(0);
  const uint64_t id1 = b.stream_id(0, s1);
  EXPECT_NE(id1, 0u);
  EXPECT_EQ(b.stream_id(0, nullptr), 0u);
  b.hold(0, s1);
  void* d = b.raw_malloc(0, 64);
  b.memset_async(0, d, 2, 64, s1);  // queued under s1 when s1 goes
  b.destroy_stream(0, s1);
  EXPECT_EQ(b.stream_id(0, s1), ds::GpuBackend::kUnknownStream);
  void* s2 = b.create_stream(0);
  ASSERT_EQ(s2, s1) << "the fake must reuse the handle, as CUDA may";
  EXPECT_NE(b.stream_id(0, s2), id1);
  EXPECT_EQ(b.stream_id(1, s2), ds::GpuBackend::kUnknownStream);  // not GPU 1's
  // s2 is not held although it has s1's handle; s1's queued work still is.
  b.memset_async(0, d, 1, 64, s2);
  b.synchronize(0, s2, soon(), "s2");
  b.release(0, s1);
  EXPECT_EQ(b.read<char>(0, d, 64)[0], 2);  // s1's write ran last
  b.destroy_stream(0, s2);
  b.raw_free(0, d);
}

// The regression: a block freed on a stream that is then destroyed (its
// work still queued) was handed at once to a new stream that got the same
// handle, as if it were the same stream; the old stream's write then landed
// in the new owner's data.
TEST(CachingAllocator, ABlockOfADestroyedStreamWaitsForItsWorkEvenWhenTheHandleIsReused) {
  for (bool freed_before_destroy : {true, false}) {
    SCOPED_TRACE(freed_before_destroy ? "freed, then its stream destroyed"
                                      : "its stream destroyed, then freed");
    auto fake = std::make_shared<FakeGpuBackend>(1);
    // A short drain deadline: a failing run must not wait 300 s at the end.
    ds::CachingAllocator a(fake, 0, 0, true, "gpu0", std::chrono::seconds(2));
    void* s1 = fake->create_stream(0);
    const size_t bytes = 4096;
    void* x = a.allocate(bytes, s1);
    fake->hold(0, s1);
    fake->memset_async(0, x, 2, bytes, s1);  // still queued when x is freed
    if (freed_before_destroy) a.deallocate(x);
    fake->destroy_stream(0, s1);
    void* s2 = fake->create_stream(0);
    ASSERT_EQ(s2, s1);
    if (!freed_before_destroy) a.deallocate(x);
    void* y = a.allocate(bytes, s2);
    fake->memset_async(0, y, 1, bytes, s2);
    // Not a wait for s2: with the block's mark on the default stream (its
    // stream was gone when it was freed) s2's work rightly waits for s1's.
    fake->run_ready();
    fake->release(0, s1);
    const std::vector<char> got = fake->read<char>(0, y, bytes);
    EXPECT_EQ(got[0], 1) << "the destroyed stream's queued write landed in the block the new "
                            "stream (same handle) was given";
    EXPECT_EQ(got[bytes - 1], 1);
    a.deallocate(y);
    fake->synchronize_device(0, soon(), "end");
    fake->destroy_stream(0, s2);
  }
}

// The same stream (same identity) still reuses its own block at once, and
// a block freed on a live stream stays that stream's.
TEST(CachingAllocator, TheSameLiveStreamStillReusesItsBlockAtOnce) {
  auto fake = std::make_shared<FakeGpuBackend>(1);
  ds::CachingAllocator a(fake, 0, 0, true, "gpu0");
  void* s = fake->create_stream(0);
  void* x = a.allocate(4096, s);
  fake->hold(0, s);
  fake->memset_async(0, x, 2, 4096, s);
  a.deallocate(x);
  EXPECT_EQ(a.allocate(4096, s), x);  // stream order protects the queued write
  fake->release(0, s);
  a.deallocate(x);
  fake->synchronize_device(0, soon(), "end");
  fake->destroy_stream(0, s);
}
