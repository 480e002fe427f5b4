// A GpuBackend whose "device memory" is host memory, so the device logic
// (DeviceManager, caching allocator, leases, replica scopes, GPU code paths
// of tensors, nn ops, optimizers and the strategies) runs in CPU tests. It
// models what a real GPU hides from such tests:
//  - asynchrony: enqueued work (copies, memsets, kernels, event marks) does
//    not run when it is called. By default (Options::executor) every stream
//    has its own executor thread that runs the stream's work in stream order,
//    each kernel launch after an injectable delay (set_launch_delay; a very
//    long one is a hung launch), so the host runs ahead of the device as on a
//    GPU and code that reads a result without waiting, or frees or rewrites
//    a buffer the device still reads, fails (and TSan sees the race). Without
//    the executor the work runs in enqueue order only when someone waits
//    (synchronize, synchronize_device, copy_to_host, event_done), so a
//    missing wait reads stale memory deterministically. Pageable host
//    sources of copies are read at the call (as CUDA stages pageable
//    memory); pinned ones (host_alloc) when the copy runs, and host_free of
//    pinned memory that a queued copy still reads is counted
//    (pinned_frees_with_pending_reads) and poisons it;
//  - stream_wait_event orders one stream after another's event mark;
//  - streams: hold(ordinal, stream) keeps a stream's work from running until
//    release(); a destroyed stream's handle goes to the next stream created
//    (CUDA reuses handle values too), so code that keys anything by the raw
//    handle mixes the two streams up (Options::reuse_stream_handles); inside,
//    work is keyed by the stream's identity (stream_id), never by the handle;
//    the default (null) stream is ordered with the created streams
//    as CUDA's legacy default stream is with blocking streams, or, with
//    Options::default_stream_orders_with_streams = false, independent (a
//    per-thread-default-stream or non-blocking-stream build);
//  - device memory that the host cannot dereference: device pointers carry a
//    tag bit (bit 62, a non-canonical x86-64 address), so a host read of one
//    crashes; fresh device memory is filled with 0xff bytes (NaN), as
//    cudaMalloc memory is not zeroed;
//  - the CUDA runtime's per-thread state: a current device and a last error
//    that a failing call sets and that a launch check reads and clears;
//    invalid ordinals and streams of another device are errors;
//  - NCCL's rule that a communicator is not aborted while another thread is
//    inside a call on it (violations are counted in aborts_during_calls);
//  - cudaFree waiting for the device: raw_free with work still queued on the
//    device counts frees_with_pending_work;
//  - graph capture (begin_capture .. end_capture, launch_graph): work
//    enqueued on a capturing stream is recorded instead of run, and a graph
//    launch replays the recorded closures in their order as one op of the
//    stream. On a capturing stream a device -> host read, a synchronize (of
//    the stream, or of its device from the capturing thread), a copy from
//    pageable host memory, a wait for an event from outside the capture, a
//    free and a query of an event recorded in the capture throw (as CUDA's
//    cudaErrorStreamCaptureUnsupported) and invalidate the capture, whose
//    end_capture then throws (cudaErrorStreamCaptureInvalidated).
// Compute goes through the library's CPU code on the untagged pointers
// (SGD and Adam as the CUDA kernels do them); collectives through an
// in-process group after the rank's stream has drained.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "allreduce/reduce_kernels.h"
#include "core/gpu_backend.h"
#include "diststrat/collective.h"
#include "diststrat/device_manager.h"
#include "diststrat/gpu_lease.h"
#include "diststrat/nn.h"
#include "diststrat/optimizer.h"
#include "gpu/call_gate.h"
#include "gpu/device_reduce.h"
#include "../common/temp_dir.h"

namespace diststrat_test {

namespace ds = diststrat;

class FakeGpuBackend : public ds::GpuBackend {
 public:
  struct Options {
    // CUDA's legacy default stream semantics (what the CUDA backend uses).
    bool default_stream_orders_with_streams = true;
    // create_stream hands out the handle of the most recently destroyed
    // stream, as cudaStreamCreate may.
    bool reuse_stream_handles = true;
    // Executor threads run the work unasked (see the top); false: lazily, at
    // waits.
    bool executor = true;
  };

