// The verdicts of diststrat-trace on synthetic flight records: one test per
// kind of hang with the exact verdict line, then 20 randomly injected hangs.
#include <gtest/gtest.h>

#include <random>
#include <regex>
#include <string>
#include <vector>

#include "dump_gen.h"
#include "flight_record.h"
#include "trace_analysis.h"

namespace tr = diststrat::trace;
using trace_test::SimCall;
using trace_test::SimProcess;

namespace {

constexpr int64_t kStepUs = 1000;

SimCall world_call(int rank, int n, int64_t seq, const std::string& state) {
  SimCall c;
  c.group = "world";
  c.group_rank = rank;
  c.group_size = n;
  c.seq = seq;
  c.name = "grad/" + std::to_string(seq);
  c.count = 1024;
  c.bytes = 4096;
  c.enqueue_us = seq * kStepUs;
  c.start_us = seq * kStepUs + 10;
  c.end_us = state == "completed" ? seq * kStepUs + 500 : -1;
  c.state = state;
  return c;
}

// n processes, process p = rank p of 'world', that all completed seqs
// [first, k); each dumps 31.2 s after seq k's start.
std::vector<SimProcess> world(int n, int64_t first, int64_t k) {
  std::vector<SimProcess> procs;
  for (int p = 0; p < n; ++p) {
    SimProcess sp;
    sp.rank = p;
    sp.size = n;
    sp.host = "h" + std::to_string(p / 2);
    sp.pid = 100 + p;
    sp.dump_time_us = k * kStepUs + 10 + 31200000;
    for (int64_t s = first; s < k; ++s) sp.calls.push_back(world_call(p, n, s, "completed"));
    procs.push_back(sp);
  }
  return procs;
}

// Rank `r` enters seq k of 'world' (the big tensor the verdicts quote).
SimCall& enter(std::vector<SimProcess>& procs, int r, int64_t k, std::vector<int> waiting = {}) {
  SimCall c = world_call(r, static_cast<int>(procs.size()), k, "started");
  c.name = "dense2/kernel +3 more";
  c.count = 314573;
  c.bytes = 1258292;  // 1.2 MB
  c.waiting_on = std::move(waiting);
  procs[r].calls.push_back(c);
  return procs[r].calls.back();
}

tr::Verdict verdict_of(const std::vector<SimProcess>& procs) {
  return tr::analyze(trace_test::parse_all(procs));
}

// "rank 3" as a word (not the start of "rank 31").
bool names_rank(const std::string& line, int rank) {
  return std::regex_search(line, std::regex("rank " + std::to_string(rank) + "([^0-9]|$)"));
}

}  // namespace

TEST(TraceVerdict, RankInCompute) {
  auto procs = world(4, 0, 17);
  for (int r : {0, 1, 3}) enter(procs, r, 17, {2});
  procs[2].dump_time_us = 16 * kStepUs + 500 + 12000000;  // 12.0 s after its last call ended
  const tr::Verdict v = verdict_of(procs);
  EXPECT_EQ(v.line,
            "rank 2 never entered all_reduce #17 ('dense2/kernel' +3 more, 1.2 MB) of group "
            "'world': it is in compute since 12.0 s (its last call, all_reduce #16, completed "
            "then)");
  EXPECT_EQ(v.kind, tr::Verdict::Kind::kMissing);
  EXPECT_EQ(v.culprit_rank, 2);
  EXPECT_EQ(v.culprit_process_rank, 2);
  EXPECT_EQ(v.culprit_state, "compute");
  EXPECT_EQ(v.seq, 17);
  EXPECT_EQ(v.tensor_name, "dense2/kernel +3 more");
}

TEST(TraceVerdict, RankSkipsACollective) {
  // Rank 1 skipped grad/17: its 17th call is the others' 18th.
  auto procs = world(4, 0, 17);
  for (int r : {0, 2, 3}) enter(procs, r, 17, {1});
  SimCall& c = enter(procs, 1, 17);
  c.name = "dense3/kernel";
  c.count = 1024;
  c.bytes = 4096;
  const tr::Verdict v = verdict_of(procs);
  EXPECT_EQ(v.line,
            "ranks disagree at all_reduce #17 of group 'world': ranks 0, 2, 3 have all_reduce "
            "'dense2/kernel' +3 more (count 314573, float32, sum, 1.2 MB), rank 1 has all_reduce "
            "'dense3/kernel' (count 1024, float32, sum, 4 KB)");
  EXPECT_EQ(v.kind, tr::Verdict::Kind::kMismatch);
  EXPECT_EQ(v.culprit_rank, 1);
  EXPECT_EQ(v.culprit_state, "mismatch");
  EXPECT_EQ(v.seq, 17);
}

