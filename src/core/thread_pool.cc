#include "core/thread_pool.h"

namespace diststrat {

ThreadPool::ThreadPool(int num_threads) {
  threads_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) threads_.emplace_back([this, i] { loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

std::vector<std::exception_ptr> ThreadPool::run_all(const std::function<void(int)>& fn) {
  std::unique_lock<std::mutex> lock(mu_);
  task_ = &fn;
  errors_.assign(threads_.size(), nullptr);
  remaining_ = size();
  ++generation_;
  work_cv_.notify_all();
  // No deadline here on purpose: replicas' own waits (collectives) carry the
  // deadlines, and a user's step may legitimately run for hours.
  done_cv_.wait(lock, [&] { return remaining_ == 0; });
  task_ = nullptr;
  return std::move(errors_);
}

void ThreadPool::loop(int index) {
  long seen = 0;
  for (;;) {
    const std::function<void(int)>* task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      task = task_;
    }
    std::exception_ptr error;
    try {
      (*task)(index);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mu_);
    errors_[index] = std::move(error);  // the worker keeps no reference after unlocking
    if (--remaining_ == 0) done_cv_.notify_all();
  }
}

}  // namespace diststrat
