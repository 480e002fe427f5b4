#include "runtime/device_feed.h"

#include <vector>

#include "core/device_manager_impl.h"
#include "core/device_scope.h"
#include "runtime/data_source.h"
#include "diststrat/strategy.h"

namespace diststrat {

namespace {
Shape with_rows(const Tensor& t, int64_t rows) {
  std::vector<int64_t> dims = t.shape().dims();
  dims[0] = rows;
  return Shape(dims);
}
}  // namespace

std::shared_ptr<DeviceFeed> make_device_feed(const std::shared_ptr<DeviceManager>& gpus,
                                             const std::vector<Device>& devices,
                                             std::chrono::milliseconds timeout,
                                             const DistributeOptions& options,
                                             const Dataset& data) {
  DISTSTRAT_CHECK(options.prefetch_to_device >= 0, kInvalidArgument,
                  "distribute: prefetch_to_device ", options.prefetch_to_device,
                  " must be 0 (off) or a number of batches");
  if (!gpus || (!options.on_device && options.prefetch_to_device == 0)) return nullptr;
  for (const Device& d : devices) {
    if (!d.is_gpu()) return nullptr;  // CPU replicas: the rows are in host memory already
  }
  return std::make_shared<DeviceFeed>(gpus, devices, timeout, options, data);
}

DeviceFeed::DeviceFeed(std::shared_ptr<DeviceManager> gpus, std::vector<Device> devices,
                       std::chrono::milliseconds timeout, const DistributeOptions& options,
                       Dataset data)
    : gpus_(gpus),
      devices_(std::move(devices)),
      timeout_(timeout),
      data_(std::move(data)),
      prefetch_(options.prefetch_to_device),
      on_device_(options.on_device),
      shuffle_(options.shuffle) {
  DeviceManager::Impl& dm = DeviceManagerAccess::impl(*gpus);
  backend_ = dm.backend;
  DISTSTRAT_CHECK(backend_ != nullptr, kFailedPrecondition,
                  "distribute: input on the device without a GPU backend");
  DISTSTRAT_CHECK(data_.features().device().is_cpu() && data_.labels().device().is_cpu(),
                  kInvalidArgument,
                  "distribute: prefetch_to_device / on_device take a dataset in host memory, not ",
                  data_.features().debug_string());
  for (const Device& d : devices_) ordinals_.push_back(dm.ordinal_of(d));
  if (on_device_) {
    orders_.resize(devices_.size());
    for (size_t r = 0; r < devices_.size(); ++r) {
      ExecScope scope;
      scope.device = devices_[r];
      scope.devices = gpus.get();
      scope.timeout = timeout_;
      ScopedExec scoped(scope);
      // The default stream: the copies are done when this returns.
      const auto place = [&](const Tensor& host, const char* what) {
        try {
          Tensor t = Tensor::uninitialized(host.shape(), host.dtype(), devices_[r]);
          t.copy_from(host);
          return t;
        } catch (const ResourceExhaustedError& e) {
          throw ResourceExhaustedError(detail::str_cat(
              "distribute(on_device): the dataset's ", what, " (", host.debug_string(), ", ",
              host.nbytes(), " bytes) do not fit on ", devices_[r].to_string(),
              " (use on_device = false, with prefetch_to_device for overlap): ", e.what()));
        }
      };
      features_.push_back(place(data_.features(), "features"));
      labels_.push_back(place(data_.labels(), "labels"));
    }
    return;
  }
  try {
    for (int o : ordinals_) streams_.push_back(backend_->create_stream(o));
  } catch (...) {
    for (size_t r = 0; r < streams_.size(); ++r)
      backend_->destroy_stream(ordinals_[r], streams_[r]);
    throw;
  }
}

DeviceFeed::~DeviceFeed() {
  // No wait: events and streams go with work still queued, as CUDA allows;
  // the staged batches' memory goes back to the allocator, which reuses it
  // only after their copies (the events it records on free).
  for (auto& [i, b] : staged_) {
    for (DeviceBatch::Part& p : b->parts) {
      if (p.copied)
        backend_->destroy_event(ordinals_[static_cast<size_t>(p.rows.replica)], p.copied);
      p.copied = nullptr;
    }
  }
  staged_.clear();
  for (auto& [o, e] : spare_events_) backend_->destroy_event(o, e);
  for (size_t r = 0; r < streams_.size(); ++r) backend_->destroy_stream(ordinals_[r], streams_[r]);
}

std::shared_ptr<DeviceManager> DeviceFeed::manager(const char* what) const {
  std::shared_ptr<DeviceManager> m = gpus_.lock();
  DISTSTRAT_CHECK(m != nullptr, kFailedPrecondition, what,
                  ": the strategy this dataset was distributed by, and its GPUs, are gone");
  return m;
}

void* DeviceFeed::take_event(int ordinal) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = spare_events_.begin(); it != spare_events_.end(); ++it) {
      if (it->first == ordinal) {
        void* e = it->second;
        spare_events_.erase(it);
        return e;
      }
    }
  }
  return backend_->create_event(ordinal);
}

