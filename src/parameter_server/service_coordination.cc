// The PS service's coordination of the workers: barriers, broadcasts, the
// agreement to stop on preemption, job-wide metrics and statistics.
#include "parameter_server/service.h"

#include <algorithm>
#include <cstdint>

#include "core/user_text.h"
#include "io/checkpoint_internal.h"

namespace diststrat {
namespace ps {

Service::Outcome Service::handle_barrier(WorkerState& w, Pending& p) {
  const int64_t count = p.request.barrier.count;
  w.barrier_count = std::max(w.barrier_count, count);
  std::string missing;
  for (const WorkerState& o : workers_) {
    if (o.done || o.gone || o.barrier_count >= count) continue;
    missing += (missing.empty() ? "" : ", ") + std::to_string(o.index);
  }
  if (missing.empty()) return Outcome::kServed;
  if (Clock::now() - p.arrived > options_.timeout) {
    throw DeadlineExceededError("barrier " + std::to_string(count) + ": worker(s) " + missing +
                                " never arrived");
  }
  return Outcome::kDeferred;
}

Service::Outcome Service::handle_broadcast(WorkerState& w, Pending& p, Reply& reply) {
  const int64_t count = p.request.broadcast.count;
  const bool root = p.request.broadcast.root;
  if (root) {
    broadcasts_.emplace(count, p.payload);
  } else {
    auto it = broadcasts_.find(count);
    if (it == broadcasts_.end()) {
      if (Clock::now() - p.arrived > options_.timeout) {
        throw DeadlineExceededError("broadcast " + std::to_string(count) + ": worker " +
                                    std::to_string(w.index) +
                                    " waited past the deadline for the root");
      }
      return Outcome::kDeferred;
    }
    DISTSTRAT_CHECK(static_cast<int64_t>(it->second.size()) == p.header.reply_bytes,
                    kInvalidArgument, "broadcast ", count, ": the root sent ", it->second.size(),
                    " bytes, worker ", w.index, " expects ", p.header.reply_bytes);
    reply.payload = it->second;
  }
  w.broadcast_count = std::max(w.broadcast_count, count);
  // Forget what every live worker has.
  int64_t done_upto = INT64_MAX;
  for (const WorkerState& o : workers_) {
    if (!o.done && !o.gone) done_upto = std::min(done_upto, o.broadcast_count);
  }
  broadcasts_.erase(broadcasts_.begin(), broadcasts_.upper_bound(done_upto));
  return Outcome::kServed;
}

int64_t Service::broadcast_bytes_held() const {
  int64_t held = 0;
  for (const auto& [count, bytes] : broadcasts_) held += static_cast<int64_t>(bytes.size());
  for (const WorkerState& o : workers_) {
    for (const Pending& p : o.queue) {
      if (p.request.op == Op::kBroadcast && p.request.broadcast.root)
        held += p.request.broadcast.bytes;
    }
  }
  return held;
}

void Service::handle_stop_check(WorkerState& w, Pending& p, Reply& reply) {
  const int64_t step = p.request.stop_check.step;
  const bool signalled = p.request.stop_check.signalled;
  w.checked_step = std::max(w.checked_step, step);
  if (stop_at_ < 0 && (signalled || ckpt::preemption_signalled())) {
    // Every worker answered "go on" for the steps it has asked about, so the
    // stop is the asker's step or, if another live worker is ahead, the step
    // after that worker's: everyone can still stop there.
    stop_at_ = step;
    for (const WorkerState& o : workers_) {
      if (&o != &w && !o.done && !o.gone) stop_at_ = std::max(stop_at_, o.checked_step + 1);
    }
    logger_.warning(who(), ": preemption (",
                    signalled ? "worker " + std::to_string(w.index) : "this process",
                    " signalled): every worker stops at step ", stop_at_);
  }
  reply.payload = encode(StopCheckReply{stop_at_ >= 0 && step >= stop_at_});
}

void Service::handle_metric(Pending& p, Reply& reply) {
  // Name, count and reply size were checked by decode_request.
  constexpr size_t kMaxMetrics = 1024;
  const std::string& name = p.request.metric.name;
  const double sum = p.request.metric.sum;
  const double count = p.request.metric.count;
  const std::string shown = name.size() > 200 ? name.substr(0, 200) + "..." : name;
  auto it = metrics_.find(name);
  if (it == metrics_.end()) {
    DISTSTRAT_CHECK(metrics_.size() < kMaxMetrics, kInvalidArgument, "metric '", shown,
                    "': already ", kMaxMetrics, " metrics on ", who());
    it = metrics_.emplace(name, std::make_pair(0.0, 0.0)).first;
  }
  it->second.first += sum;
  it->second.second += count;
  if (p.header.reply_bytes == 0) return;
  reply.payload = encode(MetricReply{it->second.first, it->second.second});
}

void Service::handle_stats(Reply& reply) {
  StatsReply r;
  r.version = stats_.version;
  r.pushes_rejected = stats_.pushes_rejected;
  r.staleness_sum = stats_.staleness_sum;
  r.staleness_max = stats_.staleness_max;
  r.max_step_gap = stats_.max_step_gap;
  r.pushes_nonfinite = stats_.pushes_nonfinite;
  for (const WorkerState& w : workers_) r.worker_steps.push_back(w.steps);
  reply.payload = encode(r);
}

ServiceStats Service::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ServiceStats s = stats_;
  for (const WorkerState& w : workers_) s.worker_steps.push_back(w.steps);
  return s;
}

std::vector<int> Service::gone_workers() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> out;
  for (const WorkerState& w : workers_) {
    if (w.gone) out.push_back(w.index);
  }
  return out;
}

}  // namespace ps
}  // namespace diststrat