TEST(TraceVerdict, RankCallsADifferentCollective) {
  auto procs = world(2, 0, 5);
  enter(procs, 0, 5, {1});
  SimCall& c = enter(procs, 1, 5);
  c.kind = "broadcast";
  c.op = "";
  c.root = 0;
  const tr::Verdict v = verdict_of(procs);
  // Two ranks: no majority, both named, no single culprit.
  EXPECT_EQ(v.line,
            "ranks disagree at all_reduce #5 of group 'world': rank 0 has all_reduce "
            "'dense2/kernel' +3 more (count 314573, float32, sum, 1.2 MB), rank 1 has broadcast "
            "'dense2/kernel' +3 more (count 314573, float32, root 0, 1.2 MB)");
  EXPECT_EQ(v.culprit_rank, -1);
}

TEST(TraceVerdict, ChainThroughAnotherGroup) {
  // Workers 0..3 ('world'); process 4 is a parameter server, in group 'ps'
  // with worker 3 (ps rank 0). Worker 3 waits in ps broadcast #88 for the
  // server, which computes: the server is the root.
  auto procs = world(4, 0, 17);
  for (int r : {0, 1, 2}) enter(procs, r, 17, {3});
  SimProcess server;
  server.rank = 4;
  server.size = 5;
  server.host = "ps0";
  server.pid = 900;
  for (int64_t s = 80; s < 88; ++s) {
    SimCall c;
    c.group = "ps";
    c.group_rank = 1;
    c.group_size = 2;
    c.seq = s;
    c.kind = "broadcast";
    c.name = "embedding";
    c.op = "";
    c.root = 1;
    c.enqueue_us = s * 100;
    c.start_us = s * 100 + 1;
    c.end_us = s * 100 + 50;
    c.state = "completed";
    server.calls.push_back(c);
    c.group_rank = 0;
    c.enqueue_us += 7;  // another clock
    c.start_us += 7;
    c.end_us += 7;
    procs[3].calls.push_back(c);
  }
  server.dump_time_us = 87 * 100 + 50 + 12000000;
  SimCall waiting = procs[3].calls.back();
  waiting.seq = 88;
  waiting.enqueue_us = 17 * kStepUs;
  waiting.start_us = 17 * kStepUs + 10;
  waiting.end_us = -1;
  waiting.state = "started";
  waiting.waiting_on = {1};
  procs[3].calls.push_back(waiting);
  procs.push_back(server);
  const tr::Verdict v = verdict_of(procs);
  EXPECT_EQ(v.line,
            "rank 1 (process rank 4) never entered broadcast #88 ('embedding', 1 KB) of group "
            "'ps': it is in compute since 12.0 s (its last call, broadcast #87, completed then)");
  EXPECT_EQ(v.culprit_rank, 1);
  EXPECT_EQ(v.culprit_process_rank, 4);
  EXPECT_EQ(v.group, "ps");
  EXPECT_EQ(v.seq, 88);
  EXPECT_EQ(v.culprit_state, "compute");
  ASSERT_EQ(v.details.size(), 3u);
  EXPECT_EQ(v.details[0], "chain (each rank waits for the next):");
  EXPECT_EQ(v.details[1],
            "  rank 3 never entered all_reduce #17 ('dense2/kernel' +3 more, 1.2 MB) of group "
            "'world': it is in broadcast #88 of group 'ps' since 31.2 s");
  EXPECT_EQ(v.details[2], "  " + v.line);
}

