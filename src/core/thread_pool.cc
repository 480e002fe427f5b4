#include "core/thread_pool.h"

#include <condition_variable>
#include <mutex>

#include "diststrat/error.h"

namespace diststrat {

struct ThreadPool::State {
  explicit State(int n) : errors(n), busy(n, 0), parked(n, 0) {}
  std::mutex mu;
  std::condition_variable work_cv;
  std::condition_variable done_cv;
  // The running step's function: each thread holds its own reference while
  // it runs it.
  std::shared_ptr<const std::function<void(int)>> task;
  std::vector<std::exception_ptr> errors;
  std::vector<char> busy;    // per thread: running the current task
  std::vector<char> parked;  // per thread: called park_forever (never finishes)
  int num_parked = 0;
  int failed = 0;
  bool broken = false;
  long generation = 0;
  int remaining = 0;
  bool stop = false;
};

namespace {
// The pool state and index of the calling thread, for park_forever (null off
// pool threads; a pool thread's loop owns a reference to its state).
thread_local ThreadPool::State* current_state = nullptr;
thread_local int current_index = -1;
}  // namespace

ThreadPool::ThreadPool(int num_threads) : state_(std::make_shared<State>(num_threads)) {
  threads_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) threads_.emplace_back(&ThreadPool::loop, state_, i);
}

ThreadPool::~ThreadPool() {
  std::vector<char> busy;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
    busy = state_->busy;
  }
  state_->work_cv.notify_all();
  for (size_t i = 0; i < threads_.size(); ++i) {
    // A thread abandoned inside a stalled task can never be joined; it keeps
    // the state alive.
    if (busy[i]) {
      threads_[i].detach();
    } else {
      threads_[i].join();
    }
  }
}

bool ThreadPool::broken() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->broken;
}

ThreadPool::Result ThreadPool::run_all(std::function<void(int)> fn,
                                       std::chrono::milliseconds grace) {
  State& s = *state_;
  auto task = std::make_shared<const std::function<void(int)>>(std::move(fn));
  std::unique_lock<std::mutex> lock(s.mu);
  if (s.broken) {
    throw FailedPreconditionError(
        "a replica thread is stuck in an earlier step and was abandoned; this strategy cannot "
        "run again (destroy it and create a new one)");
  }
  s.task = std::move(task);
  s.errors.assign(threads_.size(), nullptr);
  s.busy.assign(threads_.size(), 1);
  s.failed = 0;
  s.remaining = size();
  ++s.generation;
  s.work_cv.notify_all();
  // No deadline while all is well: a user's step may legitimately run for
  // hours, and replicas' collectives carry their own deadlines.
  s.done_cv.wait(lock, [&] { return s.remaining == 0 || s.failed > 0; });
  if (s.remaining > 0) {
    // Busy threads get `grace`; parked ones never finish.
    s.done_cv.wait_for(lock, grace, [&] { return s.remaining == s.num_parked; });
    s.broken = s.remaining > 0;
  }
  Result result;
  for (int i = 0; i < size(); ++i) {
    if (s.busy[i]) result.unfinished.push_back(i);
  }
  result.errors = std::move(s.errors);
  s.errors.assign(threads_.size(), nullptr);
  if (!s.broken) s.task.reset();
  return result;
}

void ThreadPool::loop(std::shared_ptr<State> state, int index) {
  State& s = *state;
  current_state = state.get();
  current_index = index;
  long seen = 0;
  for (;;) {
    std::shared_ptr<const std::function<void(int)>> task;  // kept alive while it runs
    {
      std::unique_lock<std::mutex> lock(s.mu);
      s.work_cv.wait(lock, [&] { return s.stop || s.generation != seen; });
      if (s.stop) return;
      seen = s.generation;
      task = s.task;
    }
    std::exception_ptr error;
    try {
      (*task)(index);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.broken) return;  // run_all gave up on this thread; nobody waits for it
    if (error) ++s.failed;
    s.errors[index] = std::move(error);  // the worker keeps no reference after unlocking
    s.busy[index] = 0;
    if (--s.remaining == 0 || s.failed > 0) s.done_cv.notify_all();
  }
}

void ThreadPool::park_forever() {
  if (State* state = current_state) {
    std::lock_guard<std::mutex> lock(state->mu);
    if (!state->parked[current_index]) {
      state->parked[current_index] = 1;
      ++state->num_parked;
    }
    state->done_cv.notify_all();
  }
  // From here on this thread touches only its own stack.
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

}  // namespace diststrat
