// Fuzz target: the TF_CONFIG parser (ClusterSpec::from_tf_config). Any input
// must either parse into a spec that validates, or throw a diststrat::Error;
// a crash, a sanitizer report or another exception type is a finding.
#include <cstdint>
#include <string>

#include "diststrat/cluster.h"
#include "diststrat/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string json(reinterpret_cast<const char*>(data), size);
  try {
    diststrat::ClusterSpec spec = diststrat::ClusterSpec::from_tf_config(json);
    spec.validate();  // a parsed spec must be valid by the same rules
    const int world = spec.world_size();
    if (world < 0 || spec.num_workers() > world) __builtin_trap();
    for (int r = 0; r < world; ++r) {
      const auto task = spec.task_of_rank(r);
      if (task.second < 0 || task.second >= spec.num_tasks(task.first)) __builtin_trap();
    }
    const int rank = spec.rank();
    if (rank >= world) __builtin_trap();
  } catch (const diststrat::Error&) {
  }
  return 0;
}
