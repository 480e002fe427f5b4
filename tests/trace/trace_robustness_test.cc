// diststrat-trace reads files from outside: truncated at every byte, bytes
// flipped at random, foreign JSON, wrong types, numbers out of range,
// duplicates, directories that are empty, missing or odd. Never a crash or
// an exception; one clear line per bad file; the rest analysed.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <random>
#include <set>
#include <string>
#include <vector>

#include "../common/temp_dir.h"
#include "chrome_trace.h"
#include "dump_gen.h"
#include "flight_record.h"
#include "trace_analysis.h"

namespace tr = diststrat::trace;
using diststrat_test::TempDir;
using trace_test::json;
using trace_test::SimProcess;

namespace {

// A small job of 3 ranks where rank 2 computes; names with non-ASCII text.
std::vector<SimProcess> sample_job(uint64_t seed = 7) {
  trace_test::JobSim sim(3, seed);
  sim.add_group("world", {{0, 0}, {1, 0}, {2, 0}}, 40);
  trace_test::CallSpec spec;
  for (int i = 0; i < 4; ++i) {
    spec.name = "couche/poids-\xc3\xa9t\xc3\xa9 " + std::to_string(i);  // UTF-8 é
    sim.complete_all("world", spec);
  }
  spec.name = "dense/kernel +2 more";
  const int64_t seq = sim.take_seq("world");
  sim.enter("world", 0, seq, spec, {2}).site = "train.cc:88";
  sim.enter("world", 1, seq, spec, {2});
  sim.compute(2, 5000000);
  return sim.finish(20000000);
}

tr::Dump parse_ok(const std::string& text) {
  tr::Dump d;
  std::string why;
  EXPECT_TRUE(tr::parse_dump(text, &d, &why)) << why;
  return d;
}

std::string why_not(const std::string& text) {
  tr::Dump d;
  std::string why;
  EXPECT_FALSE(tr::parse_dump(text, &d, &why)) << text.substr(0, 200);
  return why;
}

// A valid record with one field of call 0 (or the top level) replaced.
std::string with(const std::string& path, const json& value) {
  json j = trace_test::to_json(sample_job()[0]);
  if (path.rfind("calls.", 0) == 0) {
    j["calls"][0][path.substr(6)] = value;
  } else if (path.rfind("process.", 0) == 0) {
    j["process"][path.substr(8)] = value;
  } else {
    j[path] = value;
  }
  return j.dump();
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST(TraceRobustness, TruncatedAtEveryByte) {
  const std::string text = trace_test::to_text(sample_job()[0]);
  ASSERT_GT(text.size(), 1000u);
  size_t truncated = 0;
  for (size_t n = 0; n < text.size(); ++n) {
    const std::string prefix = text.substr(0, n);
    tr::Dump d;
    std::string why;
    const bool ok = tr::parse_dump(prefix, &d, &why);
    if (n + 1 == text.size()) {  // all but the final newline: the whole record
      EXPECT_TRUE(ok) << why;
      continue;
    }
    ASSERT_FALSE(ok) << "a prefix of " << n << " bytes parsed";
    if (n == 0) {
      EXPECT_EQ(why, "empty file");
    } else {
      EXPECT_EQ(why, "truncated JSON at byte " + std::to_string(n));
      ++truncated;
    }
  }
  EXPECT_EQ(truncated, text.size() - 2);
}

TEST(TraceRobustness, RandomByteFlipsNeverCrash) {
  const auto job = sample_job();
  const std::string text = trace_test::to_text(job[0]);
  std::mt19937_64 rng(1234);
  int parsed = 0;
  int rejected = 0;
  for (int round = 0; round < 3000; ++round) {
    std::string t = text;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      const size_t at = rng() % t.size();
      // A random byte, or a digit / a quote / a brace, which make more
      // flips that still parse.
      static const char kSpecial[] = "0123456789-\"{}[],:e.";
      t[at] = rng() % 2 ? static_cast<char>(rng() % 256) : kSpecial[rng() % (sizeof kSpecial - 1)];
    }
    tr::Dump d;
    d.file = "flipped.json";
    std::string why;
    bool ok = false;
    EXPECT_NO_THROW(ok = tr::parse_dump(t, &d, &why));
    if (!ok) {
      ++rejected;
      EXPECT_FALSE(why.empty());
      EXPECT_EQ(why.find('\n'), std::string::npos);
      continue;
    }
    ++parsed;
    // What parses goes through the analysis and the export with the others.
    std::vector<tr::Dump> dumps = trace_test::parse_all({job[1], job[2]});
    dumps.push_back(d);
    tr::Verdict v;
    EXPECT_NO_THROW(v = tr::analyze(dumps));
    EXPECT_FALSE(v.line.empty());
    EXPECT_EQ(v.line.find('\n'), std::string::npos);
    EXPECT_NO_THROW(tr::group_table(dumps));
    EXPECT_NO_THROW(tr::chrome_trace_events(dumps));
  }
  std::printf("[ trace    ] byte flips: %d records still parsed, %d rejected\n", parsed, rejected);
  EXPECT_GT(parsed, 0);
  EXPECT_GT(rejected, 0);
}

TEST(TraceRobustness, ForeignJson) {
  EXPECT_EQ(why_not("[]"), "not a flight record (the JSON is an array, not an object)");
  EXPECT_EQ(why_not("42"), "not a flight record (the JSON is a number, not an object)");
  EXPECT_EQ(why_not("null"), "not a flight record (the JSON is a null, not an object)");
  EXPECT_EQ(why_not(R"({"name": "my-package", "version": "1.0.0"})"),
            "not a flight record (no \"format\" field)");
  // A Chrome trace (the export, or the library's timeline) in the same folder.
  EXPECT_EQ(why_not(R"({"displayTimeUnit":"ms","traceEvents":[]})"),
            "not a flight record (no \"format\" field)");
  EXPECT_EQ(why_not(R"({"format": "something-else", "version": 1})"),
            "not a flight record (format \"something-else\", not \"diststrat-flight-record\")");
  EXPECT_EQ(why_not(R"({"format": 7})"),
            "not a flight record (format 7, not \"diststrat-flight-record\")");
  EXPECT_EQ(why_not(with("version", 2)),
            "format version 2 is not supported (this tool reads version 1)");
  EXPECT_EQ(why_not("{\"a\": 1} trailing"), "invalid JSON at byte 11 (invalid literal)");
  EXPECT_EQ(why_not("   \n"), "no JSON in it (only white space)");
  EXPECT_TRUE(has(why_not("{\"a\": \"\xff\"}"), "invalid JSON at byte 7"));
  EXPECT_EQ(why_not("{\"a\": 1e999}"), "unreadable JSON (number overflow parsing '1e999')");
  // Very deep nesting: no stack overflow.
  EXPECT_TRUE(
      has(why_not(std::string(200000, '[') + std::string(200000, ']')), "not a flight record"));
  // Refused before parsing (the parsed form would take ~20 times the file).
  EXPECT_EQ(why_not(std::string(200000, '[')),
            "not a flight record (arrays and objects nested more than 32 deep, at byte 32)");
  EXPECT_EQ(why_not(std::string(32, '[') + std::string(32, ']')),
            "not a flight record (the JSON is an array, not an object)");
  EXPECT_EQ(why_not("{\"a\": \"" + std::string(100, '[') + "\"}"),
            "not a flight record (no \"format\" field)");
}

TEST(TraceRobustness, WrongTypesAndRanges) {
  EXPECT_EQ(why_not(with("calls", json::object())), "calls is an object, not an array");
  EXPECT_EQ(why_not(with("calls", "none")), "calls is a string, not an array");
  EXPECT_EQ(why_not(with("process", 3)), "process is a number, not an object");
  EXPECT_EQ(why_not(with("process.rank", "3")), "process.rank is a string, not an integer");
  EXPECT_EQ(why_not(with("process.rank", -2)), "process.rank -2 is out of range [-1, 1048575]");
  EXPECT_EQ(why_not(with("dump_time_us", -1)),
            "dump_time_us -1 is out of range [0, 1152921504606846976]");
  EXPECT_EQ(why_not(with("dump_time_us", 1.5)), "dump_time_us is 1.5, not an integer");
  EXPECT_EQ(why_not(with("calls.seq", "17")), "calls[0].seq is a string, not an integer");
  EXPECT_EQ(why_not(with("calls.seq", -1)),
            "calls[0].seq -1 is out of range [0, 1152921504606846976]");
  EXPECT_EQ(why_not(with("calls.seq", json(uint64_t{18446744073709551615ull}))),
            "calls[0].seq 18446744073709551615 is out of range [0, 1152921504606846976]");
  EXPECT_EQ(why_not(with("calls.seq", json(-9223372036854775807LL - 1))),
            "calls[0].seq -9223372036854775808 is out of range [0, 1152921504606846976]");
  EXPECT_EQ(why_not(with("calls.seq", 1e30)), "calls[0].seq is 1e+30, not an integer");
  EXPECT_EQ(why_not(with("calls.group_size", 0)),
            "calls[0].group_size 0 is out of range [1, 1048576]");
  EXPECT_EQ(why_not(with("calls.group_size", 4000000000LL)),
            "calls[0].group_size 4000000000 is out of range [1, 1048576]");
  EXPECT_EQ(why_not(with("calls.group_rank", 3)),
            "calls[0].group_rank 3 is not below group_size 3");
  EXPECT_EQ(why_not(with("calls.group", json())), "calls[0].group is a null, not a string");
  EXPECT_EQ(why_not(with("calls.kind", json::array())), "calls[0].kind is an array, not a string");
  EXPECT_EQ(why_not(with("calls.state", "zombie")),
            "calls[0].state 'zombie' is not one of queued, started, completed, failed, aborted");
  EXPECT_EQ(why_not(with("calls.start_us", -7)),
            "calls[0].start_us -7 is out of range [-1, "
            "1152921504606846976]");
  EXPECT_EQ(why_not(with("calls.waiting_on", 1)), "calls[0].waiting_on is a number, not an array");
  EXPECT_EQ(why_not(with("calls.waiting_on", json::array({0, 5}))),
            "calls[0].waiting_on[1] 5 is out of range [0, 2]");
  EXPECT_EQ(why_not(with("calls.name", false)), "calls[0].name is a boolean, not a string");
  json j = trace_test::to_json(sample_job()[0]);
  j["calls"][1] = "not a call";
  EXPECT_EQ(why_not(j.dump()), "calls[1] is a string, not an object");
  j = trace_test::to_json(sample_job()[0]);
  j["calls"][2].erase("seq");
  EXPECT_EQ(why_not(j.dump()), "calls[2].seq is missing");
  j.erase("process");
  EXPECT_EQ(why_not(j.dump()), "process is missing");
  // Optional fields may be absent; the escape of control characters in a
  // bad state keeps the message on one line.
  j = trace_test::to_json(sample_job()[0]);
  for (const char* f : {"thread", "name", "count", "dtype", "op", "root", "algorithm", "bytes",
                        "enqueue_us", "start_us", "end_us"}) {
    j["calls"][0].erase(f);
  }
  j["process"].erase("size");
  j.erase("reason");
  j.erase("epoch_unix_us");
  EXPECT_EQ(parse_ok(j.dump()).calls[0].start_us, -1);
  EXPECT_EQ(why_not(with("calls.state", "a\nb")),
            "calls[0].state 'a\\nb' is not one of queued, started, completed, failed, aborted");
}

TEST(TraceRobustness, DirectoryOfGoodAndBadFiles) {
  TempDir dir("diststrat_trace_");
  const auto job = sample_job();
  trace_test::write_dir(job, dir.path());
  // Rank 1's record cut short: it is skipped, and rank 1 "left no record".
  const std::string rank1 = job[1].file_name();
  std::string text = trace_test::to_text(job[1]);
  trace_test::write_file(dir / rank1, text.substr(0, 812));
  trace_test::write_file(dir / "package.json", R"({"name": "x"})");
  trace_test::write_file(dir / "empty.json", "");
  trace_test::write_file(dir / "notes.txt", "not json, and not *.json: ignored");
  ASSERT_EQ(::mkdir((dir / "subdir.json").c_str(), 0700), 0);
  ASSERT_EQ(::mkfifo((dir / "fifo.json").c_str(), 0600), 0);  // must not block
  ASSERT_EQ(::symlink("/dev/zero", (dir / "zero.json").c_str()), 0);
  ASSERT_EQ(::symlink("missing-target", (dir / "dangling.json").c_str()), 0);
  // Larger than any record can be: skipped unread (a sparse file).
  trace_test::write_file(dir / "flight-big.json", "{");
  ASSERT_EQ(::truncate((dir / "flight-big.json").c_str(), tr::kMaxFileBytes + 1), 0);
  trace_test::write_file(dir / "ctrl\x01name.json", "[");
  const tr::LoadResult r = tr::load_dir(dir.path());
  EXPECT_TRUE(r.error.empty()) << r.error;
  ASSERT_EQ(r.dumps.size(), 2u);
  EXPECT_EQ(r.files_seen, 11);
  EXPECT_EQ(r.files_skipped, 9);
  std::string all;
  for (const std::string& m : r.messages) all += m + "\n";
  EXPECT_TRUE(has(all, "skipping " + rank1 + ": truncated JSON at byte 812\n")) << all;
  EXPECT_TRUE(has(all, "skipping package.json: not a flight record (no \"format\" field)\n"));
  EXPECT_TRUE(has(all, "skipping empty.json: empty file\n"));
  EXPECT_TRUE(has(all, "skipping subdir.json: it is a directory\n"));
  EXPECT_TRUE(has(all, "skipping fifo.json: it is not a regular file\n"));
  EXPECT_TRUE(has(all, "skipping zero.json: it is not a regular file\n"));
  EXPECT_TRUE(has(all, "skipping dangling.json: cannot open it: No such file or directory\n"));
  EXPECT_TRUE(has(all, "skipping flight-big.json: it is " + std::to_string(tr::kMaxFileBytes + 1) +
                           " bytes, more than a flight record can be"))
      << all;
  EXPECT_TRUE(has(all, "skipping ctrl\\x01name.json: truncated JSON at byte 1\n")) << all;
  // Rank 2 computes (ranks 0 and 1 wait for it): the verdict; that rank 1's
  // record is unusable is said too.
  const tr::Verdict v = tr::analyze(r.dumps, r.files_skipped);
  EXPECT_EQ(v.culprit_rank, 2);
  EXPECT_EQ(v.culprit_state, "compute");
  ASSERT_EQ(v.details.size(), 2u);
  EXPECT_EQ(v.details[0],
            "also: rank 1 of group 'world' left no record (its process died, or could not write)");
  EXPECT_EQ(v.details[1], "note: 9 files were skipped as unusable; one may be a missing record");
}

TEST(TraceRobustness, UnreadableFile) {
  if (::geteuid() == 0) GTEST_SKIP() << "root reads a mode-000 file";
  TempDir dir("diststrat_trace_");
  trace_test::write_dir(sample_job(), dir.path());
  const std::string f = dir / sample_job()[0].file_name();
  ASSERT_EQ(::chmod(f.c_str(), 0), 0);
  const tr::LoadResult r = tr::load_dir(dir.path());
  EXPECT_EQ(r.dumps.size(), 2u);
  ASSERT_FALSE(r.messages.empty());
  EXPECT_TRUE(has(r.messages[0], "cannot open it: Permission denied")) << r.messages[0];
}

TEST(TraceRobustness, EmptyMissingAndUselessDirectories) {
  TempDir dir("diststrat_trace_");
  tr::LoadResult r = tr::load_dir(dir.path());
  EXPECT_EQ(r.error, "no flight record (*.json) in '" + dir.path() + "'");
  r = tr::load_dir(dir / "nope");
  EXPECT_EQ(r.error, "cannot read directory '" + (dir / "nope") + "': No such file or directory");
  trace_test::write_file(dir / "a.json", "{");
  trace_test::write_file(dir / "b.json", "[]");
  r = tr::load_dir(dir.path());
  EXPECT_EQ(r.error,
            "no usable flight record in '" + dir.path() + "' (2 of 2 *.json files skipped)");
  EXPECT_EQ(r.messages.size(), 2u);
  trace_test::write_file(dir / "c.json", "x");
  r = tr::load_dir(dir / "c.json");
  EXPECT_EQ(r.error, "cannot read directory '" + (dir / "c.json") + "': Not a directory");
}

TEST(TraceRobustness, DuplicateFilesForOneParticipant) {
  TempDir dir("diststrat_trace_");
  auto job = sample_job();
  trace_test::write_dir(job, dir.path());
  // An exact copy of rank 0's file under another name: skipped as a duplicate.
  trace_test::write_file(dir / "copy-of-rank0.json", trace_test::to_text(job[0]));
  // An older dump of rank 2 (fewer calls, an older newest seq), from the same
  // process: the newer one is used.
  SimProcess old = job[2];
  old.calls.pop_back();
  old.dump_time_us -= 1000;
  trace_test::write_file(dir / "flight-rank2-older.json", trace_test::to_text(old));
  const tr::LoadResult r = tr::load_dir(dir.path());
  ASSERT_TRUE(r.error.empty());
  EXPECT_EQ(r.dumps.size(), 3u);
  EXPECT_EQ(r.files_skipped, 2);
  std::string all;
  for (const std::string& m : r.messages) all += m + "\n";
  // Identical records: the first file by name is used.
  EXPECT_TRUE(has(all, "skipping " + job[0].file_name() +
                           ": a duplicate (copy-of-rank0.json records rank 0 of group 'world', as "
                           "new or newer)\n"))
      << all;
  EXPECT_TRUE(has(all, "skipping flight-rank2-older.json: a duplicate (" + job[2].file_name() +
                           " records rank 2 of group 'world', as new or newer)\n"))
      << all;
  const tr::Verdict v = tr::analyze(r.dumps);
  EXPECT_EQ(v.culprit_rank, 2);
  EXPECT_EQ(v.culprit_state, "compute");
  // Two files that each hold something of their own but share a participant.
  std::vector<tr::Dump> dumps = trace_test::parse_all(job);
  SimProcess extra = job[0];
  extra.rank = 7;
  extra.pid = 77;
  extra.calls.resize(2);  // older calls of world rank 0...
  trace_test::SimCall mine = extra.calls[0];
  mine.group = "other";
  mine.group_size = 1;
  extra.calls.push_back(mine);  // ...and a group of its own
  trace_test::write_file(dir / "extra.json", trace_test::to_text(extra));
  const tr::LoadResult r2 = tr::load_dir(dir.path());
  std::string all2;
  for (const std::string& m : r2.messages) all2 += m + "\n";
  EXPECT_TRUE(has(all2,
                  "note: extra.json and copy-of-rank0.json both record rank 0 of group "
                  "'world'; using copy-of-rank0.json"))
      << all2;
  EXPECT_EQ(tr::analyze(r2.dumps).culprit_rank, 2);
}

TEST(TraceExport, ChromeTraceEventsLineUpWithTheTimeline) {
  const auto job = sample_job();
  const std::vector<tr::Dump> dumps = trace_test::parse_all(job);
  const std::vector<std::string> events = tr::chrome_trace_events(dumps);
  int complete = 0;
  int in_flight = 0;
  std::set<std::pair<int, int>> lanes;
  for (const std::string& e : events) {
    const json j = json::parse(e);  // every event is a JSON object
    ASSERT_TRUE(j.contains("ph")) << e;
    ASSERT_TRUE(j.contains("pid")) << e;
    if (j["ph"] == "M" && j["name"] == "process_name") {
      EXPECT_EQ(j["args"]["name"], "rank " + std::to_string(j["pid"].get<int>()));
    }
    if (j["ph"] == "M" && j["name"] == "thread_name") {
      EXPECT_GE(j["tid"].get<int>(), tr::kFirstFlightLane);
      EXPECT_EQ(j["args"]["name"], "flight: group world, thread 0");
    }
    if (j["ph"] != "X") continue;
    ++complete;
    // The Timeline's keys, in its order.
    EXPECT_EQ(e.rfind("{\"name\":", 0), 0u) << e;
    EXPECT_TRUE(has(e, "\"cat\":\"flight\",\"ph\":\"X\",\"ts\":")) << e;
    const int pid = j["pid"];
    lanes.insert({pid, j["tid"].get<int>()});
    const tr::Dump& d = dumps[pid];
    EXPECT_GE(j["ts"].get<int64_t>(), d.epoch_unix_us);
    if (j["args"].contains("in_flight_at_dump")) {
      ++in_flight;
      EXPECT_EQ(j["ts"].get<int64_t>() + j["dur"].get<int64_t>(), d.epoch_unix_us + d.dump_time_us);
      EXPECT_EQ(j["args"]["state"], "started");
    }
  }
  size_t calls = 0;
  for (const auto& d : dumps) calls += d.calls.size();
  EXPECT_EQ(complete, static_cast<int>(calls));
  EXPECT_EQ(in_flight, 2);
  EXPECT_EQ(lanes.size(), 3u);  // one (group, thread) lane per process
  // The whole file as Timeline::write_file wraps it is valid JSON.
  std::string text = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  for (size_t i = 0; i < events.size(); ++i) text += (i ? "," : "") + events[i];
  text += "]}";
  EXPECT_TRUE(json::accept(text));
}

// A directory kept across runs: two jobs' records together would pair one
// job's ranks with the other's (an outside trial got "no divergence" from
// a skip and a compute hang mixed). The newest job is analysed, the other
// left out with one message.
TEST(TraceRobustness, TwoJobsInOneDirectoryAnalyseTheNewest) {
  TempDir dir("diststrat_trace_jobs_");
  std::vector<SimProcess> older = sample_job(7), newer = sample_job(8);
  std::vector<json> texts;
  for (SimProcess& p : older) {
    json j = trace_test::to_json(p);
    j["process"]["job"] = "ompi111";
    trace_test::write_file(dir.path() + "/old-" + p.file_name(), j.dump(1));
  }
  for (SimProcess& p : newer) {
    json j = trace_test::to_json(p);
    j["process"]["job"] = "ompi222";
    j["epoch_unix_us"] = p.epoch_unix_us + 3600000000LL;  // an hour later
    trace_test::write_file(dir.path() + "/new-" + p.file_name(), j.dump(1));
  }
  const tr::LoadResult r = tr::load_dir(dir.path());
  ASSERT_EQ(r.dumps.size(), newer.size());
  for (const tr::Dump& d : r.dumps) EXPECT_EQ(d.job, "ompi222");
  std::string all;
  for (const std::string& m : r.messages) all += m + "\n";
  EXPECT_NE(all.find("records of 2 jobs: analysing job 'ompi222'"), std::string::npos) << all;
  const tr::Verdict v = tr::analyze(r.dumps, r.files_skipped);
  EXPECT_EQ(v.culprit_rank, 2) << v.line;
}
