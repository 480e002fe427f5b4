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
  // Each reply: version, rejected, staleness sum, staleness max, step gap,
  // non-finite pushes skipped, worker count, then each worker's steps (all int64).
  const size_t bytes = (7 + m.worker_ranks.size()) * sizeof(int64_t);
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
    ps::Reader r(reply.data(), reply.size(), "stats reply");
    const int64_t applied = r.get<int64_t>();
    out.pushes_applied += applied;
    out.pushes_rejected += r.get<int64_t>();
    staleness_sum += r.get<int64_t>();
    out.max_staleness = std::max(out.max_staleness, r.get<int64_t>());
    out.max_step_gap = std::max(out.max_step_gap, r.get<int64_t>());
    out.pushes_nonfinite += r.get<int64_t>();
    const int64_t n = r.get<int64_t>();
    // Checked before it sizes anything: the reply must count our workers.
    DISTSTRAT_CHECK(n == static_cast<int64_t>(m.worker_ranks.size()), kInternal,
                    "stats reply: protocol error: ", n, " workers, this job has ",
                    m.worker_ranks.size());
    out.worker_steps.resize(static_cast<size_t>(n), 0);
    for (int64_t i = 0; i < n; ++i) {
      out.worker_steps[i] = std::max(out.worker_steps[i], r.get<int64_t>());
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
  ps::Writer w;
  w.put<int64_t>(++m.barrier_count);
  auto c = m.client->post(0, ps::Op::kBarrier, w.bytes(), nullptr, nullptr, 0, nullptr, 0,
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
  ps::Writer w;
  w.put_string(name).put<double>(sum).put<double>(count);
  auto c = m.client->post(0, ps::Op::kMetric, w.bytes(), nullptr, nullptr, 0, nullptr, 0,
                          "add to metric '" + name.substr(0, 200) + "'");
  m.client->detach(c);
  m.client->poll();
  m.progress_cv.notify_all();
}

MetricTotals ParameterServerStrategy::read_metric(const std::string& name) {
  Impl& m = *impl_;
  m.require_worker("read_metric");
  std::lock_guard<std::mutex> lock(m.mu);
  ps::Writer w;
  w.put_string(name).put<double>(0.0).put<double>(0.0);
  double totals[2] = {0, 0};
  auto c = m.client->post(0, ps::Op::kMetric, w.bytes(), nullptr, nullptr, 0, totals, sizeof totals,
                          "read of metric '" + name.substr(0, 200) + "'");
  m.client->wait(c);
  return MetricTotals{totals[0], totals[1]};
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
  ps::Writer w;
  w.put<int64_t>(step).put<uint8_t>(signalled ? 1 : 0);
  int64_t stop = 0;
  auto c = m.client->post(0, ps::Op::kStopCheck, w.bytes(), nullptr, nullptr, 0, &stop, sizeof stop,
                          "preemption check at step " + std::to_string(step));
  m.client->wait(c);
  return stop != 0;
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
  ps::Writer w;
  w.put<int64_t>(++m.broadcast_count)
      .put<uint8_t>(root ? 1 : 0)
      .put<int64_t>(static_cast<int64_t>(t.nbytes()));
  const std::string what = "broadcast '" + name + "'";
  auto c = root ? m.client->post(0, ps::Op::kBroadcast, w.bytes(), std::make_shared<Tensor>(t),
                                 t.data(), t.nbytes(), nullptr, 0, what)
                : m.client->post(0, ps::Op::kBroadcast, w.bytes(), nullptr, nullptr, 0, t.data(),
                                 t.nbytes(), what);
  m.client->wait(c);
}

}  // namespace diststrat
