// ClusterCoordinator's internals (diststrat/cluster_coordinator.h): the
// wire protocol between the coordinator and the serving workers, and the
// coordinator's dispatcher (ClusterCoordinator::Impl).
//
// The protocol runs between worker ranks only (the PS ranks never see it),
// over the strategy's own transport, on two tags of its own. Each message is
// a fixed Header, then (when body_bytes > 0) a body on the body tag:
//   coordinator -> worker: kRun   (id, attempt; body = function name + args)
//                          kPing  (keeps an idle worker's wait alive)
//                          kStop  (leave serve())
//                          kFence (on the fence tag, no body: attempt `attempt`
//                          was lost; the worker's run() posts no more pushes
//                          for it)
//   worker -> coordinator: kResult (id, attempt, status = 0 or an ErrorCode
//                          + 1; body = the result bytes or the error text)
// Every transport call is made under the strategy's mutex (Impl::mu), which
// serializes it with the worker's progress thread and the strategy's calls.
//
// Exactly-once results: every dispatch is an attempt with a fresh id; the
// task records the attempt it waits for. A result is accepted only when its
// attempt is the task's current one and the task has no result yet; a lost
// attempt (its worker timed out or failed) is never current again, so its
// late result is refused and counted.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "diststrat/cluster_coordinator.h"
#include "parameter_server/worker.h"

namespace diststrat {

constexpr size_t kMaxFunctionName = 256;

// ---- protocol ----------------------------------------------------------------

namespace ps {

constexpr int kCoordHeaderTag = 0x5043000;
constexpr int kCoordBodyTag = 0x5043001;
constexpr int kCoordFenceTag = 0x5043002;
constexpr uint64_t kCoordMagic = 0x31444F4F43534444ull;  // "DDSCOOD1"
constexpr int64_t kMaxBodyBytes = int64_t{1} << 30;

enum Kind : uint32_t { kRun = 1, kPing = 2, kStop = 3, kResult = 4, kFence = 5 };

struct Header {
  uint64_t magic = kCoordMagic;
  uint32_t kind = 0;
  uint32_t reserved = 0;
  int64_t id = -1;
  int64_t attempt = -1;
  int64_t status = 0;  // kResult: 0 = ok, else ErrorCode + 1 (body = the error text)
  int64_t name_bytes = 0;
  int64_t body_bytes = 0;  // including the name
};

inline const char* kind_name(uint32_t k) {
  switch (k) {
    case kRun:
      return "run";
    case kPing:
      return "ping";
    case kStop:
      return "stop";
    case kResult:
      return "result";
    case kFence:
      return "fence";
  }
  return "unknown";
}

inline void check_header(const Header& h, int rank, int from, uint32_t expected_kind) {
  const bool kind_ok =
      expected_kind == kResult ? h.kind == kResult : (h.kind >= kRun && h.kind <= kStop);
  DISTSTRAT_CHECK(h.magic == kCoordMagic && kind_ok && h.name_bytes >= 0 &&
                      h.name_bytes <= static_cast<int64_t>(kMaxFunctionName) &&
                      h.body_bytes >= h.name_bytes && h.body_bytes <= kMaxBodyBytes,
                  kInvalidArgument, "ClusterCoordinator: rank ", rank,
                  " got a malformed coordinator message from rank ", from, " (kind ", h.kind,
                  ", name ", h.name_bytes, " bytes, body ", h.body_bytes, " bytes)");
}

using Ms = std::chrono::milliseconds;

inline std::string seconds(Ms d) {
  std::ostringstream os;
  os << d.count() / 1000.0 << " s";
  return os.str();
}

// Waits for `r` until `deadline`, testing under `mu` and sleeping between
// tests (so that the progress thread and the strategy keep the transport).
inline void wait_locked(std::mutex& mu, Request& r, Clock::time_point deadline,
                        const std::string& what) {
  for (int spins = 0;; ++spins) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (r.test()) return;
    }
    if (Clock::now() >= deadline) throw DeadlineExceededError(what);
    if (spins > 50) std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
}

}  // namespace ps

// ---- RemoteValue --------------------------------------------------------------

struct RemoteValue::State {
  int64_t id = 0;
  std::string function;
  ps::Ms timeout{0};
  mutable std::mutex mu;
  mutable std::condition_variable cv;
  bool ready = false;
  Bytes result;
  std::exception_ptr error;
};

// ---- the coordinator ----------------------------------------------------------

struct ClusterCoordinator::Impl {
  ParameterServerStrategy& strategy;
  ParameterServerAccess::Impl& s;
  const FunctionRegistry& functions;
  CoordinatorOptions options;
  ps::Ms function_timeout{0}, timeout{0};
  int coordinator_rank = 0;
  bool coordinator = false;

