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

inline void run_ranks(InProcessGroup& group, const std::function<void(Communicator&)>& fn) {
  std::vector<std::exception_ptr> errors(group.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < group.size(); ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(group.at(r));
      } catch (...) {
        errors[r] = std::current_exception();
        group.at(r).abort("rank " + std::to_string(r) + " failed");
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace testing
}  // namespace diststrat
