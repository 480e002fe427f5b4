// Shared pieces of the in-process fault cells (fault_test.cc,
// ps_checkpoint_fault_test.cc).
#pragma once

#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "allreduce/transport.h"
#include "diststrat/error.h"
#include "diststrat/fault.h"
#include "diststrat/strategy.h"
#include "diststrat/parameter_server.h"
#include "parameter_server/strategy_impl.h"

namespace diststrat {
namespace testing {

// Keeps `object` alive for good: a stalled thread goes on using it after the
// test ends. Reachable from a never-destroyed list (a static vector's
// destructor would run before LeakSanitizer's exit check and make these look
// leaked).
template <typename T>
void keep_for_stuck_thread(T* object) {
  static std::mutex mu;
  static auto* kept = new std::vector<const void*>;
  std::lock_guard<std::mutex> lock(mu);
  kept->push_back(object);
}

// Arms `kind` for replica `rank` at the strategy's next run() (saving a
// checkpoint runs steps too, so the step is taken now); returns that step.
inline int64_t arm_fault_at_next_run(Strategy& s, FaultKind kind, int rank) {
  FaultInjection f;
  f.kind = kind;
  f.rank = rank;
  f.step = s.steps_run();
  s.set_fault_injection(f);
  return f.step;
}

template <typename Result>
struct PsJobOutcome {
  std::vector<Result> workers;  // worker 1's stays default when it stalled
  std::string ps_error;         // what the PS's join() threw, if anything
  double seconds = 0;           // until the PS's join() returned
};

// A parameter-server job in one process: workers 0 and 1 on threads and the
// PS at rank 2, over one InProcessTransportGroup; `work(strategy, w)` is each
// worker's life. Worker 0 and the PS are joined; worker 1 is joined too,
// unless `worker1_stalls`: then it is detached and the group (which it goes
// on using) is kept for good.
template <typename Result>
PsJobOutcome<Result> run_ps_job(const ParameterServerOptions& o, bool worker1_stalls,
                                const std::function<Result(ParameterServerStrategy&, int)>& work) {
  PsJobOutcome<Result> out;
  out.workers.resize(2);
  auto* group = new InProcessTransportGroup(3);
  auto ps = ps::make_strategy(group->at(2), o);
  std::vector<std::thread> threads;
  const auto t0 = std::chrono::steady_clock::now();
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      // A stalled worker never returns; its strategy stays alive with it.
      auto* s = ps::make_strategy(group->at(w), o).release();
      Result r = work(*s, w);
      delete s;  // tells the PS this worker is done
      out.workers[w] = std::move(r);
    });
  }
  threads[0].join();
  try {
    ps->join();
  } catch (const Error& e) {
    out.ps_error = e.message();
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (worker1_stalls) {
    threads[1].detach();  // stuck for good
  } else {
    threads[1].join();
  }
  ps.reset();
  if (worker1_stalls) {
    keep_for_stuck_thread(group);
  } else {
    delete group;
  }
  return out;
}

}  // namespace testing
}  // namespace diststrat