TEST(TraceVerdict, CycleBetweenTwoGroupsBlamesTheOddRankOfTheLargerGroup) {
  // Rank 1 calls sub #5 before world #17; rank 3, its partner in 'sub',
  // calls world #17 first: each waits for the other.
  auto procs = world(4, 0, 17);
  for (int r : {0, 2, 3}) enter(procs, r, 17, {1});
  for (int r : {1, 3}) {
    for (int64_t s = 0; s <= 5; ++s) {
      if (r == 3 && s == 5) break;
      SimCall c;
      c.group = "sub";
      c.group_rank = r == 1 ? 0 : 1;
      c.group_size = 2;
      c.seq = s;
      c.kind = "broadcast";
      c.name = "sub/" + std::to_string(s);
      c.op = "";
      c.root = 0;
      c.enqueue_us = 16 * kStepUs + 600 + s;
      c.start_us = c.enqueue_us;
      c.end_us = s < 5 ? c.start_us : -1;
      c.state = s < 5 ? "completed" : "started";
      procs[r].calls.push_back(c);
    }
  }
  const tr::Verdict v = verdict_of(procs);
  EXPECT_EQ(v.culprit_rank, 1);
  EXPECT_EQ(v.group, "world");
  EXPECT_EQ(v.culprit_state, "in_call");
  EXPECT_EQ(v.culprit_call, "broadcast #5 of group 'sub'");
  EXPECT_EQ(v.line.rfind("rank 1 never entered all_reduce #17 ('dense2/kernel' +3 more, 1.2 MB) "
                         "of group 'world': it is in broadcast #5 of group 'sub' since ",
                         0),
            0u)
      << v.line;
  std::string details;
  for (const auto& d : v.details) details += d + "\n";
  EXPECT_NE(details.find("cycle: rank 1 (process rank 3) of group 'sub' waits in all_reduce #17 of "
                         "group 'world'"),
            std::string::npos)
      << details;
}

TEST(TraceVerdict, RankLeftNoRecord) {
  auto procs = world(4, 0, 17);
  for (int r : {0, 1, 2}) enter(procs, r, 17, {3});
  procs.pop_back();
  const tr::Verdict v = verdict_of(procs);
  EXPECT_EQ(v.line,
            "rank 3 of group 'world' left no record (its process died, or could not write); ranks "
            "0, 1, 2 wait in all_reduce #17 ('dense2/kernel' +3 more, 1.2 MB)");
  EXPECT_EQ(v.kind, tr::Verdict::Kind::kNoRecord);
  EXPECT_EQ(v.culprit_rank, 3);
  EXPECT_EQ(v.culprit_process_rank, -1);
  EXPECT_EQ(v.seq, 17);
  // A call that failed on the way (the library writes the record as a call
  // fails: the rank waited there) counts as waiting, and is in the details.
  SimCall& failed = procs[0].calls.back();
  failed.state = "failed";
  failed.end_us = failed.start_us + 5000000;
  failed.error = "connection reset by peer (rank 3)";
  const tr::Verdict f = verdict_of(procs);
  EXPECT_EQ(f.culprit_rank, 3);
  EXPECT_EQ(f.line,
            "rank 3 of group 'world' left no record (its process died, or could not write); ranks "
            "0, 1, 2 wait in all_reduce #17 ('dense2/kernel' +3 more, 1.2 MB)");
  ASSERT_EQ(f.details.size(), 1u);
  EXPECT_EQ(f.details[0],
            "also: rank 0 of group 'world': its all_reduce #17 ('dense2/kernel' +3 more, 1.2 MB) "
            "failed: connection reset by peer (rank 3)");
}

TEST(TraceVerdict, RingWrapIsUnknownNotMissing) {
  // Ranks 0, 1, 3 retain #100..#199 and wait in #200; rank 2 retains only
  // #197..#199 and computes. Seqs below 197 are unknown for rank 2.
  auto procs = world(4, 100, 200);
  for (int r : {0, 1, 3}) enter(procs, r, 200, {2});
  auto& calls = procs[2].calls;
  calls.erase(calls.begin(), calls.end() - 3);
  const tr::Verdict v = verdict_of(procs);
  EXPECT_EQ(v.seq, 200);
  EXPECT_EQ(v.culprit_rank, 2);
  EXPECT_EQ(v.culprit_state, "compute");
  // And when nobody is behind, a wrapped ring is no divergence either.
  auto quiet = world(3, 50, 90);
  quiet[1].calls.erase(quiet[1].calls.begin(), quiet[1].calls.end() - 2);
  const tr::Verdict q = verdict_of(quiet);
  EXPECT_EQ(q.line, "no divergence: all ranks agree up to #89 of group 'world'");
  EXPECT_EQ(q.kind, tr::Verdict::Kind::kNoDivergence);
}

