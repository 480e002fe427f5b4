// Input: an in-memory Dataset and the distributed view a strategy makes of it.
//
// Rules: nothing here communicates or blocks on a peer: each worker computes
// its own rows of every global batch from the same seed, epoch and sizes, so
// the workers agree without messages. A DistributedDataset and its batches
// are used from one thread (the loop's); inside run() each replica reads its
// own slice of a DistributedBatch, concurrently with the others.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "diststrat/tensor.h"

namespace diststrat {

class Strategy;
class ReplicaContext;
struct DeviceBatch;  // implementation detail: a batch's slices on the GPUs

// Rows of features and labels held in memory: features [N, ...], labels [N, ...].
class Dataset {
 public:
  Dataset() = default;
  // Throws InvalidArgumentError when the row counts differ.
  Dataset(Tensor features, Tensor labels);

  int64_t size() const { return features_.defined() ? features_.shape()[0] : 0; }
  const Tensor& features() const { return features_; }
  const Tensor& labels() const { return labels_; }
  // Rows [begin, end) as a view.
  Dataset slice(int64_t begin, int64_t end) const;

 private:
  Tensor features_;
  Tensor labels_;
};

struct DistributeOptions {
  // Reshuffle the rows every epoch (seeded: seed + epoch).
  bool shuffle = true;
  uint64_t seed = 0;
  // Drop a last batch smaller than the global batch. When false the last
  // batch is split as evenly as possible; some replicas may get zero rows and
  // still take part in the collectives.
  bool drop_remainder = false;
  // Input on GPU replicas (TensorFlow's prefetch_to_device). The rows of a
  // batch and of the `prefetch_to_device` batches after it are copied to
  // each local replica's GPU ahead of the steps that read them: DistributedDataset::batch(i)
  // gathers the next batches' rows into pinned host buffers and enqueues their
  // copies on a copy stream of the dataset, one per local replica, so they
  // overlap the steps running now; a replica's stream waits for its slice's
  // copy on the device (an event, no host wait) when it first reads it. A
  // pinned buffer is reused only after its copy ran, and a slice's device
  // memory only after the steps that read it. Rows and bits are those of
  // the plain path. 0 (the default): no prefetch, a replica's rows are
  // copied on its own stream when it first reads them. Memory: per local
  // replica, the slices of up to prefetch_to_device + 1 batches staged
  // ahead plus those of the steps in flight (at most 2 more) in device
  // memory, and as many pinned host buffers (each the slice's features and
  // labels, rounded up to a power of two from 64 KiB; kept by the
  // DeviceManager for reuse until it is destroyed). Negative:
  // InvalidArgumentError at distribute(). CPU replicas (and elastic
  // strategies): ignored, as in TensorFlow.
  int prefetch_to_device = 0;
  // GPU replicas: place the whole dataset (features and labels) on each
  // local replica's GPU once, at distribute() (which waits for the copy,
  // bounded by the strategy's timeout); a batch is then a view of those rows
  // (shuffle off) or a gather of them on the replica's stream in the
  // epoch's row order (shuffle on; the order, 8 bytes per row, is copied to
  // each GPU once per epoch): no host copy of rows per step, and the rows
  // and bits of the plain path. Memory: the dataset's bytes on every local
  // replica's GPU (logical GPUs of one GPU each hold a copy), its epoch
  // order, and each batch's gathered slice until the steps that read it are
  // done. A dataset that does not fit: ResourceExhaustedError from
  // distribute(). prefetch_to_device is not used with it. CPU replicas (and
  // elastic strategies): ignored.
  bool on_device = false;
};

// TensorFlow's tf.distribute.InputContext: what an input function needs to
// know to produce its share of the data.
struct InputContext {
  int num_input_pipelines = 1;   // one per worker process
  int input_pipeline_id = 0;     // this worker's index
  int num_replicas_in_sync = 1;  // across all workers
  int64_t global_batch_size = 0;
  int64_t per_replica_batch_size() const;
};

// One global batch, split over the replicas in sync. Holds this process's
// replicas' slices only.
class DistributedBatch {
 public:
  // This replica's rows (possibly zero rows), on the replica's device (a GPU
  // replica's rows are copied to its GPU on first access, on its stream;
  // with prefetch_to_device they were copied ahead and its stream waits for
  // that copy on the device; with on_device they are a view or a gather of
  // the dataset there). Never waits on the host. Each replica may only ask
  // for its own slice. In determinism mode: the rows of ctx's
  // virtual shard (diststrat/determinism.h).
  const Tensor& features(const ReplicaContext& ctx) const;
  const Tensor& labels(const ReplicaContext& ctx) const;
  // Rows in the whole global batch, over all replicas and workers: divide
  // summed per-example losses by this (the last batch may be short).
  int64_t global_size() const { return global_size_; }
  // Index of this batch within the epoch.
  int64_t index() const { return index_; }

 private:
  friend class DistributedDataset;
  std::vector<Tensor> features_;  // per local replica (per local shard)
  std::vector<Tensor> labels_;
  // Per local replica: the slices on its device, made on first access.
  mutable std::vector<Tensor> device_features_, device_labels_;
  // prefetch_to_device / on_device on GPU replicas: the slices there (then
  // features_ and labels_ are empty).
  std::shared_ptr<DeviceBatch> device_batch_;
  int64_t global_size_ = 0;
  int64_t index_ = 0;
  int first_local_replica_ = 0;
  int first_local_shard_ = -1;  // determinism mode: this process's first shard
};

// The batches of one pass over the data. Iterate with a range-for; call
// set_epoch() to reshuffle for the next pass. Made by Strategy::distribute
// and distribute_datasets_from_function; a default-constructed one (or one
// made from a null source) is empty: no batches, begin() == end().
class DistributedDataset {
 public:
  struct Source;  // implementation detail
  DistributedDataset() = default;
  DistributedDataset(std::shared_ptr<Source> source);

  int64_t num_batches() const;
  int64_t global_batch_size() const;
  // Rows the batches are drawn from (this worker's own under
  // distribute_datasets_from_function), and how they are ordered.
  int64_t num_rows() const;
  DistributeOptions options() const;
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }
  // Materializes batch i of the current epoch; InvalidArgumentError unless
  // 0 <= i < num_batches().
  DistributedBatch batch(int64_t i) const;

  class iterator {
   public:
    iterator(const DistributedDataset* ds, int64_t i) : ds_(ds), i_(i) {}
    DistributedBatch operator*() const { return ds_->batch(i_); }
    iterator& operator++() {
      ++i_;
      return *this;
    }
    bool operator!=(const iterator& o) const { return i_ != o.i_; }

   private:
    const DistributedDataset* ds_;
    int64_t i_;
  };
  iterator begin() const { return iterator(this, 0); }
  iterator end() const { return iterator(this, num_batches()); }

 private:
  friend struct DistributedDatasetAccess;  // the library's (runtime/data_source.h)
  void reshuffle();
  std::shared_ptr<Source> source_;
  int64_t epoch_ = 0;
  // Row permutation of this epoch (local rows); a new one per reshuffle.
  std::shared_ptr<const std::vector<int64_t>> order_;
};

}  // namespace diststrat
