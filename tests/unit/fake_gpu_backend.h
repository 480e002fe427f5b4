// A GpuBackend whose "device memory" is host memory, so the device logic
// (DeviceManager, caching allocator, leases, replica scopes, GPU code paths
// of tensors, nn ops, optimizers and MirroredStrategy) runs in CPU tests.
// Compute goes through the library's CPU code on wrapped host pointers;
// collectives through an in-process group.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <map>
#include <mutex>

#include "allreduce/reduce_kernels.h"
#include "core/gpu_backend.h"
#include "diststrat/collective.h"
#include "diststrat/gpu_lease.h"
#include "diststrat/nn.h"

namespace diststrat_test {

namespace ds = diststrat;

class FakeGpuBackend : public ds::GpuBackend {
 public:
  // `devices` fake GPUs of `capacity` bytes each.
  explicit FakeGpuBackend(int devices, size_t capacity = 64u << 20)
      : devices_(devices), capacity_(capacity), used_(static_cast<size_t>(devices), 0) {}

  std::string name() const override { return "fake"; }
  int device_count() override { return devices_; }
  ds::GpuInfo info(int ordinal) override {
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
    std::lock_guard<std::mutex> lock(mu_);
    if (used_[static_cast<size_t>(ordinal)] + bytes > capacity_) return nullptr;
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    used_[static_cast<size_t>(ordinal)] += bytes;
    sizes_[p] = {ordinal, bytes};
    ++mallocs;
    return p;
  }
  void raw_free(int, void* p) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sizes_.find(p);
    used_[static_cast<size_t>(it->second.first)] -= it->second.second;
    sizes_.erase(it);
    std::free(p);
    ++frees;
  }
  size_t used(int ordinal) {
    std::lock_guard<std::mutex> lock(mu_);
    return used_[static_cast<size_t>(ordinal)];
  }

  void* create_stream(int) override { return reinterpret_cast<void*>(++next_stream_); }
  void destroy_stream(int, void*) override { ++streams_destroyed; }
  void memcpy_async(int, void* dst, const void* src, size_t bytes, void*) override {
    std::memmove(dst, src, bytes);
  }
  void memset_async(int, void* dst, int value, size_t bytes, void*) override {
    std::memset(dst, value, bytes);
  }
  void synchronize(int, void*, ds::DeadlineClock::time_point, const std::string&) override {
    ++syncs;
  }

  void dense_forward(int, void*, const float* x, const float* w, const float* b, float* y,
                     int64_t n, int64_t in, int64_t out) override {
    ds::Tensor Y = host(y, {n, out});
    ds::nn::dense_forward(host(x, {n, in}), host(w, {in, out}), host(b, {out}), Y);
  }
  void dense_backward(int, void*, const float* x, const float* w, const float* dy, float* dx,
                      float* dw, float* db, int64_t n, int64_t in, int64_t out) override {
    ds::Tensor DX = dx ? host(dx, {n, in}) : ds::Tensor();
    ds::Tensor DW = host(dw, {in, out}), DB = host(db, {out});
    ds::nn::dense_backward(host(x, {n, in}), host(w, {in, out}), host(dy, {n, out}),
                           dx ? &DX : nullptr, DW, DB);
  }
  void relu_forward(int, void*, const float* x, float* y, int64_t count) override {
    ds::Tensor Y = host(y, {count});
    ds::nn::relu_forward(host(x, {count}), Y);
  }
  void relu_backward(int, void*, const float* y, const float* dy, float* dx,
                     int64_t count) override {
    ds::Tensor DX = host(dx, {count});
    ds::nn::relu_backward(host(y, {count}), host(dy, {count}), DX);
  }
  void softmax_cross_entropy(int, void*, const float* logits, const int32_t* labels,
                             float* dlogits, float* loss, int32_t* correct, int32_t* bad,
                             int64_t n, int64_t k, float scale) override {
    *bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (labels[i] < 0 || labels[i] >= k) {
        *bad = static_cast<int32_t>(i + 1);
        return;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      ds::Tensor z = host(logits + i * k, {1, k});
      ds::Tensor d = host(dlogits + i * k, {1, k});
      ds::Tensor y = ds::Tensor::wrap(const_cast<int32_t*>(labels + i), ds::Shape{1},
                                      ds::DType::kInt32);
      loss[i] = static_cast<float>(ds::nn::softmax_cross_entropy(z, y, d, scale));
      correct[i] = static_cast<int32_t>(ds::nn::count_correct(z, y));
    }
  }
  void apply_update(int, void*, const ds::UpdateRule& rule, float* var, const float* grad,
                    float* const* slots, size_t count, int64_t) override {
    ++updates;
    // SGD only (what the tests use); anything else must not silently pass.
    if (rule.kind != ds::UpdateRule::Kind::kSgd) {
      throw ds::UnimplementedError("fake backend: only SGD");
    }
    for (size_t i = 0; i < count; ++i) {
      if (rule.momentum == 0.0f) {
        var[i] -= rule.learning_rate * grad[i];
      } else {
        slots[0][i] = rule.momentum * slots[0][i] - rule.learning_rate * grad[i];
        var[i] += rule.nesterov ? rule.momentum * slots[0][i] - rule.learning_rate * grad[i]
                                : slots[0][i];
      }
    }
  }
  void reduce(int, void*, void* dst, const void* const* srcs, int n, size_t count, ds::DType dtype,
              ds::ReduceOp op, int mean_divisor) override {
    ds::kernels::reduce(dst, srcs, n, count, dtype, op, mean_divisor);
  }

