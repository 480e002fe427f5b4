// Runs a piece of test code in a forked child, bounded in time, and reports
// how it ended and how much memory it used at its peak: for checks that a
// call neither hangs (a FIFO where a file should be) nor reads without bound
// (a sparse or decompression-bomb file), without hanging or exhausting the
// test binary itself.
#pragma once

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>

namespace diststrat_test {

struct ChildResult {
  bool timed_out = false;  // killed after the limit
  int exit_code = -1;      // the function's return value (98: it threw)
  int term_signal = 0;
  long max_rss_kib = 0;  // the child's peak resident memory
};

// Forks a child that runs fn and _exits with its return value (98: it
// threw); returns its pid (-1: fork failed). Reap it with wait_for_child.
inline pid_t start_child(const std::function<int()>& fn) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 98;
    try {
      rc = fn();
    } catch (...) {
    }
    std::fflush(nullptr);
    ::_exit(rc);
  }
  return pid;
}

// Waits for child `pid` (SIGKILLed after `limit`) and says how it ended.
inline ChildResult wait_for_child(pid_t pid,
                                  std::chrono::seconds limit = std::chrono::seconds(30)) {
  ChildResult r;
  if (pid < 0) return r;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  rusage ru{};
  for (;;) {
    const pid_t w = ::wait4(pid, &status, WNOHANG, &ru);
    if (w == pid) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::wait4(pid, &status, 0, &ru);
      r.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.term_signal = WTERMSIG(status);
  r.max_rss_kib = ru.ru_maxrss;
  return r;
}

inline ChildResult run_in_child(const std::function<int()>& fn,
                                std::chrono::seconds limit = std::chrono::seconds(30)) {
  return wait_for_child(start_child(fn), limit);
}

// This process's resident memory now (the baseline a child starts from).
inline long current_rss_kib() {
  long pages_total = 0, pages_resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages_total, &pages_resident) != 2) pages_resident = 0;
    std::fclose(f);
  }
  return pages_resident * (::sysconf(_SC_PAGESIZE) / 1024);
}

}  // namespace diststrat_test