void DeviceFeed::give_event(int ordinal, void* event) {
  std::lock_guard<std::mutex> lock(mu_);
  spare_events_.emplace_back(ordinal, event);
}

std::shared_ptr<DeviceBatch> DeviceFeed::on_device_batch(
    std::shared_ptr<const std::vector<int64_t>> order, std::vector<FeedPart> parts) {
  auto b = std::make_shared<DeviceBatch>();
  b->feed = shared_from_this();
  b->order = std::move(order);
  for (const FeedPart& p : parts) b->parts.push_back(DeviceBatch::Part{p, {}, {}, nullptr, false});
  return b;
}

std::shared_ptr<DeviceBatch> DeviceFeed::stage(
    const std::shared_ptr<const std::vector<int64_t>>& order, std::vector<FeedPart> parts) {
  std::shared_ptr<DeviceManager> m = manager("DistributedDataset prefetch_to_device");
  DeviceManager::Impl& dm = DeviceManagerAccess::impl(*m);
  auto b = std::make_shared<DeviceBatch>();  // no feed: the feed hands its events back itself
  b->order = order;
  const Tensor& x = data_.features();
  const Tensor& y = data_.labels();
  for (const FeedPart& p : parts) {
    const size_t r = static_cast<size_t>(p.replica);
    const int ordinal = ordinals_[r];
    void* stream = streams_[r];
    DeviceBatch::Part part{p, {}, {}, nullptr, false};
    {
      // Device memory of the copy stream: record_stream adds the reader's.
      ExecScope scope;
      scope.device = devices_[r];
      scope.devices = m.get();
      scope.stream = stream;
      scope.timeout = timeout_;
      ScopedExec scoped(scope);
      part.features = Tensor::uninitialized(with_rows(x, p.rows), x.dtype(), devices_[r]);
      part.labels = Tensor::uninitialized(with_rows(y, p.rows), y.dtype(), devices_[r]);
    }
    const size_t xb = part.features.nbytes(), yb = part.labels.nbytes();
    const int64_t* rows = order->data() + p.begin;
    const auto fill = [&](char* host) {
      copy_rows(host, x, rows, p.rows);
      copy_rows(host + xb, y, rows, p.rows);
    };
    void* xd = xb ? part.features.data() : nullptr;
    void* yd = yb ? part.labels.data() : nullptr;
    if (!dm.stage_to_device(ordinal, {{xd, xb}, {yd, yb}}, fill, stream)) {
      // No pinned memory: from pageable memory, which the copy reads at the
      // call (CUDA stages it), so the buffer may go at once.
      std::vector<char> host(xb + yb);
      fill(host.data());
      if (xb) backend_->memcpy_async(ordinal, xd, host.data(), xb, stream);
      if (yb) backend_->memcpy_async(ordinal, yd, host.data() + xb, yb, stream);
    }
    part.copied = take_event(ordinal);
    b->parts.push_back(std::move(part));
    backend_->record_event(ordinal, b->parts.back().copied, stream);
  }
  return b;
}

