// Test helpers: run N ranks as threads over an InProcessGroup and re-raise
// the first rank's exception (Gloo's harness, in miniature).
#pragma once

#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "diststrat/collective.h"

namespace diststrat {
namespace testing {

// Runs fn(r) for r < n on n threads; when rank r throws, on_error(r) runs
// (to abort the group so the others fail fast). Returns every rank's
// exception (null: none) once all threads joined.
inline std::vector<std::exception_ptr> run_threads_collect(
    int n, const std::function<void(int)>& fn, const std::function<void(int)>& on_error) {
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[r] = std::current_exception();
        on_error(r);
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// Re-raises the first rank's exception, if any.
inline void rethrow_first(const std::vector<std::exception_ptr>& errors) {
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// run_threads_collect, then the first rank's exception is re-raised.
inline void run_threads(int n, const std::function<void(int)>& fn,
                        const std::function<void(int)>& on_error) {
  rethrow_first(run_threads_collect(n, fn, on_error));
}

inline void run_ranks(InProcessGroup& group, const std::function<void(Communicator&)>& fn) {
  run_threads(
      group.size(), [&](int r) { fn(group.at(r)); },
      [&](int r) { group.at(r).abort("rank " + std::to_string(r) + " failed"); });
}

}  // namespace testing
}  // namespace diststrat
