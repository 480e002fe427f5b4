// The device collectives' dtype x ReduceOp sweep on the fake backend: the
// decisions the NCCL and shared-device paths share (device_reduce.h: which
// op NCCL runs, integer kMean as a sum and the library's division, refusals
// of values outside the enums) against exact results computed on the host
// (tests/common/reduce_sweep.h). The same sweep on a real GPU is
// AllDtypes/GpuCollectiveSweep.* in tests/gpu/gpu_test.cc.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "../common/reduce_sweep.h"
#include "fake_gpu_backend.h"
#include "gpu/device_reduce.h"

namespace ds = diststrat;
using diststrat_test::FakeGpuBackend;

using namespace diststrat_test::reduce_sweep;  // NOLINT: the sweep's helpers

TEST(DeviceReducePlan, IntegerMeanOnNcclIsASumAndADivisionEverythingElseIsNative) {
  for (ds::DType d : kDtypes) {
    for (ds::ReduceOp op : kOps) {
      const ds::gpu::DeviceReducePlan p = ds::gpu::plan_nccl_reduce(d, op, "t");
      const bool int_mean = op == ds::ReduceOp::kMean && !ds::dtype_is_floating(d);
      EXPECT_EQ(p.divide_after, int_mean) << ds::dtype_name(d) << " " << ds::reduce_op_name(op);
      EXPECT_EQ(p.collective_op, int_mean ? ds::ReduceOp::kSum : op)
          << ds::dtype_name(d) << " " << ds::reduce_op_name(op);
    }
  }
  EXPECT_THROW(ds::gpu::plan_nccl_reduce(ds::DType::kInt32, static_cast<ds::ReduceOp>(5), "t"),
               ds::InvalidArgumentError);
  EXPECT_THROW(ds::gpu::plan_nccl_reduce(static_cast<ds::DType>(6), ds::ReduceOp::kSum, "t"),
               ds::InvalidArgumentError);
}

// Two fake GPUs under the NCCL path: 2 ranks, so kMean divides (and int32 /
// int64 truncate) and kSum / kProduct wrap.
TEST(DeviceCollectivesOnFakeGpus, NcclPathEveryDtypeAndReduceOpIsExact) {
  FakeGpuBackend b(2);
  std::vector<void*> streams{b.create_stream(0), b.create_stream(1)};
  ds::CommunicationOptions co;
  co.timeout = std::chrono::seconds(30);
  auto comms = b.nccl_local_group({0, 1}, streams, co);
  for (const std::string& e : sweep(b, comms, {0, 1}, streams, kDtypes)) ADD_FAILURE() << e;
  expect_refusals(b, comms, 0);
  comms.clear();
  for (int o = 0; o < 2; ++o) b.destroy_stream(o, streams[static_cast<size_t>(o)]);
}

// Three logical GPUs of one fake GPU under the shared-device path.
TEST(DeviceCollectivesOnFakeGpus, SharedDevicePathEveryDtypeAndReduceOpIsExact) {
  FakeGpuBackend b(1);
  std::vector<void*> streams{b.create_stream(0), b.create_stream(0), b.create_stream(0)};
  ds::CommunicationOptions co;
  co.timeout = std::chrono::seconds(30);
  auto comms = b.shared_device_group({0, streams}, co);
  for (const std::string& e : sweep(b, comms, {0, 0, 0}, streams, kDtypes)) ADD_FAILURE() << e;
  expect_refusals(b, comms, 0);
  comms.clear();
  for (void* s : streams) b.destroy_stream(0, s);
}
