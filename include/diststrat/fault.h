// Fault injection, for tests of how a job fails: one chosen rank misbehaves
// at one chosen step of Strategy::run, so tests can check that the other
// ranks end within their deadline with an error naming the rank and step.
//
//   ```cpp fragment=unqualified
//   strategy.set_fault_injection(FaultInjection::parse("throw:1:5"));
//   ```
//   DISTSTRAT_FAULT=stall:0:3 ./train ...        (read by every strategy's constructor)
//
// "rank" is the replica id (ReplicaContext::replica_id(), the worker index
// for one replica per worker); "step" counts Strategy::run calls on that
// strategy object from 0 (steps_run(); note that Checkpoint::save and
// restore run steps too). Kinds:
//   throw    the replica throws InternalError("injected fault: rank R throws at step S")
//   exit     the process exits at once with exit_code (std::_Exit: no cleanup)
//   stall    the replica blocks forever (peers time out; the strategy abandons it)
//   corrupt  the replica sends a corrupted message in that step: a corrupted
//            pack signature under multi-worker fusion; elsewhere a collective
//            whose size disagrees with its peers' (see Strategy::inject_corruption)
//   oversize under the parameter server, the replica's next push carries a
//            header that claims a payload over 1 GiB (the real one is sent):
//            the PS must reject it at once; elsewhere the same as corrupt
//
// Rules: parse and the values are plain and thread-safe; set the injection
// on a strategy before run() (Strategy::set_fault_injection, not thread-safe).
#pragma once

#include <cstdint>
#include <string>

namespace diststrat {

enum class FaultKind { kNone, kThrow, kExit, kStall, kCorrupt, kOversize };

const char* fault_kind_name(FaultKind kind);

struct FaultInjection {
  FaultKind kind = FaultKind::kNone;
  int rank = -1;
  int64_t step = -1;
  int exit_code = 17;  // kExit

  bool active() const { return kind != FaultKind::kNone; }
  // Whether the fault fires for replica `rank` at `step`.
  bool fires(int replica, int64_t at_step) const {
    return active() && replica == rank && at_step == step;
  }
  // "kind:rank:step" (kind: throw, exit, stall, corrupt, oversize); "" or "none" is
  // inactive. Throws InvalidArgumentError naming the text.
  static FaultInjection parse(const std::string& text);
  // DISTSTRAT_FAULT; inactive when unset.
  static FaultInjection from_env();
};

}  // namespace diststrat
