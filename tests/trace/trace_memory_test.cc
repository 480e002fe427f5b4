// diststrat-trace's memory on small hostile files: what the reader and the
// analysis allocate is bounded by what the files contain, never by a size a
// file claims (docs/flight_recorder.md states the bound). Each case runs in a
// forked child whose address space is capped at what it had plus a budget,
// so an unbounded allocation is a failure of the test (the child reports
// std::bad_alloc, or dies), not a machine out of memory.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <algorithm>
#include <functional>
#include <new>
#include <string>
#include <thread>

#include "../common/temp_dir.h"
#include "flight_record.h"
#include "trace_analysis.h"

namespace tr = diststrat::trace;
using diststrat_test::TempDir;

namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;  // the sanitizers reserve terabytes of address space
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

// This process's address space now, in bytes.
size_t address_space_bytes() {
  std::ifstream statm("/proc/self/statm");
  size_t pages = 0;
  statm >> pages;
  return pages * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
}

// Runs `body` in a child limited to its address space at the fork plus
// `budget` bytes. Returns "" when body returned, else what happened.
std::string run_capped(size_t budget, const std::function<void()>& body) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    const rlim_t cap = address_space_bytes() + budget;
    const rlimit lim{cap, cap};
    if (::setrlimit(RLIMIT_AS, &lim) != 0) ::_exit(4);
    int rc = 0;
    try {
      body();
    } catch (const std::bad_alloc&) {
      rc = 3;
    } catch (...) {
      rc = 5;
    }
    ::_exit(rc);
  }
  // A deadline on the wait: a runaway child is killed and reported.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  int status = 0;
  for (;;) {
    const pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return "still running after 120 s (killed)";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  switch (WEXITSTATUS(status)) {
    case 0:
      return "";
    case 3:
      return "std::bad_alloc within the budget";
    case 4:
      return "setrlimit failed";
    default:
      return "exit status " + std::to_string(WEXITSTATUS(status));
  }
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::string head(int rank, const std::string& calls) {
  return R"({"format":"diststrat-flight-record","version":1,"process":{"rank":)" +
         std::to_string(rank) + R"(,"size":2,"host":"h","pid":)" + std::to_string(100 + rank) +
         R"(},"dump_time_us":5000,"calls":[)" + calls + "]}";
}

std::string call(const std::string& group, int rank, int size, int64_t seq) {
  return R"({"group":")" + group + R"(","group_rank":)" + std::to_string(rank) +
         R"(,"group_size":)" + std::to_string(size) + R"(,"seq":)" + std::to_string(seq) +
         R"(,"kind":"all_reduce","state":"started"})";
}

// The whole tool's work on a directory, as main does it.
void analyze_dir(const std::string& dir, std::string* line = nullptr) {
  const tr::LoadResult r = tr::load_dir(dir);
  if (!r.error.empty()) throw std::runtime_error(r.error);
  const tr::Verdict v = tr::analyze(r.dumps, r.files_skipped);
  const std::string table = tr::group_table(r.dumps);
  if (line != nullptr) *line = v.line + "\n" + table;
}

constexpr size_t kMiB = size_t{1} << 20;

}  // namespace

