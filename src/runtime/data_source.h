// What a DistributedDataset iterates over. Two modes:
//  - global: `data` is the whole dataset, identical on every worker; each
//    global batch of `global_batch` rows is split over all replicas in sync,
//    and a worker copies out only its own replicas' rows.
//  - per worker (distribute_datasets_from_function): `data` is this worker's
//    own input; batches of per_replica * local_replicas rows are split over
//    the local replicas only.
#pragma once

#include "diststrat/data.h"
#include "runtime/device_feed.h"

namespace diststrat {

struct DistributedDataset::Source {
  Dataset data;
  int64_t global_batch = 0;
  DistributeOptions options;
  int num_replicas_in_sync = 1;
  int num_local_replicas = 1;
  int first_local_replica = 0;
  int num_workers = 1;
  bool per_worker = false;
  // Determinism mode (diststrat/determinism.h): each batch is cut into this
  // many fixed shards by row, and a replica gets its shards' rows; 0 = off.
  int virtual_shards = 0;
  // Elastic strategies (Strategy::replicas_may_change): the numbering above
  // is read from here at every batch(); the strategy outlives its datasets.
  const Strategy* live = nullptr;
  // Input on the GPU replicas' devices (prefetch_to_device, on_device);
  // null: the rows are copied when a replica reads them (or CPU replicas).
  std::shared_ptr<DeviceFeed> feed;

  int64_t total_rows() const { return data.size(); }
  // Rows taken from `data` per batch.
  int64_t batch_rows() const {
    return per_worker ? global_batch / num_replicas_in_sync * num_local_replicas : global_batch;
  }
  // Replicas a batch of `data` is split over, and local replica l's index among them.
  int replicas_fed() const { return per_worker ? num_local_replicas : num_replicas_in_sync; }
  int fed_index(int l) const { return per_worker ? l : first_local_replica + l; }
  // Rows in the whole global batch when this source's batch has n rows. In
  // per-worker mode other workers' shares are assumed to match ours.
  int64_t global_rows_of_batch(int64_t n) const { return per_worker ? n * num_workers : n; }
};

// The library's (and its tests') access to a dataset's source.
struct DistributedDatasetAccess {
  static const std::shared_ptr<DistributedDataset::Source>& source(const DistributedDataset& d) {
    return d.source_;
  }
};

// Copies rows `rows[0 .. n)` of host tensor `src` (each in range) to `dst`,
// back to back.
void copy_rows(char* dst, const Tensor& src, const int64_t* rows, int64_t n);
// The bytes of one row of `t` (rank >= 1).
size_t row_bytes(const Tensor& t);

}  // namespace diststrat
