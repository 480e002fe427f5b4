// ClusterCoordinator (diststrat/cluster_coordinator.h): RemoteValue, the
// coordinator's calls and the serving workers' loop; the protocol and the
// dispatcher are in coordinator_impl.h.
#include "diststrat/cluster_coordinator.h"

#include "parameter_server/coordinator_impl.h"
#include "parameter_server/shard_updater.h"

namespace diststrat {

int64_t RemoteValue::id() const {
  DISTSTRAT_CHECK(state_ != nullptr, kFailedPrecondition, "RemoteValue::id on an empty value");
  return state_->id;
}

const std::string& RemoteValue::function() const {
  DISTSTRAT_CHECK(state_ != nullptr, kFailedPrecondition,
                  "RemoteValue::function on an empty value");
  return state_->function;
}

bool RemoteValue::ready() const {
  if (!state_) return false;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->ready;
}

Bytes RemoteValue::fetch() const {
  DISTSTRAT_CHECK(state_ != nullptr, kFailedPrecondition, "RemoteValue::fetch on an empty value");
  std::unique_lock<std::mutex> lock(state_->mu);
  if (!state_->cv.wait_for(lock, state_->timeout, [&] { return state_->ready; })) {
    throw DeadlineExceededError(detail::str_cat("RemoteValue::fetch: function '", state_->function,
                                                "' (id ", state_->id, ") has no result after ",
                                                ps::seconds(state_->timeout)));
  }
  if (state_->error) std::rethrow_exception(state_->error);
  return state_->result;
}

ClusterCoordinator::ClusterCoordinator(ParameterServerStrategy& strategy,
                                       const FunctionRegistry& functions,
                                       CoordinatorOptions options)
    : impl_(std::make_unique<Impl>(strategy, functions, options)) {
  Impl& m = *impl_;
  DISTSTRAT_CHECK(!m.s.is_ps, kFailedPrecondition, "ClusterCoordinator on PS rank ", m.s.rank,
                  ": PS ranks only serve their shards (call join() there)");
  DISTSTRAT_CHECK(m.s.num_workers() >= 2, kFailedPrecondition,
                  "ClusterCoordinator needs a coordinator and at least one serving worker; this "
                  "job has ",
                  m.s.num_workers(), " worker(s)");
  DISTSTRAT_CHECK(options.max_attempts >= 1, kInvalidArgument,
                  "CoordinatorOptions::max_attempts must be >= 1, got ", options.max_attempts);
  DISTSTRAT_CHECK(options.function_timeout.count() >= 0 && options.timeout.count() >= 0,
                  kInvalidArgument, "CoordinatorOptions: timeouts must not be negative");
  const ps::Ms comm = m.s.options.communication.timeout;
  m.function_timeout = options.function_timeout.count() > 0 ? options.function_timeout : comm;
  m.timeout = options.timeout.count() > 0 ? options.timeout : comm;
  m.coordinator_rank = m.s.worker_ranks.at(0);
  m.coordinator = m.s.index == 0;
  if (!m.coordinator) return;
  for (int i = 1; i < m.s.num_workers(); ++i) {
    Impl::Worker w;
    w.index = i;
    w.rank = m.s.worker_ranks[i];
    w.last_sent = Clock::now();
    m.workers.push_back(std::move(w));
  }
  {
    std::lock_guard<std::mutex> lock(m.s.mu);
    for (auto& w : m.workers) m.post_header_recv(w);
  }
  m.dispatcher = std::thread([&m] { m.run_dispatcher(); });
}

ClusterCoordinator::~ClusterCoordinator() {
  Impl& m = *impl_;
  if (!m.coordinator) return;
  {
    std::unique_lock<std::mutex> lock(m.mu);
    // Outstanding functions get the timeout to finish; then they are failed.
    m.cv.wait_for(lock, m.timeout, [&] { return m.unfinished == 0; });
    if (m.unfinished > 0) {
      m.fail_all_queued("the coordinator is being destroyed");
      for (auto& [id, t] : m.tasks) {
        if (!t.finished) {
          m.finish(t, id, {},
                   std::make_exception_ptr(AbortedError(
                       detail::str_cat(m.who(), ": function '", t.function, "' (id ", id,
                                       ") was still out when the coordinator was destroyed"))));
        }
      }
    }
    m.stopping = true;
    m.cv.notify_all();
  }
  m.dispatcher.join();
  // Receives still posted are dropped (cancelled) with the workers.
}

bool ClusterCoordinator::is_coordinator() const { return impl_->coordinator; }

void ClusterCoordinator::declare_update_rule(const Optimizer& optimizer) {
  Impl& m = *impl_;
  m.require_coordinator("declare_update_rule");
  const ps::OptimizerConfig config = ps::describe_optimizer(optimizer);
  ps::make_shard_updater(config);  // the PS ranks check it too; fail here first
  std::lock_guard<std::mutex> lock(m.s.mu);
  std::vector<const ParameterServerAccess::Impl::VarInfo*> fresh;
  for (const auto& vi : m.s.vars) {
    // Only float32 variables are updated by an optimizer (a step counter is not).
    if (!vi->rule_declared && vi->var->dtype == DType::kFloat32) fresh.push_back(vi.get());
  }
  if (fresh.empty()) return;
  m.s.post_rules(fresh, config, false, "the coordinator's declaration of the update rule");
  for (const auto* vi : fresh)
    const_cast<ParameterServerAccess::Impl::VarInfo*>(vi)->rule_declared = true;
  if (m.s.declared_config.name.empty()) m.s.declared_config = config;
}

RemoteValue ClusterCoordinator::schedule(const std::string& function, Bytes args) {
  Impl& m = *impl_;
  m.require_coordinator("schedule");
  m.functions.at(function);  // registered?
  DISTSTRAT_CHECK(static_cast<int64_t>(args.size() + function.size()) <= ps::kMaxBodyBytes,
                  kInvalidArgument, "ClusterCoordinator::schedule('", function, "'): ", args.size(),
                  " bytes of arguments exceed ", ps::kMaxBodyBytes);
  std::unique_lock<std::mutex> lock(m.mu);
  m.raise_pending(lock);
  const int64_t id = m.next_id++;
  auto value = std::make_shared<RemoteValue::State>();
  value->id = id;
  value->function = function;
  value->timeout = m.timeout;
  Impl::Task& t = m.tasks[id];
  t.function = function;
  t.args = std::move(args);
  t.value = value;
  ++m.unfinished;
  ++m.stats.scheduled;
  m.queue.push_back(id);
  m.cv.notify_all();
  return RemoteValue(value);
}

void ClusterCoordinator::join() {
  Impl& m = *impl_;
  m.require_coordinator("join");
  std::unique_lock<std::mutex> lock(m.mu);
  if (!m.cv.wait_for(lock, m.timeout, [&] { return m.unfinished == 0; })) {
    std::string out;
    int listed = 0;
    for (const auto& [id, t] : m.tasks) {
      if (t.finished || listed++ >= 8) continue;
      out += detail::str_cat(out.empty() ? "" : ", ", "'", t.function, "' (id ", id,
                             t.attempt < 0 ? ", queued" : ", running", ")");
    }
    throw DeadlineExceededError(detail::str_cat(m.who(), ": join: ", m.unfinished,
                                                " function(s) unfinished after ",
                                                ps::seconds(m.timeout), ": ", out));
  }
  m.raise_pending(lock);
}

bool ClusterCoordinator::done() {
  Impl& m = *impl_;
  m.require_coordinator("done");
  std::unique_lock<std::mutex> lock(m.mu);
  m.raise_pending(lock);
  return m.unfinished == 0;
}

std::vector<Bytes> ClusterCoordinator::fetch(const std::vector<RemoteValue>& values) {
  std::vector<Bytes> out;
  out.reserve(values.size());
  for (const auto& v : values) out.push_back(v.fetch());
  return out;
}

CoordinatorStats ClusterCoordinator::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

void ClusterCoordinator::serve() {
  Impl& m = *impl_;
  DISTSTRAT_CHECK(!m.coordinator, kFailedPrecondition, m.who(),
                  ": serve() is for the other workers; the coordinator schedules");
  auto& t = *m.s.transport;
  const int from = m.coordinator_rank;
  std::deque<Impl::Outgoing> out;  // results in flight
  // Fencing: the coordinator says on the fence tag which attempt it lost;
  // run() asks before posting a step's pushes (Impl::before_push), so a
  // function that resumes after its attempt was lost pushes no more.
  struct Fence {
    ps::Header h;
    Request r;
    int64_t running = -1;  // the attempt being run (-1: none)
    std::string function;
    bool fenced = false;
  } fence;
  {
    std::lock_guard<std::mutex> lock(m.s.mu);
    fence.r = t.recv(from, &fence.h, sizeof(ps::Header), ps::kCoordFenceTag);
  }
  m.s.before_push = [&] {
    {
      std::lock_guard<std::mutex> lock(m.s.mu);
      while (fence.r.test()) {
        if (fence.h.kind == ps::kFence && fence.h.attempt == fence.running) fence.fenced = true;
        fence.r = t.recv(from, &fence.h, sizeof(ps::Header), ps::kCoordFenceTag);
      }
    }
    if (fence.fenced) {
      m.s.log().log(LogLevel::kWarning,
                    detail::str_cat("worker ", m.s.index, " (rank ", m.s.rank, "): function '",
                                    fence.function, "' (attempt ", fence.running,
                                    ") was fenced by the coordinator; its push is not posted"));
      throw AbortedError(detail::str_cat(
          "worker ", m.s.index, " (rank ", m.s.rank, "): function '", fence.function, "' (attempt ",
          fence.running,
          ") was fenced: the coordinator lost it after function_timeout and runs it elsewhere; "
          "its pushes are not posted"));
    }
  };
  struct Unhook {
    ParameterServerAccess::Impl& s;
    ~Unhook() { s.before_push = nullptr; }
  } unhook{m.s};
  for (;;) {
    ps::Header h;
    Request r;
    {
      std::lock_guard<std::mutex> lock(m.s.mu);
      r = t.recv(from, &h, sizeof(ps::Header), ps::kCoordHeaderTag);
    }
    ps::wait_locked(
        m.s.mu, r, Clock::now() + m.timeout,
        detail::str_cat("ClusterCoordinator::serve on worker ", m.s.index, " (rank ", m.s.rank,
                        "): the coordinator (rank ", from, ") sent nothing for ",
                        ps::seconds(m.timeout), ": it failed, or is stopped or unreachable"));
    ps::check_header(h, m.s.rank, from, ps::kRun);
    Bytes body(static_cast<size_t>(h.body_bytes));
    if (!body.empty()) {
      {
        std::lock_guard<std::mutex> lock(m.s.mu);
        r = t.recv(from, body.data(), body.size(), ps::kCoordBodyTag);
      }
      ps::wait_locked(
          m.s.mu, r, Clock::now() + m.timeout,
          detail::str_cat("ClusterCoordinator::serve on worker ", m.s.index, ": the body of a ",
                          ps::kind_name(h.kind), " message from rank ", from, " did not come"));
    }
    {  // Results sent earlier that have left.
      std::lock_guard<std::mutex> lock(m.s.mu);
      while (!out.empty()) {
        bool all = true;
        for (auto& q : out.front().requests) all = q.test() && all;
        if (!all) break;
        out.pop_front();
      }
    }
    if (h.kind == ps::kStop) break;
    if (h.kind == ps::kPing) continue;
    const std::string name(body.begin(), body.begin() + h.name_bytes);
    const Bytes args(body.begin() + h.name_bytes, body.end());
    ps::Header reply;
    reply.kind = ps::kResult;
    reply.id = h.id;
    reply.attempt = h.attempt;
    Bytes result;
    fence.running = h.attempt;
    fence.function = name;
    fence.fenced = false;
    try {
      result = m.functions.at(name)(m.strategy, args);
    } catch (const Error& e) {
      reply.status = static_cast<int64_t>(e.code()) + 1;
      result.assign(e.what(), e.what() + std::strlen(e.what()));
    } catch (const std::exception& e) {
      reply.status = static_cast<int64_t>(ErrorCode::kInternal) + 1;
      result.assign(e.what(), e.what() + std::strlen(e.what()));
    } catch (...) {
      // Any other thrown value fails the function, not the serving worker.
      static const char kWhat[] = "it threw something that is not a std::exception";
      reply.status = static_cast<int64_t>(ErrorCode::kInternal) + 1;
      result.assign(kWhat, kWhat + sizeof kWhat - 1);
    }
    DISTSTRAT_CHECK(static_cast<int64_t>(result.size()) <= ps::kMaxBodyBytes, kInvalidArgument,
                    "function '", name, "' returned ", result.size(), " bytes, over ",
                    ps::kMaxBodyBytes);
    Impl::Outgoing o;
    reply.body_bytes = static_cast<int64_t>(result.size());
    o.header = std::make_shared<ps::Header>(reply);
    o.body = std::make_shared<Bytes>(std::move(result));
    std::lock_guard<std::mutex> lock(m.s.mu);
    o.requests.push_back(t.send(from, o.header.get(), sizeof(ps::Header), ps::kCoordHeaderTag));
    if (!o.body->empty()) {
      o.requests.push_back(t.send(from, o.body->data(), o.body->size(), ps::kCoordBodyTag));
    }
    out.push_back(std::move(o));
  }
  // Results still in flight (a refused late one, at most) are left to the
  // transport's teardown.
  const auto deadline = Clock::now() + std::min<ps::Ms>(m.timeout, ps::Ms(2000));
  for (auto& o : out) {
    for (auto& q : o.requests) {
      try {
        ps::wait_locked(m.s.mu, q, deadline, "result");
      } catch (const std::exception&) {
      }
    }
  }
}

}  // namespace diststrat
