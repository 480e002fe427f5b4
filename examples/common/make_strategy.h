// The strategy that --strategy names, as fashion_mnist and torch_fashion_mnist
// build it from the shared flags (train_flags.h): --replicas devices of
// --device, --timeout, --timeline (multi_worker), --ps and --max-staleness
// (parameter_server).
//
// One-process strategies (mirrored, central_storage) use `local_gpus` for
// their GPUs when given (an example that splits a GPU into logical GPUs
// configures it), else the default DeviceManager. Multi-process strategies
// run one replica per process unless --replicas was given (mpirun -np N
// already gives one process per core) or, on CPUs in an srun step,
// SLURM_CPUS_PER_TASK says how many cores the task has (one replica each);
// on GPUs each process uses (and leases) its own GPUs of the host's, by its
// local rank.
#pragma once

#include <memory>
#include <vector>

#include "diststrat/diststrat.h"
#include "train_flags.h"

namespace diststrat_examples {

inline std::unique_ptr<diststrat::Strategy> make_strategy(
    const TrainFlags& f, std::shared_ptr<diststrat::DeviceManager> local_gpus = nullptr) {
  namespace ds = diststrat;
  if (!f.timeline.empty() && f.strategy != "multi_worker") {
    throw ds::InvalidArgumentError("--timeline needs --strategy multi_worker");
  }
  if (f.elastic != !f.rendezvous.empty()) {
    throw ds::InvalidArgumentError("--elastic and --rendezvous URL go together");
  }
  if (f.elastic && f.strategy != "multi_worker") {
    throw ds::InvalidArgumentError("--elastic needs --strategy multi_worker");
  }
  const bool gpu = f.device == "gpu";
  std::vector<ds::Device> devices;
  for (int i = 0; i < f.replicas; ++i)
    devices.push_back(gpu ? ds::Device::gpu(i) : ds::Device::cpu(i));
  ds::CommunicationOptions comm;
  apply_timeout(f.timeout, comm);
  ds::DeterminismOptions determinism;
  determinism.virtual_shards = f.virtual_shards;
  if (f.virtual_shards > 0 && f.strategy == "parameter_server") {
    throw ds::InvalidArgumentError(
        "--deterministic-across-workers needs a synchronous strategy (mirrored, "
        "central_storage, multi_worker)");
  }
  if (f.strategy == "mirrored") {
    ds::MirroredOptions o;
    o.determinism = determinism;
    o.devices = devices;
    o.device_manager = local_gpus;
    o.communication = comm;
    return std::make_unique<ds::MirroredStrategy>(o);
  }
  if (f.strategy == "central_storage") {
    ds::CentralStorageOptions o;
    o.determinism = determinism;
    o.devices = devices;
    o.device_manager = local_gpus;
    o.communication = comm;
    return std::make_unique<ds::CentralStorageStrategy>(o);
  }
  std::vector<ds::Device> per_process =
      f.replicas_given ? devices : std::vector<ds::Device>{devices.front()};
  if (!f.replicas_given && !gpu && ds::in_slurm_step()) {
    ds::SlurmOptions so;
    so.auto_set_gpu = false;
    const int cpus = ds::SlurmClusterResolver(so).cpus_per_task();
    for (int i = 1; i < cpus; ++i) per_process.push_back(ds::Device::cpu(i));
  }
  const std::shared_ptr<ds::DeviceManager> process_gpus =
      gpu ? std::make_shared<ds::DeviceManager>(
                ds::gpu_options_for_local_process(static_cast<int>(per_process.size())))
          : nullptr;
  if (f.strategy == "multi_worker") {
    ds::MultiWorkerOptions o;
    o.determinism = determinism;
    o.devices = per_process;
    o.device_manager = process_gpus;
    o.timeline_path = f.timeline;
    o.communication.timeout = comm.timeout;
    o.communication.algorithm = ds::parse_algorithm(f.algorithm);
    if (f.elastic) {
      o.elastic.rendezvous = f.rendezvous;
      o.elastic.min_workers = f.min_workers;
      o.elastic.max_workers = f.max_workers;
      o.elastic.worker_id = f.worker_id;
      o.elastic.listen_host = f.listen_host;
    }
    return std::make_unique<ds::MultiWorkerMirroredStrategy>(o);
  }
  if (f.strategy == "parameter_server") {
    ds::ParameterServerOptions o;
    o.num_ps = f.ps;
    o.devices = per_process;
    o.device_manager = process_gpus;
    o.max_staleness = f.max_staleness;
    o.communication.timeout = comm.timeout;
    return std::make_unique<ds::ParameterServerStrategy>(o);
  }
  throw ds::InvalidArgumentError(
      "unknown --strategy '" + f.strategy +
      "' (available: mirrored, central_storage, multi_worker, parameter_server)");
}

}  // namespace diststrat_examples
