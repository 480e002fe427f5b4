// Input on the device (DistributeOptions::prefetch_to_device and on_device):
// a DistributedDataset's slices of each batch made on its GPU replicas'
// devices ahead of, or without, a host copy per step.
//  - prefetch: DistributedDataset::batch(i) stages batch i and the next
//    `prefetch` batches: per part (a local replica's or a local shard's rows)
//    the rows are gathered straight into a pinned host buffer of the
//    DeviceManager's staging pool, copied on the feed's copy stream of the
//    part's replica into device memory allocated for that stream, and an
//    event is recorded behind the copy. The reading replica's stream waits
//    for that event on the device (stream_wait_event) and the memory is
//    recorded as used on that stream too (CachingAllocator::record_stream),
//    so it is reused only after the steps that read it. The pinned buffer is
//    reused only after its copy ran (the pool's event).
//  - on_device: the dataset is copied to every local replica's device once
//    (at construction, waited for); a part is a view of its rows (no
//    shuffle) or a gather of them on the reading replica's stream in the
//    epoch's order, which is copied to the device once per epoch per replica.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "core/gpu_backend.h"
#include "diststrat/data.h"
#include "diststrat/device_manager.h"
#include "diststrat/tensor.h"

namespace diststrat {

class DeviceFeed;

// The rows of one part of a batch: rows [begin, begin + rows) of the epoch's
// order, read by local replica `replica`.
struct FeedPart {
  int replica = 0;
  int64_t begin = 0;
  int64_t rows = 0;
};

// One batch's parts on their replicas' devices (DistributedBatch's).
struct DeviceBatch {
  struct Part {
    FeedPart rows;
    Tensor features, labels;  // on the replica's device once made
    void* copied = nullptr;   // prefetch: the event behind its copy
    bool ready = false;       // made / waited for on the replica's stream
  };
  std::shared_ptr<DeviceFeed> feed;
  std::shared_ptr<const std::vector<int64_t>> order;  // the epoch's row order
  std::vector<Part> parts;
  // Part `i`'s features or labels for `ctx` (its replica, on its thread):
  // the first call orders ctx's stream after the part's copy, or gathers
  // the rows on it. Never waits on the host.
  const Tensor& get(size_t i, const ReplicaContext& ctx, bool labels, const char* what);
  ~DeviceBatch();  // hands the copy events back to the feed
};

class DeviceFeed : public std::enable_shared_from_this<DeviceFeed> {
 public:
  // `devices`: the local replicas' GPUs. on_device: copies `data` to each
  // now, waiting at most `timeout` (ResourceExhaustedError when it does not
  // fit).
  DeviceFeed(std::shared_ptr<DeviceManager> gpus, std::vector<Device> devices,
             std::chrono::milliseconds timeout, const DistributeOptions& options, Dataset data);
  ~DeviceFeed();  // destroys its streams and events without waiting
  DeviceFeed(const DeviceFeed&) = delete;
  DeviceFeed& operator=(const DeviceFeed&) = delete;

  bool on_device() const { return on_device_; }
  // on_device: batch `index`'s parts, made when their replicas read them.
  std::shared_ptr<DeviceBatch> on_device_batch(std::shared_ptr<const std::vector<int64_t>> order,
                                               std::vector<FeedPart> parts);
  // prefetch: batch `index` of `order`, staged now unless it was, after the
  // next `prefetch` batches (< num_batches; plan(j) gives batch j's parts)
  // have been staged too. Staged batches of another order, before `index`
  // or past the window are dropped (their memory is reused only after their
  // copies and readers). From the thread that drives the dataset.
  std::shared_ptr<DeviceBatch> prefetched(
      const std::shared_ptr<const std::vector<int64_t>>& order, int64_t index, int64_t num_batches,
      const std::function<std::vector<FeedPart>(int64_t)>& plan);

  // The copy stream of local replica r (tests hold it to delay the copies).
  void* copy_stream(int r) const { return streams_.at(static_cast<size_t>(r)); }

 private:
  friend struct DeviceBatch;
  std::shared_ptr<DeviceBatch> stage(const std::shared_ptr<const std::vector<int64_t>>& order,
                                     std::vector<FeedPart> parts);
  // The manager, or FailedPreconditionError naming `what` once the strategy is gone.
  std::shared_ptr<DeviceManager> manager(const char* what) const;
  void* take_event(int ordinal);
  void give_event(int ordinal, void* event);
  // on_device, shuffled: the epoch's order on replica r's device (made on
  // its stream the first time the replica reads a batch of that order).
  const Tensor& device_order(int r, const std::shared_ptr<const std::vector<int64_t>>& order);

  // The strategy's manager, not kept alive by a dataset that outlives it
  // (its leases go with the strategy); the backend is, for the destructor.
  std::weak_ptr<DeviceManager> gpus_;
  std::shared_ptr<GpuBackend> backend_;
  std::vector<Device> devices_;
  std::vector<int> ordinals_;
  std::chrono::milliseconds timeout_;
  Dataset data_;  // the host rows
  int prefetch_ = 0;
  bool on_device_ = false;
  bool shuffle_ = true;
  std::vector<void*> streams_;  // prefetch: a copy stream per local replica
  // on_device: the dataset on each local replica's device, and each
  // replica's epoch order there (touched by that replica's thread only).
  std::vector<Tensor> features_, labels_;
  struct Order {
    std::shared_ptr<const std::vector<int64_t>> host;
    Tensor device;
  };
  std::vector<Order> orders_;
  std::mutex mu_;
  std::map<int64_t, std::shared_ptr<DeviceBatch>> staged_;  // prefetch, by index
  std::shared_ptr<const std::vector<int64_t>> staged_order_;
  std::vector<std::pair<int, void*>> spare_events_;  // (ordinal, event)
};

// What distribute() gives a dataset: null unless `options` ask for input on
// the device and the replicas are GPUs (`gpus` set); checks the options.
std::shared_ptr<DeviceFeed> make_device_feed(const std::shared_ptr<DeviceManager>& gpus,
                                             const std::vector<Device>& devices,
                                             std::chrono::milliseconds timeout,
                                             const DistributeOptions& options, const Dataset& data);

}  // namespace diststrat
