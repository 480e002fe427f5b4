// ParameterServerStrategy: roles, variable placement, and the worker's step
// protocol (pull before a step, push after it, prefetch the next pull right
// behind the push). The PS side is service.cc; the wire protocol wire.h.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <unordered_map>

#include "allreduce/reduce_kernels.h"
#include "core/env.h"
#include "diststrat/config.h"
#include "diststrat/optimizer.h"
#include "io/checkpoint_internal.h"
#include "runtime/local_replicas.h"
#include "runtime/process_group.h"
#include "parameter_server/client.h"
#include "parameter_server/strategy_impl.h"
#include "parameter_server/update_rule.h"
#if DISTSTRAT_HAVE_MPI
#include "allreduce/mpi_communicator.h"
#include "runtime/mpi_env.h"
#endif

namespace diststrat {

namespace {
// How long a worker that failed (or lost a PS) waits for the other PS ranks
// to take its kAbort / kDone: they are answering, or they are gone too.
constexpr std::chrono::milliseconds kShutdownGrace{3000};

// Whether this process has reached its exit (std::exit, or main returned
// with the strategy alive): it is no longer working for the job.
bool process_exiting() {
#if DISTSTRAT_HAVE_MPI
  return mpi::exiting();
#else
  return false;
#endif
}

// mpi::mark_failed() when this process runs under an MPI launcher.
void mark_mpi_failed_if_launched() {
#if DISTSTRAT_HAVE_MPI
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized && mpi::launched_under_mpi()) mpi::mark_failed();
#endif
}
}  // namespace

namespace ps {

ServiceRunner::ServiceRunner(Transport& transport, ServiceOptions options, const Logger& logger)
    : service_(transport, std::move(options), logger) {
  thread_ = std::thread([this] {
    std::exception_ptr error;
    try {
      service_.run();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mu_);
    error_ = error;
    finished_ = true;
    cv_.notify_all();
  });
}

ServiceRunner::~ServiceRunner() {
  service_.stop();
  if (thread_.joinable()) thread_.join();
}

void ServiceRunner::fail(const std::string& reason, std::chrono::milliseconds grace) {
  std::unique_lock<std::mutex> lock(mu_);
  if (finished_) return;  // every worker has left: nobody to tell
  service_.fail(reason);
  cv_.wait_for(lock, grace, [&] { return finished_; });
}

void ServiceRunner::join() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    // The loop ends by itself: when every worker is done, or declared gone
    // after the service's timeout of silence, so this wait is bounded.
    cv_.wait(lock, [&] { return finished_; });
    if (error_) std::rethrow_exception(error_);
  }
  const std::string failure = service_.failure();
  if (!failure.empty()) throw AbortedError("parameter server: " + failure);
  const std::vector<int> gone = service_.gone_workers();
  if (!gone.empty()) {
    // Name each silent worker with the step it was in (its pushed step count).
    const ServiceStats st = service_.stats();
    std::string list;
    for (int g : gone) {
      list += (list.empty() ? "" : ", ") + std::string("rank ") + std::to_string(g);
      if (static_cast<size_t>(g) < st.worker_steps.size()) {
        list += " (at step " + std::to_string(st.worker_steps[static_cast<size_t>(g)]) + ")";
      }
    }
    throw DeadlineExceededError("parameter server: worker(s) " + list +
                                " went silent and never shut down");
  }
}

}  // namespace ps

namespace ps {
// One kRestore item: a shard's value (optional), slots and step (-1 = keep).
struct RestoreItem {
  Entry entry;
  const char* value = nullptr;                             // the shard's rows, or null
  std::vector<std::pair<std::string, const char*>> slots;  // the shard's rows of each slot
  int64_t step = -1;
  size_t value_bytes = 0, slot_bytes = 0;
};
}  // namespace ps

// ---------------------------------------------------------------------------

struct ParameterServerStrategy::Impl {
  struct ShardPlace {
    int ps = 0;
    int64_t index = 0, offset = 0, rows = 0;
  };
  struct VarInfo {
    int64_t id = 0;
    Variable::Impl* var = nullptr;
    bool row_sparse = false;
    std::vector<ShardPlace> shards;
    size_t row_bytes = 0;        // bytes of one row (the whole value for scalars)
    bool rule_declared = false;  // this worker declared its update rule to the PS ranks (kRule)
  };
  struct StagedPush {
    ps::OptimizerConfig config;
    const VarInfo* iterations = nullptr;
    std::vector<std::pair<const VarInfo*, Tensor>> dense;
    struct Rows {
      const VarInfo* info;
      std::vector<int64_t> ids;
      Tensor values;
    };
    std::vector<Rows> sparse;
  };

  ParameterServerOptions options;
  std::unique_ptr<Transport> owned_transport;
  std::unique_ptr<InProcessTransportGroup> own_group;  // single-process mode
  Transport* transport = nullptr;
  int rank = 0, world = 1;
  std::vector<int> ps_ranks, worker_ranks;
  bool is_ps = false;
  int index = 0;  // among PS ranks or among workers
  // This process's task as TF_CONFIG / the explicit spec names it ("chief",
  // "worker" or "ps" and its index), when the cluster came from one.
  std::string task_type;
  int task_index = 0;
  std::vector<std::unique_ptr<ps::ServiceRunner>> services;  // PS loops in this process

  // Worker side.
  ParameterServerStrategy* owner = nullptr;
  std::unique_ptr<LocalReplicas> replicas;
  std::vector<Device> no_devices;
  std::mutex mu;  // serializes use of the client and the state below
  std::unique_ptr<ps::Client> client;
  std::vector<std::unique_ptr<VarInfo>> vars;  // creation order
  std::unordered_map<const Variable::Impl*, VarInfo*> info_of;
  int64_t next_ps = 0;
  bool creating_row_sparse = false;
  int64_t steps = 0;  // pushes this worker has sent (its clock)
  int64_t pushes_sent = 0;
  int64_t barrier_count = 0;
  int64_t broadcast_count = 0;
  // The update rule this worker declared (the first push's optimizer), and
  // whether a push with another optimizer config was warned about.
  ps::OptimizerConfig declared_config;
  bool warned_config = false;
  std::vector<int64_t> versions;  // per PS: version its last dense pull saw
  // The outstanding dense pull: per PS its call, reply buffer and the shards
  // it asked for (variables created later are not in it).
  std::vector<ps::Client::CallPtr> pull_calls;
  std::vector<std::vector<char>> pull_buffers;
  std::vector<std::vector<std::pair<const VarInfo*, ShardPlace>>> pull_plan;
  std::vector<StagedPush> staged;
  std::mutex staged_mu;
  // Drives outstanding transfers while the program computes (a transport
  // may move bytes only while someone calls into it).
  std::thread progress;
  std::atomic<bool> in_step{false};  // the replicas are running a step (no heartbeats)
  std::condition_variable progress_cv;
  bool progress_stop = false;
  // Where a worker's time went (logged at info level on shutdown).
  int64_t runs = 0;
  double pull_wait_s = 0, replicas_s = 0, push_post_s = 0;
  // std::uncaught_exceptions() when the strategy was made: more at
  // destruction = it is torn down by an exception (this worker failed).
  int uncaught_at_construction = std::uncaught_exceptions();

  // Marks this process's MPI state failed (mpi::mark_failed), so that its
  // exit does not wait a full deadline for peers that may never come.
  void mark_failed() const {
    if (owned_transport) mark_mpi_failed_if_launched();
  }
  // The worker's end: drains, then tells every PS it is done, or, when it
  // failed, that it failed (kAbort), so that the PS fails the other workers'
  // requests at once naming it. After a failure nothing waits a second full
  // deadline: an unreachable PS is skipped, the others get
  // kShutdownGrace, and the exit waits at most mpi::kFailedFinalizeGrace.
  void shutdown(bool unwinding, const Logger& logger);