  struct Task {
    std::string function;
    Bytes args;
    std::shared_ptr<RemoteValue::State> value;
    int attempts = 0;
    int64_t attempt = -1;  // the current attempt (-1: queued)
    bool finished = false;
    std::string lost_on;  // workers that lost it, for the error
  };
  enum class Slot { kIdle, kBusy, kFenced, kDead };
  struct Outgoing {
    std::shared_ptr<ps::Header> header;
    std::shared_ptr<Bytes> body;
    std::vector<Request> requests;
  };
  struct Worker {
    int index = 0, rank = -1;
    Slot slot = Slot::kIdle;
    int64_t task = -1, attempt = -1;
    int64_t fenced_attempt = -1;  // the attempt it lost last
    Clock::time_point due, last_sent;
    ps::Header in;
    Request in_request;  // the posted recv of the next header
    std::deque<Outgoing> out;
  };

  // Guarded by mu (not the strategy's: the coordinator's own state).
  mutable std::mutex mu;
  std::condition_variable cv;  // state changes (results, failures)
  std::map<int64_t, Task> tasks;
  std::deque<int64_t> queue;
  std::map<int64_t, int64_t> attempt_task;  // attempt -> task (every attempt ever made)
  int64_t next_id = 0, next_attempt = 0, unfinished = 0;
  std::exception_ptr first_error;
  CoordinatorStats stats;
  std::vector<Worker> workers;  // dispatcher thread only
  bool stopping = false;
  std::thread dispatcher;

  Impl(ParameterServerStrategy& st, const FunctionRegistry& fns, CoordinatorOptions o)
      : strategy(st), s(ParameterServerAccess::impl(st)), functions(fns), options(o) {}

  std::string who() const {
    return detail::str_cat("ClusterCoordinator (worker ", s.index, ", rank ", s.rank, ")");
  }

  // Posts header + body to `w` (dispatcher thread, under s.mu).
  void post(Worker& w, ps::Header h, Bytes body) {
    Outgoing o;
    h.body_bytes = static_cast<int64_t>(body.size());
    o.header = std::make_shared<ps::Header>(h);
    o.body = std::make_shared<Bytes>(std::move(body));
    o.requests.push_back(
        s.transport->send(w.rank, o.header.get(), sizeof(ps::Header), ps::kCoordHeaderTag));
    if (!o.body->empty()) {
      o.requests.push_back(
          s.transport->send(w.rank, o.body->data(), o.body->size(), ps::kCoordBodyTag));
    }
    w.out.push_back(std::move(o));
    w.last_sent = Clock::now();
  }

  void finish(Task& t, int64_t id, Bytes result, std::exception_ptr error) {
    t.finished = true;
    t.attempt = -1;
    --unfinished;
    if (error) {
      ++stats.failed;
      if (!first_error) first_error = error;
    } else {
      ++stats.results_delivered;
    }
    {
      std::lock_guard<std::mutex> lock(t.value->mu);
      t.value->ready = true;
      t.value->result = std::move(result);
      t.value->error = error;
    }
    t.value->cv.notify_all();
    t.args.clear();
    (void)id;
  }

  // The attempt of `w` is lost (caller holds mu): the task goes back to the
  // queue's front, or fails when it was lost too often.
  void lose(Worker& w, const std::string& why) {
    stats.lost_workers.push_back(w.index);
    auto it = tasks.find(w.task);
    w.task = -1;
    w.attempt = -1;
    if (it == tasks.end() || it->second.finished) return;
    Task& t = it->second;
    t.attempt = -1;
    t.lost_on += detail::str_cat(t.lost_on.empty() ? "" : "; ", "worker ", w.index, " (rank ",
                                 w.rank, "): ", why);
    if (t.attempts >= options.max_attempts) {
      finish(t, it->first, {},
             std::make_exception_ptr(UnavailableError(
                 detail::str_cat(who(), ": function '", t.function, "' (id ", it->first,
                                 ") was lost ", t.attempts, " times: ", t.lost_on))));
      return;
    }
    queue.push_front(it->first);
    s.log().log(
        LogLevel::kWarning,
        detail::str_cat(who(), ": function '", t.function, "' (id ", it->first, ") lost on worker ",
                        w.index, " (rank ", w.rank, "): ", why, "; it runs again elsewhere"));
  }

