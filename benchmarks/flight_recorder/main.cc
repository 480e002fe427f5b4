// What the flight recorder and straggler tracking cost per collective call
// (issue 28's bar: <= 0.5 us). A communicator that does nothing
// stands for the collective, so the difference between the two loops is
// the recording alone:
//   BM_BareCall      the call through the bare communicator
//   BM_RecordedCall  the same call through RecordingCommunicator (ring
//                    entry, two clock reads, the name copied, the compute
//                    gap taken for the straggler window)
//   BM_RecorderOnly  Recorder::begin + end alone
// Run: build/benchmarks/flight_recorder_bench --benchmark_repetitions=5
#include <benchmark/benchmark.h>

#include <string>

#include "allreduce/flight_recording.h"
#include "core/flight_recorder.h"

namespace ds = diststrat;

namespace {

// Does nothing, as fast as a virtual call can.
class NullCommunicator : public ds::Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }  // straggler windows on (their exchange included)
  const ds::CommunicationOptions& options() const override { return options_; }
  void all_reduce(const void*, void*, size_t, ds::DType, ds::ReduceOp,
                  const std::string&) override {}
  void broadcast(void*, size_t, ds::DType, int, const std::string&) override {}
  void all_gather(const void*, void*, size_t, ds::DType, const std::string&) override {}
  void reduce_scatter(const void*, void*, size_t, ds::DType, ds::ReduceOp,
                      const std::string&) override {}
  void barrier(const std::string&) override {}
  void abort(const std::string&) override {}
  void reset() override {}

 private:
  ds::CommunicationOptions options_;
};

const std::string kName = "dense2/kernel +3 more";

void BM_BareCall(benchmark::State& state) {
  NullCommunicator c;
  float x = 1.f;
  ds::Communicator& comm = c;
  for (auto _ : state) {
    comm.all_reduce(&x, &x, 1, ds::DType::kFloat32, ds::ReduceOp::kSum, kName);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_BareCall);

void BM_RecordedCall(benchmark::State& state) {
  NullCommunicator c;
  ds::RecordingCommunicator recorded(c, "bench", ds::RecordingCommunicator::Options{});
  ds::Communicator& comm = recorded;
  float x = 1.f;
  for (auto _ : state) {
    comm.all_reduce(&x, &x, 1, ds::DType::kFloat32, ds::ReduceOp::kSum, kName);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_RecordedCall);

void BM_RecorderOnly(benchmark::State& state) {
  ds::flight::Recorder rec("bench", 0, 2);
  for (auto _ : state) {
    const uint64_t seq = rec.begin("all_reduce", kName, 1, "float32", "sum", -1, 4);
    rec.end(seq, ds::flight::State::kCompleted);
  }
}
BENCHMARK(BM_RecorderOnly);

}  // namespace

BENCHMARK_MAIN();
