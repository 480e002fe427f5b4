// Shared by the strategy tests: a small synthetic classification set, plain
// single-device reference training, and the same loop under a Strategy.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "diststrat/diststrat.h"
#include "harness.h"

namespace diststrat {
namespace testing {

namespace ds = diststrat;

// Communication options with this timeout, the rest default.
inline ds::CommunicationOptions comm_with_timeout(std::chrono::milliseconds timeout) {
  ds::CommunicationOptions comm;
  comm.timeout = timeout;
  return comm;
}

// CPU devices 0..n-1.
inline std::vector<ds::Device> cpu_devices(int n) {
  std::vector<ds::Device> d;
  for (int i = 0; i < n; ++i) d.push_back(ds::Device::cpu(i));
  return d;
}

// fn(strategy, w) for every worker w < zero.size(), each on its own thread: a
// MultiWorkerMirroredStrategy with `local` CPU replicas and `comm` over one
// InProcessGroup, sharding its optimizer state when zero[w]. A worker that
// throws aborts its group member so the others fail fast; returns every
// worker's exception (null: none).
inline std::vector<std::exception_ptr> run_multi_worker(
    const std::vector<bool>& zero, int local, const ds::CommunicationOptions& comm,
    const std::function<void(ds::MultiWorkerMirroredStrategy&, int)>& fn) {
  const int workers = static_cast<int>(zero.size());
  ds::InProcessGroup group(workers, comm);
  return run_threads_collect(
      workers,
      [&](int w) {
        ds::MultiWorkerOptions o;
        o.communication = comm;
        o.communicator = &group.at(w);
        o.devices = cpu_devices(local);
        o.shard_optimizer_state = zero[static_cast<size_t>(w)];
        ds::MultiWorkerMirroredStrategy s(o);
        fn(s, w);
      },
      [&](int w) { group.at(w).abort("worker " + std::to_string(w) + " failed"); });
}

// `steps` plain Adam updates of a copy of `init` with gradient = the value
// itself (the gradient of 0.5 * w^2), using the optimizer's own rule.
inline ds::Tensor adam_reference(const ds::Optimizer& adam, const ds::Tensor& init, int steps) {
  ds::Tensor w = init.clone();
  ds::Tensor m(w.shape(), ds::DType::kFloat32), v(w.shape(), ds::DType::kFloat32);
  for (int s = 1; s <= steps; ++s) {
    const ds::Tensor g = w.clone();
    adam.update_tensor(w, g, {&m, &v}, s);
  }
  return w;
}

// A small deterministic classification set: 784 features, 10 classes.
inline ds::Dataset synthetic(int64_t rows, uint64_t seed) {
  ds::Tensor x(ds::Shape{rows, 784}, ds::DType::kFloat32);
  ds::Tensor y(ds::Shape{rows}, ds::DType::kInt32);
  ds::init::RandomNormal{0.0, 1.0, seed}(x);
  for (int64_t i = 0; i < rows; ++i) {
    // Label from a fixed linear rule so the model has something to learn.
    double s = 0;
    for (int j = 0; j < 10; ++j) s += x.data<float>()[i * 784 + j * 7];
    y.data<int32_t>()[i] = static_cast<int32_t>(std::fabs(s) * 3) % 10;
  }
  return ds::Dataset(x, y);
}

// Plain single-device training: no strategy, the same batches in order.
inline std::vector<ds::Tensor> reference_training(const ds::nn::Mlp& mlp, const ds::Dataset& data,
                                                  int64_t batch, int steps, float lr,
                                                  float momentum) {
  std::vector<ds::Tensor> params = mlp.init_params(5);
  std::vector<ds::Tensor> velocity;
  for (auto& p : params) velocity.emplace_back(p.shape(), ds::DType::kFloat32);
  for (int s = 0; s < steps; ++s) {
    const int64_t lo = s * batch, hi = std::min<int64_t>(lo + batch, data.size());
    ds::Dataset b = data.slice(lo, hi);
    auto step = mlp.forward_backward(params, b.features(), b.labels(), 1.0f / (hi - lo));
    for (size_t i = 0; i < params.size(); ++i) {
      float* w = params[i].data<float>();
      float* v = velocity[i].data<float>();
      const float* g = step.grads[i].data<float>();
      for (int64_t k = 0; k < params[i].num_elements(); ++k) {
        v[k] = momentum * v[k] - lr * g[k];
        w[k] += v[k];
      }
    }
  }
  return params;
}

inline void train_under(ds::Strategy& strategy, const ds::nn::Mlp& mlp, const ds::Dataset& data,
                        int64_t batch, int steps, float lr, float momentum,
                        std::vector<ds::Variable>* out_vars) {
  std::vector<ds::Variable> vars = mlp.create_variables(strategy, 5);
  ds::SGD opt(strategy, {lr, momentum});
  ds::DistributeOptions o;
  o.shuffle = false;
  ds::DistributedDataset dist = strategy.distribute(data, batch, o);
  int done = 0;
  for (const auto& b : dist) {
    if (done++ == steps) break;
    strategy.run([&](ds::ReplicaContext& ctx) {
      std::vector<ds::Tensor> values;
      for (auto& v : vars) values.push_back(v.read(ctx));
      auto step = mlp.forward_backward(values, b.features(ctx), b.labels(ctx),
                                       1.0f / static_cast<float>(b.global_size()));
      std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
      for (size_t i = 0; i < vars.size(); ++i) gv.emplace_back(step.grads[i], vars[i]);
      opt.apply_gradients(ctx, gv);
    });
  }
  *out_vars = vars;
}

inline double max_abs_diff(const ds::Tensor& a, const ds::Tensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.num_elements(); ++i) {
    m = std::max(m, std::fabs(double(a.data<float>()[i]) - b.data<float>()[i]));
  }
  return m;
}

// The largest difference over lists of host float tensors (parameters);
// infinity when the lists or shapes differ or a tensor is not in host memory.
inline double max_abs_diff(const std::vector<ds::Tensor>& a, const std::vector<ds::Tensor>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].device().is_cpu() || !b[i].device().is_cpu() || a[i].shape() != b[i].shape()) {
      return INFINITY;
    }
    m = std::max(m, max_abs_diff(a[i], b[i]));
  }
  return m;
}

// Element i of a numeric tensor as a double, and the other way round.
inline double get_element(const ds::Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case ds::DType::kFloat32:
      return t.data<float>()[i];
    case ds::DType::kFloat64:
      return t.data<double>()[i];
    case ds::DType::kInt32:
      return t.data<int32_t>()[i];
    case ds::DType::kInt64:
      return static_cast<double>(t.data<int64_t>()[i]);
    default:
      throw ds::UnimplementedError("get_element: 16-bit floats");
  }
}
inline void set_element(ds::Tensor& t, int64_t i, double v) {
  switch (t.dtype()) {
    case ds::DType::kFloat32:
      t.data<float>()[i] = static_cast<float>(v);
      break;
    case ds::DType::kFloat64:
      t.data<double>()[i] = v;
      break;
    case ds::DType::kInt32:
      t.data<int32_t>()[i] = static_cast<int32_t>(v);
      break;
    case ds::DType::kInt64:
      t.data<int64_t>()[i] = static_cast<int64_t>(v);
      break;
    default:
      throw ds::UnimplementedError("set_element: 16-bit floats");
  }
}

}  // namespace testing
}  // namespace diststrat