  void fail_all_queued(const std::string& why) {
    while (!queue.empty()) {
      const int64_t id = queue.front();
      queue.pop_front();
      Task& t = tasks.at(id);
      finish(t, id, {},
             std::make_exception_ptr(UnavailableError(detail::str_cat(
                 who(), ": function '", t.function, "' (id ", id, ") cannot run: ", why,
                 t.lost_on.empty() ? "" : "; lost before on ", t.lost_on))));
    }
  }

  void mark_dead(Worker& w, const std::string& why) {
    std::lock_guard<std::mutex> lock(mu);
    if (w.slot == Slot::kBusy) lose(w, why);
    w.slot = Slot::kDead;
    w.in_request = Request();
    s.log().log(LogLevel::kWarning, detail::str_cat(who(), ": worker ", w.index, " (rank ", w.rank,
                                                    ") is gone: ", why));
  }

  // A result header arrived from `w`: receive its body and settle it.
  void on_result(Worker& w) {
    const ps::Header h = w.in;
    ps::check_header(h, s.rank, w.rank, ps::kResult);
    Bytes body(static_cast<size_t>(h.body_bytes));
    if (!body.empty()) {
      Request r;
      {
        std::lock_guard<std::mutex> lock(s.mu);
        r = s.transport->recv(w.rank, body.data(), body.size(), ps::kCoordBodyTag);
      }
      ps::wait_locked(
          s.mu, r, Clock::now() + timeout,
          detail::str_cat(who(), ": the body of a result from worker ", w.index, " (rank ", w.rank,
                          ") did not come within ", ps::seconds(timeout)));
    }
    std::lock_guard<std::mutex> lock(mu);
    auto at = attempt_task.find(h.attempt);
    const bool known = at != attempt_task.end() && at->second == h.id;
    auto it = tasks.find(h.id);
    const bool current =
        known && it != tasks.end() && !it->second.finished && it->second.attempt == h.attempt;
    if (w.slot == Slot::kBusy && w.attempt == h.attempt) {
      w.slot = Slot::kIdle;
      w.task = w.attempt = -1;
    } else if (w.slot == Slot::kFenced) {
      // It was stopped or slow, and is back: it may work again.
      w.slot = Slot::kIdle;
      s.log().log(LogLevel::kWarning,
                  detail::str_cat(who(), ": worker ", w.index, " (rank ", w.rank,
                                  ") answered after its attempt was lost; its result of function "
                                  "id ",
                                  h.id, " (attempt ", h.attempt, ") is refused"));
    }
    if (!current) {
      ++stats.late_results_refused;
    } else if (h.status == 0) {
      finish(it->second, h.id, std::move(body), nullptr);
    } else {
      const std::string text(body.begin(), body.end());
      const auto code = static_cast<ErrorCode>(
          std::clamp<int64_t>(h.status - 1, 0, static_cast<int64_t>(ErrorCode::kInternal)));
      std::exception_ptr e;
      try {
        throw_error(
            code, detail::str_cat("function '", it->second.function, "' (id ", h.id,
                                  ") failed on worker ", w.index, " (rank ", w.rank, "): ", text));
      } catch (...) {
        e = std::current_exception();
      }
      finish(it->second, h.id, {}, e);
    }
    cv.notify_all();
  }

  void post_header_recv(Worker& w) {
    w.in_request = s.transport->recv(w.rank, &w.in, sizeof(ps::Header), ps::kCoordHeaderTag);
  }

