// ParameterServerStrategy::Impl's code (worker.h): the layout, shards, pulls
// and pushes, the progress thread and the worker's shutdown.
#include "runtime/variable_impl.h"
#include "parameter_server/worker.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <unordered_map>

#include "allreduce/reduce_kernels.h"
#include "core/env.h"
#include "diststrat/config.h"
#include "diststrat/optimizer.h"
#include "io/checkpoint_internal.h"
#include "runtime/local_replicas.h"
#include "parameter_server/client.h"
#include "parameter_server/messages.h"
#include "parameter_server/strategy_impl.h"
#include "parameter_server/shard_updater.h"
#if DISTSTRAT_HAVE_MPI
#include "runtime/mpi_env.h"
#endif

namespace diststrat {

namespace {
// Whether this process has reached its exit (std::exit, or main returned
// with the strategy alive): it is no longer working for the job.
bool process_exiting() {
#if DISTSTRAT_HAVE_MPI
  return mpi::exiting();
#else
  return false;
#endif
}
}  // namespace

namespace ps {

void mark_mpi_failed_if_launched() {
#if DISTSTRAT_HAVE_MPI
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized && mpi::launched_under_mpi()) mpi::mark_failed();
#endif
}

}  // namespace ps

using ps::kShutdownGrace;
using ps::mark_mpi_failed_if_launched;

void ParameterServerStrategy::Impl::mark_failed() const {
  if (owned_transport) mark_mpi_failed_if_launched();
}

void ParameterServerStrategy::Impl::init_layout(Transport& t) {
  transport = &t;
  rank = t.rank();
  world = t.size();
  DISTSTRAT_CHECK(options.num_ps >= 1, kInvalidArgument, "ParameterServerStrategy: num_ps ",
                  options.num_ps, " must be at least 1");
  DISTSTRAT_CHECK(options.num_ps < world, kInvalidArgument,
                  "ParameterServerStrategy: ", options.num_ps,
                  " PS rank(s) leave no worker in a job of ", world, " rank(s)");
  for (int r = 0; r < world; ++r)
    (r >= world - options.num_ps ? ps_ranks : worker_ranks).push_back(r);
  is_ps = rank >= world - options.num_ps;
  index = is_ps ? rank - (world - options.num_ps) : rank;
}

std::string ParameterServerStrategy::Impl::checkpoint_dir() const {
  std::string dir = env::text("DISTSTRAT_PS_CHECKPOINT_DIR").value_or(options.checkpoint_dir);
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

ps::ServiceOptions ParameterServerStrategy::Impl::service_options(int ps_index) const {
  ps::ServiceOptions so;
  so.ps_index = ps_index;
  so.num_ps = static_cast<int>(ps_ranks.size());
  so.checkpoint_dir = checkpoint_dir();
  so.skip_nonfinite_gradients = options.skip_nonfinite_gradients;
  so.max_broadcast_bytes = options.max_broadcast_bytes;
  so.worker_ranks = worker_ranks;
  so.max_staleness = options.max_staleness;
  so.timeout = options.communication.timeout;
  so.worker_timeout = options.worker_timeout.count() > 0 ? options.worker_timeout : so.timeout;
  return so;
}

void ParameterServerStrategy::Impl::attach(ParameterServerStrategy* s) {
  owner = s;
  if (is_ps) {
    services.push_back(
        std::make_unique<ps::ServiceRunner>(*transport, service_options(index), s->logger()));
    return;
  }
  std::vector<Device> devices =
      options.devices.empty() ? std::vector<Device>{Device::cpu(0)} : options.devices;
  std::shared_ptr<DeviceManager> gpus = options.device_manager;
  resolve_replica_devices(devices, gpus, "ParameterServerStrategy");
  replicas = std::make_unique<LocalReplicas>(s, devices, options.communication, gpus);
  client = std::make_unique<ps::Client>(*transport, ps_ranks, index, options.communication.timeout);
  versions.assign(ps_ranks.size(), -1);
  pull_buffers.resize(ps_ranks.size());
  pull_plan.resize(ps_ranks.size());
  progress = std::thread([this] { progress_loop(); });
}

void ParameterServerStrategy::Impl::progress_loop() {
  const bool poll_transport = !transport->shared_address_space();
  const std::chrono::milliseconds silence =
      options.worker_timeout.count() > 0 ? options.worker_timeout : options.communication.timeout;
  const auto beat = std::max<std::chrono::milliseconds>(silence / 4, std::chrono::milliseconds(1));
  std::unique_lock<std::mutex> lock(mu);
  while (!progress_stop) {
    if (poll_transport && client->has_outstanding()) {
      client->poll();
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(30));
      lock.lock();
      continue;
    }
    const auto now = Clock::now(), due = client->last_post() + beat;
    if (!in_step.load() && !process_exiting() && now >= due) {
      bool posted = false;
      for (int p = 0; p < client->num_ps(); ++p) {
        if (!client->broken(p).empty()) continue;
        // Fire and forget: an error (the job is ending) is raised by the
        // worker's next call.
        client->detach(
            client->post(p, ps::Op::kAlive, {}, nullptr, nullptr, 0, nullptr, 0, "heartbeat"));
        posted = true;
      }
      if (posted) continue;
    }
    // In a step, exiting, or no PS reachable, with a heartbeat due: look
    // again a beat later (the lock is released while waiting; the
    // destructor needs it to stop this thread).
    progress_cv.wait_until(lock, now >= due ? now + beat : due, [&] {
      return progress_stop || (poll_transport && client->has_outstanding());
    });
  }
}

