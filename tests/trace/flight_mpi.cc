// The flight recorder and straggler detection under mpirun, through the
// public ProcessGroup (tests/trace/flight_mpi_cell.sh runs it):
//   flight_mpi skip        the last rank skips step_3
//   flight_mpi different   rank 2 broadcasts where the others all_reduce step_2
//   flight_mpi compute     rank 1 computes 4 s before step_3 (deadline 1 s)
//   flight_mpi other_group rank 3 waits in a barrier of a second group for
//                          ranks that wait in the first group's step_3
//   flight_mpi exit        rank 2 finishes its loop before step_3 and exits
//                          normally (its record: trigger exit)
//   flight_mpi KIND CULPRIT STEP   the same with another culprit and step
//                          (tests/trace/random_hangs.sh)
//   flight_mpi straggler STEPS SLOW_RANK
//                          every rank "computes" 2 ms per step (a sleep),
//                          SLOW_RANK 30 % longer (-1: none); prints when the
//                          report first flags a rank, and the last report
// The hang kinds print each rank's error and exit 0 (the cell analyses the
// records the ranks wrote).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "diststrat/diststrat.h"

namespace ds = diststrat;

namespace {

ds::ProcessGroupOptions options(int timeout_ms) {
  ds::ProcessGroupOptions o;
  o.communication.timeout = std::chrono::milliseconds(timeout_ms);
  return o;
}

void all_reduce(ds::ProcessGroup& pg, const std::string& name) {
  std::vector<float> x(256, 1.f);
  pg.all_reduce(x.data(), x.data(), x.size(), ds::DType::kFloat32, ds::ReduceOp::kSum, name);
}

int hang(const std::string& kind, int culprit, int step) {
  ds::ProcessGroup world(options(1000));
  const int rank = world.rank(), size = world.size();
  const bool me = rank == (culprit >= 0            ? culprit
                           : kind == "skip"        ? size - 1
                           : kind == "compute"     ? 1
                           : kind == "other_group" ? 3
                                                   : 2);
  if (step < 0) step = kind == "different" ? 2 : 3;
  // A second group, made by every rank after the first (its name: world.1).
  ds::ProcessGroup second(options(3000));
  second.barrier("sync");
  for (int s = 0; s < step + 3; ++s) {
    const std::string name = "step_" + std::to_string(s);
    if (kind == "skip" && me && s == step) continue;
    if (kind == "exit" && me && s == step) return 0;
    if (kind == "compute" && me && s == step) std::this_thread::sleep_for(std::chrono::seconds(4));
    if (kind == "other_group" && me && s == step) second.barrier("sync");
    if (kind == "different" && me && s == step) {
      float x = 1.f;
      world.broadcast(&x, 1, 0, name);
      continue;
    }
    all_reduce(world, name);
  }
  return 0;
}

int straggler(int steps, int slow) {
  ds::ProcessGroup pg(options(30000));
  const int rank = pg.rank();
  int flagged_at = -1;
  for (int s = 0; s < steps; ++s) {
    const double ms = rank == slow ? 2.6 : 2.0;
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int>(ms * 1000)));
    all_reduce(pg, "grad");
    const ds::StragglerReport r = pg.straggler_report();
    if (flagged_at < 0) {
      for (const auto& x : r.ranks) {
        if (x.straggler) {
          flagged_at = s + 1;
          if (rank == 0) {
            std::printf("flagged rank %d (host %s) after %d steps: %.2f ms per call\n", x.rank,
                        x.host.c_str(), flagged_at, x.mean_compute_ms);
          }
        }
      }
    }
  }
  const ds::StragglerReport r = pg.straggler_report();
  if (rank == 0) {
    std::printf("windows %lld of %d calls\n", static_cast<long long>(r.windows),
                r.calls_per_window);
    for (const auto& x : r.ranks) {
      std::printf("rank %d host %s median %.3f ms mean %.3f ms last %.0f %% straggler %d\n", x.rank,
                  x.host.c_str(), x.median_compute_ms, x.mean_compute_ms,
                  100 * x.arrived_last_share, x.straggler ? 1 : 0);
    }
    std::printf("warning: %s\n", r.warning.empty() ? "(none)" : r.warning.c_str());
  }
  return 0;
}

}  // namespace

// MPI is the library's to start and end (the process group initializes it
// and finalizes it at exit, bounded, also after a failure).
int main(int argc, char** argv) {
  const std::string kind = argc > 1 ? argv[1] : "";
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  try {
    if (kind == "straggler") {
      return straggler(argc > 2 ? std::atoi(argv[2]) : 200, argc > 3 ? std::atoi(argv[3]) : -1);
    }
    return hang(kind, argc > 2 ? std::atoi(argv[2]) : -1, argc > 3 ? std::atoi(argv[3]) : -1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %s: %s\n", rank ? rank : "?", e.what());
    return 0;
  }
}