  // One pass of the dispatcher. Returns whether anything happened.
  bool poll() {
    bool progress = false;
    std::vector<Worker*> fence;  // workers whose attempt was just lost
    const auto now = Clock::now();
    for (Worker& w : workers) {
      if (w.slot == Slot::kDead) continue;
      bool arrived = false;
      try {
        std::lock_guard<std::mutex> lock(s.mu);
        while (!w.out.empty()) {
          bool all = true;
          for (auto& r : w.out.front().requests) all = r.test() && all;
          if (!all) break;
          w.out.pop_front();
        }
        arrived = w.in_request.test();
      } catch (const std::exception& e) {
        mark_dead(w, e.what());
        progress = true;
        continue;
      }
      if (arrived) {
        try {
          on_result(w);
          std::lock_guard<std::mutex> lock(s.mu);
          post_header_recv(w);
        } catch (const std::exception& e) {
          mark_dead(w, e.what());
        }
        progress = true;
        continue;
      }
      std::lock_guard<std::mutex> lock(mu);
      if (w.slot == Slot::kBusy && now >= w.due) {
        w.fenced_attempt = w.attempt;
        lose(w, detail::str_cat("no answer within function_timeout ", ps::seconds(function_timeout),
                                " (stopped, hung or unreachable); it is fenced: its result "
                                "will be refused"));
        w.slot = Slot::kFenced;
        cv.notify_all();
        progress = true;
        fence.push_back(&w);
      }
    }
    // A fenced worker is told (it reads it when it runs again, before its
    // next push): its late pushes for the lost attempt are not posted.
    for (Worker* w : fence) {
      auto f = std::make_shared<ps::Header>();
      f->kind = ps::kFence;
      f->attempt = w->fenced_attempt;
      try {
        std::lock_guard<std::mutex> tl(s.mu);
        Outgoing o;
        o.header = f;
        o.requests.push_back(
            s.transport->send(w->rank, f.get(), sizeof(ps::Header), ps::kCoordFenceTag));
        w->out.push_back(std::move(o));
      } catch (const std::exception& e) {
        mark_dead(*w, e.what());
      }
    }
    // Dispatch queued functions to idle workers; ping the other idle ones.
    for (Worker& w : workers) {
      if (w.slot != Slot::kIdle) continue;
      std::unique_lock<std::mutex> lock(mu);
      if (!queue.empty()) {
        const int64_t id = queue.front();
        queue.pop_front();
        Task& t = tasks.at(id);
        const int64_t attempt = next_attempt++;
        if (t.attempts > 0) ++stats.reruns;
        ++t.attempts;
        ++stats.attempts;
        t.attempt = attempt;
        attempt_task[attempt] = id;
        w.slot = Slot::kBusy;
        w.task = id;
        w.attempt = attempt;
        w.due = now + function_timeout;
        ps::Header h;
        h.kind = ps::kRun;
        h.id = id;
        h.attempt = attempt;
        h.name_bytes = static_cast<int64_t>(t.function.size());
        Bytes body(t.function.begin(), t.function.end());
        body.insert(body.end(), t.args.begin(), t.args.end());
        lock.unlock();
        try {
          std::lock_guard<std::mutex> tl(s.mu);
          post(w, h, std::move(body));
        } catch (const std::exception& e) {
          mark_dead(w, e.what());
        }
        progress = true;
      } else if (now - w.last_sent > timeout / 4) {
        lock.unlock();
        ps::Header h;
        h.kind = ps::kPing;
        try {
          std::lock_guard<std::mutex> tl(s.mu);
          post(w, h, {});
        } catch (const std::exception& e) {
          mark_dead(w, e.what());
        }
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    if (!queue.empty() && std::all_of(workers.begin(), workers.end(),
                                      [](const Worker& w) { return w.slot == Slot::kDead; })) {
      fail_all_queued("every serving worker is gone");
      cv.notify_all();
    }
    return progress;
  }

  void run_dispatcher() {
    for (;;) {
      bool progress = false;
      try {
        progress = poll();
      } catch (const std::exception& e) {
        s.log().log(LogLevel::kError, detail::str_cat(who(), ": dispatcher: ", e.what()));
      }
      {
        std::unique_lock<std::mutex> lock(mu);
        if (stopping && unfinished == 0) break;
        if (!progress) cv.wait_for(lock, std::chrono::milliseconds(1));  // results come by polling
      }
    }
    // Tell every live worker to leave serve(); wait briefly for the sends.
    const auto deadline = Clock::now() + std::min<ps::Ms>(timeout, ps::Ms(5000));
    for (Worker& w : workers) {
      if (w.slot == Slot::kDead) continue;
      ps::Header h;
      h.kind = ps::kStop;
      try {
        std::lock_guard<std::mutex> tl(s.mu);
        post(w, h, {});
      } catch (const std::exception&) {
      }
    }
    for (Worker& w : workers) {
      if (w.slot == Slot::kDead || w.slot == Slot::kFenced) continue;
      for (auto& o : w.out) {
        for (auto& r : o.requests) {
          try {
            ps::wait_locked(s.mu, r, deadline, "stop");
          } catch (const std::exception&) {
          }
        }
      }
    }
  }

  // Raises (and forgets) the first error (caller holds mu).
  void raise_pending(std::unique_lock<std::mutex>& lock) {
    if (!first_error) return;
    std::exception_ptr e = first_error;
    first_error = nullptr;
    lock.unlock();
    std::rethrow_exception(e);
  }

  void require_coordinator(const char* what) const {
    DISTSTRAT_CHECK(coordinator, kFailedPrecondition, "ClusterCoordinator::", what, " on worker ",
                    s.index, " (rank ", s.rank, "): only the coordinator (worker 0, rank ",
                    coordinator_rank, ") schedules; the other workers call serve()");
  }
};

}  // namespace diststrat
