// The reduction kernels' helpers that the collectives tests do not reach at
// every alignment: copy_streaming (streaming stores for large outputs).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "allreduce/reduce_kernels.h"

namespace ds = diststrat;

TEST(ReduceKernels, CopyStreamingCopiesAnySizeAtAnyAlignment) {
  std::vector<unsigned char> src(4096 + 128), dst(4096 + 128);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 7 + 3);
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{31}, size_t{63}, size_t{64}, size_t{65}, size_t{127},
                       size_t{200}, size_t{4096}}) {
    for (size_t dst_off : {size_t{0}, size_t{1}, size_t{4}, size_t{63}}) {
      for (size_t src_off : {size_t{0}, size_t{3}, size_t{32}}) {
        std::fill(dst.begin(), dst.end(), 0xEE);
        ds::kernels::copy_streaming(dst.data() + dst_off, src.data() + src_off, bytes);
        ASSERT_EQ(std::memcmp(dst.data() + dst_off, src.data() + src_off, bytes), 0)
            << bytes << " bytes, dst+" << dst_off << ", src+" << src_off;
        // Nothing around the destination is touched.
        for (size_t i = 0; i < dst_off; ++i) ASSERT_EQ(dst[i], 0xEE) << "before, " << i;
        for (size_t i = dst_off + bytes; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xEE) << "after, " << i;
      }
    }
  }
}
