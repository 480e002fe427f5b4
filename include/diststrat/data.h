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
  // replica's rows are copied to its GPU on first access). Each replica may
  // only ask for its own slice. In determinism mode: the rows of ctx's
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
  void reshuffle();
  std::shared_ptr<Source> source_;
  int64_t epoch_ = 0;
  std::vector<int64_t> order_;  // row permutation of this epoch (local rows)
};

}  // namespace diststrat
