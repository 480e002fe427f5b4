// Persistent worker threads, one per replica. run_all(fn) runs fn(i) on
// thread i for every i and waits for all; thread i is always the same OS
// thread, so per-replica state (a CUDA device, thread-local caches) sticks.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
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
  // after that is stuck (a stalled replica) and is abandoned: run_all returns,
  // listing it, and the pool is unusable from then on (FailedPrecondition).
  // The destructor detaches abandoned threads. An abandoned task must never
  // return: the frames it was called from are gone (a stuck replica is
  // assumed stuck for good — the process should save what it can and exit).
  // Not reentrant.
  Result run_all(const std::function<void(int)>& fn,
                 std::chrono::milliseconds grace = std::chrono::hours(24 * 365));
  bool broken() const { return broken_; }

 private:
  void loop(int index);

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  // A copy of run_all's fn that each thread holds while running it, so a
  // thread abandoned mid-task never refers to a destroyed function object
  // (TSan reported the free racing with the stuck thread's earlier reads).
  std::shared_ptr<const std::function<void(int)>> task_;
  std::vector<std::exception_ptr> errors_;
  std::vector<bool> busy_;
  int failed_ = 0;
  bool broken_ = false;
  long generation_ = 0;
  int remaining_ = 0;
  bool stop_ = false;
};

}  // namespace diststrat
