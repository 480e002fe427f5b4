// diststrat-trace on what a process leaves besides a hang: a record written
// as it ended normally (trigger "exit": it is gone, not dead, not
// computing), and groups of its own threads (in-process#N), which every
// process numbers from 0 and which are kept apart per process.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../common/temp_dir.h"
#include "dump_gen.h"
#include "flight_record.h"
#include "trace_analysis.h"

namespace tr = diststrat::trace;
using diststrat_test::TempDir;
using trace_test::SimCall;
using trace_test::SimProcess;

namespace {

SimCall world_call(const std::string& group, int rank, int size, int64_t seq,
                   const std::string& state) {
  SimCall c;
  c.group = group;
  c.group_rank = rank;
  c.group_size = size;
  c.seq = seq;
  c.name = "step_" + std::to_string(seq);
  c.enqueue_us = c.start_us = 1000000 * (seq + 1);
  c.end_us = state == "completed" ? c.start_us + 100 : -1;
  c.state = state;
  return c;
}

// Rank `r` of a 3-rank job: steps 0..last completed, then (when `waits`)
// all_reduce #last+1 started.
SimProcess process(int r, int64_t last, bool waits) {
  SimProcess p;
  p.rank = r;
  p.size = 3;
  p.pid = 1000 + r;
  p.host = "h0";
  for (int64_t s = 0; s <= last; ++s) p.calls.push_back(world_call("world", r, 3, s, "completed"));
  if (waits) p.calls.push_back(world_call("world", r, 3, last + 1, "started"));
  p.dump_time_us = 1000000 * (last + 4);
  p.trigger = "failure";
  return p;
}

std::string all_messages(const tr::LoadResult& r) {
  std::string s;
  for (const std::string& m : r.messages) s += m + "\n";
  return s;
}

}  // namespace

// Rank 2 finished its loop after step 2 and exited; the others wait in
// step 3. It is named, as gone, not as a rank in compute or without record.
TEST(TraceProcesses, RankThatExitedNormallyIsGone) {
  std::vector<SimProcess> job = {process(0, 2, true), process(1, 2, true), process(2, 2, false)};
  job[2].trigger = "exit";
  job[2].dump_time_us = job[2].calls.back().end_us + 1000000;
  const tr::Verdict v = tr::analyze(trace_test::parse_all(job));
  EXPECT_EQ(v.kind, tr::Verdict::Kind::kMissing);
  EXPECT_EQ(v.culprit_rank, 2);
  EXPECT_EQ(v.culprit_state, "exited");
  EXPECT_EQ(v.line,
            "rank 2 never entered all_reduce #3 ('step_3', 1 KB) of group 'world': it is gone: its "
            "process exited normally (its record was written at exit; its last call, all_reduce "
            "#2, completed 1.0 s before)");
}

// Rank 2's exit record does not show group 'world.1' (closed long before:
// the record keeps the groups closed last). The others wait in world.1's
// barrier: its missing record is not called a death.
TEST(TraceProcesses, GroupClosedBeforeANormalExitIsNotCalledADeath) {
  std::vector<SimProcess> job = {process(0, 2, false), process(1, 2, false), process(2, 2, false)};
  for (int r = 0; r < 2; ++r) {
    SimCall b = world_call("world.1", r, 3, 0, "started");
    b.kind = "barrier";
    job[r].calls.push_back(b);
  }
  job[2].trigger = "exit";
  const tr::Verdict v = tr::analyze(trace_test::parse_all(job));
  EXPECT_EQ(v.kind, tr::Verdict::Kind::kNoRecord);
  EXPECT_EQ(v.line,
            "rank 2 of group 'world.1' left no record (its process died, could not write, or "
            "exited normally long after closing this group: 1 record here was written at a "
            "normal exit, which shows only the groups closed last); ranks 0, 1 wait in barrier "
            "#0 ('step_0', 1 KB)");
  // Without an exit record, the words stay as they were.
  job[2].trigger = "failure";
  job[2].calls.clear();
  job[2].calls.push_back(world_call("other", 0, 1, 0, "completed"));
  EXPECT_NE(tr::analyze(trace_test::parse_all(job))
                .line.find("left no record (its process died, or could not write)"),
            std::string::npos);
}

// Two processes, each with its own in-process#0 of two replica threads: in
// process 1, replica 1 computes while replica 0 waits. Neither a note about
// a participant recorded twice nor one merged table.
TEST(TraceProcesses, InProcessGroupsOfTwoProcessesStayApart) {
  TempDir dir("diststrat_trace_proc_");
  std::vector<SimProcess> job;
  for (int p = 0; p < 2; ++p) {
    SimProcess proc;
    proc.rank = p;
    proc.size = 2;
    proc.pid = 100 + p;
    for (int64_t s = 0; s < 3; ++s) proc.calls.push_back(world_call("world", p, 2, s, "completed"));
    for (int t = 0; t < 2; ++t) {
      const int64_t newest = p == 1 && t == 1 ? 3 : 4;
      for (int64_t s = 0; s <= newest; ++s) {
        SimCall c = world_call("in-process#0", t, 2, s, "completed");
        c.thread = t;
        if (p == 1 && t == 0 && s == 4) c.state = "started", c.end_us = -1;
        proc.calls.push_back(c);
      }
    }
    proc.dump_time_us = 9000000;
    job.push_back(proc);
  }
  trace_test::write_dir(job, dir.path());
  const tr::LoadResult r = tr::load_dir(dir.path());
  ASSERT_TRUE(r.error.empty()) << r.error;
  EXPECT_EQ(r.dumps.size(), 2u);
  EXPECT_EQ(r.files_skipped, 0);
  EXPECT_EQ(all_messages(r), "");
  const tr::Verdict v = tr::analyze(r.dumps, r.files_skipped);
  EXPECT_EQ(v.group, "in-process#0 of process 1 (pid 101)");
  EXPECT_EQ(v.culprit_rank, 1);
  EXPECT_EQ(v.culprit_state, "compute");
  const std::string table = tr::group_table(r.dumps);
  EXPECT_NE(table.find("group 'in-process#0 of process 0 (pid 100)': 2 ranks, 2 with a record"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("group 'in-process#0 of process 1 (pid 101)': 2 ranks, 2 with a record"),
            std::string::npos)
      << table;
  // One process's records (the single-process case): the names as recorded.
  job.pop_back();
  EXPECT_EQ(tr::analyze(trace_test::parse_all(job)).line.find("of process"), std::string::npos);
  TempDir one("diststrat_trace_proc_");
  trace_test::write_dir(job, one.path());
  EXPECT_NE(tr::group_table(tr::load_dir(one.path()).dumps).find("group 'in-process#0': 2 ranks"),
            std::string::npos);
}
