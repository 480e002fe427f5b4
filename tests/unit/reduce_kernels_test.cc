// The reduction kernels' helpers that the collectives tests do not reach at
// every alignment: copy_streaming (streaming stores for large outputs).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "allreduce/reduce_kernels.h"

namespace ds = diststrat;

TEST(ReduceKernels, CopyStreamingCopiesAnySizeAtAnyAlignment) {
  std::vector<unsigned char> src(4096 + 128), dst(4096 + 128);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 7 + 3);
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{31}, size_t{63}, size_t{64}, size_t{65},
                       size_t{127}, size_t{200}, size_t{4096}}) {
    for (size_t dst_off : {size_t{0}, size_t{1}, size_t{4}, size_t{63}}) {
      for (size_t src_off : {size_t{0}, size_t{3}, size_t{32}}) {
        std::fill(dst.begin(), dst.end(), 0xEE);
        ds::kernels::copy_streaming(dst.data() + dst_off, src.data() + src_off, bytes);
        ASSERT_EQ(std::memcmp(dst.data() + dst_off, src.data() + src_off, bytes), 0)
            << bytes << " bytes, dst+" << dst_off << ", src+" << src_off;
        // Nothing around the destination is touched.
        for (size_t i = 0; i < dst_off; ++i) ASSERT_EQ(dst[i], 0xEE) << "before, " << i;
        for (size_t i = dst_off + bytes; i < dst.size(); ++i)
          ASSERT_EQ(dst[i], 0xEE) << "after, " << i;
      }
    }
  }
}

// Integer sums and products wrap modulo 2^bits, like MPI's and NCCL's, and
// are defined behaviour (they were signed overflow: UBSan).
TEST(ReduceKernels, IntegerSumAndProductWrapAroundWithoutUndefinedBehaviour) {
  const int32_t a32[2] = {std::numeric_limits<int32_t>::max(), -7};
  const int32_t b32[2] = {1, std::numeric_limits<int32_t>::min()};
  const void* s32[2] = {a32, b32};
  int32_t out32[2];
  ds::kernels::reduce(out32, s32, 2, 2, ds::DType::kInt32, ds::ReduceOp::kSum, 2);
  EXPECT_EQ(out32[0], std::numeric_limits<int32_t>::min());
  EXPECT_EQ(out32[1], std::numeric_limits<int32_t>::max() - 6);
  const int64_t a64[1] = {int64_t(1) << 40};
  const int64_t b64[1] = {(int64_t(1) << 40) + 1};
  const void* s64[2] = {a64, b64};
  int64_t out64[1];
  ds::kernels::reduce(out64, s64, 2, 1, ds::DType::kInt64, ds::ReduceOp::kProduct, 2);
  const uint64_t want = (uint64_t(1) << 40) * ((uint64_t(1) << 40) + 1);
  EXPECT_EQ(static_cast<uint64_t>(out64[0]), want);
}