void ParameterServerStrategy::Impl::stop_progress() {
  if (!progress.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu);
    progress_stop = true;
  }
  progress_cv.notify_all();
  progress.join();
}

ParameterServerStrategy::Impl::VarInfo& ParameterServerStrategy::Impl::info(
    const Variable::Impl& v) {
  auto it = info_of.find(&v);
  DISTSTRAT_CHECK(it != info_of.end(), kInvalidArgument, "variable '", v.name,
                  "' does not belong to this ParameterServerStrategy");
  return *it->second;
}

ps::Entry ParameterServerStrategy::Impl::entry_of(const VarInfo& vi, const ShardPlace& sp) {
  ps::Entry e;
  e.var_id = vi.id;
  e.shard_index = sp.index;
  e.name = vi.var->name;
  e.dtype = static_cast<int32_t>(vi.var->dtype);
  return e;
}

Shape ParameterServerStrategy::Impl::shard_shape(const VarInfo& vi, const ShardPlace& sp) {
  std::vector<int64_t> d = vi.var->shape.dims();
  if (!d.empty()) d[0] = sp.rows;
  return Shape(d);
}

void ParameterServerStrategy::Impl::post_dense_pull() {
  std::vector<ps::PullRequest> requests(ps_ranks.size());
  std::vector<size_t> bytes(ps_ranks.size(), 0);
  for (auto& plan : pull_plan) plan.clear();
  for (const auto& vi : vars) {
    if (vi->row_sparse) continue;
    for (const ShardPlace& sp : vi->shards) {
      requests[sp.ps].entries.push_back(entry_of(*vi, sp));
      pull_plan[sp.ps].emplace_back(vi.get(), sp);
      bytes[sp.ps] += static_cast<size_t>(sp.rows) * vi->row_bytes;
    }
  }
  pull_calls.clear();
  for (size_t p = 0; p < ps_ranks.size(); ++p) {
    requests[p].clock = steps;
    pull_buffers[p].resize(bytes[p]);
    pull_calls.push_back(client->post(static_cast<int>(p), ps::Op::kPull, ps::encode(requests[p]),
                                      nullptr, nullptr, 0, pull_buffers[p].data(), bytes[p],
                                      "pull for step " + std::to_string(steps)));
  }
}

void ParameterServerStrategy::Impl::finish_dense_pull() {
  for (auto& c : pull_calls) client->wait(c);
  for (size_t p = 0; p < ps_ranks.size(); ++p) {
    versions[p] = pull_calls[p]->reply.version;
    const char* src = pull_buffers[p].data();
    for (const auto& [vi, sp] : pull_plan[p]) {
      const size_t n = static_cast<size_t>(sp.rows) * vi->row_bytes;
      if (n)
        std::memcpy(static_cast<char*>(vi->var->copies[0].data()) + sp.offset * vi->row_bytes, src,
                    n);
      src += n;
    }
  }
  pull_calls.clear();
}

void ParameterServerStrategy::Impl::discard_dense_pull() {
  for (auto& c : pull_calls) {
    try {
      client->wait(c);
    } catch (const Error&) {
      // A failed prefetch is as good as discarded.
    }
  }
  pull_calls.clear();
}

