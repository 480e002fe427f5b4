// A process of a job (job 'probe', rank 2 of 4) through the recorder's own
// interface: group world.1 made, used and closed, then world used 40 times.
//   flight_exit_probe          returns from main: an exit record
//   flight_exit_probe _exit    ends by _Exit: no record
//   flight_exit_probe failure  writes a failure record, then returns: the
//                              failure record stays
//   flight_exit_probe fork     a forked child exits (no record of its own),
//                              then the process returns: its exit record
// tests/trace/flight_exit_cell.sh checks the records.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "core/flight_recorder.h"

namespace fl = diststrat::flight;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  fl::set_process(2, 4);
  fl::set_job("probe");
  {
    fl::Recorder closed("world.1", 2, 4);
    for (int i = 0; i < 3; ++i) {
      closed.end(closed.begin("barrier", "sync", 0, "", "", -1, 0), fl::State::kCompleted);
    }
  }
  fl::Recorder world("world", 2, 4);
  for (int i = 0; i < 40; ++i) {
    world.end(
        world.begin("all_reduce", "step_" + std::to_string(i), 256, "float32", "sum", -1, 1024),
        fl::State::kCompleted);
  }
  if (mode == "_exit") std::_Exit(0);
  if (mode == "failure") fl::dump(fl::Trigger::kFailure, "a failure");
  if (mode == "fork") {
    const pid_t child = ::fork();
    if (child == 0) std::exit(0);
    int status = 0;
    ::waitpid(child, &status, 0);
  }
  return 0;
}