  std::vector<std::unique_ptr<ds::Communicator>> nccl_local_group(
      const std::vector<int>& ordinals, const std::vector<void*>&,
      const ds::CommunicationOptions& options) override {
    ++nccl_groups;
    return group(static_cast<int>(ordinals.size()), options);
  }
  std::vector<std::unique_ptr<ds::Communicator>> shared_device_group(
      const ds::SharedDeviceGroupSpec& spec, const ds::CommunicationOptions& options) override {
    ++shared_groups;
    return group(static_cast<int>(spec.streams.size()), options);
  }

  std::atomic<int> mallocs{0}, frees{0}, syncs{0}, updates{0}, streams_destroyed{0};
  std::atomic<int> nccl_groups{0}, shared_groups{0};

 private:
  static ds::Tensor host(const float* p, std::initializer_list<int64_t> dims) {
    return ds::Tensor::wrap(const_cast<float*>(p), ds::Shape(dims), ds::DType::kFloat32);
  }

  // Communicators forwarding to an in-process group they keep alive.
  class Forward : public ds::Communicator {
   public:
    Forward(std::shared_ptr<ds::InProcessGroup> g, int r) : g_(std::move(g)), c_(&g_->at(r)) {}
    int rank() const override { return c_->rank(); }
    int size() const override { return c_->size(); }
    const ds::CommunicationOptions& options() const override { return c_->options(); }
    void all_reduce(const void* in, void* out, size_t n, ds::DType d, ds::ReduceOp op,
                    const std::string& name) override {
      c_->all_reduce(in, out, n, d, op, name);
    }
    void broadcast(void* b, size_t n, ds::DType d, int root, const std::string& name) override {
      c_->broadcast(b, n, d, root, name);
    }
    void all_gather(const void* in, void* out, size_t n, ds::DType d,
                    const std::string& name) override {
      c_->all_gather(in, out, n, d, name);
    }
    void reduce_scatter(const void* in, void* out, size_t n, ds::DType d, ds::ReduceOp op,
                        const std::string& name) override {
      c_->reduce_scatter(in, out, n, d, op, name);
    }
    void barrier(const std::string& name) override { c_->barrier(name); }
    void abort(const std::string& reason) override { c_->abort(reason); }
    void reset() override { c_->reset(); }

   private:
    std::shared_ptr<ds::InProcessGroup> g_;
    ds::Communicator* c_;
  };
  std::vector<std::unique_ptr<ds::Communicator>> group(int n, ds::CommunicationOptions o) {
    // Stands in for NCCL / the device kernel, whatever algorithm names them.
    o.algorithm = ds::Algorithm::kAuto;
    auto g = std::make_shared<ds::InProcessGroup>(n, o);
    std::vector<std::unique_ptr<ds::Communicator>> out;
    for (int r = 0; r < n; ++r) out.push_back(std::make_unique<Forward>(g, r));
    return out;
  }

  int devices_;
  size_t capacity_;
  std::mutex mu_;
  std::vector<size_t> used_;
  std::map<void*, std::pair<int, size_t>> sizes_;
  std::atomic<long> next_stream_{0};
};

// A fresh lock directory per test.
class LeaseDir {
 public:
  LeaseDir() {
    char tmpl[] = "/tmp/diststrat-lease-test-XXXXXX";
    path_ = ::mkdtemp(tmpl);
  }
  ~LeaseDir() { std::filesystem::remove_all(path_); }
  ds::LeaseOptions options() const {
    ds::LeaseOptions o;
    o.lock_dir = path_;
    o.poll_interval = std::chrono::milliseconds(5);
    return o;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace diststrat_test
