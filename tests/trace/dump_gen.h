// Synthetic flight records for the tests of diststrat-trace: a small job
// simulator that plays collectives on groups of ranks (each process with a
// clock of its own), then dumps every process's record in format version 1,
// and the injected hangs the tests check verdicts against.
#pragma once

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "flight_record.h"

namespace trace_test {

using json = nlohmann::json;

struct SimCall {
  std::string group = "world";
  int group_rank = 0;
  int group_size = 1;
  int64_t seq = 0;
  int thread = 0;
  std::string kind = "all_reduce";
  std::string name;
  int64_t count = 256;
  std::string dtype = "float32";
  std::string op = "sum";
  int64_t root = -1;
  std::string algorithm = "ring";
  int64_t bytes = 1024;
  int64_t enqueue_us = -1;
  int64_t start_us = -1;
  int64_t end_us = -1;
  std::string state = "completed";
  std::vector<int> waiting_on;
  std::string error;
  std::string site;
};

struct SimProcess {
  int rank = 0;
  int size = 0;
  std::string host = "h0";
  int64_t pid = 1000;
  std::string reason = "deadline exceeded";
  int64_t dump_time_us = 0;
  int64_t epoch_unix_us = 1764750000000000;
  std::string trigger;  // written when not empty
  std::vector<SimCall> calls;
  // Members the process declares (group, group rank, group size, thread).
  struct Member {
    std::string group;
    int group_rank = 0, group_size = 1, thread = 0;
  };
  std::vector<Member> members;

  std::string file_name() const {
    return "flight-rank" + std::to_string(rank) + "-pid" + std::to_string(pid) + ".json";
  }
};

inline json to_json(const SimCall& c) {
  json j = {{"group", c.group},
            {"group_rank", c.group_rank},
            {"group_size", c.group_size},
            {"seq", c.seq},
            {"thread", c.thread},
            {"kind", c.kind},
            {"name", c.name},
            {"count", c.count},
            {"dtype", c.dtype},
            {"op", c.op},
            {"root", c.root},
            {"algorithm", c.algorithm},
            {"bytes", c.bytes},
            {"enqueue_us", c.enqueue_us},
            {"start_us", c.start_us},
            {"end_us", c.end_us},
            {"state", c.state}};
  if (!c.waiting_on.empty()) j["waiting_on"] = c.waiting_on;
  if (!c.error.empty()) j["error"] = c.error;
  if (!c.site.empty()) j["site"] = c.site;
  return j;
}

inline json to_json(const SimProcess& p) {
  json calls = json::array();
  for (const SimCall& c : p.calls) calls.push_back(to_json(c));
  json j = {{"format", "diststrat-flight-record"},
            {"version", 1},
            {"process", {{"rank", p.rank}, {"size", p.size}, {"host", p.host}, {"pid", p.pid}}},
            {"reason", p.reason},
            {"dump_time_us", p.dump_time_us},
            {"epoch_unix_us", p.epoch_unix_us},
            {"calls", calls}};
  if (!p.trigger.empty()) j["trigger"] = p.trigger;
  if (!p.members.empty()) {
    json members = json::array();
    for (const SimProcess::Member& m : p.members) {
      members.push_back({{"group", m.group},
                         {"group_rank", m.group_rank},
                         {"group_size", m.group_size},
                         {"thread", m.thread}});
    }
    j["members"] = members;
  }
  return j;
}

inline std::string to_text(const SimProcess& p) { return to_json(p).dump(1) + "\n"; }

inline void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  if (!f) throw std::runtime_error("cannot write " + path);
}

inline void write_dir(const std::vector<SimProcess>& procs, const std::string& dir) {
  for (const SimProcess& p : procs) write_file(dir + "/" + p.file_name(), to_text(p));
}

// Every process's record through the text parser (as the tool reads it).
inline std::vector<diststrat::trace::Dump> parse_all(const std::vector<SimProcess>& procs) {
  std::vector<diststrat::trace::Dump> out;
  for (const SimProcess& p : procs) {
    diststrat::trace::Dump d;
    d.file = p.file_name();
    std::string why;
    if (!diststrat::trace::parse_dump(to_text(p), &d, &why)) {
      throw std::runtime_error("generated record does not parse: " + why);
    }
    out.push_back(std::move(d));
  }
  return out;
}

// What a collective is, apart from who calls it when.
struct CallSpec {
  std::string kind = "all_reduce";
  std::string name;
  int64_t count = 256;
  std::string dtype = "float32";
  std::string op = "sum";
  int64_t root = -1;
  int64_t bytes() const { return kind == "barrier" ? 0 : count * 4; }
};