void ParameterServerStrategy::Impl::declare_rules(const StagedPush& s) {
  if (!declared_config.name.empty() && ps::config_difference(declared_config, s.config) != "" &&
      !warned_config) {
    warned_config = true;
    log().warning("worker ", index,
                  ": the optimizer now differs from the update rule it declared (",
                  ps::config_difference(declared_config, s.config),
                  "); the PS ranks keep applying the declared rule: change it with "
                  "ParameterServerStrategy::update_hyperparameters on the chief");
  }
  std::vector<const VarInfo*> fresh;
  for (const auto& d : s.dense) {
    if (!d.first->rule_declared) fresh.push_back(d.first);
  }
  for (const auto& r : s.sparse) {
    if (!r.info->rule_declared) fresh.push_back(r.info);
  }
  if (fresh.empty()) return;
  std::sort(fresh.begin(), fresh.end());
  fresh.erase(std::unique(fresh.begin(), fresh.end()), fresh.end());
  post_rules(fresh, s.config, false, "declaration of the update rule");
  for (const VarInfo* vi : fresh) const_cast<VarInfo*>(vi)->rule_declared = true;
  if (declared_config.name.empty()) declared_config = s.config;
}

void ParameterServerStrategy::Impl::post_rules(const std::vector<const VarInfo*>& vars,
                                               const ps::OptimizerConfig& config, bool replace,
                                               const std::string& what) {
  std::vector<std::vector<ps::Entry>> per_ps(ps_ranks.size());
  for (const VarInfo* vi : vars) {
    for (const ShardPlace& sp : vi->shards) per_ps[sp.ps].push_back(entry_of(*vi, sp));
  }
  std::vector<ps::Client::CallPtr> calls;
  for (size_t p = 0; p < per_ps.size(); ++p) {
    if (per_ps[p].empty()) continue;
    const ps::RuleRequest req{replace, config, per_ps[p]};
    calls.push_back(client->post(static_cast<int>(p), ps::Op::kRule, ps::encode(req), nullptr,
                                 nullptr, 0, nullptr, 0, what));
  }
  wait_all(calls);
}

void ParameterServerStrategy::Impl::post_push(StagedPush& s) {
  declare_rules(s);
  const int64_t step = steps++;
  for (size_t p = 0; p < ps_ranks.size(); ++p) {
    std::vector<ps::Entry> entries;
    auto payload = std::make_shared<std::vector<char>>();
    auto append = [&](const void* data, size_t n) {
      if (n == 0) return;
      const char* c = static_cast<const char*>(data);
      payload->insert(payload->end(), c, c + n);
    };
    for (auto& [vi, grad] : s.dense) {
      for (const ShardPlace& sp : vi->shards) {
        if (sp.ps != static_cast<int>(p)) continue;
        ps::Entry e = entry_of(*vi, sp);
        e.dtype = static_cast<int32_t>(grad.dtype());
        e.shape = shard_shape(*vi, sp);
        entries.push_back(e);
        append(static_cast<const char*>(grad.data()) + sp.offset * vi->row_bytes,
               static_cast<size_t>(sp.rows) * vi->row_bytes);
      }
    }
    for (auto& rows : s.sparse) {
      const VarInfo& vi = *rows.info;
      const size_t vrow = rows.values.nbytes() / std::max<size_t>(1, rows.ids.size());
      for (const ShardPlace& sp : vi.shards) {
        if (sp.ps != static_cast<int>(p)) continue;
        std::vector<size_t> mine;
        for (size_t k = 0; k < rows.ids.size(); ++k) {
          if (rows.ids[k] >= sp.offset && rows.ids[k] < sp.offset + sp.rows) mine.push_back(k);
        }
        if (mine.empty()) continue;
        ps::Entry e = entry_of(vi, sp);
        e.dtype = static_cast<int32_t>(rows.values.dtype());
        std::vector<int64_t> d = rows.values.shape().dims();
        d[0] = static_cast<int64_t>(mine.size());
        e.shape = Shape(d);
        e.sparse = 1;
        e.num_ids = static_cast<int64_t>(mine.size());
        entries.push_back(e);
        for (size_t k : mine) append(&rows.ids[k], sizeof(int64_t));
        const char* v = static_cast<const char*>(rows.values.data());
        for (size_t k : mine) append(v + k * vrow, vrow);
      }
    }
    const bool has_iter = s.iterations && s.iterations->shards[0].ps == static_cast<int>(p);
    ps::PushRequest req;
    req.steps_after = steps;
    req.pulled_version = versions[p];
    req.iter_var = has_iter ? s.iterations->id : -1;
    req.iter_name = has_iter ? s.iterations->var->name : "";
    req.entries = std::move(entries);
    const void* data = payload->data();
    const size_t n = payload->size();
    auto call = client->post(static_cast<int>(p), ps::Op::kPush, ps::encode(req), payload, data, n,
                             nullptr, 0, "push of step " + std::to_string(step));
    client->detach(call);
    ++pushes_sent;
  }
}

