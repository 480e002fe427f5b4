// Persistent worker threads, one per replica. run_all(fn) runs fn(i) on
// thread i for every i and waits for all; thread i is always the same OS
// thread, so per-replica state (a CUDA device, thread-local caches) sticks.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

namespace diststrat {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(threads_.size()); }
  struct Result {
    std::vector<std::exception_ptr> errors;  // per thread; null where fn returned
    std::vector<int> unfinished;             // threads abandoned (see below)
  };
  // Runs fn(i) on thread i for all i and waits for all. Once some thread has
  // failed, the others get `grace` to finish (a failed replica aborts its
  // peers' collectives, so healthy ones return at once); a thread still busy
  // after that, or parked (park_forever), is stuck and is abandoned: run_all
  // returns, listing it, and the pool is unusable from then on
  // (FailedPrecondition). The destructor detaches abandoned threads.
  //
  // Ownership: fn is copied into state the pool threads co-own (with the
  // pool's own mutexes and bookkeeping), so an abandoned thread never touches
  // freed pool memory or a destroyed function object, even if it returns
  // after the pool is gone. What fn captures by reference is the caller's to
  // keep alive for a thread that may still use it. Not reentrant.
  Result run_all(std::function<void(int)> fn,
                 std::chrono::milliseconds grace = std::chrono::hours(24 * 365));
  bool broken() const;

  // For a task that is stuck on purpose (fault injection's stall): tells the
  // pool running it (if the calling thread is a pool thread) that this
  // thread will never finish, then blocks forever touching nothing shared.
  // The pool abandons a parked thread as soon as another thread has failed,
  // without waiting `grace`; and because parking synchronizes with run_all,
  // everything the task did before it happens-before run_all's return (the
  // caller may then free what the task read). Never returns.
  [[noreturn]] static void park_forever();

  struct State;  // shared with the threads (thread_pool.cc)

 private:
  static void loop(std::shared_ptr<State> state, int index);

  std::shared_ptr<State> state_;  // co-owned by every pool thread
  std::vector<std::thread> threads_;
};

}  // namespace diststrat