  // `devices` fake GPUs of `capacity` bytes each.
  explicit FakeGpuBackend(int devices, size_t capacity = 64u << 20)
      : FakeGpuBackend(devices, capacity, Options()) {}
  FakeGpuBackend(int devices, size_t capacity, Options options)
      : devices_(devices),
        capacity_(capacity),
        options_(options),
        used_(static_cast<size_t>(devices), 0) {}
  ~FakeGpuBackend() override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      held_.clear();
      stop_ = true;  // cuts launch delays short
      cv_.notify_all();
      cv_.wait_for(lock, std::chrono::seconds(60),
                   [&] { return pending_.empty() || workers_.empty(); });
    }
    for (auto& [key, t] : workers_) t.join();
    std::lock_guard<std::mutex> lock(mu_);
    options_.executor = false;
    run_pending_locked();
    for (auto& [p, s] : sizes_) std::free(p);
    for (auto& [p, bytes] : pinned_) std::free(p);
    for (void* p : poisoned_) std::free(p);
    for (auto& [e, info] : events_) delete static_cast<int*>(e);
    for (Graph* g : graphs_) delete g;
  }

  // ---- the pointer model ----
  static constexpr uintptr_t kDeviceTag = uintptr_t{1} << 62;
  static bool is_device(const void* p) { return reinterpret_cast<uintptr_t>(p) & kDeviceTag; }
  static void* untag(const void* p) {
    return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) & ~kDeviceTag);
  }
  // Device memory read back for a test's assertions (after the queued work).
  template <typename T>
  std::vector<T> read(int ordinal, const void* dev, size_t count) {
    std::vector<T> out(count);
    copy_to_host(ordinal, out.data(), dev, count * sizeof(T), nullptr,
                 ds::DeadlineClock::now() + std::chrono::seconds(30), "fake read");
    return out;
  }

  // ---- test controls ----
  // release(ordinal, stream) releases the stream that was held under that
  // handle, even when the handle names a newer stream by now.
  void hold(int ordinal, void* stream) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t id = id_locked(stream);
    held_.insert({ordinal, id});
    held_by_handle_[{ordinal, stream}] = id;
  }
  void release(int ordinal, void* stream) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = held_by_handle_.find({ordinal, stream});
    if (it != held_by_handle_.end()) {
      held_.erase({ordinal, it->second});
      held_by_handle_.erase(it);
    }
    run_pending_locked();
    cv_.notify_all();
  }
  // Each kernel launch runs `delay` after its turn comes (executor only).
  void set_launch_delay(std::chrono::microseconds delay) { launch_delay_us_ = delay.count(); }
  // While paused, no kernel named `name` starts (executor only; its stream
  // stops there): "the step's work is still queued when run() returns" holds
  // whatever the host's speed (a launch delay alone does not under a
  // sanitizer). A host wait for paused work runs into its deadline.
  void pause_kernels(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    paused_kernel_ = name;
  }
  void resume_kernels() {
    std::lock_guard<std::mutex> lock(mu_);
    paused_kernel_.clear();
    cv_.notify_all();
  }
  // Runs the queued work that nothing holds back now, as a GPU would unasked
  // (the executor does so anyway).
  void run_ready() {
    std::lock_guard<std::mutex> lock(mu_);
    run_pending_locked();
    cv_.notify_all();
  }
  // Called inside every fake NCCL call (after entering it): lets a test park
  // replicas inside a collective while another one fails.
  std::function<void(int rank)> inside_collective;

  std::string name() const override { return "fake"; }
  int device_count() override { return devices_; }
  ds::GpuInfo info(int ordinal) override {
    DISTSTRAT_CHECK(ordinal >= 0 && ordinal < devices_, kNotFound, "fake GPU ordinal ", ordinal,
                    " does not exist (", devices_, " visible)");
    ds::GpuInfo g;
    g.name = "FakeGPU";
    g.uuid = "GPU-fake-" + std::to_string(ordinal);
    g.total_bytes = capacity_;
    std::lock_guard<std::mutex> lock(mu_);
    g.free_bytes = capacity_ - used_[static_cast<size_t>(ordinal)];
    g.compute_capability = 90;
    return g;
  }
  void* raw_malloc(int ordinal, size_t bytes) override {
    set_device(ordinal, "cudaSetDevice(ordinal)");
    std::lock_guard<std::mutex> lock(mu_);
    if (used_[static_cast<size_t>(ordinal)] + bytes > capacity_) return nullptr;
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    std::memset(p, 0xff, bytes);  // cudaMalloc does not zero
    used_[static_cast<size_t>(ordinal)] += bytes;
    sizes_[p] = {ordinal, bytes};
    ++mallocs;
    return tag(p);
  }
  void raw_free(int ordinal, void* dev) override {
    refuse_on_capturing_thread(ordinal, "cudaFree");
    std::unique_lock<std::mutex> lock(mu_);
    for (const Op& op : pending_) {
      if (op.device == ordinal) {
        ++frees_with_pending_work;  // cudaFree would have blocked on it
        break;
      }
    }
    run_pending_locked();
    if (options_.executor) {
      // cudaFree waits for the device: for what can run (not for held work).
      cv_.wait_for(lock, std::chrono::seconds(60), [&] {
        const std::vector<State> st = classify_locked();
        for (size_t i = 0; i < st.size(); ++i) {
          if (pending_[i].device == ordinal && st[i] != State::kStuck) return false;
        }
        return true;
      });
    }
    auto it = sizes_.find(untag(dev));
    if (it == sizes_.end()) {
      ++bad_frees;
      return;
    }
    used_[static_cast<size_t>(it->second.first)] -= it->second.second;
    std::free(it->first);
    sizes_.erase(it);
    ++frees;
  }
  size_t used(int ordinal) {
    std::lock_guard<std::mutex> lock(mu_);
    return used_[static_cast<size_t>(ordinal)];
  }

  void* create_stream(int ordinal) override {
    set_device(ordinal, "cudaSetDevice(ordinal)");
    std::lock_guard<std::mutex> lock(mu_);
    void* s = nullptr;
    if (options_.reuse_stream_handles && !free_handles_.empty()) {
      s = free_handles_.back();
      free_handles_.pop_back();
      ++stream_handles_reused;
    } else {
      s = reinterpret_cast<void*>(static_cast<uintptr_t>(0x5000 + ++next_stream_));
    }
    stream_device_[s] = ordinal;
    stream_ids_[s] = ++next_stream_id_;
    return s;
  }
  void destroy_stream(int ordinal, void* stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    // Queued work still runs (under the old identity), as with cudaStreamDestroy.
    if (stream_device_.erase(stream)) free_handles_.push_back(stream);
    stream_ids_.erase(stream);
    ++streams_destroyed;
  }

  void memcpy_async(int ordinal, void* dst, const void* src, size_t bytes, void* stream) override {
    begin_call(ordinal, stream, "cudaMemcpyAsync");
    if (is_device(src) && !is_device(dst)) {
      refuse_capturing(ordinal, stream, "cudaMemcpyAsync (device -> host)");
    } else if (!is_device(src) && !pinned_block(src)) {
      refuse_capturing(ordinal, stream, "cudaMemcpyAsync (from pageable host memory)");
    }
    ++launches;
    count_launch(is_device(src) ? (is_device(dst) ? "memcpy d2d" : "memcpy d2h") : "memcpy h2d");
    if (is_device(src) && !is_device(dst)) ++host_reads;
    void* d = untag(dst);
    if (is_device(src)) {
      const void* s = untag(src);
      enqueue(ordinal, stream, [d, s, bytes] {
        if (bytes) std::memmove(d, s, bytes);
      });
    } else if (pinned_block(src)) {
      // Pinned memory is read when the copy runs: the caller keeps it.
      std::lock_guard<std::mutex> lock(mu_);
      if (enqueue_locked(ordinal, stream, [d, src, bytes] {
            if (bytes) std::memcpy(d, src, bytes);
          }) != kCaptured) {
        pending_.back().pinned_src = src;
      }
    } else {
      // Pageable host memory is staged at the call.
      auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                        static_cast<const char*>(src) + bytes);
      // (A copy of 0 bytes, legal in CUDA, has no buffer: memcpy must not see it.)
      enqueue(ordinal, stream, [d, staged] {
        if (!staged->empty()) std::memcpy(d, staged->data(), staged->size());
      });
    }
  }
  void memset_async(int ordinal, void* dst, int value, size_t bytes, void* stream) override {
    begin_call(ordinal, stream, "cudaMemsetAsync");
    ++launches;
    count_launch("memset");
    void* d = untag(dst);
    enqueue(ordinal, stream, [d, value, bytes] {
      if (bytes) std::memset(d, value, bytes);
    });
  }
  void copy_to_host(int ordinal, void* dst, const void* src, size_t bytes, void* stream,
                    ds::DeadlineClock::time_point deadline, const std::string& what) override {
    ++copies_to_host;
    refuse_capturing(ordinal, stream, "cudaMemcpyAsync (device -> host) for " + what);
    ds::GpuBackend::copy_to_host(ordinal, dst, src, bytes, stream, deadline, what);
  }
  void synchronize(int ordinal, void* stream, ds::DeadlineClock::time_point deadline,
                   const std::string& what) override {
    begin_call(ordinal, stream, "cudaStreamSynchronize");
    refuse_capturing(ordinal, stream, "cudaStreamSynchronize for " + what);
    ++syncs;
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t id = id_locked(stream);
    auto it = last_seq_.find({ordinal, id});
    const long target = it == last_seq_.end() ? -1 : it->second;
    wait_locked(
        lock, ordinal, [&](const Op& op) { return op.stream == id && op.seq <= target; }, deadline,
        what);
  }
  void synchronize_device(int ordinal, ds::DeadlineClock::time_point deadline,
                          const std::string& what) override {
    set_device(ordinal, "cudaSetDevice(ordinal)");
    refuse_on_capturing_thread(ordinal, "cudaDeviceSynchronize for " + what);
    ++device_syncs;
    std::unique_lock<std::mutex> lock(mu_);
    const long target = next_seq_;
    wait_locked(
        lock, ordinal, [&](const Op& op) { return op.seq < target; }, deadline, what);
  }

  bool stream_alive(int ordinal, void* stream) override {
    if (!stream) return true;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = stream_device_.find(stream);
    return it != stream_device_.end() && it->second == ordinal;
  }
  uint64_t stream_id(int ordinal, void* stream) override {
    if (!stream) return 0;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = stream_device_.find(stream);
    if (it == stream_device_.end() || it->second != ordinal) return kUnknownStream;
    return stream_ids_.at(stream);
  }

  void* create_event(int ordinal) override {
    set_device(ordinal, "cudaSetDevice(ordinal)");
    std::lock_guard<std::mutex> lock(mu_);
    void* e = new int(0);
    events_[e] = -1;  // never recorded: complete
    return e;
  }
  void record_event(int ordinal, void* event, void* stream) override {
    begin_call(ordinal, stream, "cudaEventRecord");
    std::lock_guard<std::mutex> lock(mu_);
    const long seq = enqueue_locked(ordinal, stream, [] {});
    events_.at(event) = seq;  // kCaptured: a node of the capture
    ++events_recorded;
  }
  bool event_done(int ordinal, void* event) override {
    std::lock_guard<std::mutex> lock(mu_);
    refuse_captured_event_locked(event, "cudaEventQuery");
    run_pending_locked();
    return !pending_seq_locked(events_.at(event));
  }
  void stream_wait_event(int ordinal, void* stream, void* event) override {
    begin_call(ordinal, stream, "cudaStreamWaitEvent");
    std::lock_guard<std::mutex> lock(mu_);
    const long mark = events_.at(event);
    if (captures_.count({ordinal, id_locked(stream)}) && mark != kCaptured) {
      invalidate_locked(ordinal, stream);
      thread_state().last_error =
          "operation would make the legacy stream depend on a capturing blocking stream / an "
          "event from outside the capture (cudaErrorStreamCaptureIsolation)";
      fail("cudaStreamWaitEvent");
    }
    ++stream_waits;
    if (mark == kCaptured) {
      enqueue_locked(ordinal, stream, [] {});  // inside one capture: its order
      return;
    }
    if (!pending_seq_locked(mark)) return;  // already done
    enqueue_locked(ordinal, stream, [] {});
    pending_.back().wait_seq = mark;
  }

  // Waits for the event's mark alone (work enqueued after it may still run).
  void wait_event(int ordinal, void* event, ds::DeadlineClock::time_point deadline,
                  const std::string& what) override {
    set_device(ordinal, "cudaSetDevice(ordinal)");
    ++event_waits;
    std::unique_lock<std::mutex> lock(mu_);
    refuse_captured_event_locked(event, "cudaEventSynchronize for " + what);
    const long mark = events_.at(event);
    wait_locked(
        lock, ordinal, [&](const Op& op) { return op.seq == mark; }, deadline, what);
  }

  // Pinned host memory: plain host memory that copies read when they run.
  void* host_alloc(size_t bytes) override {
    void* p = std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
    std::lock_guard<std::mutex> lock(mu_);
    pinned_[p] = bytes;
    ++host_allocs;
    return p;
  }
  void host_free(void* p) override {
    if (!p) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pinned_.find(p);
    if (it == pinned_.end()) {
      ++bad_frees;
      return;
    }
    const char* b = static_cast<const char*>(p);
    bool read_later = false;
    for (const Op& op : pending_) {
      const char* src = static_cast<const char*>(op.pinned_src);
      if (src && src >= b && src < b + std::max<size_t>(it->second, 1)) read_later = true;
    }
    if (read_later) {
      // cudaFreeHost would hand the pages back while the copy reads them:
      // poison them so the copy brings garbage, and count it.
      ++pinned_frees_with_pending_reads;
      std::memset(p, 0xff, it->second);
      poisoned_.push_back(p);
    } else {
      std::free(p);
    }
    pinned_.erase(it);
  }
  void destroy_event(int, void* event) override {
    std::lock_guard<std::mutex> lock(mu_);
    events_.erase(event);
    delete static_cast<int*>(event);
  }

  void dense_forward(int ordinal, void* stream, const float* x, const float* w, const float* b,
                     float* y, int64_t n, int64_t in, int64_t out) override {
    launch(ordinal, stream, "dense_forward", [=] {
      ds::Tensor Y = host(y, {n, out});
      ds::nn::dense_forward(host(x, {n, in}), host(w, {in, out}), host(b, {out}), Y);
    });
  }
  void dense_backward(int ordinal, void* stream, const float* x, const float* w, const float* dy,
                      float* dx, float* dw, float* db, int64_t n, int64_t in,
                      int64_t out) override {
    launch(ordinal, stream, "dense_backward", [=] {
      ds::Tensor DX = dx ? host(dx, {n, in}) : ds::Tensor();
      ds::Tensor DW = host(dw, {in, out}), DB = host(db, {out});
      ds::nn::dense_backward(host(x, {n, in}), host(w, {in, out}), host(dy, {n, out}),
                             dx ? &DX : nullptr, DW, DB);
    });
  }
  void relu_forward(int ordinal, void* stream, const float* x, float* y, int64_t count) override {
    launch(ordinal, stream, "relu_forward", [=] {
      ds::Tensor Y = host(y, {count});
      ds::nn::relu_forward(host(x, {count}), Y);
    });
  }
  void relu_backward(int ordinal, void* stream, const float* y, const float* dy, float* dx,
                     int64_t count) override {
    launch(ordinal, stream, "relu_backward", [=] {
      ds::Tensor DX = host(dx, {count});
      ds::nn::relu_backward(host(y, {count}), host(dy, {count}), DX);
    });
  }
  void softmax_cross_entropy(int ordinal, void* stream, const float* logits_d,
                             const int32_t* labels_d, float* dlogits_d, float* loss_d,
                             int32_t* correct_d, int32_t* bad_d, int64_t n, int64_t k,
                             float scale) override {
    launch(ordinal, stream, "softmax_xent", [=] {
      const float* logits = h(logits_d);
      const int32_t* labels = h(labels_d);
      float* dlogits = h(dlogits_d);
      float* loss = h(loss_d);
      int32_t* correct = h(correct_d);
      int32_t* bad = h(bad_d);
      *bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        if (labels[i] < 0 || labels[i] >= k) {
          *bad = static_cast<int32_t>(i + 1);
          return;
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        ds::Tensor z = ds::Tensor::wrap(const_cast<float*>(logits + i * k), ds::Shape{1, k},
                                        ds::DType::kFloat32);
        ds::Tensor d = ds::Tensor::wrap(dlogits + i * k, ds::Shape{1, k}, ds::DType::kFloat32);
        ds::Tensor y =
            ds::Tensor::wrap(const_cast<int32_t*>(labels + i), ds::Shape{1}, ds::DType::kInt32);
        loss[i] = static_cast<float>(ds::nn::softmax_cross_entropy(z, y, d, scale));
        correct[i] = static_cast<int32_t>(ds::nn::count_correct(z, y));
      }
    });
  }
  void apply_update(int ordinal, void* stream, const ds::UpdateRule& rule, float* var_d,
                    const float* grad_d, float* const* slots_d, size_t count,
                    int64_t step) override {
    ++updates;
    if (rule.kind == ds::UpdateRule::Kind::kNone) {
      throw ds::UnimplementedError("fake backend: the optimizer has no device rule");
    }
    // The slot pointer array is host memory valid only during the call.
    std::vector<float*> slots;
    const size_t n_slots = rule.kind == ds::UpdateRule::Kind::kAdam ? 2
                           : rule.momentum == 0.0f                  ? 0
                                                                    : 1;
    for (size_t i = 0; i < n_slots; ++i) slots.push_back(h(slots_d[i]));
    float* var = h(var_d);
    const float* grad = h(grad_d);
    if (rule.kind == ds::UpdateRule::Kind::kAdam) ++adam_updates;
    launch(ordinal, stream, "update",
           [=] { update_elements(rule, var, grad, slots.data(), count, step); });
  }
  // The rule on one tensor, as kernels.cu's sgd / adam elements do it.
  static void update_elements(const ds::UpdateRule& rule, float* var, const float* grad,
                              float* const* slots, size_t count, int64_t step) {
    if (rule.kind == ds::UpdateRule::Kind::kSgd) {
      for (size_t i = 0; i < count; ++i) {
        if (rule.momentum == 0.0f) {
          var[i] -= rule.learning_rate * grad[i];
        } else {
          slots[0][i] = rule.momentum * slots[0][i] - rule.learning_rate * grad[i];
          var[i] += rule.nesterov ? rule.momentum * slots[0][i] - rule.learning_rate * grad[i]
                                  : slots[0][i];
        }
      }
      return;
    }
    // Adam as kernels.cu's adam_kernel: bias correction folded into alpha.
    const double t = static_cast<double>(step);
    const float alpha =
        static_cast<float>(rule.learning_rate * std::sqrt(1.0 - std::pow(rule.beta2, t)) /
                           (1.0 - std::pow(rule.beta1, t)));
    const float b1 = rule.beta1, b2 = rule.beta2;
    for (size_t i = 0; i < count; ++i) {
      slots[0][i] = b1 * slots[0][i] + (1 - b1) * grad[i];
      slots[1][i] = b2 * slots[1][i] + (1 - b2) * grad[i] * grad[i];
      var[i] -= alpha * slots[0][i] / (std::sqrt(slots[1][i]) + rule.epsilon);
    }
  }
  void reduce(int ordinal, void* stream, void* dst, const void* const* srcs, int n, size_t count,
              ds::DType dtype, ds::ReduceOp op, int mean_divisor) override {
    std::vector<const void*> in;
    for (int i = 0; i < n; ++i) in.push_back(untag(srcs[i]));
    void* out = untag(dst);
    launch(ordinal, stream, "reduce",
           [=] { ds::kernels::reduce(out, in.data(), n, count, dtype, op, mean_divisor); });
  }
  // Input on the device: one launch, the row indices read when it runs.
  void gather_rows(int ordinal, void* stream, void* dst, const void* src, const int64_t* rows,
                   int64_t n, size_t row_bytes) override {
    char* d = static_cast<char*>(untag(dst));
    const char* sp = static_cast<const char*>(untag(src));
    const int64_t* r = h(rows);
    launch(ordinal, stream, "gather_rows", [=] {
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(d + i * row_bytes, sp + r[i] * row_bytes, row_bytes);
    });
  }

  std::vector<std::unique_ptr<ds::Communicator>> nccl_local_group(
      const std::vector<int>& ordinals, const std::vector<void*>& streams,
      const ds::CommunicationOptions& options) override {
    ++nccl_groups;
    return group(ordinals, streams, options, /*nccl=*/true);
  }
  std::vector<std::unique_ptr<ds::Communicator>> shared_device_group(
      const ds::SharedDeviceGroupSpec& spec, const ds::CommunicationOptions& options) override {
    ++shared_groups;
    return group(std::vector<int>(spec.streams.size(), spec.ordinal), spec.streams, options,
                 /*nccl=*/false);
  }

  std::atomic<int> mallocs{0}, frees{0}, syncs{0}, device_syncs{0}, updates{0}, adam_updates{0},
      streams_destroyed{0}, copies_to_host{0}, events_recorded{0}, stream_handles_reused{0};
  std::atomic<int> nccl_groups{0}, shared_groups{0};
  std::atomic<int> frees_with_pending_work{0}, bad_frees{0}, aborts_during_calls{0};
  // Work enqueued on streams (kernels, copies, memsets, collectives), and
  // device -> host copies: a test counts them per training step.
  std::atomic<int> launches{0}, host_reads{0};
  std::atomic<int> stream_waits{0}, host_allocs{0}, pinned_frees_with_pending_reads{0};
  // wait_event calls (the host waiting for one mark, e.g. a bounded number of steps in flight).
  std::atomic<int> event_waits{0};
  // Kernel launches made, and those that have run (their delay included).
  std::atomic<int> kernels_launched{0}, kernels_run{0};
  std::string paused_kernel_;  // pause_kernels (under mu_)
  // launches by kernel (or "memcpy h2d", "memset", "collective", ...).
  std::map<std::string, int> launched() {
    std::lock_guard<std::mutex> lock(mu_);
    return launched_;
  }
  void count_launch(const char* what) {
    std::lock_guard<std::mutex> lock(mu_);
    ++launched_[what];
  }

  // The calling thread's fake CUDA state (the runtime's is per thread too).
  struct ThreadState {
    int device = 0;
    std::string last_error;
  };
  static ThreadState& thread_state() {
    thread_local ThreadState s;
    return s;
  }

 private:
  struct Op {
    long seq;
    int device;
    uint64_t stream;  // the stream's identity (0: the default stream)
    std::function<void()> fn;
    bool kernel = false;               // a launch: the launch delay applies
    const char* name = nullptr;        // the kernel's name (launch)
    bool running = false;              // an executor thread runs it now
    long wait_seq = -1;                // stream_wait_event: runs after this op
    const void* pinned_src = nullptr;  // a pinned host source it reads
  };
  // Where an op stands: it may run now; it waits for work that will run; or
  // it is stuck behind a held stream.
  enum class State { kRunnable, kRunning, kWaiting, kStuck };
  // The identity of the live stream `stream` names (0 for null; a value no
  // stream has for a handle that names none).
  uint64_t id_locked(void* stream) const {
    if (!stream) return 0;
    auto it = stream_ids_.find(stream);
    return it == stream_ids_.end() ? ~uint64_t{0} : it->second;
  }

  static void* tag(void* p) {
    return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) | kDeviceTag);
  }
  template <typename T>
  static T* h(T* p) {
    return static_cast<T*>(untag(p));
  }
  static ds::Tensor host(const float* p, std::initializer_list<int64_t> dims) {
    return ds::Tensor::wrap(static_cast<float*>(untag(p)), ds::Shape(dims), ds::DType::kFloat32);
  }

  // Like throw_cuda_error: reports the thread's last error and clears it, so
  // the next launch check does not see it again.
  [[noreturn]] static void fail(const std::string& call) {
    std::string err;
    std::swap(err, thread_state().last_error);
    throw ds::InternalError("fake CUDA call " + call + " failed: " + err);
  }
  void set_device(int ordinal, const char* call) {
    if (ordinal < 0 || ordinal >= devices_) {
      thread_state().last_error = "invalid device ordinal (cudaErrorInvalidDevice)";
      fail(call);
    }
    thread_state().device = ordinal;
  }
  // cudaSetDevice, then the stream must belong to the current device.
  void begin_call(int ordinal, void* stream, const char* call) {
    set_device(ordinal, "cudaSetDevice(ordinal)");
    if (!stream) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = stream_device_.find(stream);
    if (it == stream_device_.end() || it->second != thread_state().device) {
      thread_state().last_error = "invalid resource handle (cudaErrorInvalidResourceHandle)";
      fail(call);
    }
  }
  // A kernel launch: enqueued, then checked as kernels.cu's check_launch does
  // (cudaGetLastError: reads and clears the thread's last error).
  void launch(int ordinal, void* stream, const char* kernel, std::function<void()> fn) {
    begin_call(ordinal, stream, kernel);
    ++launches;
    ++kernels_launched;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++launched_[kernel];
      if (enqueue_locked(ordinal, stream, std::move(fn)) == kCaptured) {
        captures_.at({ordinal, id_locked(stream)}).ops.back().name = kernel;
      } else {
        pending_.back().kernel = true;
        pending_.back().name = kernel;
      }
    }
    std::string err;
    std::swap(err, thread_state().last_error);
    if (!err.empty()) {
      throw ds::InternalError(std::string("fake kernel launch ") + kernel + " failed: " + err);
    }
  }
  void enqueue(int ordinal, void* stream, std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(mu_);
    enqueue_locked(ordinal, stream, std::move(fn));
  }
  long enqueue_locked(int ordinal, void* stream, std::function<void()> fn) {
    const uint64_t id = id_locked(stream);
    auto capture = captures_.find({ordinal, id});
    if (capture != captures_.end()) {
      // Recorded for the graph, not run.
      capture->second.ops.push_back(Op{-1, ordinal, id, std::move(fn)});
      ++captured_ops;
      return kCaptured;
    }
    const long seq = next_seq_++;
    pending_.push_back(Op{seq, ordinal, id, std::move(fn)});
    last_seq_[{ordinal, id}] = seq;
    if (options_.executor && !stop_) {
      const std::pair<int, uint64_t> key{ordinal, id};
      if (!workers_.count(key)) workers_.emplace(key, std::thread([this, key] { work(key); }));
    }
    cv_.notify_all();
    return seq;
  }
  bool pending_seq_locked(long seq) const {
    if (seq < 0) return false;
    for (const Op& op : pending_) {
      if (op.seq == seq) return true;
    }
    return false;
  }
  bool pinned_block(const void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pinned_.upper_bound(const_cast<void*>(p));
    if (it == pinned_.begin()) return false;
    --it;
    const char* b = static_cast<const char*>(it->first);
    return static_cast<const char*>(p) < b + std::max<size_t>(it->second, 1);
  }
  // The state of every queued op, in queue order: an op follows the earlier
  // ops of its stream, the op its stream_wait_event names, and (legacy
  // default-stream semantics) every earlier op of the device when it is on
  // the default stream, every earlier default-stream op otherwise. With
  // `run_inline` (no executor), runnable ops run at once, in order.
  std::vector<State> scan_locked(bool run_inline) {
    std::vector<State> out;
    std::set<std::pair<int, uint64_t>> stuck_keys, busy_keys;
    std::set<int> dev_stuck, legacy_stuck, dev_busy, legacy_busy;
    std::set<long> stuck_seqs, seqs;
    for (const Op& op : pending_) seqs.insert(op.seq);
    const bool order = options_.default_stream_orders_with_streams;
    for (size_t i = 0; i < pending_.size();) {
      const Op& op = pending_[i];
      const std::pair<int, uint64_t> key{op.device, op.stream};
      const bool legacy = op.stream == 0;
      bool stuck = held_.count(key) || stuck_keys.count(key) ||
                   (op.wait_seq >= 0 && stuck_seqs.count(op.wait_seq));
      if (!stuck && order) {
        stuck = legacy ? dev_stuck.count(op.device) > 0 : legacy_stuck.count(op.device) > 0;
      }
      State st = State::kStuck;
      if (!stuck) {
        bool wait = busy_keys.count(key) || (op.wait_seq >= 0 && seqs.count(op.wait_seq));
        if (!wait && order) {
          wait = legacy ? dev_busy.count(op.device) > 0 : legacy_busy.count(op.device) > 0;
        }
        st = op.running ? State::kRunning : wait ? State::kWaiting : State::kRunnable;
      }
      if (st == State::kRunnable && run_inline) {
        if (op.kernel) ++kernels_run;
        std::function<void()> fn = std::move(pending_[i].fn);
        seqs.erase(op.seq);
        pending_.erase(pending_.begin() + static_cast<long>(i));
        try {
          fn();
        } catch (const std::exception& e) {
          device_error_ = e.what();  // as a failed kernel: reported by the next wait
        }
        continue;
      }
      if (st == State::kStuck) {
        stuck_keys.insert(key);
        stuck_seqs.insert(op.seq);
        dev_stuck.insert(op.device);
        if (legacy) legacy_stuck.insert(op.device);
      }
      busy_keys.insert(key);
      dev_busy.insert(op.device);
      if (legacy) legacy_busy.insert(op.device);
      out.push_back(st);
      ++i;
    }
    return out;
  }
  std::vector<State> classify_locked() { return scan_locked(false); }
  // Without the executor: runs, in enqueue order, every queued op that
  // nothing holds back. With it, the executor threads do.
  void run_pending_locked() {
    if (!options_.executor) scan_locked(true);
  }
  // An executor thread: runs the work of stream `key` in stream order.
  void work(std::pair<int, uint64_t> key) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      const std::vector<State> st = classify_locked();
      size_t mine = pending_.size();
      bool left = false;
      for (size_t i = 0; i < pending_.size(); ++i) {
        if (pending_[i].device != key.first || pending_[i].stream != key.second) continue;
        left = true;
        if (st[i] == State::kRunnable) mine = i;
        break;
      }
      if (stop_ && !left) return;
      if (mine == pending_.size() || (pending_[mine].kernel && !paused_kernel_.empty() &&
                                      paused_kernel_ == pending_[mine].name)) {
        cv_.wait(lock);
        continue;
      }
      Op& op = pending_[mine];
      op.running = true;
      const long seq = op.seq;
      const bool kernel = op.kernel;
      std::function<void()> fn = std::move(op.fn);
      const long delay = launch_delay_us_.load();
      if (kernel && delay > 0) {
        cv_.wait_for(lock, std::chrono::microseconds(delay), [&] { return stop_; });
      }
      lock.unlock();
      std::string error;
      try {
        fn();
      } catch (const std::exception& e) {
        error = e.what();
      }
      lock.lock();
      if (kernel) ++kernels_run;
      if (!error.empty()) device_error_ = error;  // reported by the next wait
      for (auto it = pending_.begin(); it != pending_.end(); ++it) {
        if (it->seq == seq) {
          pending_.erase(it);
          break;
        }
      }
      cv_.notify_all();
    }
  }
  template <typename Pred>
  void wait_locked(std::unique_lock<std::mutex>& lock, int ordinal, Pred&& counts,
                   ds::DeadlineClock::time_point deadline, const std::string& what) {
    for (;;) {
      run_pending_locked();
      if (!device_error_.empty()) {
        std::string e;
        std::swap(e, device_error_);
        throw ds::InternalError(what + ": fake GPU work failed: " + e);
      }
      bool done = true;
      for (const Op& op : pending_) {
        if (op.device == ordinal && counts(op)) {
          done = false;
          break;
        }
      }
      if (done) return;
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout &&
          ds::DeadlineClock::now() >= deadline) {
        run_pending_locked();
        throw ds::DeadlineExceededError(what + ": the work on fake GPU " + std::to_string(ordinal) +
                                        " did not finish before the deadline (its stream is "
                                        "held or a launch hangs)");
      }
    }
  }

  // NCCL-like communicators: a collective drains the rank's stream, then runs
  // on the untagged buffers through an in-process group. Its "NCCL call"
  // goes through the same CallGate as NcclCommunicator's; an abort that finds
  // a thread inside a call is counted as a violation of NCCL's rule.
  struct CommState {
    ds::gpu::CallGate gate;
    std::atomic<int> inside{0};
  };
  class Forward : public ds::Communicator {
   public:
    Forward(FakeGpuBackend* b, std::shared_ptr<ds::InProcessGroup> g, std::shared_ptr<CommState> st,
            int r, int ordinal, void* stream, bool nccl)
        : b_(b),
          g_(std::move(g)),
          st_(std::move(st)),
          c_(&g_->at(r)),
          rank_(r),
          ordinal_(ordinal),
          stream_(stream),
          nccl_(nccl) {}
    int rank() const override { return c_->rank(); }
    int size() const override { return c_->size(); }
    const ds::CommunicationOptions& options() const override { return c_->options(); }
    // Reductions decide dtype and op as the real device collectives do
    // (device_reduce.h): refusals first, then NCCL's plan (integer kMean is a
    // sum and the library's division) or the shared-device kernel's.
    void all_reduce(const void* in, void* out, size_t n, ds::DType d, ds::ReduceOp op,
                    const std::string& name) override {
      const ds::gpu::DeviceReducePlan plan = plan_for(d, op, "all_reduce", name);
      call(name, [&] {
        c_->all_reduce(untag(in), untag(out), n, d, plan.collective_op, name);
        if (plan.divide_after) ds::kernels::scale_mean(untag(out), n, d, size());
      });
    }
    void broadcast(void* buf, size_t n, ds::DType d, int root, const std::string& name) override {
      call(name, [&] { c_->broadcast(untag(buf), n, d, root, name); });
    }
    void all_gather(const void* in, void* out, size_t n, ds::DType d,
                    const std::string& name) override {
      call(name, [&] { c_->all_gather(untag(in), untag(out), n, d, name); });
    }
    void reduce_scatter(const void* in, void* out, size_t n, ds::DType d, ds::ReduceOp op,
                        const std::string& name) override {
      const ds::gpu::DeviceReducePlan plan = plan_for(d, op, "reduce_scatter", name);
      call(name, [&] {
        c_->reduce_scatter(untag(in), untag(out), n, d, plan.collective_op, name);
        if (plan.divide_after) ds::kernels::scale_mean(untag(out), n, d, size());
      });
    }
    void barrier(const std::string& name) override { c_->barrier(name); }
    void abort(const std::string& reason) override {
      st_->gate.abort(reason, [&] {
        if (st_->inside.load() > 0) ++b_->aborts_during_calls;  // ncclCommAbort now
      });
      c_->abort(reason);
    }
    void reset() override {
      st_->gate.reset([] {});
      c_->reset();
    }

   private:
    ds::gpu::DeviceReducePlan plan_for(ds::DType d, ds::ReduceOp op, const char* kind,
                                       const std::string& name) const {
      const std::string what = "rank " + std::to_string(rank_) + (nccl_ ? " fake NCCL " : " ") +
                               kind + " '" + name + "'";
      if (nccl_) return ds::gpu::plan_nccl_reduce(d, op, what);
      ds::gpu::check_device_reduce(d, op, what);
      ds::gpu::DeviceReducePlan kernel;  // the kernel reduces every op itself
      kernel.collective_op = op;
      return kernel;
    }
    // The "NCCL call" (enqueue) through the gate, then the wait for the peers.
    template <typename F>
    void call(const std::string& name, F&& run) {
      ++b_->launches;
      b_->count_launch("collective");
      b_->synchronize(ordinal_, stream_, ds::DeadlineClock::now() + c_->options().timeout,
                      "fake NCCL " + name);
      st_->gate.enter("fake NCCL " + name, [&] {
        ++st_->inside;
        if (b_->inside_collective) b_->inside_collective(rank_);
        --st_->inside;
      });
      run();
    }
    FakeGpuBackend* b_;
    std::shared_ptr<ds::InProcessGroup> g_;
    std::shared_ptr<CommState> st_;
    ds::Communicator* c_;
    int rank_;
    int ordinal_;
    void* stream_;
    bool nccl_;  // NCCL's plan; else the shared-device kernel's
  };
  std::vector<std::unique_ptr<ds::Communicator>> group(const std::vector<int>& ordinals,
                                                       const std::vector<void*>& streams,
                                                       ds::CommunicationOptions o, bool nccl) {
    const int n = static_cast<int>(ordinals.size());
    // Stands in for NCCL / the device kernel, whatever algorithm names them.
    o.algorithm = ds::Algorithm::kAuto;
    auto g = std::make_shared<ds::InProcessGroup>(n, o);
    auto st = std::make_shared<CommState>();
    std::vector<std::unique_ptr<ds::Communicator>> out;
    for (int r = 0; r < n; ++r) {
      out.push_back(std::make_unique<Forward>(this, g, st, r, ordinals[static_cast<size_t>(r)],
                                              streams[static_cast<size_t>(r)], nccl));
    }
    return out;
  }

  int devices_;
  size_t capacity_;
  Options options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<size_t> used_;
  std::map<void*, std::pair<int, size_t>> sizes_;  // untagged -> (ordinal, bytes)
  std::map<void*, int> stream_device_;             // live streams
  std::map<void*, uint64_t> stream_ids_;           // live streams' identities
  std::vector<void*> free_handles_;                // of destroyed streams, for reuse
  uint64_t next_stream_id_ = 0;
  std::map<void*, long> events_;  // -> seq of the mark (-1: never recorded)
  std::deque<Op> pending_;
  std::map<std::pair<int, uint64_t>, long> last_seq_;
  std::set<std::pair<int, uint64_t>> held_;
  std::map<std::pair<int, void*>, uint64_t> held_by_handle_;
  std::string device_error_;
  long next_seq_ = 0;
  long next_stream_ = 0;
  bool stop_ = false;  // the destructor runs: executors end once their work is done
  std::map<std::pair<int, uint64_t>, std::thread> workers_;  // a stream's executor
  std::atomic<long> launch_delay_us_{0};
  std::map<std::string, int> launched_;
  std::map<void*, size_t> pinned_;  // host_alloc blocks -> bytes
  std::vector<void*> poisoned_;     // freed while a copy still read them

 public:
  // ==== Training features on device gradients ====
  // As optim_kernels.cu, with the host path's arithmetic and summation order
  // (so fake-GPU training equals CPU training bit for bit); run in enqueue
  // order like every kernel here. The lists are copied at the call.
  void sum_of_squares(int ordinal, void* stream, const float* const* in, const size_t* counts,
                      int n, const float* loss_scale, double* sums, double* scratch) override {
    ++training_launches;
    std::vector<const float*> ins;
    for (int i = 0; i < n; ++i) ins.push_back(h(in[i]));
    std::vector<size_t> sizes(counts, counts + n);
    const float* ls = loss_scale ? h(loss_scale) : nullptr;
    double* out = h(sums);
    launch(ordinal, stream, "sum_of_squares", [=] {
      const float inv = ls ? 1.0f / *ls : 1.0f;
      for (size_t i = 0; i < ins.size(); ++i) {
        double s = 0;
        for (size_t j = 0; j < sizes[i]; ++j) {
          const float x = ls ? ins[i][j] * inv : ins[i][j];
          s += double(x) * x;
        }
        out[i] = s;
      }
    });
  }
  void scale_and_clip(int ordinal, void* stream, const float* const* in, float* const* out_d,
                      const size_t* counts, int n, const float* loss_scale, float scale,
                      const double* sums, float clip_norm, float clip_value) override {
    ++training_launches;
    std::vector<const float*> ins;
    std::vector<float*> outs;
    for (int i = 0; i < n; ++i) {
      ins.push_back(h(in[i]));
      outs.push_back(h(out_d[i]));
    }
    std::vector<size_t> sizes(counts, counts + n);
    const float* ls = loss_scale ? h(loss_scale) : nullptr;
    const double* norms = sums ? h(sums) : nullptr;
    launch(ordinal, stream, "scale_and_clip", [=] {
      const float inv = ls ? 1.0f / *ls : 1.0f;
      for (size_t i = 0; i < ins.size(); ++i) {
        float f = scale;
        if (clip_norm > 0) {
          const double norm = std::sqrt(norms[i]);
          f = std::isfinite(norm)
                  ? static_cast<float>(clip_norm / std::max<double>(norm, clip_norm))
                  : std::nanf("");
        }
        for (size_t j = 0; j < sizes[i]; ++j) {
          float x = ls ? ins[i][j] * inv : ins[i][j];
          if (f != 1.0f) x *= f;
          if (clip_value > 0) x = x < -clip_value ? -clip_value : (x > clip_value ? clip_value : x);
          outs[i][j] = x;
        }
      }
    });
  }
  void accumulate(int ordinal, void* stream, float* const* acc_d, const float* const* in,
                  const size_t* counts, int n, bool first) override {
    ++training_launches;
    std::vector<const float*> ins;
    std::vector<float*> accs;
    for (int i = 0; i < n; ++i) {
      ins.push_back(h(in[i]));
      accs.push_back(h(acc_d[i]));
    }
    std::vector<size_t> sizes(counts, counts + n);
    launch(ordinal, stream, "accumulate", [=] {
      for (size_t i = 0; i < ins.size(); ++i) {
        for (size_t j = 0; j < sizes[i]; ++j)
          accs[i][j] = first ? ins[i][j] : accs[i][j] + ins[i][j];
      }
    });
  }
  void fill(int ordinal, void* stream, float* dst_d, size_t count, float value) override {
    float* dst = h(dst_d);
    launch(ordinal, stream, "fill", [=] { std::fill(dst, dst + count, value); });
  }
  // Launches of the three list kernels above (sum_of_squares, scale_and_clip,
  // accumulate): a test counts them per step.
  std::atomic<int> training_launches{0};
  // ==== end of the training-feature block ====

  // ==== Fewer launches (issue 44 item 3) ====
  // The fused layer calls and the list update, each one launch with the
  // unfused calls' arithmetic in their order (so results are bit-identical).
  void dense_relu_forward(int ordinal, void* stream, const float* x, const float* w, const float* b,
                          float* y, int64_t n, int64_t in, int64_t out) override {
    launch(ordinal, stream, "dense_relu_forward", [=] {
      ds::Tensor Y = host(y, {n, out});
      ds::nn::dense_forward(host(x, {n, in}), host(w, {in, out}), host(b, {out}), Y);
      ds::nn::relu_forward(Y, Y);
    });
  }
  void dense_relu_backward(int ordinal, void* stream, const float* x, const float* w,
                           const float* y, float* dy, float* dx, float* dw, float* db, int64_t n,
                           int64_t in, int64_t out) override {
    launch(ordinal, stream, "dense_relu_backward", [=] {
      ds::Tensor DY = host(dy, {n, out});
      ds::nn::relu_backward(host(y, {n, out}), DY, DY);
      ds::Tensor DX = dx ? host(dx, {n, in}) : ds::Tensor();
      ds::Tensor DW = host(dw, {in, out}), DB = host(db, {out});
      ds::nn::dense_backward(host(x, {n, in}), host(w, {in, out}), DY, dx ? &DX : nullptr, DW, DB);
    });
  }
  // A list update's tensors as host pointers (slots of tensor i at
  // slots[i * per ...]), counted in updates / adam_updates / update_lists.
  struct HostUpdateList {
    std::vector<float*> vars, slots;
    std::vector<const float*> grads;
    std::vector<size_t> sizes;
    size_t per = 0;
  };
  HostUpdateList host_update_list(const ds::UpdateRule& rule, float* const* vars_d,
                                  const float* const* grads_d, float* const* slots_d,
                                  const size_t* counts, int n) {
    if (rule.kind == ds::UpdateRule::Kind::kNone) {
      throw ds::UnimplementedError("fake backend: the optimizer has no device rule");
    }
    updates += n;  // tensors updated on the device
    if (rule.kind == ds::UpdateRule::Kind::kAdam) adam_updates += n;
    ++update_lists;
    HostUpdateList l;
    const int per = ds::update_slot_count(rule);
    l.per = static_cast<size_t>(per);
    for (int i = 0; i < n; ++i) {
      l.vars.push_back(h(vars_d[i]));
      l.grads.push_back(h(grads_d[i]));
      for (int s = 0; s < per; ++s) l.slots.push_back(h(slots_d[s * n + i]));
    }
    l.sizes.assign(counts, counts + n);
    return l;
  }
  void apply_update_list(int ordinal, void* stream, const ds::UpdateRule& rule,
                         float* const* vars_d, const float* const* grads_d, float* const* slots_d,
                         const size_t* counts, int n, int64_t step) override {
    const HostUpdateList l = host_update_list(rule, vars_d, grads_d, slots_d, counts, n);
    launch(ordinal, stream, "update list", [=] {
      for (size_t i = 0; i < l.vars.size(); ++i) {
        update_elements(rule, l.vars[i], l.grads[i], l.slots.data() + i * l.per, l.sizes[i], step);
      }
    });
  }
  std::atomic<int> update_lists{0};  // apply_update_list calls
  // ==== end of the fewer-launches block ====

  // ==== Host functions on a stream (issue 45: fake_nccl.h) ====
  // Enqueues `fn` on `stream` as a launch named `name` (cudaLaunchHostFunc):
  // it runs on the stream's executor in stream order, after the launch
  // delay. An exception it throws is reported by the next wait, as a failed
  // kernel's.
  void launch_host_function(int ordinal, void* stream, const char* name, std::function<void()> fn) {
    launch(ordinal, stream, name, std::move(fn));
  }
  // ==== end of the host-function block ====
  // ==== Graph capture (issue 44 item 2) ====
  void begin_capture(int ordinal, void* stream) override {
    begin_call(ordinal, stream, "cudaStreamBeginCapture");
    std::lock_guard<std::mutex> lock(mu_);
    if (!stream) {
      thread_state().last_error =
          "operation not permitted on the legacy stream "
          "(cudaErrorStreamCaptureUnsupported)";
      fail("cudaStreamBeginCapture");
    }
    const std::pair<int, uint64_t> key{ordinal, id_locked(stream)};
    if (captures_.count(key)) {
      thread_state().last_error = "the stream is already capturing (cudaErrorIllegalState)";
      fail("cudaStreamBeginCapture");
    }
    Capture& c = captures_[key];
    c.thread = std::this_thread::get_id();
    ++captures_begun;
  }
  void* end_capture(int ordinal, void* stream) override {
    begin_call(ordinal, stream, "cudaStreamEndCapture");
    std::lock_guard<std::mutex> lock(mu_);
    auto it = captures_.find({ordinal, id_locked(stream)});
    if (it == captures_.end()) {
      thread_state().last_error = "the stream is not capturing (cudaErrorIllegalState)";
      fail("cudaStreamEndCapture");
    }
    Capture c = std::move(it->second);
    captures_.erase(it);
    if (!c.invalid.empty()) {
      thread_state().last_error =
          "the capture was invalidated by " + c.invalid + " (cudaErrorStreamCaptureInvalidated)";
      fail("cudaStreamEndCapture");
    }
    auto* g = new Graph{ordinal, std::move(c.ops)};
    graphs_.insert(g);
    return g;
  }
  void launch_graph(int ordinal, void* graph, void* stream) override {
    begin_call(ordinal, stream, "cudaGraphLaunch");
    std::lock_guard<std::mutex> lock(mu_);
    auto* g = static_cast<Graph*>(graph);
    if (!graphs_.count(g) || g->device != ordinal) {
      thread_state().last_error = "invalid graph (cudaErrorInvalidValue)";
      fail("cudaGraphLaunch");
    }
    ++launches;
    ++graph_launches;
    ++launched_["graph"];
    // The recorded work, in its recorded order, as one op of the stream (the
    // graph keeps its closures: a destroyed graph's launch in flight still runs).
    std::vector<std::function<void()>> work;
    for (const Op& op : g->ops) work.push_back(op.fn);
    const long seq = enqueue_locked(ordinal, stream, [work] {
      for (const auto& f : work) f();
    });
    if (seq != kCaptured) {
      pending_.back().kernel = true;  // the launch delay applies once
      pending_.back().name = "graph";
    }
  }
  void destroy_graph(int, void* graph) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto* g = static_cast<Graph*>(graph);
    if (graphs_.erase(g)) delete g;
  }
  bool capturing(int ordinal, void* stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    return captures_.count({ordinal, id_locked(stream)}) > 0;
  }
  // apply_update_list with the rate read from device memory when it runs.
  void apply_update_list_at(int ordinal, void* stream, const ds::UpdateRule& rule,
                            float* const* vars_d, const float* const* grads_d,
                            float* const* slots_d, const size_t* counts, int n,
                            const float* rate_d) override {
    const HostUpdateList l = host_update_list(rule, vars_d, grads_d, slots_d, counts, n);
    const float* rate = h(rate_d);
    launch(ordinal, stream, "update list", [=] {
      for (size_t i = 0; i < l.vars.size(); ++i) {
        update_elements_at(rule, l.vars[i], l.grads[i], l.slots.data() + i * l.per, l.sizes[i],
                           *rate);
      }
    });
  }
  // The rule on one tensor at `rate` (ds::update_step_rate of the step): the
  // elements update_elements gives at that step.
  static void update_elements_at(const ds::UpdateRule& rule, float* var, const float* grad,
                                 float* const* slots, size_t count, float rate) {
    ds::UpdateRule r = rule;
    if (rule.kind == ds::UpdateRule::Kind::kSgd) {
      r.learning_rate = rate;
      update_elements(r, var, grad, slots, count, 1);
      return;
    }
    const float b1 = rule.beta1, b2 = rule.beta2;
    for (size_t i = 0; i < count; ++i) {
      slots[0][i] = b1 * slots[0][i] + (1 - b1) * grad[i];
      slots[1][i] = b2 * slots[1][i] + (1 - b2) * grad[i] * grad[i];
      var[i] -= rate * slots[0][i] / (std::sqrt(slots[1][i]) + rule.epsilon);
    }
  }
  std::atomic<int> captures_begun{0}, graph_launches{0}, captured_ops{0};

 private:
  static constexpr long kCaptured = -2;  // the "seq" of work recorded by a capture
  struct Capture {
    std::thread::id thread;
    std::vector<Op> ops;
    std::string invalid;  // the call that invalidated it
  };
  struct Graph {
    int device;
    std::vector<Op> ops;
  };
  void invalidate_locked(int ordinal, void* stream) {
    auto it = captures_.find({ordinal, id_locked(stream)});
    if (it != captures_.end() && it->second.invalid.empty()) it->second.invalid = "a refused call";
  }
  // A call a capturing stream cannot take: invalidates the capture, throws.
  void refuse_capturing(int ordinal, void* stream, const std::string& call) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = captures_.find({ordinal, id_locked(stream)});
    if (it == captures_.end()) return;
    if (it->second.invalid.empty()) it->second.invalid = call;
    thread_state().last_error =
        "operation not permitted when stream is capturing (cudaErrorStreamCaptureUnsupported)";
    fail(call);
  }
  // A device synchronize (it would wait for the capturing stream) and a free
  // (cudaFree synchronizes the device) from the thread that captures on
  // `ordinal`: refused (the library must not make them there).
  void refuse_on_capturing_thread(int ordinal, const std::string& call) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, c] : captures_) {
      if (key.first != ordinal || c.thread != std::this_thread::get_id()) continue;
      if (c.invalid.empty()) c.invalid = call;
      thread_state().last_error =
          "operation not permitted when stream is capturing (cudaErrorStreamCaptureUnsupported)";
      fail(call);
    }
  }
  void refuse_captured_event_locked(void* event, const std::string& call) {
    if (events_.at(event) != kCaptured) return;
    thread_state().last_error =
        "operation not permitted on an event last recorded in a capturing stream "
        "(cudaErrorCapturedEvent)";
    fail(call);
  }
  std::map<std::pair<int, uint64_t>, Capture> captures_;  // by (ordinal, stream identity)
  std::set<Graph*> graphs_;
  // ==== end of the graph-capture block ====
};

// A fresh lock directory per test.
class LeaseDir {
 public:
  LeaseDir() : dir_("diststrat-lease-test-") {}
  ds::LeaseOptions options() const {
    ds::LeaseOptions o;
    o.lock_dir = dir_.path();
    o.poll_interval = std::chrono::milliseconds(5);
    return o;
  }
  // GpuOptions whose lease is options().
  ds::GpuOptions gpu_options() const {
    ds::GpuOptions o;
    o.lease = options();
    return o;
  }
  const std::string& path() const { return dir_.path(); }

 private:
  TempDir dir_;
};

}  // namespace diststrat_test