std::shared_ptr<DeviceBatch> DeviceFeed::prefetched(
    const std::shared_ptr<const std::vector<int64_t>>& order, int64_t index, int64_t num_batches,
    const std::function<std::vector<FeedPart>(int64_t)>& plan) {
  std::map<int64_t, std::shared_ptr<DeviceBatch>> dropped;
  std::shared_ptr<DeviceBatch> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Keep only this order's batches in [index, index + prefetch].
    if (staged_order_ != order) {
      dropped.swap(staged_);
      staged_order_ = order;
    }
    for (auto it = staged_.begin(); it != staged_.end();) {
      if (it->first < index || it->first > index + prefetch_) {
        dropped.insert(*it);
        it = staged_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& [i, b] : dropped) {
    for (DeviceBatch::Part& p : b->parts) {
      give_event(ordinals_[static_cast<size_t>(p.rows.replica)], p.copied);
      p.copied = nullptr;
    }
  }
  dropped.clear();  // their memory: reused after the copies (allocator events)
  const int64_t last = std::min<int64_t>(num_batches - 1, index + prefetch_);
  for (int64_t j = index; j <= last; ++j) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (staged_.count(j)) continue;
    }
    std::shared_ptr<DeviceBatch> b = stage(order, plan(j));
    std::lock_guard<std::mutex> lock(mu_);
    staged_[j] = std::move(b);
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = staged_.find(index);
  out = it->second;
  staged_.erase(it);  // handed out: the batch hands its events back
  out->feed = shared_from_this();
  return out;
}

const Tensor& DeviceFeed::device_order(int r,
                                       const std::shared_ptr<const std::vector<int64_t>>& order) {
  Order& o = orders_.at(static_cast<size_t>(r));
  if (o.host != order) {
    const int64_t n = static_cast<int64_t>(order->size());
    Tensor d = Tensor::uninitialized(Shape{n}, DType::kInt64, devices_[static_cast<size_t>(r)]);
    // On the replica's stream (the calling thread's scope), staged: no wait.
    d.copy_from(
        Tensor::wrap(const_cast<int64_t*>(order->data()), Shape{n}, DType::kInt64, Device::cpu()));
    o.device = d;
    o.host = order;
  }
  return o.device;
}

DeviceBatch::~DeviceBatch() {
  if (!feed) return;
  for (Part& p : parts) {
    if (p.copied) feed->give_event(feed->ordinals_[static_cast<size_t>(p.rows.replica)], p.copied);
  }
}

const Tensor& DeviceBatch::get(size_t i, const ReplicaContext& ctx, bool labels, const char* what) {
  DISTSTRAT_CHECK_LT(i, parts.size(), what, ": part");
  Part& p = parts[i];
  const Device& mine = feed->devices_[static_cast<size_t>(p.rows.replica)];
  DISTSTRAT_CHECK(ctx.device() == mine, kInvalidArgument, what, ": rows put on ", mine.to_string(),
                  " read by a replica on ", ctx.device().to_string());
  if (!p.ready) {
    std::shared_ptr<DeviceManager> m = feed->manager(what);
    DeviceManager::Impl& dm = DeviceManagerAccess::impl(*m);
    const GpuExec e = gpu_exec(mine, what);  // the replica's stream
    if (p.copied) {
      // Prefetched: this stream's work waits for the copy on the device, and
      // the memory is not reused before this stream's steps are past it.
      e.backend->stream_wait_event(e.ordinal, e.stream, p.copied);
      if (p.features.nbytes()) dm.record_stream(mine, p.features.data(), e.stream);
      if (p.labels.nbytes()) dm.record_stream(mine, p.labels.data(), e.stream);
    } else {
      const size_t r = static_cast<size_t>(p.rows.replica);
      const Tensor& x = feed->features_.at(r);
      const Tensor& y = feed->labels_.at(r);
      const int64_t begin = p.rows.begin, n = p.rows.rows;
      // The dataset (default-stream memory) is read on this stream too.
      dm.record_stream(mine, x.data(), e.stream);
      dm.record_stream(mine, y.data(), e.stream);
      if (!feed->shuffle_) {
        // The epoch's order is 0, 1, 2, ...: the rows lie end to end.
        p.features = x.slice_rows(begin, begin + n);
        p.labels = y.slice_rows(begin, begin + n);
      } else {
        const Tensor& idx = feed->device_order(p.rows.replica, order);
        p.features = Tensor::uninitialized(with_rows(x, n), x.dtype(), mine);
        p.labels = Tensor::uninitialized(with_rows(y, n), y.dtype(), mine);
        if (n) {
          const int64_t* rows = idx.data<int64_t>() + begin;
          e.backend->gather_rows(e.ordinal, e.stream, p.features.data(), x.data(), rows, n,
                                 row_bytes(x));
          e.backend->gather_rows(e.ordinal, e.stream, p.labels.data(), y.data(), rows, n,
                                 row_bytes(y));
        }
      }
    }
    p.ready = true;
  }
  return labels ? p.labels : p.features;
}

}  // namespace diststrat