TEST(TraceVerdict, InProcessGroupSeveralRanksInOneFile) {
  // One process; ranks 0..3 of 'local' are its threads 0..3. Threads 0, 1
  // and 3 wait in #9; thread 2 computes. Their calls interleave in the file.
  SimProcess p;
  p.rank = 0;
  p.size = 1;
  p.dump_time_us = 50000000;
  for (int64_t s = 0; s < 9; ++s) {
    for (int t = 0; t < 4; ++t) {
      SimCall c;
      c.group = "local";
      c.group_rank = t;
      c.group_size = 4;
      c.thread = t;
      c.seq = s;
      c.name = "w" + std::to_string(s);
      c.enqueue_us = s * 1000 + t;
      c.start_us = c.enqueue_us + 1;
      c.end_us = c.enqueue_us + 100;
      p.calls.push_back(c);
    }
  }
  for (int t : {0, 1, 3}) {
    SimCall c;
    c.group = "local";
    c.group_rank = t;
    c.group_size = 4;
    c.thread = t;
    c.seq = 9;
    c.name = "w9";
    c.enqueue_us = 9000 + t;
    c.start_us = c.enqueue_us + 1;
    c.state = "started";
    c.waiting_on = {2};
    p.calls.push_back(c);
  }
  p.dump_time_us = 8000 + 2 + 100 + 3000000;
  const tr::Verdict v = verdict_of({p});
  EXPECT_EQ(v.line,
            "rank 2 (process rank 0) never entered all_reduce #9 ('w9', 1 KB) of group 'local': "
            "it is in compute since 3.0 s (its last call, all_reduce #8, completed then)");
  EXPECT_EQ(v.culprit_rank, 2);
  EXPECT_EQ(v.culprit_process_rank, 0);
}

// A fresh group's silent member in a process of several ranks' threads,
// none of them its own (its creator thread made no call): what it does is
// not in the record, so the verdict stays with the rank that waits for it,
// whatever order the other threads' calls ended in. (CI's TSan pass saw the
// member take another thread's failed call as its own, and the verdict blame
// it "in compute".)
TEST(TraceVerdict, AFreshGroupsSilentMemberIsNotGivenAnotherThreadsCalls) {
  SimProcess p;
  p.rank = 0;
  p.size = 1;
  auto add = [&](const std::string& group, int rank, int size, int thread, int64_t seq,
                 int64_t start, int64_t end, const std::string& state, const std::string& kind) {
    SimCall c;
    c.group = group;
    c.group_rank = rank;
    c.group_size = size;
    c.thread = thread;
    c.seq = seq;
    c.kind = kind;
    c.name = kind == "barrier" ? "sync" : "step_" + std::to_string(seq);
    c.bytes = kind == "barrier" ? 0 : 4;
    c.count = kind == "barrier" ? 0 : 1;
    c.enqueue_us = c.start_us = start;
    c.end_us = end;
    c.state = state;
    if (state == "failed") c.error = "rank 3 did not arrive within 1000 ms";
    p.calls.push_back(c);
  };
  // 'world' is threads 1..4 (ranks 0..3); 'pair' was made by thread 0 (the
  // main thread, which makes no call); thread 4 is pair's rank 1.
  for (int64_t s = 0; s < 3; ++s) {
    for (int r = 0; r < 4; ++r)
      add("world", r, 4, r + 1, s, s * 100 + r, s * 100 + 50, "completed", "all_reduce");
  }
  add("pair", 1, 2, 4, 0, 300, -1, "started", "barrier");
  // Ranks 0..2 fail at #3; rank 2 started last but rank 0 ended last.
  add("world", 0, 4, 1, 3, 300, 1000400, "failed", "all_reduce");
  add("world", 1, 4, 2, 3, 301, 1000300, "failed", "all_reduce");
  add("world", 2, 4, 3, 3, 302, 1000200, "failed", "all_reduce");
  p.members = {{"world", 0, 4, 0}, {"world", 1, 4, 0}, {"world", 2, 4, 0},
               {"world", 3, 4, 0}, {"pair", 0, 2, 0},  {"pair", 1, 2, 0}};
  p.dump_time_us = 1000500;
  const tr::Verdict v = verdict_of({p});
  EXPECT_EQ(v.kind, tr::Verdict::Kind::kMissing) << v.line;
  EXPECT_EQ(v.culprit_rank, 3) << v.line;
  EXPECT_EQ(v.culprit_state, "in_call") << v.line;
  EXPECT_NE(v.culprit_call.find("barrier #0"), std::string::npos) << v.culprit_call;
  std::string details;
  for (const std::string& d : v.details) details += d + "\n";
  EXPECT_NE(details.find("rank 0 never entered barrier #0 ('sync', 0 B) of group 'pair': it is "
                         "where the record does not show"),
            std::string::npos)
      << details;
}