// Plays a job: groups of (process, thread) members, collectives on them,
// one clock per process (the clocks of two processes never line up).
class JobSim {
 public:
  JobSim(int processes, uint64_t seed) : rng_(seed) {
    std::uniform_int_distribution<int64_t> epoch(0, 1000000000);
    for (int p = 0; p < processes; ++p) {
      SimProcess sp;
      sp.rank = p;
      sp.size = processes;
      sp.host = "h" + std::to_string(p / 2);
      sp.pid = 4000 + 17 * p;
      sp.epoch_unix_us = 1764750000000000 + epoch(rng_);
      procs_.push_back(sp);
      now_.push_back(uniform(1000, 900000));  // each clock starts elsewhere
    }
  }

  // Group `name`: member i (its group rank) is thread members[i].second of
  // process members[i].first. Its seq numbers start at `first_seq` (what
  // came before is older than any ring buffer keeps).
  void add_group(const std::string& name, std::vector<std::pair<int, int>> members,
                 int64_t first_seq = 0) {
    groups_[name] = Group{std::move(members), first_seq};
  }
  int64_t next_seq(const std::string& group) const { return groups_.at(group).next; }
  std::pair<int, int> member(const std::string& group, int rank) const {
    return groups_.at(group).members.at(rank);
  }
  int size(const std::string& group) const {
    return static_cast<int>(groups_.at(group).members.size());
  }

  // Every member runs the group's next call to completion.
  int64_t complete_all(const std::string& group, const CallSpec& spec) {
    Group& g = groups_.at(group);
    const int64_t seq = g.next++;
    for (size_t r = 0; r < g.members.size(); ++r) {
      SimCall& c = add(group, static_cast<int>(r), seq, spec, "completed");
      c.end_us = c.start_us + uniform(50, 3000);
      now_[g.members[r].first] = c.end_us + uniform(100, 5000);  // then some compute
    }
    return seq;
  }

  // Member `rank` enters seq `seq` of the group and is still in it
  // (state "started" or "queued") at the dump.
  SimCall& enter(const std::string& group, int rank, int64_t seq, const CallSpec& spec,
                 const std::vector<int>& waiting_on, const std::string& state = "started") {
    SimCall& c = add(group, rank, seq, spec, state);
    if (state == "queued") c.start_us = -1;
    c.waiting_on = waiting_on;
    return c;
  }

  // The group's next seq, taken (the caller records who entered it).
  int64_t take_seq(const std::string& group) { return groups_.at(group).next++; }

  void compute(int process, int64_t us) { now_[process] += us; }
  void ring(int process, size_t calls) { ring_[process] = calls; }
  void drop(int process) { dropped_.push_back(process); }
  int64_t now(int process) const { return now_[process]; }

  // The dumps: every process dumps `hang_us` after its own last event; each
  // participant keeps only its last ring(process) calls.
  std::vector<SimProcess> finish(int64_t hang_us) {
    std::vector<SimProcess> out;
    for (SimProcess p : procs_) {
      if (std::find(dropped_.begin(), dropped_.end(), p.rank) != dropped_.end()) continue;
      p.dump_time_us = now_[p.rank] + hang_us;
      const auto it = ring_.find(p.rank);
      if (it != ring_.end()) {
        std::map<std::pair<std::string, int>, size_t> total;
        for (const SimCall& c : p.calls) ++total[{c.group, c.group_rank}];
        std::map<std::pair<std::string, int>, size_t> seen;
        std::vector<SimCall> kept;
        for (const SimCall& c : p.calls) {
          const auto key = std::make_pair(c.group, c.group_rank);
          if (total[key] - seen[key]++ <= it->second) kept.push_back(c);
        }
        p.calls = kept;
      }
      out.push_back(p);
    }
    return out;
  }