// 300 groups (2 files, about 40 KB in all) each claiming 2^20 ranks of which
// one or two left a record: memory follows the records (the verdict still
// counts every claimed rank).
TEST(TraceMemory, ClaimedGroupSizeAllocatesByRecords) {
  if (kSanitized) GTEST_SKIP() << "address space caps do not work under sanitizers";
  TempDir dir("diststrat_trace_mem_");
  std::string a, b;
  for (int g = 0; g < 300; ++g) {
    const std::string name = "g" + std::to_string(g);
    a += (g ? "," : "") + call(name, 0, tr::kMaxGroupSize, 7);
    b += (g ? "," : "") + call(name, 1, tr::kMaxGroupSize, 7);
  }
  write_text(dir / "flight-rank0.json", head(0, a));
  write_text(dir / "flight-rank1.json", head(1, b));
  EXPECT_EQ(run_capped(64 * kMiB, [&] { analyze_dir(dir.path()); }), "");
  // What it says, in this process: every missing rank counted.
  std::string out;
  analyze_dir(dir.path(), &out);
  EXPECT_NE(out.find("ranks 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17 and " +
                     std::to_string(tr::kMaxGroupSize - 2 - 16) + " more of group 'g"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find(": " + std::to_string(tr::kMaxGroupSize) + " ranks, 2 with a record"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("... and " + std::to_string(tr::kMaxGroupSize - 32) + " more ranks"),
            std::string::npos)
      << out;
}

// Arrays nested 8 million deep (16 MB): refused at once, as nothing a
// flight record holds is nested more than a few levels; the parsed form of
// such a file takes about 20 times its size, and freeing it allocates.
TEST(TraceMemory, DeepNestingIsRefusedWithoutParsing) {
  if (kSanitized) GTEST_SKIP() << "address space caps do not work under sanitizers";
  TempDir dir("diststrat_trace_mem_");
  const size_t depth = 8 * kMiB;
  write_text(dir / "flight-rank0.json", head(0, call("world", 0, 2, 1)));
  write_text(dir / "flight-nested.json", std::string(depth, '[') + std::string(depth, ']'));
  write_text(dir / "flight-nested-open.json", std::string(depth, '['));
  write_text(dir / "flight-nested-in-record.json",
             head(1, call("world", 1, 2, 1))
                 .insert(1, "\"x\":" + std::string(depth, '[') + std::string(depth, ']') + ","));
  EXPECT_EQ(run_capped(64 * kMiB, [&] { analyze_dir(dir.path()); }), "");
  const tr::LoadResult r = tr::load_dir(dir.path());
  ASSERT_EQ(r.messages.size(), 3u);
  for (const std::string& m : r.messages) {
    EXPECT_NE(m.find(": not a flight record (arrays and objects nested more than " +
                     std::to_string(tr::kMaxNesting) + " deep, at byte "),
              std::string::npos)
        << m;
  }
}

// Files of many tiny values (empty arrays, zeros, empty strings, one-byte
// keys) under a key the reader ignores: the tool stays within the stated
// bound (docs/flight_recorder.md: kMemoryPerFileByte times the largest file,
// plus the same per byte of all records).
TEST(TraceMemory, TinyValuesStayWithinTheStatedBound) {
  if (kSanitized) GTEST_SKIP() << "address space caps do not work under sanitizers";
  const size_t n = 2 * kMiB;
  const std::string fillers[] = {"[],", "0,", "\"\",", "{},", "[[]],"};
  for (const std::string& filler : fillers) {
    TempDir dir("diststrat_trace_mem_");
    std::string junk = "[";
    while (junk.size() < n) junk += filler;
    junk.back() = ']';
    std::string text = head(0, call("world", 0, 1, 1));
    text.insert(1, "\"x\":" + junk + ",");
    write_text(dir / "flight-rank0.json", text);
    // The bound for a directory of one file, plus room for the test itself.
    const size_t budget = 2 * tr::kMemoryPerFileByte * text.size() + 16 * kMiB;
    EXPECT_EQ(run_capped(budget, [&] { analyze_dir(dir.path()); }), "") << "filler " << filler;
  }
}

// Two records of 40,000 minimal calls each (about 3 MB in all) that agree
// throughout: what is kept of them and the walk over every seq stay within
// the stated bound.
TEST(TraceMemory, ManyCallsStayWithinTheStatedBound) {
  if (kSanitized) GTEST_SKIP() << "address space caps do not work under sanitizers";
  TempDir dir("diststrat_trace_mem_");
  size_t total = 0, largest = 0;
  for (int r = 0; r < 2; ++r) {
    std::string calls;
    for (int64_t s = 0; s < 40000; ++s) calls += (s ? "," : "") + call("w", r, 2, s);
    const std::string text = head(r, calls);
    write_text(dir / ("flight-rank" + std::to_string(r) + ".json"), text);
    total += text.size();
    largest = std::max(largest, text.size());
  }
  const size_t budget = tr::kMemoryPerFileByte * (largest + total) + 16 * kMiB;
  std::string out;
  EXPECT_EQ(run_capped(budget, [&] { analyze_dir(dir.path(), &out); }), "");
}