TEST(TraceVerdict, GroupSizeConflictIsNoted) {
  // Rank 2's record says 'world' has 5 ranks, the others say 3.
  auto procs = world(3, 0, 6);
  for (auto& c : procs[2].calls) c.group_size = 5;
  const tr::Verdict v = verdict_of(procs);
  EXPECT_EQ(v.line,
            "ranks 3, 4 of group 'world' left no record (their processes died, or could not "
            "write)");
  ASSERT_EQ(v.details.size(), 1u);
  EXPECT_EQ(v.details[0],
            "note: the members of group 'world' disagree on its size (3, 5); the largest is used");
}

TEST(TraceVerdict, NoDivergence) {
  const tr::Verdict v = verdict_of(world(3, 0, 8));
  EXPECT_EQ(v.line, "no divergence: all ranks agree up to #7 of group 'world'");
  auto waiting = world(3, 0, 8);
  for (int r : {0, 1, 2}) enter(waiting, r, 8);
  const tr::Verdict w = verdict_of(waiting);
  EXPECT_EQ(w.line, "no divergence: all ranks agree up to #8 of group 'world'");
  ASSERT_EQ(w.details.size(), 1u);
  EXPECT_NE(w.details[0].find("3 of 3 ranks of group 'world' are still in all_reduce #8"),
            std::string::npos);
  EXPECT_EQ(tr::analyze({}).line, "no divergence: the records hold no collective call");
}

TEST(TraceVerdict, WaitsInAnOlderCallOfItsOwnGroup) {
  // Rank 1 is still in #16 (the others completed it and wait in #17).
  auto procs = world(3, 0, 17);
  SimCall& last = procs[1].calls.back();
  last.state = "started";
  last.end_us = -1;
  for (int r : {0, 2}) enter(procs, r, 17, {1});
  const tr::Verdict v = verdict_of(procs);
  EXPECT_EQ(v.culprit_rank, 1);
  EXPECT_EQ(v.culprit_state, "in_call");
  EXPECT_EQ(v.culprit_call, "all_reduce #16 of group 'world'");
}

TEST(TraceVerdict, NamesAreEscapedAndCapped) {
  auto procs = world(3, 0, 4);
  const std::string evil = "line1\nline2\t\x1b[31m" + std::string(500, 'x');
  for (int r : {0, 1}) enter(procs, r, 4, {2}).name = evil;
  const tr::Verdict v = verdict_of(procs);
  EXPECT_EQ(v.tensor_name, evil);
  EXPECT_EQ(v.line.find('\n'), std::string::npos);
  EXPECT_EQ(v.line.find('\x1b'), std::string::npos);
  EXPECT_NE(v.line.find("'line1\\nline2\\t\\x1b[31mxxx"), std::string::npos) << v.line;
  EXPECT_NE(v.line.find("... (517 bytes)"), std::string::npos) << v.line;
  EXPECT_LT(v.line.size(), 400u);
}

TEST(TraceVerdict, HumanBytes) {
  EXPECT_EQ(tr::human_bytes(0), "0 B");
  EXPECT_EQ(tr::human_bytes(1023), "1023 B");
  EXPECT_EQ(tr::human_bytes(4096), "4 KB");
  EXPECT_EQ(tr::human_bytes(1258292), "1.2 MB");
  EXPECT_EQ(tr::human_bytes(int64_t{3} << 30), "3 GB");
  EXPECT_EQ(tr::human_bytes(tr::kMaxValue), "1 EB");
}

