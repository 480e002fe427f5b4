// Persistent worker threads, one per replica. run_all(fn) runs fn(i) on
// thread i for every i and waits for all; thread i is always the same OS
// thread, so per-replica state (a CUDA device, thread-local caches) sticks.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
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
  // Runs fn(i) on thread i for all i; returns each thread's exception (null
  // where fn returned normally). Not reentrant.
  std::vector<std::exception_ptr> run_all(const std::function<void(int)>& fn);

 private:
  void loop(int index);

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int)>* task_ = nullptr;
  std::vector<std::exception_ptr> errors_;
  long generation_ = 0;
  int remaining_ = 0;
  bool stop_ = false;
};

}  // namespace diststrat