  int64_t uniform(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
  std::mt19937_64& rng() { return rng_; }

 private:
  struct Group {
    std::vector<std::pair<int, int>> members;
    int64_t next = 0;
  };

  SimCall& add(const std::string& group, int rank, int64_t seq, const CallSpec& spec,
               const std::string& state) {
    const Group& g = groups_.at(group);
    const auto [p, thread] = g.members.at(rank);
    SimCall c;
    c.group = group;
    c.group_rank = rank;
    c.group_size = static_cast<int>(g.members.size());
    c.seq = seq;
    c.thread = thread;
    c.kind = spec.kind;
    c.name = spec.name;
    c.count = spec.count;
    c.dtype = spec.dtype;
    c.op = spec.op;
    c.root = spec.root;
    c.bytes = spec.bytes();
    c.algorithm = spec.kind == "barrier" ? "" : "ring";
    c.enqueue_us = now_[p];
    c.start_us = c.enqueue_us + uniform(1, 40);
    c.state = state;
    now_[p] = c.start_us + 1;
    procs_[p].calls.push_back(c);
    return procs_[p].calls.back();
  }

  std::mt19937_64 rng_;
  std::vector<SimProcess> procs_;
  std::vector<int64_t> now_;
  std::map<std::string, Group> groups_;
  std::map<int, size_t> ring_;
  std::vector<int> dropped_;
};

// ---- injected hangs ---------------------------------------------------------

enum class Scenario { kSkip, kDifferent, kCompute, kChain, kNoDump, kRingWrap, kInProcess };
constexpr int kNumScenarios = 7;

inline const char* scenario_name(Scenario s) {
  switch (s) {
    case Scenario::kSkip:
      return "skip";
    case Scenario::kDifferent:
      return "different";
    case Scenario::kCompute:
      return "compute";
    case Scenario::kChain:
      return "chain";
    case Scenario::kNoDump:
      return "no_dump";
    case Scenario::kRingWrap:
      return "ring_wrap";
    case Scenario::kInProcess:
      return "in_process";
  }
  return "?";
}

// What the verdict must say.
struct Expected {
  std::string group;
  int64_t seq = -1;
  std::string tensor_name;
  std::string other_name;  // mismatch: the culprit's call's name
  int culprit_rank = -1;   // group rank in `group`
  int culprit_process_rank = -1;
  std::string state;  // mismatch | compute | no_record
};

struct Hang {
  Scenario scenario;
  int ranks = 0;  // processes
  std::vector<SimProcess> dumps;
  Expected expect;
};

inline CallSpec random_spec(JobSim& sim, int group_size) {
  static const char* const kKinds[] = {"all_reduce", "broadcast", "all_gather", "reduce_scatter",
                                       "barrier"};
  CallSpec s;
  s.kind = kKinds[sim.uniform(0, 4)];
  s.name =
      "layer" + std::to_string(sim.uniform(0, 99)) + "/" + (sim.uniform(0, 1) ? "kernel" : "bias");
  if (sim.uniform(0, 2) == 0) s.name += " +" + std::to_string(sim.uniform(1, 9)) + " more";
  s.count = s.kind == "barrier" ? 0 : sim.uniform(1, 1 << 20);
  s.op = (s.kind == "all_reduce" || s.kind == "reduce_scatter") ? "sum" : "";
  s.root = s.kind == "broadcast" ? sim.uniform(0, group_size - 1) : -1;
  return s;
}

// A job of `ranks` processes (4..8) that hangs as `scenario` says, with a
// random culprit, collective and seq.
inline Hang make_hang(Scenario scenario, int ranks, uint64_t seed) {
  JobSim sim(ranks, seed);
  Hang h;
  h.scenario = scenario;
  h.ranks = ranks;
  const int culprit = static_cast<int>(sim.uniform(0, ranks - 1));
  const int64_t k = sim.uniform(1, 5000);  // the seq the job hangs at
  const int64_t history = std::min<int64_t>(k, sim.uniform(1, 40));
  // Rings from 8 to 64 calls: most records have lost their oldest calls.
  for (int p = 0; p < ranks; ++p) sim.ring(p, static_cast<size_t>(sim.uniform(8, 64)));

  auto world_of = [&](std::vector<int> procs) {
    std::vector<std::pair<int, int>> m;
    for (int p : procs) m.emplace_back(p, 0);
    return m;
  };
  std::vector<int> all;
  for (int p = 0; p < ranks; ++p) all.push_back(p);

  if (scenario == Scenario::kChain) {
    // The culprit is a process outside 'world' (a parameter server, say):
    // one worker waits for it in a broadcast of group 'sub' and so never
    // enters the world's collective the other workers wait in.
    std::vector<int> workers;
    for (int p : all) {
      if (p != culprit) workers.push_back(p);
    }
    const int w = static_cast<int>(sim.uniform(0, static_cast<int64_t>(workers.size()) - 1));
    const int waiter = workers[w];
    const bool culprit_first = sim.uniform(0, 1) == 1;
    const int64_t j = sim.uniform(1, 800);
    const int64_t sub_history = std::min<int64_t>(j, sim.uniform(1, 20));
    sim.add_group("world", world_of(workers), k - history);
    sim.add_group("sub", culprit_first ? world_of({culprit, waiter}) : world_of({waiter, culprit}),
                  j - sub_history);
    const int c_sub = culprit_first ? 0 : 1;
    for (int64_t i = 0; i < std::max(history, sub_history); ++i) {
      if (i < history) sim.complete_all("world", random_spec(sim, ranks - 1));
      if (i < sub_history) sim.complete_all("sub", random_spec(sim, 2));
    }
    const CallSpec stuck = random_spec(sim, ranks - 1);
    const int64_t seq = sim.take_seq("world");
    for (int r = 0; r < ranks - 1; ++r) {
      if (r != w) sim.enter("world", r, seq, stuck, {w});
    }
    const CallSpec sub = random_spec(sim, 2);
    const int64_t sub_seq = sim.take_seq("sub");
    sim.enter("sub", 1 - c_sub, sub_seq, sub, {c_sub});
    sim.compute(culprit, sim.uniform(1000000, 9000000));
    h.expect = Expected{"sub", sub_seq, sub.name, "", c_sub, culprit, "compute"};
    h.dumps = sim.finish(sim.uniform(1000000, 60000000));
    return h;
  }

  if (scenario == Scenario::kInProcess) {
    // One or two processes, each holding several ranks of 'world' as threads.
    const int procs = ranks >= 6 ? 2 : 1;
    std::vector<std::pair<int, int>> members;
    for (int r = 0; r < ranks; ++r) {
      const int p = procs == 1 ? 0 : r % 2;
      members.emplace_back(p, r / procs);
    }
    JobSim local(procs, seed ^ 0x5eed);
    for (int p = 0; p < procs; ++p) local.ring(p, static_cast<size_t>(8 * ranks));
    local.add_group("world", members, k - history);
    for (int64_t i = 0; i < history; ++i) local.complete_all("world", random_spec(local, ranks));
    const CallSpec stuck = random_spec(local, ranks);
    const int64_t seq = local.take_seq("world");
    for (int r = 0; r < ranks; ++r) {
      if (r != culprit) local.enter("world", r, seq, stuck, {culprit});
    }
    h.expect = Expected{"world", seq, stuck.name, "", culprit, members[culprit].first, "compute"};
    h.dumps = local.finish(local.uniform(1000000, 60000000));
    return h;
  }

  sim.add_group("world", world_of(all), k - history);
  for (int64_t i = 0; i < history; ++i) sim.complete_all("world", random_spec(sim, ranks));
  if (scenario == Scenario::kRingWrap) {
    // The culprit's ring is far shorter than the others': what it has
    // forgotten is unknown, not missing.
    sim.ring(culprit, static_cast<size_t>(sim.uniform(1, 3)));
    for (int p = 0; p < ranks; ++p) {
      if (p != culprit) sim.ring(p, static_cast<size_t>(sim.uniform(30, 64)));
    }
  }
  const CallSpec stuck = random_spec(sim, ranks);
  const int64_t seq = sim.take_seq("world");
  for (int r = 0; r < ranks; ++r) {
    if (r != culprit) sim.enter("world", r, seq, stuck, {culprit});
  }
  h.expect = Expected{"world", seq, stuck.name, "", culprit, culprit, "compute"};
  switch (scenario) {
    case Scenario::kSkip: {
      // The culprit skipped this call: its seq k is the others' next one.
      CallSpec next = random_spec(sim, ranks);
      next.name = "skipped_ahead/" + next.name;
      sim.enter("world", culprit, seq, next, {});
      h.expect.state = "mismatch";
      h.expect.other_name = next.name;
      break;
    }
    case Scenario::kDifferent: {
      // The culprit calls a different collective under the same seq.
      CallSpec other = stuck;
      switch (sim.uniform(0, 3)) {
        case 0:
          other.kind = other.kind == "all_gather" ? "broadcast" : "all_gather";
          break;
        case 1:
          other.name = "other/" + other.name;
          break;
        case 2:
          other.count += sim.uniform(1, 1000);
          break;
        default:
          other.dtype = "float16";
          break;
      }
      sim.enter("world", culprit, seq, other, {});
      h.expect.state = "mismatch";
      h.expect.other_name = other.name;
      break;
    }
    case Scenario::kNoDump:
      sim.drop(culprit);
      h.expect.state = "no_record";
      h.expect.culprit_process_rank = -1;
      break;
    default:  // kCompute, kRingWrap: the culprit computes on
      sim.compute(culprit, sim.uniform(1000000, 9000000));
      break;
  }
  h.dumps = sim.finish(sim.uniform(1000000, 60000000));
  return h;
}

}  // namespace trace_test