TEST(TraceVerdict, GroupTableShowsEveryRankAndTheMissingOne) {
  auto procs = world(4, 0, 17);
  for (int r : {0, 1, 2}) enter(procs, r, 17, {3});
  procs.pop_back();
  const std::string table = tr::group_table(trace_test::parse_all(procs));
  EXPECT_NE(table.find("group 'world': 4 ranks, 3 with a record"), std::string::npos) << table;
  EXPECT_NE(table.find("no record"), std::string::npos) << table;
  EXPECT_NE(table.find("started for 31.2 s"), std::string::npos) << table;
}

// 20 hangs injected at random (4-8 ranks, culprit, collective, seq and
// scenario drawn from a fixed seed): the verdict names the culprit, the
// seq, the tensor and the culprit's state every time.
TEST(TraceVerdict, TwentyRandomHangs) {
  std::mt19937_64 rng(20251203);
  std::vector<trace_test::Scenario> scenarios;
  for (int round = 0; round < 2; ++round) {
    for (int s = 0; s < trace_test::kNumScenarios; ++s) {
      scenarios.push_back(static_cast<trace_test::Scenario>(s));
    }
  }
  while (scenarios.size() < 20) {
    scenarios.push_back(static_cast<trace_test::Scenario>(rng() % trace_test::kNumScenarios));
  }
  std::shuffle(scenarios.begin(), scenarios.end(), rng);
  int right = 0;
  for (size_t i = 0; i < scenarios.size(); ++i) {
    const int ranks = 4 + static_cast<int>(rng() % 5);
    const trace_test::Hang h = trace_test::make_hang(scenarios[i], ranks, rng());
    const trace_test::Expected& e = h.expect;
    const tr::Verdict v = tr::analyze(trace_test::parse_all(h.dumps));
    SCOPED_TRACE("hang " + std::to_string(i) + " (" + trace_test::scenario_name(h.scenario) + ", " +
                 std::to_string(ranks) + " ranks, culprit " + std::to_string(e.culprit_rank) +
                 " of '" + e.group + "', #" + std::to_string(e.seq) + "): " + v.line);
    bool ok = true;
    auto check = [&](bool cond, const char* what) {
      EXPECT_TRUE(cond) << what;
      ok = ok && cond;
    };
    check(v.culprit_rank == e.culprit_rank, "culprit rank");
    check(v.culprit_process_rank == e.culprit_process_rank, "culprit process rank");
    check(v.group == e.group, "group");
    check(v.seq == e.seq, "seq");
    check(v.tensor_name == e.tensor_name, "tensor name");
    check(v.culprit_state == e.state, "state");
    // The line says all of it.
    check(names_rank(v.line, e.culprit_rank), "line names the rank");
    check(v.line.find("#" + std::to_string(e.seq) + " ") != std::string::npos, "line names #seq");
    const std::string base = e.tensor_name.substr(0, e.tensor_name.find(" +"));
    check(v.line.find("'" + base + "'") != std::string::npos, "line names the tensor");
    check(v.line.find("group '" + e.group + "'") != std::string::npos, "line names the group");
    if (e.state == "compute") {
      check(v.line.find("it is in compute since ") != std::string::npos, "line says compute");
    } else if (e.state == "mismatch") {
      check(v.line.rfind("ranks disagree at ", 0) == 0, "line says disagree");
      const std::string other = e.other_name.substr(0, e.other_name.find(" +"));
      check(v.line.find("rank " + std::to_string(e.culprit_rank) + " has ") != std::string::npos,
            "line names the odd rank");
      check(v.line.find("'" + other + "'") != std::string::npos, "line names the other call");
    } else if (e.state == "no_record") {
      check(v.line.find("left no record") != std::string::npos, "line says no record");
    }
    if (e.culprit_process_rank >= 0 && e.culprit_process_rank != e.culprit_rank) {
      check(v.line.find("(process rank " + std::to_string(e.culprit_process_rank) + ")") !=
                std::string::npos,
            "line names the process");
    }
    right += ok ? 1 : 0;
  }
  std::printf("[ trace    ] %d of %zu injected hangs named right\n", right, scenarios.size());
  EXPECT_EQ(right, 20);
}
