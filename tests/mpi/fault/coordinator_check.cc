// A ClusterCoordinator job for the fault cells (coordinator_cell.sh):
//
//   diststrat_coordinator_check [--functions N] [--sleep-ms S]
//       [--function-timeout-ms F] [--timeout-ms T] [--pid-dir DIR] [--expect-late 1]
//       [--survive 1]
//
// Under `mpirun -np 4` (or TF_CONFIG with 3 workers and 1 PS): worker 0 is
// the coordinator, workers 1 and 2 serve, the last rank is the PS. The
// coordinator schedules N functions "step" (argument i): each pushes a
// gradient of ones to a variable, sleeps S ms and returns 2 i. Each process
// writes DIR/<task>.pid (worker1.pid, ...) so that the cell can stop or kill
// one. The coordinator checks that every RemoteValue holds 2 i, fetched
// once each, that the stats account for every function exactly once
// (results_delivered == N), and, with --expect-late, waits for a refused
// late result; it prints
//   final: functions=N delivered=D reruns=R late_refused=L attempts=A pushes=P OK
// and exits 0, or prints FAILED and exits 1. F is the function timeout, T
// every other deadline (and the PS's worker_timeout). --survive 1 sets
// ParameterServerOptions::survive_worker_loss (a TF_CONFIG job whose worker
// is killed): the PS's join then reports the lost worker, which it prints
// ("ps0: OK, lost: ...") before it exits 0.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <thread>

#include "diststrat/diststrat.h"

namespace ds = diststrat;
using std::chrono::milliseconds;

namespace {

ds::Bytes int_bytes(int64_t v) {
  ds::Bytes b(sizeof v);
  std::memcpy(b.data(), &v, sizeof v);
  return b;
}

int64_t bytes_int(const ds::Bytes& b) {
  if (b.size() != sizeof(int64_t)) throw ds::InvalidArgumentError("a result of the wrong size");
  int64_t v = 0;
  std::memcpy(&v, b.data(), sizeof v);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  int functions = 40, sleep_ms = 100, function_timeout_ms = 1000, timeout_ms = 20000;
  bool expect_late = false, survive = false;
  std::string pid_dir;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--functions")
      functions = std::atoi(v.c_str());
    else if (k == "--sleep-ms")
      sleep_ms = std::atoi(v.c_str());
    else if (k == "--function-timeout-ms")
      function_timeout_ms = std::atoi(v.c_str());
    else if (k == "--timeout-ms")
      timeout_ms = std::atoi(v.c_str());
    else if (k == "--pid-dir")
      pid_dir = v;
    else if (k == "--expect-late")
      expect_late = v == "1";
    else if (k == "--survive")
      survive = v == "1";
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  std::string who = "?";
  try {
    ds::ParameterServerOptions o;
    o.num_ps = 1;
    o.communication.timeout = milliseconds(timeout_ms);
    o.worker_timeout = milliseconds(timeout_ms);
    o.survive_worker_loss = survive;
    ds::ParameterServerStrategy strategy(o);
    const ds::ClusterInfo c = strategy.cluster();
    who = strategy.is_ps() ? "ps" + std::to_string(c.task_index)
                           : "worker" + std::to_string(c.worker_index);
    if (!pid_dir.empty()) std::ofstream(pid_dir + "/" + who + ".pid") << getpid() << "\n";
    if (strategy.is_ps()) {
      try {
        strategy.join();
        std::printf("%s: OK\n", who.c_str());
      } catch (const ds::DeadlineExceededError& e) {
        if (!survive) throw;
        std::printf("%s: OK, lost: %s\n", who.c_str(), e.what());
      }
      std::fflush(stdout);
      return 0;
    }
    ds::Variable w =
        strategy.create_variable("w", ds::Shape{4}, ds::DType::kFloat32, ds::init::Zeros{});
    ds::SGD sgd(strategy, {0.01f});
    ds::FunctionRegistry fns;
    fns.register_function("step", [&](ds::ParameterServerStrategy& s, const ds::Bytes& args) {
      s.run([&](ds::ReplicaContext& ctx) {
        ds::Tensor g(ds::Shape{4}, ds::DType::kFloat32);
        ds::init::Constant{1.0}(g);
        sgd.apply_gradients(ctx, {{g, w}});
      });
      s.flush();
      std::this_thread::sleep_for(milliseconds(sleep_ms));
      return int_bytes(2 * bytes_int(args));
    });
    ds::CoordinatorOptions co;
    co.function_timeout = milliseconds(function_timeout_ms);
    co.timeout = milliseconds(timeout_ms);
    ds::ClusterCoordinator coordinator(strategy, fns, co);
    if (!coordinator.is_coordinator()) {
      coordinator.serve();
      std::printf("%s: served\n", who.c_str());
      std::fflush(stdout);
      return 0;
    }
    coordinator.declare_update_rule(sgd);
    std::vector<ds::RemoteValue> values;
    for (int i = 0; i < functions; ++i)
      values.push_back(coordinator.schedule("step", int_bytes(i)));
    std::printf("%s: scheduled %d\n", who.c_str(), functions);
    std::fflush(stdout);
    coordinator.join();
    std::set<int64_t> ids;
    std::string bad;
    for (int i = 0; i < functions; ++i) {
      const int64_t r = bytes_int(values[i].fetch());
      if (r != 2 * i) bad += " value " + std::to_string(i) + " = " + std::to_string(r);
      if (!ids.insert(values[i].id()).second)
        bad += " id " + std::to_string(values[i].id()) + " twice";
    }
    const auto until = std::chrono::steady_clock::now() + milliseconds(timeout_ms);
    while (expect_late && coordinator.stats().late_results_refused == 0 &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(milliseconds(20));
    }
    const ds::CoordinatorStats st = coordinator.stats();
    const ds::ParameterServerStats ps = strategy.stats();
    if (st.results_delivered != functions)
      bad += " delivered " + std::to_string(st.results_delivered);
    if (st.attempts != functions + st.reruns) bad += " attempts " + std::to_string(st.attempts);
    // Every accepted attempt pushed once; lost ones may have pushed too.
    if (ps.pushes_applied < functions) bad += " pushes " + std::to_string(ps.pushes_applied);
    if (expect_late && st.late_results_refused == 0) bad += " no late result was refused";
    std::printf(
        "final: functions=%d delivered=%lld reruns=%lld late_refused=%lld attempts=%lld "
        "pushes=%lld lost_workers=%zu %s%s\n",
        functions, static_cast<long long>(st.results_delivered), static_cast<long long>(st.reruns),
        static_cast<long long>(st.late_results_refused), static_cast<long long>(st.attempts),
        static_cast<long long>(ps.pushes_applied), st.lost_workers.size(),
        bad.empty() ? "OK" : "FAILED:", bad.c_str());
    std::fflush(stdout);
    return bad.empty() ? 0 : 1;
  } catch (const std::exception& e) {
    std::printf("%s: FAILED: %s\n", who.c_str(), e.what());
    std::fflush(stdout);
    return 1;
  }
}
