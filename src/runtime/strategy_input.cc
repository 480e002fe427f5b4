// Strategy's input: distribute (every worker takes its share of each global
// batch of one dataset) and distribute_datasets_from_function (each worker's
// own rows), with their checks, and the device feed of GPU replicas
// (device_feed.h).
#include "diststrat/strategy.h"

#include <memory>
#include <utility>

#include "runtime/data_source.h"
#include "runtime/device_feed.h"

namespace diststrat {

namespace {
// What both ways of distributing take from the strategy.
std::shared_ptr<DistributedDataset::Source> new_source(const Strategy& strategy, Dataset data,
                                                       int64_t global_batch,
                                                       const DistributeOptions& options) {
  auto s = std::make_shared<DistributedDataset::Source>();
  s->data = std::move(data);
  s->global_batch = global_batch;
  s->options = options;
  s->num_replicas_in_sync = strategy.num_replicas_in_sync();
  s->num_local_replicas = strategy.num_local_replicas();
  s->first_local_replica = strategy.first_local_replica();
  s->num_workers = strategy.cluster().num_workers;
  return s;
}
}  // namespace

DistributedDataset Strategy::distribute(const Dataset& dataset, int64_t global_batch,
                                        const DistributeOptions& options) {
  DISTSTRAT_CHECK(global_batch > 0, kInvalidArgument, "distribute: global batch ", global_batch,
                  " must be positive");
  DISTSTRAT_CHECK(global_batch >= num_replicas_in_sync(), kInvalidArgument,
                  "distribute: global batch ", global_batch, " has fewer rows than the ",
                  num_replicas_in_sync(), " replicas in sync");
  DISTSTRAT_CHECK(dataset.size() > 0, kInvalidArgument, "distribute: empty dataset");
  DISTSTRAT_CHECK(global_batch >= determinism_.virtual_shards, kInvalidArgument,
                  "distribute: global batch ", global_batch, " has fewer rows than the ",
                  determinism_.virtual_shards, " virtual shards (determinism mode)");
  auto s = new_source(*this, dataset, global_batch, options);
  s->virtual_shards = determinism_.virtual_shards;
  if (replicas_may_change()) s->live = this;
  // Input on the device; ignored where the replicas may change (elastic).
  s->feed = make_device_feed(replicas_may_change() ? nullptr : input_gpus_, devices(),
                             input_timeout_, options, dataset);
  note_distributed(dataset, global_batch, options);
  return DistributedDataset(s);
}

DistributedDataset Strategy::distribute_datasets_from_function(
    const std::function<Dataset(const InputContext&)>& fn, int64_t global_batch,
    const DistributeOptions& options) {
  DISTSTRAT_CHECK(!replicas_may_change(), kUnimplemented,
                  "distribute_datasets_from_function: each worker's own input cannot follow an "
                  "elastic group's changes; use distribute() (every worker sees the whole "
                  "dataset and takes its share of each global batch)");
  DISTSTRAT_CHECK(!determinism_.enabled(), kUnimplemented,
                  "distribute_datasets_from_function in determinism mode: each worker's own "
                  "rows depend on the number of workers; use distribute()");
  InputContext ic;
  ic.num_input_pipelines = cluster().num_workers;
  ic.input_pipeline_id = cluster().worker_index;
  ic.num_replicas_in_sync = num_replicas_in_sync();
  ic.global_batch_size = global_batch;
  (void)ic.per_replica_batch_size();  // validates divisibility
  auto s = new_source(*this, fn(ic), global_batch, options);
  DISTSTRAT_CHECK(s->data.size() > 0, kInvalidArgument,
                  "distribute_datasets_from_function: the input function returned no rows");
  s->per_worker = true;
  s->feed = make_device_feed(input_gpus_, devices(), input_timeout_, options, s->data);
  return DistributedDataset(s);
}

}  // namespace diststrat