  int num_workers() const { return static_cast<int>(worker_ranks.size()); }
  // Checkpoints (parameter_server_strategy.cc, "checkpoints"); callers hold mu
  // for post_restore, restore_from takes it.
  void post_restore(const std::vector<std::vector<ps::RestoreItem>>& per_ps,
                    const std::string& what);
  CheckpointMetadata restore_from(const std::string& path,
                                  const std::vector<std::pair<std::string, Tensor>>& expected,
                                  const std::vector<std::string>& optional,
                                  const RestoreOptions& options);
  bool chief() const { return !is_ps && index == 0; }
  Logger& log() { return owner->logger(); }

  void init_layout(Transport& t) {
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

  // The checkpoint directory of this process's PS ranks: the options', or
  // the environment's override.
  std::string checkpoint_dir() const {
    std::string dir = env::text("DISTSTRAT_PS_CHECKPOINT_DIR").value_or(options.checkpoint_dir);
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    return dir;
  }

  ps::ServiceOptions service_options(int ps_index) const {
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

  void attach(ParameterServerStrategy* s) {
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
    client =
        std::make_unique<ps::Client>(*transport, ps_ranks, index, options.communication.timeout);
    versions.assign(ps_ranks.size(), -1);
    pull_buffers.resize(ps_ranks.size());
    pull_plan.resize(ps_ranks.size());
    progress = std::thread([this] { progress_loop(); });
  }

  // The worker's background thread: completes outstanding transfers while
  // the program computes (a transport may move bytes only while someone
  // calls into it; in-process transports need no polling), and sends each
  // PS a heartbeat (kAlive) when this worker has sent it nothing for a
  // quarter of the worker timeout, so that a worker busy outside the
  // strategy (evaluating, saving) for longer than the timeout is not taken
  // for gone: the PS's timeout bounds silence, not work. Not while the
  // replicas run a step: a step stuck for the timeout (a hung device) is
  // silence, as the multi-worker strategy's deadline bounds a step; nor once
  // the process is at its exit with the strategy alive (std::exit): it will
  // not shut down, and the PS must take it for gone.
  void progress_loop() {
    const bool poll_transport = !transport->shared_address_space();
    const std::chrono::milliseconds silence =
        options.worker_timeout.count() > 0 ? options.worker_timeout : options.communication.timeout;
    const auto beat =
        std::max<std::chrono::milliseconds>(silence / 4, std::chrono::milliseconds(1));
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

  void stop_progress() {
    if (!progress.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mu);
      progress_stop = true;
    }
    progress_cv.notify_all();
    progress.join();
  }

  void require_worker(const char* what) const {
    DISTSTRAT_CHECK(!is_ps, kFailedPrecondition, "ParameterServerStrategy::", what, " on PS rank ",
                    rank, ": PS ranks hold shards and serve; call join() there");
  }

  VarInfo& info(const Variable::Impl& v) {
    auto it = info_of.find(&v);
    DISTSTRAT_CHECK(it != info_of.end(), kInvalidArgument, "variable '", v.name,
                    "' does not belong to this ParameterServerStrategy");
    return *it->second;
  }

  static ps::Entry entry_of(const VarInfo& vi, const ShardPlace& sp) {
    ps::Entry e;
    e.var_id = vi.id;
    e.shard_index = sp.index;
    e.name = vi.var->name;
    e.dtype = static_cast<int32_t>(vi.var->dtype);
    return e;
  }
  static Shape shard_shape(const VarInfo& vi, const ShardPlace& sp) {
    std::vector<int64_t> d = vi.var->shape.dims();
    if (!d.empty()) d[0] = sp.rows;
    return Shape(d);
  }

  // ---- dense pulls -------------------------------------------------------

  // Posts a pull of every dense variable from every PS (an empty one to a PS
  // without dense shards, so that each PS sees the clock).
  void post_dense_pull() {
    std::vector<ps::Writer> bodies(ps_ranks.size());
    std::vector<std::vector<ps::Entry>> entries(ps_ranks.size());
    std::vector<size_t> bytes(ps_ranks.size(), 0);
    for (auto& plan : pull_plan) plan.clear();
    for (const auto& vi : vars) {
      if (vi->row_sparse) continue;
      for (const ShardPlace& sp : vi->shards) {
        entries[sp.ps].push_back(entry_of(*vi, sp));
        pull_plan[sp.ps].emplace_back(vi.get(), sp);
        bytes[sp.ps] += static_cast<size_t>(sp.rows) * vi->row_bytes;
      }
    }
    pull_calls.clear();
    for (size_t p = 0; p < ps_ranks.size(); ++p) {
      bodies[p].put<int64_t>(steps).put<int64_t>(static_cast<int64_t>(entries[p].size()));
      for (const ps::Entry& e : entries[p]) ps::write_entry(bodies[p], e);
      pull_buffers[p].resize(bytes[p]);
      pull_calls.push_back(client->post(static_cast<int>(p), ps::Op::kPull, bodies[p].bytes(),
                                        nullptr, nullptr, 0, pull_buffers[p].data(), bytes[p],
                                        "pull for step " + std::to_string(steps)));
    }
  }

  // Completes the outstanding dense pull and copies it into the caches.
  void finish_dense_pull() {
    for (auto& c : pull_calls) client->wait(c);
    for (size_t p = 0; p < ps_ranks.size(); ++p) {
      versions[p] = pull_calls[p]->reply.version;
      const char* src = pull_buffers[p].data();
      for (const auto& [vi, sp] : pull_plan[p]) {
        const size_t n = static_cast<size_t>(sp.rows) * vi->row_bytes;
        if (n)
          std::memcpy(static_cast<char*>(vi->var->copies[0].data()) + sp.offset * vi->row_bytes,
                      src, n);
        src += n;
      }
    }
    pull_calls.clear();
  }

  // Drops a prefetched pull (its data predates a write this worker made).
  void discard_dense_pull() {
    for (auto& c : pull_calls) {
      try {
        client->wait(c);
      } catch (const Error&) {
        // A failed prefetch is as good as discarded.
      }
    }
    pull_calls.clear();
  }

  // ---- pushes ----------------------------------------------------------------

  // Declares the update rule of the variables this push is the first to
  // touch (kRule; the PS ranks fix it from the chief's declaration and check
  // every other worker's against it). Blocks: once per variable.
  void declare_rules(const StagedPush& s) {
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

  // Sends `config` as the rule of `vars` to the PS ranks holding them and
  // waits for every acknowledgement.
  void post_rules(const std::vector<const VarInfo*>& vars, const ps::OptimizerConfig& config,
                  bool replace, const std::string& what) {
    std::vector<std::vector<ps::Entry>> per_ps(ps_ranks.size());
    for (const VarInfo* vi : vars) {
      for (const ShardPlace& sp : vi->shards) per_ps[sp.ps].push_back(entry_of(*vi, sp));
    }
    std::vector<ps::Client::CallPtr> calls;
    for (size_t p = 0; p < per_ps.size(); ++p) {
      if (per_ps[p].empty()) continue;
      ps::Writer w;
      w.put<uint8_t>(replace ? 1 : 0);
      ps::write_config(w, config);
      w.put<int64_t>(static_cast<int64_t>(per_ps[p].size()));
      for (const ps::Entry& e : per_ps[p]) ps::write_entry(w, e);
      calls.push_back(client->post(static_cast<int>(p), ps::Op::kRule, w.bytes(), nullptr, nullptr,
                                   0, nullptr, 0, what));
    }
    wait_all(calls);
  }

  void post_push(StagedPush& s) {
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
      ps::Writer w;
      w.put<int64_t>(steps).put<int64_t>(versions[p]);
      w.put<int64_t>(has_iter ? s.iterations->id : -1);
      w.put_string(has_iter ? s.iterations->var->name : "");
      w.put<int64_t>(static_cast<int64_t>(entries.size()));
      for (const ps::Entry& e : entries) ps::write_entry(w, e);
      const void* data = payload->data();
      const size_t n = payload->size();
      auto call = client->post(static_cast<int>(p), ps::Op::kPush, w.bytes(), payload, data, n,
                               nullptr, 0, "push of step " + std::to_string(step));
      client->detach(call);
      ++pushes_sent;
    }
  }

  // ---- blocking helpers --------------------------------------------------

  void wait_all(std::vector<ps::Client::CallPtr>& calls) {
    for (auto& c : calls) client->wait(c);
  }

  Tensor pull_whole(const VarInfo& vi) {
    Tensor out(vi.var->shape, vi.var->dtype);
    std::vector<ps::Client::CallPtr> calls;
    for (const ShardPlace& sp : vi.shards) {
      ps::Writer w;
      w.put<int64_t>(-1).put<int64_t>(1);
      ps::write_entry(w, entry_of(vi, sp));
      calls.push_back(client->post(sp.ps, ps::Op::kPull, w.bytes(), nullptr, nullptr, 0,
                                   static_cast<char*>(out.data()) + sp.offset * vi.row_bytes,
                                   static_cast<size_t>(sp.rows) * vi.row_bytes,
                                   "read of '" + vi.var->name + "'"));
    }
    wait_all(calls);
    return out;
  }

  // Checks ids (int64 [n], each in [0, rows)) of row-sparse `vi`.
  std::vector<int64_t> checked_ids(const VarInfo& vi, const Tensor& ids, const char* what) {
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
};

// ---------------------------------------------------------------------------

namespace ps {
namespace {
std::unique_ptr<ParameterServerStrategy::Impl> new_impl(const ParameterServerOptions& o) {
  auto impl = std::make_unique<ParameterServerStrategy::Impl>();
  impl->options = o;
  return impl;
}
}  // namespace

std::unique_ptr<ParameterServerStrategy> make_strategy(Transport& transport,
                                                       const ParameterServerOptions& options) {
  auto impl = new_impl(options);
  impl->init_layout(transport);
  return std::make_unique<ParameterServerStrategy>(std::move(impl));
}

std::unique_ptr<ParameterServerStrategy> make_strategy(std::unique_ptr<Transport> transport,
                                                       const ParameterServerOptions& options) {
  auto impl = new_impl(options);
  impl->init_layout(*transport);
  impl->owned_transport = std::move(transport);
  return std::make_unique<ParameterServerStrategy>(std::move(impl));
}

Service& local_service(ParameterServerStrategy& strategy) {
  DISTSTRAT_CHECK(!strategy.impl().services.empty(), kFailedPrecondition,
                  "no parameter-server service in this process");
  return strategy.impl().services[0]->service();
}
}  // namespace ps

ParameterServerStrategy::ParameterServerStrategy(std::unique_ptr<Impl> impl) try
    : Strategy(impl->options.log_level, impl->is_ps
                                            ? "[ps " + std::to_string(impl->index) + "]"
                                            : "[worker " + std::to_string(impl->index) + "]"),
      impl_(std::move(impl)) {
  if (!impl_->transport) {
    // One process: it is worker 0 and the PS ranks are threads of it.
    DISTSTRAT_CHECK(impl_->options.num_ps >= 1, kInvalidArgument,
                    "ParameterServerStrategy: num_ps ", impl_->options.num_ps,
                    " must be at least 1");
    impl_->own_group = std::make_unique<InProcessTransportGroup>(impl_->options.num_ps + 1);
    impl_->init_layout(impl_->own_group->at(0));
    impl_->attach(this);
    for (int r = 1; r <= impl_->options.num_ps; ++r) {
      impl_->services.push_back(std::make_unique<ps::ServiceRunner>(
          impl_->own_group->at(r), impl_->service_options(r - 1), logger_));
    }
    logger_.info("ParameterServerStrategy in one process: ", impl_->options.num_ps,
                 " PS thread(s)");
    return;
  }
  impl_->attach(this);
  logger_.info("ParameterServerStrategy: rank ", impl_->rank, " of ", impl_->world, " is ",
               impl_->is_ps ? "PS " : "worker ", impl_->index);
} catch (...) {
  // Set-up failed on this rank after the job's transport was made (a junk
  // environment variable, devices): its peers will not hear from it again,
  // so its exit must not wait a deadline for them (mpi_env.h); the
  // launcher then ends the job.
  mark_mpi_failed_if_launched();
}

namespace {
// The job's transport (the MPI backend seam), or null for a one-process run.
std::unique_ptr<Transport> job_transport(const ResolvedCluster& cluster,
                                         std::chrono::milliseconds timeout) {
  if (cluster.info.world_size <= 1) return nullptr;
#if DISTSTRAT_HAVE_MPI
  if (mpi::launched_under_mpi()) {
    mpi::ensure_initialized();
    return make_mpi_transport(MPI_COMM_WORLD, timeout);
  }
#endif
  throw UnimplementedError("ParameterServerStrategy: a cluster of " +
                           std::to_string(cluster.info.world_size) +
                           " processes needs MPI (launch "
                           "with mpirun)" +
                           (DISTSTRAT_HAVE_MPI ? "" : ", which this build does not have"));
}

ParameterServerOptions with_cluster(ParameterServerOptions o, const ResolvedCluster& cluster) {
  const int ps_tasks = cluster.spec.num_tasks("ps");
  if (ps_tasks > 0) o.num_ps = ps_tasks;
  return o;
}

std::unique_ptr<ParameterServerStrategy::Impl> make_job_impl_checked(
    const ParameterServerOptions& options);

std::unique_ptr<ParameterServerStrategy::Impl> make_job_impl(
    const ParameterServerOptions& options) {
  // What the Strategy base reads from the environment is checked before MPI
  // meets the other ranks, so that a junk value ends this rank before it
  // joins the job (the launcher then ends the job at once).
  Logger(options.log_level);
  FaultInjection::from_env();
  try {
    return make_job_impl_checked(options);
  } catch (...) {
    // Failed after MPI met the other ranks: see the constructor's handler.
    mark_mpi_failed_if_launched();
    throw;
  }
}

std::unique_ptr<ParameterServerStrategy::Impl> make_job_impl_checked(
    const ParameterServerOptions& options) {
  // Set-up is bounded by the job's own deadline, as the multi-worker strategy's is.
  const ResolvedCluster cluster = resolve_cluster(options.cluster, options.communication.timeout);
  auto impl = std::make_unique<ParameterServerStrategy::Impl>();
  impl->options = with_cluster(options, cluster);
  impl->owned_transport = job_transport(cluster, options.communication.timeout);
#if DISTSTRAT_HAVE_MPI
  if (impl->owned_transport && mpi::launched_under_mpi()) {
    mpi::bound_finalize(std::max(options.communication.timeout, options.worker_timeout));
  }
#endif
  if (impl->owned_transport) {
    impl->init_layout(*impl->owned_transport);
    const std::string want = impl->is_ps ? "ps" : "worker";
    const bool agrees =
        cluster.info.task_type == want || (want == "worker" && cluster.info.task_type == "chief");
    DISTSTRAT_CHECK(cluster.spec.num_tasks("ps") == 0 || agrees, kInvalidArgument,
                    "ParameterServerStrategy: rank ", impl->rank, " is task '",
                    cluster.info.task_type, "' in the cluster but a ", want,
                    " by rank order (chief, worker, ps)");
    // cluster() reports the task the spec names (TF_CONFIG's chief is
    // "chief:0", its worker:0 is "worker:0" though it is worker index 1).
    const bool named =
        cluster.source == ClusterSource::kExplicit || cluster.source == ClusterSource::kTfConfig;
    if (named && agrees) {
      impl->task_type = cluster.info.task_type;
      impl->task_index = cluster.info.task_index;
    }
  }
  return impl;
}
}  // namespace

ParameterServerStrategy::ParameterServerStrategy(ParameterServerOptions options)
    : ParameterServerStrategy(make_job_impl(options)) {}

ParameterServerStrategy::~ParameterServerStrategy() {
  if (!impl_->is_ps && impl_->runs) {
    logger_.info(impl_->runs, " runs: ", impl_->pull_wait_s * 1e3, " ms waiting for pulls, ",
                 impl_->replicas_s * 1e3, " ms in the replicas, ", impl_->push_post_s * 1e3,
                 " ms posting pushes");
  }
  impl_->stop_progress();
  const bool unwinding = std::uncaught_exceptions() > impl_->uncaught_at_construction;
  impl_->shutdown(unwinding, logger_);
  if (impl_->is_ps && unwinding) {
    // This PS rank failed (in the program's code, before or instead of
    // join()): its workers learn it at their next request, not at their
    // deadline; they leave (kAbort) and the loop ends, or the grace passes.
    for (auto& s : impl_->services) {
      s->fail("it left during an exception (its own error is in its output)",
              std::min<std::chrono::milliseconds>(impl_->options.communication.timeout,
                                                  kShutdownGrace));
    }
    impl_->mark_failed();
  }
  // In-process PS threads end once every worker is done; a PS rank's own
  // loop is stopped if the program did not join() it.
  for (auto& s : impl_->services) {
    if (!impl_->is_ps) {
      try {
        s->join();
      } catch (const std::exception& e) {
        logger_.error("parameter-server thread: ", e.what());
      }
    }
  }
  impl_->services.clear();
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
      ps::Writer w;
      w.put_string(reason);
      calls.push_back(
          client->post(p, ps::Op::kAbort, w.bytes(), nullptr, nullptr, 0, nullptr, 0, "abort"));
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

int ParameterServerStrategy::num_local_replicas() const {
  return impl_->replicas ? impl_->replicas->size() : 0;
}
int ParameterServerStrategy::num_replicas_in_sync() const {
  return std::max(1, num_local_replicas()) * impl_->num_workers();
}
const std::vector<Device>& ParameterServerStrategy::devices() const {
  return impl_->replicas ? impl_->replicas->devices() : impl_->no_devices;
}
int ParameterServerStrategy::first_local_replica() const {
  return impl_->is_ps ? 0 : impl_->index * num_local_replicas();
}

ClusterInfo ParameterServerStrategy::cluster() const {
  ClusterInfo c;
  // The spec's task when there is one; else the role by rank order.
  c.task_type = !impl_->task_type.empty() ? impl_->task_type : impl_->is_ps ? "ps" : "worker";
  c.task_index = !impl_->task_type.empty() ? impl_->task_index : impl_->index;
  c.rank = impl_->own_group ? 0 : impl_->rank;
  c.world_size = impl_->own_group ? 1 : impl_->world;
  c.num_workers = impl_->num_workers();
  c.worker_index = impl_->is_ps ? -1 : impl_->index;  // PS ranks run no replicas (as cluster.h)
  return c;
}

bool ParameterServerStrategy::is_ps() const { return impl_->is_ps; }

void ParameterServerStrategy::join() {
  DISTSTRAT_CHECK(impl_->is_ps, kFailedPrecondition, "ParameterServerStrategy::join on worker ",
                  impl_->index, ": only PS ranks join");
  try {
    impl_->services.at(0)->join();
  } catch (...) {
    // A worker failed or went silent: it may never meet this rank at exit.
    impl_->mark_failed();
    throw;
  }
}

void ParameterServerStrategy::place_variable(Variable::Impl& var, const Initializer& init) {
  Impl& m = *impl_;
  m.require_worker("create_variable");
  std::lock_guard<std::mutex> lock(m.mu);
  auto vi = std::make_unique<Impl::VarInfo>();
  vi->id = var.creation_index;
  vi->var = &var;
  vi->row_sparse = m.creating_row_sparse;
  DISTSTRAT_CHECK(!vi->row_sparse || var.shape.rank() >= 1, kInvalidArgument,
                  "row-sparse variable '", var.name, "' needs at least one dimension");
  const int64_t rows = var.shape.rank() == 0 ? 1 : var.shape[0];
  vi->row_bytes =
      dtype_size(var.dtype) * static_cast<size_t>(rows ? var.shape.num_elements() / rows : 0);
  if (var.shape.rank() == 0) vi->row_bytes = dtype_size(var.dtype);
  int64_t n = 1;
  if (var.shape.rank() >= 1 && m.options.partitioner) {
    n = m.options.partitioner(var.shape, var.dtype);
    DISTSTRAT_CHECK(n >= 1 && n <= std::max<int64_t>(1, rows), kInvalidArgument,
                    "partitioner split '", var.name, "' ", var.shape.to_string(), " into ", n,
                    " shards");
  }
  for (const auto& [offset, count] : shard_rows(rows, n)) {
    Impl::ShardPlace sp;
    sp.ps = static_cast<int>(m.next_ps++ % static_cast<int64_t>(m.ps_ranks.size()));
    sp.index = static_cast<int64_t>(vi->shards.size());
    sp.offset = offset;
    sp.rows = count;
    vi->shards.push_back(sp);
  }
  // The chief initializes and sends the value; the others only declare the
  // variable and wait until the chief's value is there.
  Tensor value;
  if (!vi->row_sparse) {
    var.copies.emplace_back(var.shape, var.dtype);
    init(var.copies[0]);
    value = var.copies[0];
  } else if (m.chief()) {
    value = Tensor(var.shape, var.dtype);
    init(value);
  }
  auto owner = std::make_shared<Tensor>(value);
  std::vector<ps::Client::CallPtr> calls;
  for (const Impl::ShardPlace& sp : vi->shards) {
    ps::Writer w;
    w.put<int64_t>(vi->id).put_string(var.name).put<int32_t>(static_cast<int32_t>(var.dtype));
    w.put_shape(var.shape).put<int64_t>(sp.index).put<int64_t>(n).put<int64_t>(sp.offset);
    w.put<int64_t>(sp.rows).put<uint8_t>(m.chief() ? 1 : 0);
    const size_t bytes = m.chief() ? static_cast<size_t>(sp.rows) * vi->row_bytes : 0;
    const char* data =
        m.chief() ? static_cast<const char*>(value.data()) + sp.offset * vi->row_bytes : nullptr;
    calls.push_back(m.client->post(sp.ps, ps::Op::kCreate, w.bytes(), owner, data, bytes, nullptr,
                                   0, "create of '" + var.name + "'"));
  }
  m.wait_all(calls);
  m.info_of[&var] = vi.get();
  m.vars.push_back(std::move(vi));
}

Variable ParameterServerStrategy::create_row_sparse_variable(const std::string& name,
                                                             const Shape& shape, DType dtype,
                                                             const Initializer& init,
                                                             const VariableOptions& options) {
  impl_->creating_row_sparse = true;
  try {
    Variable v = create_variable(name, shape, dtype, init, options);
    impl_->creating_row_sparse = false;
    return v;
  } catch (...) {
    impl_->creating_row_sparse = false;
    throw;
  }
}

void ParameterServerStrategy::inject_corruption(ReplicaContext&, int64_t) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);  // guards the client
  if (fault_injection().kind == FaultKind::kOversize) {
    m.client->oversize_next_push();
  } else {
    m.client->corrupt_next_push();
  }
}

void ParameterServerStrategy::run_replicas(const std::function<void(ReplicaContext&)>& fn) {
  Impl& m = *impl_;
  m.require_worker("run");
  const auto t0 = Clock::now();
  {
    std::lock_guard<std::mutex> lock(m.mu);
    // An earlier push's rejection is reported first; a failed pull is not
    // kept, so the next run pulls afresh.
    std::exception_ptr earlier = m.client->take_deferred();
    try {
      if (m.pull_calls.empty()) m.post_dense_pull();
      m.finish_dense_pull();
    } catch (...) {
      m.pull_calls.clear();
      if (!earlier) earlier = m.client->take_deferred();  // completed by the wait
      if (!earlier) throw;
    }
    if (!earlier) earlier = m.client->take_deferred();
    if (earlier) std::rethrow_exception(earlier);
  }
  const auto t1 = Clock::now();
  try {
    m.in_step = true;
    m.replicas->run(fn);
    m.in_step = false;
  } catch (...) {
    m.in_step = false;
    std::lock_guard<std::mutex> lock(m.staged_mu);
    m.staged.clear();
    throw;
  }
  const auto t2 = Clock::now();
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<Impl::StagedPush> staged;
  {
    std::lock_guard<std::mutex> slock(m.staged_mu);
    staged.swap(m.staged);
  }
  for (Impl::StagedPush& s : staged) m.post_push(s);
  // Prefetch: the next step's pull travels behind the push.
  if (!staged.empty()) m.post_dense_pull();
  m.client->poll();
  m.progress_cv.notify_all();
  ++m.runs;
  m.pull_wait_s += std::chrono::duration<double>(t1 - t0).count();
  m.replicas_s += std::chrono::duration<double>(t2 - t1).count();
  m.push_post_s += std::chrono::duration<double>(Clock::now() - t2).count();
}

void ParameterServerStrategy::apply_gradients(
    ReplicaContext& ctx, Optimizer& optimizer,
    const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) {
  apply_gradients(ctx, optimizer, grads_and_vars, {});
}

void ParameterServerStrategy::apply_gradients(
    ReplicaContext& ctx, Optimizer& optimizer,
    const std::vector<std::pair<Tensor, Variable>>& grads_and_vars,
    const std::vector<SparseGradient>& sparse) {
  Impl& m = *impl_;
  const ps::OptimizerConfig config = ps::describe_optimizer(optimizer);
  std::vector<Tensor> grads;
  std::vector<std::string> names;
  for (const auto& [g, v] : grads_and_vars) {
    const Impl::VarInfo& vi = m.info(v.impl());
    DISTSTRAT_CHECK(!vi.row_sparse, kInvalidArgument, "apply_gradients: variable '", v.name(),
                    "' is row-sparse: pass its gradient as a SparseGradient");
    DISTSTRAT_CHECK(g.shape() == v.shape() && g.dtype() == v.dtype(), kInvalidArgument,
                    "apply_gradients: gradient ", g.debug_string(), " does not match variable '",
                    v.name(), "' ", dtype_name(v.dtype()), v.shape().to_string());
    grads.push_back(g);
    names.push_back(v.name() + "/grad");
  }
  for (const SparseGradient& s : sparse) {
    const Impl::VarInfo& vi = m.info(s.variable.impl());
    DISTSTRAT_CHECK(vi.row_sparse, kInvalidArgument, "apply_gradients: variable '",
                    s.variable.name(), "' is not row-sparse: pass a dense gradient");
    DISTSTRAT_CHECK(s.values.defined() && s.values.dtype() == DType::kFloat32, kInvalidArgument,
                    "apply_gradients: row gradient of '", s.variable.name(),
                    "' must be float32, got ",
                    s.values.defined() ? s.values.debug_string() : "an undefined tensor");
    std::vector<int64_t> want = s.variable.shape().dims();
    want[0] = s.ids.defined() && s.ids.shape().rank() == 1 ? s.ids.shape()[0] : -1;
    DISTSTRAT_CHECK(s.values.shape().dims() == want, kInvalidArgument,
                    "apply_gradients: row gradient ", s.values.debug_string(), " of '",
                    s.variable.name(), "' does not match ", want[0], " ids of rows ",
                    s.variable.shape().to_string());
  }
  // Inside the worker, replicas are synchronous: dense gradients are summed
  // over the local replicas, row gradients concatenated.
  const bool local_many = m.replicas->size() > 1;
  if (local_many && !grads.empty()) {
    for (Tensor& g : grads) g = g.clone();
    ctx.all_reduce(ReduceOp::kSum, grads, names);  // on the GPUs for GPU replicas
  }
  for (Tensor& g : grads) stage_to_host(g);     // pushed from host memory
  std::vector<std::pair<Tensor, Tensor>> rows;  // (ids, values) per sparse gradient
  for (const SparseGradient& s : sparse) {
    if (local_many) {
      rows.emplace_back(ctx.all_gather(s.ids, s.variable.name() + "/ids"),
                        ctx.all_gather(s.values, s.variable.name() + "/rows"));
    } else {
      rows.emplace_back(s.ids, s.values);
    }
    stage_to_host(rows.back().first);
    stage_to_host(rows.back().second);
  }
  ctx.merge_call([&](Strategy&) {
    Impl::StagedPush push;
    push.config = config;
    push.iterations = &m.info(optimizer.iterations().impl());
    for (size_t k = 0; k < grads.size(); ++k) {
      push.dense.emplace_back(&m.info(grads_and_vars[k].second.impl()),
                              local_many ? grads[k] : grads[k].clone());
    }
    for (size_t k = 0; k < sparse.size(); ++k) {
      const Impl::VarInfo& vi = m.info(sparse[k].variable.impl());
      const std::vector<int64_t> ids = m.checked_ids(vi, rows[k].first, "push");
      // Sum duplicate ids so each row is updated once.
      std::unordered_map<int64_t, size_t> first;
      Impl::StagedPush::Rows r{&vi, {}, {}};
      const int64_t re =
          rows[k].second.shape().num_elements() / std::max<int64_t>(1, rows[k].second.shape()[0]);
      std::vector<float> acc;
      const float* src = rows[k].second.data<float>();
      for (size_t i = 0; i < ids.size(); ++i) {
        auto [it, fresh] = first.emplace(ids[i], r.ids.size());
        if (fresh) {
          r.ids.push_back(ids[i]);
          acc.insert(acc.end(), src + i * re, src + (i + 1) * re);
        } else {
          float* dst = acc.data() + it->second * re;
          for (int64_t j = 0; j < re; ++j) dst[j] += src[i * re + j];
        }
      }
      std::vector<int64_t> d = sparse[k].variable.shape().dims();
      d[0] = static_cast<int64_t>(r.ids.size());
      r.values = Tensor(Shape(d), DType::kFloat32);
      if (!acc.empty()) std::memcpy(r.values.data(), acc.data(), acc.size() * sizeof(float));
      push.sparse.push_back(std::move(r));
    }
    std::lock_guard<std::mutex> lock(m.staged_mu);
    m.staged.push_back(std::move(push));
  });
}

Tensor ParameterServerStrategy::gather_rows(const Variable& var, const Tensor& ids) {
  Impl& m = *impl_;
  m.require_worker("gather_rows");
  std::lock_guard<std::mutex> lock(m.mu);
  const Impl::VarInfo& vi = m.info(var.impl());
  const std::vector<int64_t> id = m.checked_ids(vi, ids, "gather_rows");
  std::vector<int64_t> dims = var.shape().dims();
  dims[0] = static_cast<int64_t>(id.size());
  Tensor out{Shape(dims), var.dtype()};
  // Route each id to its shard; one pull per PS with one entry per shard.
  struct Part {
    std::vector<ps::Entry> entries;
    std::vector<int64_t> ids;
    std::vector<size_t> positions;  // where each returned row goes
    std::vector<char> buffer;
  };
  std::vector<Part> parts(m.ps_ranks.size());
  for (const Impl::ShardPlace& sp : vi.shards) {
    ps::Entry e = Impl::entry_of(vi, sp);
    e.sparse = 1;
    Part& part = parts[sp.ps];
    for (size_t k = 0; k < id.size(); ++k) {
      if (id[k] < sp.offset || id[k] >= sp.offset + sp.rows) continue;
      part.ids.push_back(id[k]);
      part.positions.push_back(k);
      ++e.num_ids;
    }
    if (e.num_ids) part.entries.push_back(e);
  }
  std::vector<ps::Client::CallPtr> calls;
  for (size_t p = 0; p < parts.size(); ++p) {
    Part& part = parts[p];
    if (part.entries.empty()) continue;
    ps::Writer w;
    w.put<int64_t>(-1).put<int64_t>(static_cast<int64_t>(part.entries.size()));
    for (const ps::Entry& e : part.entries) ps::write_entry(w, e);
    part.buffer.resize(part.ids.size() * vi.row_bytes);
    calls.push_back(m.client->post(static_cast<int>(p), ps::Op::kPull, w.bytes(), nullptr,
                                   part.ids.data(), part.ids.size() * sizeof(int64_t),
                                   part.buffer.data(), part.buffer.size(),
                                   "gather_rows of '" + var.name() + "'"));
  }
  m.wait_all(calls);
  char* dst = static_cast<char*>(out.data());
  for (Part& part : parts) {
    for (size_t k = 0; k < part.positions.size(); ++k) {
      std::memcpy(dst + part.positions[k] * vi.row_bytes, part.buffer.data() + k * vi.row_bytes,
                  vi.row_bytes);
    }
  }
  return out;
}

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

std::vector<ShardSnapshot> ParameterServerStrategy::local_shards() const {
  DISTSTRAT_CHECK(impl_->is_ps, kFailedPrecondition,
                  "local_shards on a worker: PS ranks hold the shards");
  return impl_->services.at(0)->service().snapshot();
}

void ParameterServerStrategy::restore_local_shards(const std::vector<ShardSnapshot>& shards) {
  DISTSTRAT_CHECK(impl_->is_ps, kFailedPrecondition,
                  "restore_local_shards on a worker: PS ranks hold the shards");
  impl_->services.at(0)->service().restore(shards);
}

Tensor ParameterServerStrategy::read_variable(const Variable::Impl& var,
                                              const ReplicaContext& ctx) const {
  const Impl::VarInfo& vi = impl_->info(var);
  DISTSTRAT_CHECK(!vi.row_sparse, kFailedPrecondition, "read of row-sparse variable '", var.name,
                  "': it is not pulled whole; use gather_rows");
  return read_on_replica_device(var.copies[0], ctx.device());
}

Tensor ParameterServerStrategy::variable_value(const Variable::Impl& var) const {
  Impl& m = *impl_;
  m.require_worker("value");
  std::lock_guard<std::mutex> lock(m.mu);
  return m.pull_whole(m.info(var));
}

void ParameterServerStrategy::assign_variable(Variable::Impl& var, const Tensor& value) {
  Impl& m = *impl_;
  m.require_worker("assign");
  DISTSTRAT_CHECK(value.shape() == var.shape && value.dtype() == var.dtype, kInvalidArgument,
                  "assign to variable '", var.name, "' ", dtype_name(var.dtype),
                  var.shape.to_string(), " from ", value.debug_string());
  std::lock_guard<std::mutex> lock(m.mu);
  const Impl::VarInfo& vi = m.info(var);
  auto owner = std::make_shared<Tensor>(value.clone());
  std::vector<ps::Client::CallPtr> calls;
  for (const Impl::ShardPlace& sp : vi.shards) {
    ps::Entry e = Impl::entry_of(vi, sp);
    e.shape = Impl::shard_shape(vi, sp);
    ps::Writer w;
    w.put<int64_t>(1);
    ps::write_entry(w, e);
    calls.push_back(m.client->post(
        sp.ps, ps::Op::kAssign, w.bytes(), owner,
        static_cast<const char*>(owner->data()) + sp.offset * vi.row_bytes,
        static_cast<size_t>(sp.rows) * vi.row_bytes, nullptr, 0, "assign to '" + var.name + "'"));
  }
  m.wait_all(calls);
  if (!vi.row_sparse) var.copies[0].copy_from(value);
  m.discard_dense_pull();  // the next run pulls what we just wrote
}

void ParameterServerStrategy::update(Variable& var, const std::function<void(Tensor&)>& fn) {
  Tensor v = var.value();
  fn(v);
  var.assign(v);
}

Tensor ParameterServerStrategy::reduce_tensors_across(ReduceOp op,
                                                      const std::vector<Tensor>& local) {
  impl_->require_worker("reduce");
  // As reduce_across: this worker's replicas, so kMean divides by their
  // number (the base class divides by every worker's replicas).
  const std::vector<Tensor> host = impl_->replicas->to_host(local);
  if (op != ReduceOp::kMean) return Strategy::reduce_tensors_across(op, host);
  Tensor out = Strategy::reduce_tensors_across(ReduceOp::kSum, host);
  kernels::scale_mean(out.data(), static_cast<size_t>(out.num_elements()), out.dtype(),
                      static_cast<int>(host.size()));
  return out;
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

Tensor ParameterServerStrategy::gather_across(const std::vector<Tensor>& local) {
  impl_->require_worker("gather");
  return Strategy::gather_across(impl_->replicas->to_host(local));
}

// ---- checkpoints -------------------------------------------------------------------
//
// Save: every worker flushes its pushes and meets the others at a barrier
// (through PS 0), so the PS ranks hold exactly the pushes every worker made
// before the save and receive none until it ends; the chief asks each PS to
// write its shard file, waits until every one is durable, then writes the
// index; the others wait for the chief's status (a broadcast through PS 0).
// Restore: the same quiescence; the chief reads and verifies the index and
// every shard file, matches the reassembled state against the model, re-splits
// it onto the current PS ranks and writes each PS's shards (values, slots,
// step counters) at once.

namespace {
uint64_t new_save_id() {
  std::random_device rd;
  const uint64_t t = static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  return ((static_cast<uint64_t>(rd()) << 32) ^ rd() ^ (t * 0x9e3779b97f4a7c15ULL)) | 1;
}
}  // namespace

void ParameterServerStrategy::check_checkpoint_supported(Strategy&, const std::string& what) {
  DISTSTRAT_CHECK(
      !impl_->is_ps, kFailedPrecondition, "rank ", impl_->rank, " (ps ", impl_->index, "): ", what,
      ": the workers save and restore checkpoints (every worker calls it); a PS rank only "
      "serves (join()) and writes its shards when the chief asks");
}

bool ParameterServerStrategy::needs_state_to_write() const { return false; }

std::vector<Tensor> ParameterServerStrategy::read_slots(Strategy&,
                                                        const std::vector<SlotRef>& slots) {
  Impl& m = *impl_;
  m.require_worker("read_slots");
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<Tensor> out;
  std::vector<ps::Writer> bodies(m.ps_ranks.size());
  std::vector<int64_t> counts(m.ps_ranks.size(), 0);
  struct Dest {
    char* dst;
    size_t bytes;
  };
  std::vector<std::vector<Dest>> dests(m.ps_ranks.size());
  std::vector<size_t> bytes(m.ps_ranks.size(), 0);
  for (const SlotRef& ref : slots) {
    const Impl::VarInfo& vi = m.info(*ref.var);
    DISTSTRAT_CHECK(vi.var->dtype == DType::kFloat32, kInvalidArgument, "read_slots: variable '",
                    vi.var->name, "' is ", dtype_name(vi.var->dtype),
                    "; only float32 variables have slots");
    out.emplace_back(vi.var->shape, DType::kFloat32);
    for (const Impl::ShardPlace& sp : vi.shards) {
      ps::write_entry(bodies[sp.ps], Impl::entry_of(vi, sp));
      bodies[sp.ps].put_string(ref.slot);
      ++counts[sp.ps];
      const size_t n = static_cast<size_t>(sp.rows) * vi.row_bytes;
      dests[sp.ps].push_back({static_cast<char*>(out.back().data()) + sp.offset * vi.row_bytes, n});
      bytes[sp.ps] += n;
    }
  }
  std::vector<std::vector<char>> replies(m.ps_ranks.size());
  std::vector<ps::Client::CallPtr> calls;
  for (size_t p = 0; p < m.ps_ranks.size(); ++p) {
    if (!counts[p]) continue;
    ps::Writer w;
    w.put<int64_t>(counts[p]);
    w.bytes().insert(w.bytes().end(), bodies[p].bytes().begin(), bodies[p].bytes().end());
    replies[p].resize(bytes[p]);
    calls.push_back(m.client->post(static_cast<int>(p), ps::Op::kReadSlots, w.bytes(), nullptr,
                                   nullptr, 0, replies[p].data(), bytes[p],
                                   "read of optimizer slots"));
  }
  m.wait_all(calls);
  for (size_t p = 0; p < m.ps_ranks.size(); ++p) {
    const char* src = replies[p].data();
    for (const Dest& d : dests[p]) {
      if (d.bytes) std::memcpy(d.dst, src, d.bytes);
      src += d.bytes;
    }
  }
  return out;
}

void ParameterServerStrategy::assign_slots(Strategy&, const std::vector<SlotRef>& slots,
                                           const std::vector<Tensor>& values) {
  Impl& m = *impl_;
  m.require_worker("assign_slots");
  DISTSTRAT_CHECK_EQ(slots.size(), values.size(), "assign_slots");
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<std::vector<ps::RestoreItem>> per_ps(m.ps_ranks.size());
  for (size_t k = 0; k < slots.size(); ++k) {
    const Impl::VarInfo& vi = m.info(*slots[k].var);
    DISTSTRAT_CHECK(values[k].dtype() == DType::kFloat32 && values[k].shape() == vi.var->shape,
                    kInvalidArgument, "assign_slots: slot '", slots[k].slot, "' of '", vi.var->name,
                    "' from ", values[k].debug_string());
    for (const Impl::ShardPlace& sp : vi.shards) {
      ps::RestoreItem it;
      it.entry = Impl::entry_of(vi, sp);
      it.entry.shape = Impl::shard_shape(vi, sp);
      it.slots.emplace_back(slots[k].slot,
                            static_cast<const char*>(values[k].data()) + sp.offset * vi.row_bytes);
      it.slot_bytes = static_cast<size_t>(sp.rows) * vi.row_bytes;
      per_ps[sp.ps].push_back(std::move(it));
    }
  }
  m.post_restore(per_ps, "restore of optimizer slots");
}

void ParameterServerStrategy::Impl::post_restore(
    const std::vector<std::vector<ps::RestoreItem>>& per_ps, const std::string& what) {
  std::vector<ps::Client::CallPtr> calls;
  for (size_t p = 0; p < per_ps.size(); ++p) {
    if (per_ps[p].empty()) continue;
    ps::Writer w;
    w.put<int64_t>(static_cast<int64_t>(per_ps[p].size()));
    auto payload = std::make_shared<std::vector<char>>();
    for (const ps::RestoreItem& it : per_ps[p]) {
      ps::write_entry(w, it.entry);
      w.put<uint8_t>(it.value ? 1 : 0)
          .put<int64_t>(it.step)
          .put<int64_t>(static_cast<int64_t>(it.slots.size()));
      for (const auto& sl : it.slots) w.put_string(sl.first);
      if (it.value) payload->insert(payload->end(), it.value, it.value + it.value_bytes);
      for (const auto& sl : it.slots)
        payload->insert(payload->end(), sl.second, sl.second + it.slot_bytes);
    }
    calls.push_back(client->post(static_cast<int>(p), ps::Op::kRestore, w.bytes(), payload,
                                 payload->data(), payload->size(), nullptr, 0, what));
  }
  wait_all(calls);
  discard_dense_pull();  // the next run pulls what was just written
}

void ParameterServerStrategy::write_checkpoint(Strategy&, const std::string& path,
                                               const std::vector<std::pair<std::string, Tensor>>&,
                                               const CheckpointMetadata& metadata) {
  Impl& m = *impl_;
  m.require_worker("checkpoint save");
  // Quiesce: this worker's pushes are applied, then every live worker's.
  flush();
  barrier("checkpoint save '" + path + "'");
  ckpt::on_chief_then_agree(*this, "to write checkpoint '" + path + "'", [&] {
    const uint64_t save_id = new_save_id();
    const int num_ps = static_cast<int>(m.ps_ranks.size());
    // The PS ranks write into their own checkpoint directory under names
    // they derive from the stem (never a path from a request): the index
    // must be in that directory.
    const size_t slash = path.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "."
                            : slash == 0               ? "/"
                                                       : path.substr(0, slash);
    std::string stem = path.substr(slash == std::string::npos ? 0 : slash + 1);
    static const std::string kSuffix = ".safetensors";
    if (stem.size() > kSuffix.size() &&
        stem.compare(stem.size() - kSuffix.size(), kSuffix.size(), kSuffix) == 0) {
      stem.resize(stem.size() - kSuffix.size());
    }
    DISTSTRAT_CHECK(ps::valid_file_stem(stem), kInvalidArgument, "checkpoint '", path,
                    "': the file name '", stem,
                    "' is not a checkpoint name for the PS ranks (1 to 200 of [A-Za-z0-9._-], not "
                    "starting with '.')");
    if (m.own_group) {
      // One process: its PS threads write where this program saves.
      for (auto& sr : m.services) sr->service().set_checkpoint_dir(dir);
    } else {
      const std::string configured = m.checkpoint_dir();
      DISTSTRAT_CHECK(configured.empty() || configured == dir, kInvalidArgument, "checkpoint '",
                      path,
                      "' is not in the PS ranks' "
                      "checkpoint directory '",
                      configured, "' (ParameterServerOptions::checkpoint_dir)");
    }
    std::vector<std::string> files;
    std::vector<ckpt::IndexVariable> index;
    {
      std::lock_guard<std::mutex> lock(m.mu);
      std::vector<int64_t> expect(m.ps_ranks.size(), 0);
      for (const auto& vi : m.vars) {
        ckpt::IndexVariable iv{vi->var->name, vi->var->dtype, vi->var->shape, {}};
        for (const Impl::ShardPlace& sp : vi->shards) {
          iv.shards.push_back({sp.index, sp.ps, sp.offset, sp.rows});
          ++expect[sp.ps];
        }
        index.push_back(std::move(iv));
      }
      std::vector<std::vector<char>> replies(m.ps_ranks.size(), std::vector<char>(sizeof(int64_t)));
      std::vector<ps::Client::CallPtr> calls;
      for (int p = 0; p < num_ps; ++p) {
        files.push_back(ckpt::shard_file_path(path, p, num_ps, save_id));
        ps::Writer w;
        w.put_string(stem).put<uint64_t>(save_id).put_string(dir);
        calls.push_back(m.client->post(p, ps::Op::kSave, w.bytes(), nullptr, nullptr, 0,
                                       replies[p].data(), sizeof(int64_t),
                                       "save of shard file '" + files.back() + "'"));
      }
      m.wait_all(calls);  // every shard file is durable (or the error names the PS and file)
      for (int p = 0; p < num_ps; ++p) {
        int64_t n;
        std::memcpy(&n, replies[p].data(), sizeof n);
        DISTSTRAT_CHECK(n == expect[p], kInternal, "checkpoint '", path, "': PS rank ",
                        m.ps_ranks[p], " saved ", n, " shards to '", files[p],
                        "', the chief placed ", expect[p], " there");
      }
    }
    // Last: the index. A crash before this leaves the previous checkpoint the loadable one.
    ckpt::write_index(path, save_id, files, index, metadata);
  });
}

CheckpointContents ParameterServerStrategy::read_checkpoint(
    Strategy&, const std::string& path, const std::vector<std::pair<std::string, Tensor>>& expected,
    const std::vector<std::string>& optional, const RestoreOptions& options) {
  Impl& m = *impl_;
  m.require_worker("checkpoint restore");
  flush();
  barrier("checkpoint restore '" + path + "'");
  CheckpointContents out;
  ckpt::on_chief_then_agree(*this, "to restore checkpoint '" + path + "'", [&] {
    out.metadata = m.restore_from(path, expected, optional, options);
  });
  if (ckpt::is_multi_process(*this)) {
    out.metadata = ckpt::decode_metadata(
        ckpt::broadcast_string(*this, ckpt::encode_metadata(out.metadata), "checkpoint metadata"));
    std::lock_guard<std::mutex> lock(m.mu);
    m.discard_dense_pull();  // a prefetch from before the restore
  }
  return out;  // no tensors: the PS ranks hold the restored state already
}

CheckpointMetadata ParameterServerStrategy::Impl::restore_from(
    const std::string& path, const std::vector<std::pair<std::string, Tensor>>& expected,
    const std::vector<std::string>& optional, const RestoreOptions& options) {
  // Everything is read, verified and matched against the model before the
  // first write to a PS.
  SafetensorsLoadOptions lo;
  lo.require_checksums = options.require_checksums;
  lo.allow_non_finite = options.allow_non_finite;
  const ckpt::LoadedCheckpoint lc = ckpt::load_any(path, lo);
  const CheckpointContents c = match_checkpoint(lc.file, path, expected, optional);
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : c.tensors) by_name[name] = &t;
  // A single-file checkpoint (another strategy's) has no per-shard step
  // counters: the optimizer's iterations stand in for them.
  int64_t fallback_step = -1;
  if (!lc.sharded) {
    for (const auto& [name, t] : c.tensors) {
      const std::string suffix = "/iterations";
      if (name.size() > suffix.size() &&
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
          t.dtype() == DType::kInt64 && t.num_elements() == 1) {
        fallback_step = std::max(fallback_step, t.data<int64_t>()[0]);
      }
    }
  }
  std::lock_guard<std::mutex> lock(mu);
  // Slot names: checkpoint names that are not variables, under their longest variable prefix.
  std::map<std::string, std::vector<std::pair<std::string, const Tensor*>>> slots_of;
  std::set<std::string> var_names;
  for (const auto& vi : vars) var_names.insert(vi->var->name);
  for (const auto& [name, t] : by_name) {
    if (var_names.count(name)) continue;
    std::string owner;
    for (const std::string& v : var_names) {
      if (name.size() > v.size() + 1 && name.compare(0, v.size() + 1, v + "/") == 0 &&
          v.size() > owner.size())
        owner = v;
    }
    DISTSTRAT_CHECK(!owner.empty(), kInvalidArgument, "checkpoint '", path, "': tensor '", name,
                    "' is neither a variable nor a slot of one");
    slots_of[owner].emplace_back(name.substr(owner.size() + 1), t);
  }
  std::vector<std::vector<ps::RestoreItem>> per_ps(ps_ranks.size());
  for (const auto& vi : vars) {
    auto it = by_name.find(vi->var->name);
    const auto& slots = slots_of[vi->var->name];
    if (it == by_name.end() && slots.empty()) continue;  // optional and absent: keeps its state
    auto steps = lc.steps.find(vi->var->name);
    for (const ShardPlace& sp : vi->shards) {
      ps::RestoreItem item;
      item.entry = entry_of(*vi, sp);
      item.entry.shape = shard_shape(*vi, sp);
      const size_t bytes = static_cast<size_t>(sp.rows) * vi->row_bytes;
      if (it != by_name.end()) {
        item.value = static_cast<const char*>(it->second->data()) + sp.offset * vi->row_bytes;
        item.value_bytes = bytes;
      }
      for (const auto& [slot, t] : slots) {
        item.slots.emplace_back(slot,
                                static_cast<const char*>(t->data()) + sp.offset * vi->row_bytes);
      }
      item.slot_bytes = bytes;
      // A re-split shard takes the largest step of the saved shards it
      // overlaps (equal for dense training: every push updates every shard).
      item.step = fallback_step;
      if (steps != lc.steps.end()) {
        item.step = 0;
        for (const auto& [rows, step] : steps->second) {
          const bool overlaps =
              sp.rows == 0 || rows.second == 0 ||
              (rows.first < sp.offset + sp.rows && sp.offset < rows.first + rows.second);
          if (overlaps) item.step = std::max(item.step, step);
        }
      }
      per_ps[sp.ps].push_back(std::move(item));
    }
  }
  post_restore(per_ps, "restore of checkpoint '" + path + "'");
  return c.metadata;
}

void ParameterServerStrategy::update_hyperparameters(const Optimizer& optimizer) {
  Impl& m = *impl_;
  m.require_worker("update_hyperparameters");
  DISTSTRAT_CHECK(
      m.chief(), kFailedPrecondition, "worker ", m.index,
      ": update_hyperparameters: only the chief (worker 0) changes the PS ranks' update rules");
  const ps::OptimizerConfig config = ps::describe_optimizer(optimizer);
  ps::make_update_rule(config);  // the PS ranks check it too; fail here first
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

double ParameterServerStrategy::reduce_across(ReduceOp op, const std::vector<double>& local) {
  // Workers never meet: reduce over this worker's replicas only.
  if (op != ReduceOp::kMean) return Strategy::reduce_across(op, local);
  return Strategy::reduce_across(ReduceOp::kSum, local) / static_cast<double>(local.size());
}

}  // namespace diststrat
