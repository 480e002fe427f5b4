// Test helper: run the same code under each strategy (multi-worker as
// threads over an InProcessGroup, the parameter server as one worker and
// one PS over the in-process transport).
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "allreduce/transport.h"
#include "diststrat/diststrat.h"
#include "diststrat/multi_worker_mirrored.h"
#include "harness.h"
#include "parameter_server/strategy_impl.h"
#include "training_util.h"

namespace diststrat {
namespace testing {

// kind: "mirrored", "central_storage", "multi_worker", "parameter_server";
// workers (multi_worker only) and replicas per worker.
struct StrategyConfig {
  std::string kind;
  int workers = 1;
  int replicas = 1;
  std::string label() const {
    return kind + " " + std::to_string(workers) + "x" + std::to_string(replicas);
  }
};

// Runs fn(strategy, worker) once per worker of `c` (threads for multi_worker).
inline void with_strategy(const StrategyConfig& c, const std::function<void(Strategy&, int)>& fn) {
  CommunicationOptions co;
  co.timeout = std::chrono::seconds(30);
  if (c.kind == "mirrored") {
    MirroredStrategy s(cpu_devices(c.replicas));
    fn(s, 0);
  } else if (c.kind == "central_storage") {
    CentralStorageStrategy s(cpu_devices(c.replicas));
    fn(s, 0);
  } else if (c.kind == "parameter_server") {
    ParameterServerOptions o;
    o.num_ps = 1;
    o.devices = cpu_devices(c.replicas);
    o.communication = co;
    InProcessTransportGroup group(2);  // worker 0, PS rank 1
    auto ps = ps::make_strategy(group.at(1), o);
    {
      auto worker = ps::make_strategy(group.at(0), o);
      fn(*worker, 0);
    }
    ps->join();
  } else {
    InProcessGroup group(c.workers, co);
    run_ranks(group, [&](Communicator& comm) {
      MultiWorkerOptions o;
      o.devices = cpu_devices(c.replicas);
      o.communication = co;
      o.communicator = &comm;
      MultiWorkerMirroredStrategy s(o);
      fn(s, comm.rank());
    });
  }
}

}  // namespace testing
}  // namespace diststrat
