// ParameterServerStrategy's calls that coordinate a worker with the PS
// ranks and the other workers outside the step: flush and stats, barriers
// and broadcasts (through PS 0), job-wide metrics, the agreement to stop on
// preemption, and the chief's update of the hyper-parameters.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "diststrat/optimizer.h"
#include "parameter_server/client.h"
#include "parameter_server/messages.h"
#include "parameter_server/worker.h"
#include "parameter_server/shard_updater.h"

namespace diststrat {

void ParameterServerStrategy::flush() {
  Impl& m = *impl_;
  m.require_worker("flush");
  std::lock_guard<std::mutex> lock(m.mu);
  m.client->drain();
  m.client->throw_deferred();
}

ParameterServerStats ParameterServerStrategy::stats() {
  Impl& m = *impl_;
  m.require_worker("stats");
  std::lock_guard<std::mutex> lock(m.mu);
  const size_t bytes = static_cast<size_t>(ps::stats_reply_bytes(m.worker_ranks.size()));
  std::vector<std::vector<char>> replies(m.ps_ranks.size(), std::vector<char>(bytes));
  std::vector<ps::Client::CallPtr> calls;
  for (int p = 0; p < m.client->num_ps(); ++p) {
    calls.push_back(m.client->post(p, ps::Op::kStats, {}, nullptr, nullptr, 0, replies[p].data(),
                                   bytes, "stats"));
  }
  m.wait_all(calls);
  ParameterServerStats out;
  out.pushes_sent = m.pushes_sent;
  int64_t staleness_sum = 0;
  for (const std::vector<char>& reply : replies) {
    const ps::StatsReply r =
        ps::decode_stats_reply(reply.data(), reply.size(), m.worker_ranks.size(), "stats reply");
    out.pushes_applied += r.version;
    out.pushes_rejected += r.pushes_rejected;
    staleness_sum += r.staleness_sum;
    out.max_staleness = std::max(out.max_staleness, r.staleness_max);
    out.max_step_gap = std::max(out.max_step_gap, r.max_step_gap);
    out.pushes_nonfinite += r.pushes_nonfinite;
    out.worker_steps.resize(r.worker_steps.size(), 0);
    for (size_t i = 0; i < r.worker_steps.size(); ++i) {
      out.worker_steps[i] = std::max(out.worker_steps[i], r.worker_steps[i]);
    }
  }
  out.mean_staleness =
      out.pushes_applied ? static_cast<double>(staleness_sum) / out.pushes_applied : 0.0;
  return out;
}

void ParameterServerStrategy::barrier(const std::string& name) {
  Impl& m = *impl_;
  m.require_worker("barrier");
  std::lock_guard<std::mutex> lock(m.mu);
  ps::BarrierRequest req;
  req.count = ++m.barrier_count;
  auto c = m.client->post(0, ps::Op::kBarrier, ps::encode(req), nullptr, nullptr, 0, nullptr, 0,
                          "barrier '" + name + "'");
  m.client->wait(c);
}

void ParameterServerStrategy::add_to_metric(const std::string& name, double sum, double count) {
  Impl& m = *impl_;
  m.require_worker("add_to_metric");
  DISTSTRAT_CHECK(std::isfinite(count) && count >= 0, kInvalidArgument, "worker ", m.index,
                  ": add_to_metric '", name.substr(0, 200), "': count ", count,
                  " is not a finite number >= 0");
  std::lock_guard<std::mutex> lock(m.mu);
  const ps::MetricRequest req{name, sum, count};
  auto c = m.client->post(0, ps::Op::kMetric, ps::encode(req), nullptr, nullptr, 0, nullptr, 0,
                          "add to metric '" + name.substr(0, 200) + "'");
  m.client->detach(c);
  m.client->poll();
  m.progress_cv.notify_all();
}

MetricTotals ParameterServerStrategy::read_metric(const std::string& name) {
  Impl& m = *impl_;
  m.require_worker("read_metric");
  std::lock_guard<std::mutex> lock(m.mu);
  const ps::MetricRequest req{name, 0.0, 0.0};
  std::vector<char> reply(ps::kMetricReplyBytes);
  const std::string what = "read of metric '" + name.substr(0, 200) + "'";
  auto c = m.client->post(0, ps::Op::kMetric, ps::encode(req), nullptr, nullptr, 0, reply.data(),
                          reply.size(), what);
  m.client->wait(c);
  const ps::MetricReply totals = ps::decode_metric_reply(reply.data(), reply.size(), what);
  return MetricTotals{totals.sum, totals.count};
}

void ParameterServerStrategy::update_hyperparameters(const Optimizer& optimizer) {
  Impl& m = *impl_;
  m.require_worker("update_hyperparameters");
  DISTSTRAT_CHECK(
      m.chief(), kFailedPrecondition, "worker ", m.index,
      ": update_hyperparameters: only the chief (worker 0) changes the PS ranks' update rules");
  const ps::OptimizerConfig config = ps::describe_optimizer(optimizer);
  ps::make_shard_updater(config);  // the PS ranks check it too; fail here first
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<const Impl::VarInfo*> vars;
  for (const auto& vi : m.vars) {
    if (vi->rule_declared) vars.push_back(vi.get());
  }
  if (!vars.empty()) m.post_rules(vars, config, true, "update of the hyper-parameters");
  m.declared_config = config;
  m.warned_config = false;
}

bool ParameterServerStrategy::agree_to_stop(Strategy&, int64_t step, bool signalled) {
  Impl& m = *impl_;
  m.require_worker("PreemptionHandler::should_stop");
  std::lock_guard<std::mutex> lock(m.mu);
  const ps::StopCheckRequest req{step, signalled};
  std::vector<char> reply(ps::kStopCheckReplyBytes);
  const std::string what = "preemption check at step " + std::to_string(step);
  auto c = m.client->post(0, ps::Op::kStopCheck, ps::encode(req), nullptr, nullptr, 0, reply.data(),
                          reply.size(), what);
  m.client->wait(c);
  return ps::decode_stop_check_reply(reply.data(), reply.size(), what).stop;
}

void ParameterServerStrategy::broadcast(Tensor& t, int root_worker, const std::string& name) {
  Impl& m = *impl_;
  m.require_worker("broadcast");
  if (m.num_workers() == 1) return;
  DISTSTRAT_CHECK(root_worker >= 0 && root_worker < m.num_workers(), kInvalidArgument,
                  "broadcast '", name, "': root worker ", root_worker, " of ", m.num_workers());
  DISTSTRAT_CHECK(t.defined() && t.device().is_cpu(), kInvalidArgument, "broadcast '", name,
                  "': a host tensor is needed");
  std::lock_guard<std::mutex> lock(m.mu);
  const bool root = m.index == root_worker;
  const ps::BroadcastRequest req{++m.broadcast_count, root, static_cast<int64_t>(t.nbytes())};
  const std::vector<char> body = ps::encode(req);
  const std::string what = "broadcast '" + name + "'";
  auto c = root ? m.client->post(0, ps::Op::kBroadcast, body, std::make_shared<Tensor>(t), t.data(),
                                 t.nbytes(), nullptr, 0, what)
                : m.client->post(0, ps::Op::kBroadcast, body, nullptr, nullptr, 0, t.data(),
                                 t.nbytes(), what);
  m.client->wait(c);
}

}  // namespace diststrat
