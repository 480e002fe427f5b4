#include "core/env.h"
#include "runtime/variable_impl.h"
#include "runtime/local_replicas.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <set>

#include "allreduce/inprocess.h"
#include "allreduce/flight_recording.h"
#include "runtime/collective_check.h"
#include "core/device_manager_impl.h"
#include "core/step_capture.h"
#include "core/user_text.h"

namespace diststrat {

void validate_devices(const std::vector<Device>& devices, const char* strategy_name) {
  DISTSTRAT_CHECK(!devices.empty(), kInvalidArgument, strategy_name, ": no devices");
  std::set<Device> seen;
  for (const Device& d : devices) {
    DISTSTRAT_CHECK(d.index >= 0, kInvalidArgument, strategy_name, ": bad device ", d.to_string());
    DISTSTRAT_CHECK(seen.insert(d).second, kInvalidArgument, strategy_name, ": device ",
                    d.to_string(), " listed twice");
  }
}

void resolve_replica_devices(std::vector<Device>& devices, std::shared_ptr<DeviceManager>& manager,
                             const char* strategy_name) {
  if (devices.empty()) {
    if (!manager) manager = std::make_shared<DeviceManager>();
    if (!manager->list_physical_devices().empty()) {
      for (const LogicalDeviceInfo& l : manager->list_logical_devices())
        devices.push_back(l.device);
    }
    if (devices.empty()) devices = {Device::cpu(0)};
  }
  validate_devices(devices, strategy_name);
  const bool any_gpu =
      std::any_of(devices.begin(), devices.end(), [](const Device& d) { return d.is_gpu(); });
  if (!any_gpu) {
    manager = nullptr;
  } else if (!manager) {
    manager = std::make_shared<DeviceManager>();
  }
}

Tensor read_on_replica_device(const Tensor& stored, const Device& device) {
  if (!device.is_gpu() || !dtype_is_floating(stored.dtype())) return stored;
  Tensor on_device(stored.shape(), stored.dtype(), device);
  on_device.copy_from(stored);
  return on_device;
}

void stage_to_host(Tensor& t) {
  if (!t.device().is_gpu()) return;
  Tensor host(t.shape(), t.dtype());
  host.copy_from(t);
  t = host;
}

std::string strategy_display_name(const Strategy& s) {
  const std::string n = s.name();
  if (n == "mirrored") return "MirroredStrategy";
  if (n == "central_storage") return "CentralStorageStrategy";
  if (n == "multi_worker") return "MultiWorkerMirroredStrategy";
  if (n == "parameter_server") return "ParameterServerStrategy";
  return n;
}

namespace {
// The options of the local replicas' host group. Multi-worker: the
// algorithm is the cross-worker communicator's (its local replicas meet in
// the fusion engine; this group only carries merge_call and barriers), so
// the group runs its own default. GPU replicas all-reduce on the device
// communicator (checked in LocalReplicas). CPU replicas: the group runs the
// algorithm, or refuses it by name.
CommunicationOptions local_group_options(const Strategy& strategy,
                                         const std::vector<Device>& devices,
                                         CommunicationOptions o) {
  const std::string who = strategy_display_name(strategy);
  // Every strategy makes its local replicas: one place for the timeout.
  env::check_timeout(o.timeout, who + ": communication.timeout");
  if (strategy.name() == "multi_worker") {
    o.algorithm = Algorithm::kAuto;
    return o;
  }
  const bool gpu =
      std::any_of(devices.begin(), devices.end(), [](const Device& d) { return d.is_gpu(); });
  if (gpu) {
    o.algorithm = Algorithm::kAuto;  // LocalReplicas checks the device communicator's
    return o;
  }
  check_in_process_algorithm(o, who);
  return o;
}
}  // namespace

LocalReplicasCore::LocalReplicasCore(Strategy* strategy, std::vector<Device> devices,
                                     CommunicationOptions options)
    : strategy(strategy),
      num_in_sync(static_cast<int>(devices.size())),
      devices(std::move(devices)),
      options(options),
      group(static_cast<int>(this->devices.size()),
            local_group_options(*strategy, this->devices, options)) {}

LocalReplicasCore::~LocalReplicasCore() {
  device_comms.clear();
  if (gpus) {
    // No wait here (a hung launch must not hang the destructor): events and
    // streams go with work still queued, as CUDA allows.
    DeviceManager::Impl& dm = DeviceManagerAccess::impl(*gpus);
    for (size_t i = 0; i < streams.size(); ++i) {
      const int ordinal = dm.ordinal_of(devices[i]);
      for (void* e : in_flight[i]) dm.backend->destroy_event(ordinal, e);
      for (void* e : spare_events[i]) dm.backend->destroy_event(ordinal, e);
      dm.backend->destroy_stream(ordinal, streams[i]);
    }
  }
}

void LocalReplicasCore::end_step(int i) {
  const size_t r = static_cast<size_t>(i);
  const Device& d = devices[r];
  const GpuExec e = gpu_exec(d, "replica step");
  std::vector<void*>& spare = spare_events[r];
  void* mark = nullptr;
  if (spare.empty()) {
    mark = e.backend->create_event(e.ordinal);
  } else {
    mark = spare.back();
    spare.pop_back();
  }
  std::deque<void*>& q = in_flight[r];
  try {
    e.backend->record_event(e.ordinal, mark, e.stream);
  } catch (...) {
    spare.push_back(mark);
    throw;
  }
  q.push_back(mark);
  const int64_t s = step.load();
  while (q.size() > kMaxStepsInFlight) {
    e.backend->wait_event(
        e.ordinal, q.front(), e.deadline(),
        "replica " + std::to_string(i) + " on " + d.to_string() + ": waiting for its step " +
            std::to_string(s - static_cast<int64_t>(kMaxStepsInFlight)) + " (at most " +
            std::to_string(kMaxStepsInFlight) + " steps in flight)");
    spare.push_back(q.front());
    q.pop_front();
  }
  if (checks[r]->pending() >= DeviceChecks::kMaxPending) checks[r]->run();
}

void LocalReplicasCore::synchronize() {
  if (!gpus) return;
  std::exception_ptr first;
  for (int i = 0; i < size(); ++i) {
    const size_t r = static_cast<size_t>(i);
    try {
      ScopedExec scoped(scope(i, /*with_stream=*/true));
      const GpuExec e = gpu_exec(devices[r], "synchronize");
      e.synchronize("replica " + std::to_string(i) + "'s steps on " + devices[r].to_string());
      for (void* m : in_flight[r]) spare_events[r].push_back(m);
      in_flight[r].clear();
      checks[r]->run();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

ExecScope LocalReplicasCore::scope(int i, bool with_stream) const {
  ExecScope s;
  s.device = devices[static_cast<size_t>(i)];
  s.devices = gpus.get();
  s.stream = with_stream && !streams.empty() ? streams[static_cast<size_t>(i)] : nullptr;
  s.placement = &strategy->placement_log();
  s.timeout = options.timeout;
  if (!checks.empty()) s.checks = checks[static_cast<size_t>(i)];
  s.step = step.load();
  return s;
}

void LocalReplicasCore::abort_all(int i, const std::string& why) {
  group.at(i).abort(why);
  if (!device_comms.empty()) device_comms[static_cast<size_t>(i)]->abort(why);
}

LocalReplicas::LocalReplicas(Strategy* strategy, std::vector<Device> devices,
                             CommunicationOptions options, std::shared_ptr<DeviceManager> gpus)
    : core_(std::make_shared<LocalReplicasCore>(strategy, std::move(devices), options)),
      pool_(core_->size()) {
  LocalReplicasCore& c = *core_;
  const bool any_gpu =
      std::any_of(c.devices.begin(), c.devices.end(), [](const Device& d) { return d.is_gpu(); });
  if (any_gpu) {
    for (const Device& d : c.devices) {
      DISTSTRAT_CHECK(d.is_gpu(), kInvalidArgument, strategy->name(), ": device ", d.to_string(),
                      " mixed with GPU devices; use only GPUs or only CPUs");
    }
    DISTSTRAT_CHECK(gpus != nullptr, kInvalidArgument, strategy->name(),
                    ": GPU devices need a DeviceManager");
    c.gpus = std::move(gpus);
    DeviceManager::Impl& dm = DeviceManagerAccess::impl(*c.gpus);
    GpuBackend& backend = dm.require_backend(strategy->name() + " on " + c.devices[0].to_string());
    std::vector<int> ordinals;
    for (const Device& d : c.devices) ordinals.push_back(dm.ordinal_of(d));
    for (int o : ordinals) c.streams.push_back(backend.create_stream(o));
    for (size_t i = 0; i < ordinals.size(); ++i)
      c.checks.push_back(std::make_shared<DeviceChecks>());
    c.in_flight.resize(ordinals.size());
    c.spare_events.resize(ordinals.size());
    const std::set<int> distinct(ordinals.begin(), ordinals.end());
    const Algorithm a = c.options.algorithm;
    const bool shared = distinct.size() == 1;
    if (strategy->name() != "multi_worker") {
      // The device communicator runs one algorithm: NCCL across physical
      // GPUs, the device kernel (direct) for logical GPUs of one GPU.
      DISTSTRAT_CHECK(
          a == Algorithm::kAuto || a == (shared ? Algorithm::kDirect : Algorithm::kNccl),
          kInvalidArgument, strategy_display_name(*strategy), " on GPU replicas (",
          shared ? "logical GPUs of one GPU" : "several GPUs", "): algorithm '", algorithm_name(a),
          "' is not available; use 'auto' or '", shared ? "direct" : "nccl", "'");
    }
    if (shared) {
      // Logical GPUs of one physical GPU (or a single GPU): device-side reduction.
      c.device_comms = backend.shared_device_group({ordinals[0], c.streams}, c.options);
    } else if (distinct.size() == ordinals.size()) {
      c.device_comms = backend.nccl_local_group(ordinals, c.streams, c.options);
    } else {
      throw UnimplementedError(strategy->name() +
                               ": replicas on several physical GPUs, some of them split into "
                               "logical GPUs, are not supported; use one logical GPU per "
                               "physical GPU, or logical GPUs of a single physical GPU");
    }
    // In the flight record like every communicator. These calls only
    // enqueue work on the replicas' streams: "completed" means enqueued.
    static std::atomic<int> groups{0};
    const std::string group = "gpu-local#" + std::to_string(groups++);
    RecordingCommunicator::Options recording;
    recording.stragglers = false;
    recording.members_reset_together = false;
    for (auto& comm : c.device_comms) comm = wrap_recorded(std::move(comm), group, recording);
  }
  for (int i = 0; i < size(); ++i) {
    c.contexts.push_back(std::make_unique<LocalReplicaContext>(core_.get(), i));
  }
  // Input on the device (distribute's prefetch_to_device, on_device).
  strategy->input_gpus_ = c.gpus;
  strategy->input_timeout_ = c.options.timeout;
  // Strategy::synchronize reaches the newest replicas of the strategy.
  std::weak_ptr<LocalReplicasCore> weak = core_;
  strategy->synchronize_devices_ = [weak] {
    if (std::shared_ptr<LocalReplicasCore> c = weak.lock()) c->synchronize();
  };
}

int LocalReplicas::replica_of(const Device& d) const {
  const std::vector<Device>& devs = devices();
  for (size_t i = 0; i < devs.size(); ++i) {
    if (devs[i] == d) return static_cast<int>(i);
  }
  throw InvalidArgumentError(strategy().name() + ": device " + d.to_string() +
                             " is not a replica device");
}

Tensor LocalReplicas::to_host(const Tensor& t) const {
  if (t.device().is_cpu()) return t.clone();
  ScopedExec scoped(scope(replica_of(t.device()), /*with_stream=*/false));
  Tensor host(t.shape(), t.dtype());
  host.copy_from(t);
  return host;
}

std::vector<Tensor> LocalReplicas::to_host(const std::vector<Tensor>& ts) const {
  std::vector<Tensor> host;
  host.reserve(ts.size());
  for (const Tensor& t : ts) host.push_back(t.device().is_gpu() ? to_host(t) : t);
  return host;
}

void LocalReplicas::place_copies(Variable::Impl& var, const Tensor& initial) const {
  const bool host_only = !dtype_is_floating(var.dtype);
  for (int i = 0; i < size(); ++i) {
    const Device d = host_only ? Device::cpu(i) : devices()[static_cast<size_t>(i)];
    ScopedExec scoped(scope(i, /*with_stream=*/false));
    Tensor t(var.shape, var.dtype, d);
    t.copy_from(initial);
    var.copies.push_back(t);
  }
}

void LocalReplicas::for_each_copy(std::vector<Tensor>& copies,
                                  const std::function<void(Tensor&)>& fn) const {
  for (size_t i = 0; i < copies.size(); ++i) {
    ScopedExec scoped(scope(static_cast<int>(i), /*with_stream=*/false));
    fn(copies[i]);
  }
}

void LocalReplicas::run(const std::function<void(ReplicaContext&)>& fn) {
  // Fixed once the strategy is constructed; written only when they change, so
  // a later run() does not write what an abandoned replica may have read.
  const int first_id = core_->strategy->first_local_replica();
  const int in_sync = core_->strategy->num_replicas_in_sync();
  if (core_->first_replica != first_id) core_->first_replica = first_id;
  if (core_->num_in_sync != in_sync) core_->num_in_sync = in_sync;
  core_->step = core_->strategy->steps_run() - 1;
  // The task owns everything it refers to (the core and a copy of fn), so a
  // replica abandoned inside it never sees them freed.
  ThreadPool::Result result = pool_.run_all(
      [core = core_, fn](int i) {
        ScopedExec scoped(core->scope(i, /*with_stream=*/true));
        try {
          fn(*core->contexts[static_cast<size_t>(i)]);
          // The step's device work is enqueued, not done, when run()
          // returns: the host waits only for the steps beyond the bound.
          if (core->gpus) core->end_step(i);
        } catch (const AbortedError&) {
          throw;  // caused by another replica's failure
        } catch (const std::exception& e) {
          core->abort_all(i, "replica " + std::to_string(i) + " failed: " + e.what());
          throw;
        } catch (...) {
          core->abort_all(i,
                          "replica " + std::to_string(i) + " failed with a non-standard exception");
          throw;
        }
      },
      options().timeout);
  std::exception_ptr first, first_abort;
  for (auto& e : result.errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const AbortedError&) {
      if (!first_abort) first_abort = e;
    } catch (...) {
      if (!first) first = e;
    }
  }
  if (!result.unfinished.empty()) {
    // A stalled replica: its peers failed (usually with DeadlineExceeded
    // naming it) and it still did not return within the timeout. It cannot
    // be interrupted, so this strategy is finished; report why.
    std::string who;
    for (int r : result.unfinished) who += (who.empty() ? "" : ", ") + std::to_string(r);
    const std::string msg = "replica " + who + " is stuck and did not return within " +
                            std::to_string(options().timeout.count()) +
                            " ms after the step failed; this strategy cannot run again";
    strategy().logger().error(msg);
    if (first) std::rethrow_exception(first);
    throw DeadlineExceededError(msg);
  }
  if (first || first_abort) {
    core_->group.at(0).reset();  // every replica thread is idle now
    if (!core_->device_comms.empty()) core_->device_comms[0]->reset();
    std::rethrow_exception(first ? first : first_abort);
  }
}

namespace {
// The pack buffer of a GPU replica: a device tensor from its caching
// allocator, kept for the next collective; copies go to the replica's stream.
class DevicePackMemory : public PackMemory {
 public:
  DevicePackMemory(const Device& device, Tensor& keep)
      : device_(device), keep_(keep), exec_(gpu_exec(device, "all_reduce pack")) {}
  void* buffer(size_t bytes) override {
    if (!keep_.defined() || keep_.nbytes() < bytes) {
      keep_ = Tensor(Shape{static_cast<int64_t>((bytes + 7) / 8)}, DType::kInt64, device_);
    }
    return keep_.data();
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    exec_.backend->memcpy_async(exec_.ordinal, dst, src, bytes, exec_.stream);
  }

 private:
  Device device_;
  Tensor& keep_;
  GpuExec exec_;
};
}  // namespace

int LocalReplicaContext::replica_id() const { return owner_->first_replica + local_id_; }
int LocalReplicaContext::num_replicas_in_sync() const { return owner_->num_in_sync; }
const Device& LocalReplicaContext::device() const { return owner_->devices[local_id_]; }
Strategy& LocalReplicaContext::strategy() const { return *owner_->strategy; }
Communicator& LocalReplicaContext::local_comm() const { return owner_->group.at(local_id_); }
Communicator* LocalReplicaContext::device_comm() const {
  return owner_->device_comms.empty() ? nullptr
                                      : owner_->device_comms[static_cast<size_t>(local_id_)].get();
}
void* LocalReplicaContext::stream() const {
  return owner_->streams.empty() ? nullptr : owner_->streams[static_cast<size_t>(local_id_)];
}

void LocalReplicaContext::all_reduce(ReduceOp op, std::vector<Tensor>& tensors,
                                     const std::vector<std::string>& names) {
  check_replica_tensors(*this, "all_reduce", tensors, names);
  const PlacementLog& placement = owner_->strategy->placement_log();
  if (placement.enabled()) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      placement.record(
          "collective all_reduce",
          i < names.size() && !names[i].empty() ? names[i] : "tensor#" + std::to_string(i),
          device());
    }
  }
  if (Communicator* dc = device_comm()) {
    const ExecScope* scope = current_exec_scope();
    if (scope && scope->capture && scope->capture->active()) {
      // One replica: the all-reduce in place is the identity (a sum or mean
      // of one buffer, reduced in place), so the captured step leaves it out.
      if (dc->size() == 1) return;
      // The device collectives wait on the host (NCCL's issue(), the
      // shared-device group's meeting), so a graph cannot hold them: a
      // captured step is split around each one, and every replay runs it
      // between the same two graphs on the same buffers (reduced in place).
      const size_t bytes_per_pack = owner_->options.bytes_per_pack;
      scope->capture->boundary("all_reduce", [this, dc, op, tensors, names, bytes_per_pack]() {
        std::vector<Tensor> same = tensors;
        DevicePackMemory memory(device(), device_pack_);
        packer_.run(*dc, op, same, names, bytes_per_pack, &memory);
      });
      return;
    }
    // GPU buffers: packed in device memory, copies and collectives on the
    // replica's stream.
    DevicePackMemory memory(device(), device_pack_);
    packer_.run(*dc, op, tensors, names, owner_->options.bytes_per_pack, &memory);
    return;
  }
  packer_.run(local_comm(), op, tensors, names, owner_->options.bytes_per_pack);
}

void LocalReplicaContext::barrier(const std::string& name) { local_comm().barrier(name); }

Tensor LocalReplicaContext::all_gather(const Tensor& t, const std::string& name) {
  Communicator& comm = local_comm();
  const int n = comm.size();
  // GPU replicas gather through host memory, so host tensors are fine there.
  check_replica_tensors(*this, "all_gather", {t}, {name}, /*host_ok=*/true);
  DISTSTRAT_CHECK(t.shape().rank() >= 1, kInvalidArgument, "all_gather '", echo(name),
                  "' of a scalar: reshape to [1]");
  owner_->strategy->placement_log().record("collective all_gather", name, device());
  if (t.device().is_gpu()) {
    // Gathered through host memory; the result comes back to this device.
    Tensor host(t.shape(), t.dtype());
    host.copy_from(t);
    Tensor gathered_host = all_gather(host, name);
    Tensor out(gathered_host.shape(), t.dtype(), t.device());
    out.copy_from(gathered_host);
    return out;
  }
  // Rows may differ per replica: share row counts, pad to the largest, gather, compact.
  int64_t rows = t.shape()[0];
  std::vector<int64_t> all_rows(n);
  comm.all_gather(&rows, all_rows.data(), 1, DType::kInt64, name + "/rows");
  const int64_t max_rows = *std::max_element(all_rows.begin(), all_rows.end());
  const int64_t row_elems = rows ? t.num_elements() / rows : [&] {
    int64_t r = 1;
    for (size_t i = 1; i < t.shape().rank(); ++i) r *= t.shape()[i];
    return r;
  }();
  const size_t row_bytes = static_cast<size_t>(row_elems) * dtype_size(t.dtype());
  const size_t padded_count = static_cast<size_t>(max_rows * row_elems);
  std::vector<char> padded(padded_count * dtype_size(t.dtype()));
  if (t.nbytes()) std::memcpy(padded.data(), t.data(), t.nbytes());
  std::vector<char> gathered(padded.size() * n);
  comm.all_gather(padded.data(), gathered.data(), padded_count, t.dtype(), name);
  std::vector<int64_t> dims = t.shape().dims();
  dims[0] = 0;
  for (int64_t r : all_rows) dims[0] += r;
  Tensor out(Shape(dims), t.dtype());
  char* dst = static_cast<char*>(out.data());
  for (int r = 0; r < n; ++r) {
    const size_t bytes = static_cast<size_t>(all_rows[r]) * row_bytes;
    if (bytes) std::memcpy(dst, gathered.data() + r * padded.size(), bytes);
    dst += bytes;
  }
  return out;
}

std::shared_ptr<void> LocalReplicaContext::merge_call_impl(
    const std::function<std::shared_ptr<void>(Strategy&)>& fn) {
  Communicator& comm = local_comm();
  refuse_in_capture("merge_call (host work that a replay would not repeat)");
  comm.barrier("merge_call enter");
  std::exception_ptr mine;  // replica 0's own exception
  if (local_id_ == 0) {
    owner_->merge_result.reset();
    owner_->merge_failed = false;
    try {
      owner_->merge_result = fn(*owner_->strategy);
    } catch (...) {
      mine = std::current_exception();
      owner_->merge_failed = true;
      try {
        throw;
      } catch (const Error& e) {
        owner_->merge_error_is_error = true;
        owner_->merge_code = e.code();
        owner_->merge_message = e.message();
      } catch (const std::exception& e) {
        owner_->merge_error_is_error = false;
        owner_->merge_message = e.what();
      } catch (...) {
        owner_->merge_error_is_error = false;
        owner_->merge_message = "a non-standard exception";
      }
    }
  }
  comm.barrier("merge_call result");
  std::shared_ptr<void> result = owner_->merge_result;
  const bool failed = owner_->merge_failed;
  const bool is_error = owner_->merge_error_is_error;
  const ErrorCode code = owner_->merge_code;
  const std::string message = failed ? owner_->merge_message : std::string();
  comm.barrier("merge_call exit");
  if (mine) std::rethrow_exception(mine);
  if (failed) {
    if (is_error) throw_error(code, message);
    throw AbortedError("replica " + std::to_string(replica_id()) +
                       ": merge_call failed on local replica 0: " + message);
  }
  return result;
}

}  // namespace diststrat
