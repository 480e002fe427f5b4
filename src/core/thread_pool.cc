#include "core/thread_pool.h"

#include "diststrat/error.h"

namespace diststrat {

ThreadPool::ThreadPool(int num_threads) {
  threads_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) threads_.emplace_back([this, i] { loop(i); });
}

ThreadPool::~ThreadPool() {
  std::vector<bool> busy;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    busy = busy_;
  }
  work_cv_.notify_all();
  for (size_t i = 0; i < threads_.size(); ++i) {
    // A thread abandoned inside a stalled task can never be joined.
    if (i < busy.size() && busy[i]) {
      threads_[i].detach();
    } else {
      threads_[i].join();
    }
  }
}

ThreadPool::Result ThreadPool::run_all(const std::function<void(int)>& fn,
                                       std::chrono::milliseconds grace) {
  std::unique_lock<std::mutex> lock(mu_);
  if (broken_) {
    throw FailedPreconditionError(
        "a replica thread is stuck in an earlier step and was abandoned; this strategy cannot "
        "run again (destroy it and create a new one)");
  }
  task_ = std::make_shared<const std::function<void(int)>>(fn);
  errors_.assign(threads_.size(), nullptr);
  busy_.assign(threads_.size(), true);
  failed_ = 0;
  remaining_ = size();
  ++generation_;
  work_cv_.notify_all();
  // No deadline while all is well: a user's step may legitimately run for
  // hours, and replicas' collectives carry their own deadlines.
  done_cv_.wait(lock, [&] { return remaining_ == 0 || failed_ > 0; });
  if (remaining_ > 0 && !done_cv_.wait_for(lock, grace, [&] { return remaining_ == 0; })) {
    broken_ = true;
  }
  Result result;
  for (int i = 0; i < size(); ++i) {
    if (busy_[i]) result.unfinished.push_back(i);
  }
  result.errors = std::move(errors_);
  errors_.assign(threads_.size(), nullptr);
  if (!broken_) task_.reset();
  return result;
}

void ThreadPool::loop(int index) {
  long seen = 0;
  for (;;) {
    std::shared_ptr<const std::function<void(int)>> task;  // kept alive while it runs
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
    if (broken_) return;  // run_all gave up on this thread; nobody waits for it
    if (error) ++failed_;
    errors_[index] = std::move(error);  // the worker keeps no reference after unlocking
    busy_[index] = false;
    if (--remaining_ == 0 || failed_ > 0) done_cv_.notify_all();
  }
}

}  // namespace diststrat
