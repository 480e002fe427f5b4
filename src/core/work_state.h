// The shared state behind a Work handle, for the code that completes it
// (strategy.cc, the multi-worker fusion engine).
#pragma once

#include <condition_variable>
#include <exception>
#include <mutex>

#include "diststrat/strategy.h"

namespace diststrat {

struct Work::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;

  // Marks the work complete (with `e` as its error, if any) and wakes waiters.
  // Notifies under the lock: a waiter that sees `done` may drop the last
  // reference and destroy this state at once, so nothing here may touch it
  // after the lock is released (TSan: cond_broadcast vs cond_destroy).
  void finish(std::exception_ptr e = nullptr) {
    std::lock_guard<std::mutex> lock(mu);
    if (done) return;
    error = e;
    done = true;
    cv.notify_all();
  }
};

}  // namespace diststrat