Tensor ParameterServerStrategy::Impl::pull_whole(const VarInfo& vi) {
  Tensor out(vi.var->shape, vi.var->dtype);
  std::vector<ps::Client::CallPtr> calls;
  for (const ShardPlace& sp : vi.shards) {
    ps::PullRequest req;
    req.entries.push_back(entry_of(vi, sp));
    calls.push_back(client->post(sp.ps, ps::Op::kPull, ps::encode(req), nullptr, nullptr, 0,
                                 static_cast<char*>(out.data()) + sp.offset * vi.row_bytes,
                                 static_cast<size_t>(sp.rows) * vi.row_bytes,
                                 "read of '" + vi.var->name + "'"));
  }
  wait_all(calls);
  return out;
}

std::vector<int64_t> ParameterServerStrategy::Impl::checked_ids(const VarInfo& vi,
                                                                const Tensor& ids,
                                                                const char* what) {
  DISTSTRAT_CHECK(vi.row_sparse, kInvalidArgument, what, ": variable '", vi.var->name,
                  "' is not row-sparse (create it with create_row_sparse_variable)");
  DISTSTRAT_CHECK(ids.defined() && ids.dtype() == DType::kInt64 && ids.shape().rank() == 1,
                  kInvalidArgument, what, " of '", vi.var->name, "': ids must be int64 [n], got ",
                  ids.defined() ? ids.debug_string() : "an undefined tensor");
  const int64_t rows = vi.var->shape[0];
  std::vector<int64_t> out(ids.data<int64_t>(), ids.data<int64_t>() + ids.num_elements());
  for (int64_t id : out) {
    DISTSTRAT_CHECK(id >= 0 && id < rows, kInvalidArgument, "worker ", index, ": ", what, " of '",
                    vi.var->name, "': row id ", id, " is out of range [0, ", rows, ")");
  }
  return out;
}

void ParameterServerStrategy::Impl::shutdown(bool unwinding, const Logger& logger) {
  if (is_ps || !client) return;
  std::lock_guard<std::mutex> lock(mu);
  bool failed = unwinding;
  std::string first_error;
  try {
    client->drain();
    client->throw_deferred();
  } catch (const std::exception& e) {
    logger.error("outstanding parameter-server requests failed at shutdown: ", e.what());
    first_error = e.what();
  }
  for (int p = 0; p < client->num_ps(); ++p) failed = failed || !client->broken(p).empty();
  const std::string reason =
      "rank " + std::to_string(rank) + " left during an exception" +
      (first_error.empty() ? std::string(" (its own error is in its output)") : ": " + first_error);
  const auto until = Clock::now() + std::min<std::chrono::milliseconds>(
                                        options.communication.timeout, kShutdownGrace);
  std::vector<ps::Client::CallPtr> calls;
  for (int p = 0; p < client->num_ps(); ++p) {
    if (!client->broken(p).empty()) continue;  // nothing reaches it; it learns by its own deadline
    if (unwinding) {
      calls.push_back(client->post(p, ps::Op::kAbort, ps::encode(ps::AbortRequest{reason}), nullptr,
                                   nullptr, 0, nullptr, 0, "abort"));
    } else {
      calls.push_back(
          client->post(p, ps::Op::kDone, {}, nullptr, nullptr, 0, nullptr, 0, "shutdown"));
    }
  }
  for (auto& c : calls) {
    try {
      if (failed) {
        client->wait(c, until);
      } else {
        client->wait(c);
      }
    } catch (const std::exception& e) {
      logger.error("shutdown: ", e.what());
      failed = true;
    }
  }
  if (failed) mark_failed();
}

}  // namespace diststrat
