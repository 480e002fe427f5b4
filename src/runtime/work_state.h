// The shared state behind a Work handle, for the code that completes it
// (strategy.cc, the multi-worker fusion engine).
#pragma once

#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>

#include "diststrat/error.h"
#include "diststrat/strategy.h"

namespace diststrat {

struct Work::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  // The error as plain data, never as a shared exception object: an
  // exception_ptr shared between the finishing thread and the waiters is
  // reference-counted inside libstdc++, where ThreadSanitizer cannot see the
  // ordering, and its last release may fall on either side.
  bool failed = false;
  ErrorCode code = ErrorCode::kInternal;
  std::string message;

  // Marks the work complete (failed with `e`, if any) and wakes waiters.
  // `e` is read here, in the finishing thread, and not kept.
  // Notifies under the lock: a waiter that sees `done` may drop the last
  // reference and destroy this state at once, so nothing here may touch it
  // after the lock is released (TSan: cond_broadcast vs cond_destroy).
  void finish(std::exception_ptr e = nullptr) {
    bool is_error = false;
    ErrorCode c = ErrorCode::kInternal;
    std::string m;
    if (e) {
      is_error = true;
      try {
        std::rethrow_exception(e);
      } catch (const Error& err) {
        c = err.code();
        m = err.message();
      } catch (const std::exception& err) {
        m = err.what();
      } catch (...) {
        m = "an exception that is not a std::exception";
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    if (done) return;
    failed = is_error;
    code = c;
    message = std::move(m);
    done = true;
    cv.notify_all();
  }
};

}  // namespace diststrat
