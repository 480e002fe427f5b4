// ZeRO-1 test model, shared by tests/unit/zero_test.cc and
// tests/mpi/zero_mpi_test.cc: variables of awkward sizes (a prime, fewer
// elements than replicas, a matrix) and per-replica gradients whose sum over
// the replicas is the same function of the weights and the step whatever the
// replica count, so a run can be checkpointed on R replicas and continued on
// another number of them against one reference.
#pragma once

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "runtime/variable_impl.h"
#include "diststrat/diststrat.h"

namespace diststrat {
namespace zero_cases {

namespace ds = diststrat;

inline std::vector<ds::Variable> create_model(ds::Strategy& s) {
  return {
      s.create_variable("zero/prime", ds::Shape{13}, ds::DType::kFloat32,
                        ds::init::GlorotUniform{3}),
      s.create_variable("zero/tiny", ds::Shape{2}, ds::DType::kFloat32, ds::init::Constant{0.25}),
      s.create_variable("zero/matrix", ds::Shape{7, 5}, ds::DType::kFloat32,
                        ds::init::RandomNormal{0.0, 0.5, 11})};
}

// Replica `replica` of `replicas`' gradient of variable `k` at `step` (the
// update's 0-based index): weights (r + 1) / (R (R + 1) / 2) of f(w, step),
// f_i = 0.5 (w_i - t_i) + 0.05 sin(0.7 step + 1.3 i + k): the replicas' sum
// is f whatever R. Nonlinear in the step so the slots matter.
inline ds::Tensor replica_grad(const ds::Tensor& w, size_t k, int64_t step, int replica,
                               int replicas) {
  ds::Tensor g(w.shape(), ds::DType::kFloat32);
  const double share = 2.0 * (replica + 1) / (double(replicas) * (replicas + 1));
  const float* pw = w.data<float>();
  float* pg = g.data<float>();
  for (int64_t i = 0; i < w.num_elements(); ++i) {
    const double f =
        0.5 * (pw[i] - (0.1 * i - 0.3)) + 0.05 * std::sin(0.7 * step + 1.3 * i + double(k));
    pg[i] = static_cast<float>(f * share);
  }
  return g;
}

inline std::unique_ptr<ds::Optimizer> make_optimizer(ds::Strategy& s, bool adam) {
  if (adam) {
    ds::AdamOptions o;
    o.learning_rate = 0.02f;
    return std::make_unique<ds::Adam>(s, o);
  }
  ds::SGDOptions o;
  o.learning_rate = 0.1f;
  o.momentum = 0.9f;
  return std::make_unique<ds::SGD>(s, o);
}

struct StepLog {
  std::vector<double> norms;  // ApplyResult::global_norm of local replica 0, per step
  std::vector<bool> skipped;
};

// `steps` steps; the gradient of step s is f(w, first + s), first = the
// optimizer's step counter at the start (so a restored run continues).
// `poison`: at that update, global replica `poison_replica` puts an inf into
// its gradient (loss-scaling tests). Gradients are passed in reverse
// creation order (apply_gradients must not depend on the order given).
inline StepLog train(ds::Strategy& s, ds::Optimizer& opt, const std::vector<ds::Variable>& vars,
                     int steps, int64_t poison = -1, int poison_replica = 0) {
  StepLog log;
  const int64_t first = opt.iterations().value().data<int64_t>()[0];
  for (int n = 0; n < steps; ++n) {
    const int64_t step = first + n;
    std::vector<ds::ApplyResult> results(static_cast<size_t>(s.num_local_replicas()));
    s.run([&](ds::ReplicaContext& ctx) {
      std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
      for (size_t k = vars.size(); k-- > 0;) {
        ds::Tensor g =
            replica_grad(vars[k].read(ctx), k, step, ctx.replica_id(), ctx.num_replicas_in_sync());
        if (opt.loss_scaling()) {
          float* p = g.data<float>();
          for (int64_t i = 0; i < g.num_elements(); ++i) p[i] *= opt.loss_scale(ctx);
        }
        if (step == poison && ctx.replica_id() == poison_replica && k == 0) {
          g.data<float>()[0] = INFINITY;
        }
        gv.emplace_back(g, vars[k]);
      }
      results[static_cast<size_t>(ctx.local_replica_id())] = opt.apply_gradients(ctx, gv);
    });
    log.norms.push_back(results[0].global_norm);
    log.skipped.push_back(results[0].skipped);
  }
  return log;
}

inline std::vector<ds::Tensor> values(const std::vector<ds::Variable>& vars) {
  std::vector<ds::Tensor> out;
  for (const ds::Variable& v : vars) out.push_back(v.value());
  return out;
}

// Every local copy of every variable byte-identical to local copy 0.
inline bool copies_identical(const std::vector<ds::Variable>& vars) {
  for (const ds::Variable& v : vars) {
    const std::vector<ds::Tensor>& c = v.impl().copies;
    for (size_t i = 1; i < c.size(); ++i) {
      if (std::memcmp(c[i].data(), c[0].data(), c[0].nbytes()) != 0) return false;
    }
  }
  return true;
}

inline double max_diff(const std::vector<ds::Tensor>& a, const std::vector<ds::Tensor>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t k = 0; k < a.size(); ++k) {
    if (a[k].num_elements() != b[k].num_elements()) return INFINITY;
    for (int64_t i = 0; i < a[k].num_elements(); ++i) {
      m = std::max(m, std::fabs(double(a[k].data<float>()[i]) - b[k].data<float>()[i]));
    }
  }
  return m;
}

// Element count of the model (13 + 2 + 35) and the slot bytes a replica
// holds without sharding.
constexpr int64_t kModelElements = 50;

}  // namespace zero_cases
}  // namespace diststrat
