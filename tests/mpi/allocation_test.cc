// Small collectives on shared memory allocate nothing. A 4-byte all-reduce
// there takes 0.2-0.3 us; formatting its error text in advance on every call
// (as the calls once did) made it 0.7 us, and any heap allocation on that
// path is a visible part of it. This binary replaces operator new with one
// that counts the calling thread's allocations.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "allreduce/flight_recording.h"
#include "allreduce/mpi_communicator.h"
#include "diststrat/collective.h"
#include "diststrat/process_group.h"
#include "mpi_test_util.h"

namespace {
thread_local long allocations = 0;

void* counted(std::size_t n) {
  ++allocations;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
}  // namespace

void* operator new(std::size_t n) { return counted(n); }
void* operator new[](std::size_t n) { return counted(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace ds = diststrat;

namespace {

// Six small calls (all_reduce of 1 and 1024 floats with a long name and of
// one unnamed, broadcast, all_gather, barrier) once to set up, then `rounds`
// more; returns the heap allocations of those.
long allocations_in_rounds(ds::Communicator& comm, int rounds) {
  const int n = comm.size();
  const std::string name = "a/tensor/name/longer/than/the/record/keeps/of/it/in/its/slot";
  std::vector<float> in(1024, 1.f), out(1024), gathered(1024 * n);
  auto calls = [&] {
    for (size_t count : {size_t{1}, size_t{1024}}) {
      comm.all_reduce(in.data(), out.data(), count, ds::DType::kFloat32, ds::ReduceOp::kSum, name);
      EXPECT_EQ(out[0], static_cast<float>(n));
    }
    comm.all_reduce(in.data(), out.data(), 1, ds::DType::kFloat32, ds::ReduceOp::kSum, "");
    comm.broadcast(out.data(), 4, ds::DType::kFloat32, 0, name);
    comm.all_gather(in.data(), gathered.data(), 1, ds::DType::kFloat32, name);
    comm.barrier(name);
  };
  calls();  // the first calls may set things up
  const long before = allocations;
  for (int i = 0; i < rounds; ++i) calls();
  return allocations - before;
}

TEST(MpiSmallCalls, SharedMemoryCollectivesAllocateNothing) {
  if (diststrat_test::world_size() < 2) GTEST_SKIP() << "one rank: no shared-memory path";
  // Also through the flight recorder, as the strategies call them.
  for (auto [algorithm, recorded] :
       {std::pair{ds::Algorithm::kSharedMemory, false}, std::pair{ds::Algorithm::kAuto, false},
        std::pair{ds::Algorithm::kAuto, true}}) {
    SCOPED_TRACE(std::string(ds::algorithm_name(algorithm)) + (recorded ? ", recorded" : ""));
    ds::CommunicationOptions o;
    o.algorithm = algorithm;
    o.timeout = std::chrono::seconds(60);
    auto comm = ds::make_mpi_communicator(MPI_COMM_WORLD, o);
    // (Straggler detection off: its exchange, once per window of calls,
    // allocates.)
    if (recorded) comm = ds::wrap_recorded(std::move(comm), "small calls", {false, true});
    EXPECT_EQ(allocations_in_rounds(*comm, 10), 0) << "heap allocations in 10 rounds";
  }
}

// The same through ProcessGroup (which wrote "all_reduce 'name'" for every
// call, for the message of a call from a second thread). Its straggler
// detection exchanges (and allocates) every 50 calls: 1 + 7 rounds of six
// stay within the first window.
TEST(MpiSmallCalls, ProcessGroupCallsAllocateNothing) {
  if (diststrat_test::world_size() < 2) GTEST_SKIP() << "one rank: no shared-memory path";
  ds::ProcessGroupOptions o;
  o.communication.timeout = std::chrono::seconds(60);
  ds::ProcessGroup pg(o);
  EXPECT_EQ(allocations_in_rounds(pg, 7), 0) << "heap allocations in 7 rounds";
}

}  // namespace
