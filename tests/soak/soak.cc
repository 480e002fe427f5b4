// Soak and accounting: runs each strategy for many small steps with randomly
// sized tensors and checks invariants at every step.
//   - mirrored, central_storage, multi_worker (2 workers x 2 replicas as
//     threads): every step all-reduces a tensor of random size (1..4096) with
//     integer-valued data and checks the exact sum; applies SGD to variables of
//     random sizes, then every replica hashes its copy of every variable and
//     the hashes are all-gathered over all replicas (all workers): they must be
//     bit-identical.
//   - parameter_server (W workers + 1 PS, threads, oversubscribed): every
//     worker pushes a gradient of ones for variables of random sizes every
//     step; at the end pushes applied by the PS == pushes the workers sent,
//     none rejected, and every element equals -lr * (W * steps) exactly
//     (a lost push or a push applied twice changes it).
// Usage: diststrat_soak [--steps N] [--strategy NAME|all] [--ps-workers W] [--seed S]
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "allreduce/transport.h"
#include "common/ones_step.h"
#include "diststrat/diststrat.h"
#include "diststrat/multi_worker_mirrored.h"
#include "parameter_server/strategy_impl.h"
#include "unit/harness.h"

namespace ds = diststrat;
using ds::testing::run_threads;

namespace {

struct Args {
  int64_t steps = 200;
  std::string strategy = "all";
  int ps_workers = 6;
  uint64_t seed = 1;
};

[[noreturn]] void violation(const std::string& what) {
  throw std::runtime_error("INVARIANT VIOLATED: " + what);
}

uint64_t fnv1a(const void* data, size_t n) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

std::vector<ds::Variable> random_variables(ds::Strategy& s, std::mt19937_64& rng) {
  std::vector<ds::Variable> vars;
  for (int k = 0; k < 3; ++k) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 3000);
    vars.push_back(s.create_variable("v" + std::to_string(k), ds::Shape{n}, ds::DType::kFloat32,
                                     ds::init::Zeros{}));
  }
  return vars;
}

// One soak step in replica context; returns nothing, throws on a violation.
void sync_step(ds::ReplicaContext& ctx, ds::SGD& opt, const std::vector<ds::Variable>& vars,
               int64_t step, uint64_t seed) {
  const int R = ctx.num_replicas_in_sync();
  const int me = ctx.replica_id();
  std::mt19937_64 rng(seed * 1000003u + static_cast<uint64_t>(step));  // same on every replica
  const int64_t n = 1 + static_cast<int64_t>(rng() % 4096);
  ds::Tensor t(ds::Shape{n}, ds::DType::kFloat32);
  float* p = t.data<float>();
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>((me + 1) * (i % 7));
  std::vector<ds::Tensor> v{t};
  ctx.all_reduce(ds::ReduceOp::kSum, v, {"soak/random"});
  const float* q = v[0].data<float>();
  const float tri = static_cast<float>(R * (R + 1) / 2);
  for (int64_t i = 0; i < n; ++i) {
    if (q[i] != tri * static_cast<float>(i % 7)) {
      violation("step " + std::to_string(step) + " replica " + std::to_string(me) +
                ": all_reduce of " + std::to_string(n) + " elements wrong at " + std::to_string(i));
    }
  }
  std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
  for (const ds::Variable& var : vars) {
    ds::Tensor g(var.shape(), ds::DType::kFloat32);
    float* gp = g.data<float>();
    for (int64_t i = 0; i < g.num_elements(); ++i) {
      gp[i] = static_cast<float>(static_cast<int>((step + i + me) % 5) - 2) / 64.0f;
    }
    gv.emplace_back(g, var);
  }
  opt.apply_gradients(ctx, gv);
  uint64_t h = 1469598103934665603ull;
  for (const ds::Variable& var : vars) {
    const ds::Tensor c = var.read(ctx);
    h ^= fnv1a(c.data(), c.nbytes()) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  }
  ds::Tensor mine(ds::Shape{1}, ds::DType::kInt64);
  std::memcpy(mine.data(), &h, sizeof h);
  const ds::Tensor all = ctx.all_gather(mine, "soak/hash");
  if (all.num_elements() != R)
    violation("hash gather returned " + std::to_string(all.num_elements()));
  for (int r = 0; r < R; ++r) {
    if (all.data<int64_t>()[r] != all.data<int64_t>()[0]) {
      violation("step " + std::to_string(step) + ": replica " + std::to_string(r) +
                "'s variables differ from replica 0's (hash mismatch)");
    }
  }
}

void soak_sync(ds::Strategy& s, const Args& a, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<ds::Variable> vars = random_variables(s, rng);
  ds::SGD opt(s, {1.0f / 16});
  const int64_t first = s.steps_run();
  std::atomic<int64_t> checked{0};
  for (int64_t step = 0; step < a.steps; ++step) {
    s.run([&](ds::ReplicaContext& ctx) {
      sync_step(ctx, opt, vars, step, seed);
      ++checked;
    });
  }
  // Every step ran on every replica and passed its checks.
  if (s.steps_run() - first != a.steps || checked != a.steps * s.num_local_replicas()) {
    violation("ran " + std::to_string(s.steps_run() - first) + " steps, " +
              std::to_string(checked.load()) + " replica-steps checked");
  }
  std::printf("  %s: %lld replica-steps checked, %lld replicas in sync\n", s.name().c_str(),
              static_cast<long long>(checked.load()),
              static_cast<long long>(s.num_replicas_in_sync()));
}

std::vector<ds::Device> two_cpus() { return {ds::Device::cpu(0), ds::Device::cpu(1)}; }

void soak_mirrored(const Args& a) {
  ds::MirroredOptions o;
  o.devices = two_cpus();
  ds::MirroredStrategy s(o);
  soak_sync(s, a, a.seed);
}

void soak_central_storage(const Args& a) {
  ds::CentralStorageOptions o;
  o.devices = two_cpus();
  ds::CentralStorageStrategy s(o);
  soak_sync(s, a, a.seed);
}

void soak_multi_worker(const Args& a) {
  ds::InProcessGroup group(2);
  ds::testing::run_ranks(group, [&](ds::Communicator& comm) {
    ds::MultiWorkerOptions o;
    o.devices = two_cpus();
    o.communicator = &comm;
    ds::MultiWorkerMirroredStrategy s(o);
    soak_sync(s, a, a.seed);
  });
}

void soak_parameter_server(const Args& a) {
  const int W = a.ps_workers;
  const float lr = 1.0f / 1024;
  ds::ParameterServerOptions o;
  o.num_ps = 1;
  ds::InProcessTransportGroup group(W + 1);
  auto ps = ds::ps::make_strategy(group.at(W), o);
  std::vector<int64_t> sent(W);
  std::mt19937_64 rng(a.seed);
  std::vector<int64_t> sizes;
  for (int k = 0; k < 3; ++k) sizes.push_back(1 + static_cast<int64_t>(rng() % 3000));
  run_threads(
      W,
      [&](int w) {
        auto s = ds::ps::make_strategy(group.at(w), o);
        std::vector<ds::Variable> vars;
        for (size_t k = 0; k < sizes.size(); ++k) {
          vars.push_back(s->create_variable("v" + std::to_string(k), ds::Shape{sizes[k]},
                                            ds::DType::kFloat32, ds::init::Zeros{}));
        }
        ds::SGD sgd(*s, {lr});
        for (int64_t step = 0; step < a.steps; ++step) {
          s->run([&](ds::ReplicaContext& ctx) {
            ds::testing::apply_gradient_of_ones(ctx, sgd, vars);
          });
        }
        s->flush();
        sent[w] = s->stats().pushes_sent;
        s->barrier("soak/done");  // every worker's pushes are applied
        if (w == 0) {
          const float want = -lr * static_cast<float>(W * a.steps);
          for (const ds::Variable& v : vars) {
            const ds::Tensor t = v.value();
            for (int64_t i = 0; i < t.num_elements(); ++i) {
              if (t.data<float>()[i] != want) {
                violation(v.name() + "[" + std::to_string(i) +
                          "] = " + std::to_string(t.data<float>()[i]) + ", want " +
                          std::to_string(want) + " (a push lost or applied twice)");
              }
            }
          }
        }
      },
      [&](int) {});
  ps->join();
  const ds::ps::ServiceStats st = ds::ps::local_service(*ps).stats();
  int64_t total_sent = 0;
  for (int64_t n : sent) total_sent += n;
  std::printf("parameter_server: %d workers, pushes sent %lld, applied %lld, rejected %lld\n", W,
              static_cast<long long>(total_sent), static_cast<long long>(st.version),
              static_cast<long long>(st.pushes_rejected));
  if (total_sent != st.version || st.pushes_rejected != 0 || total_sent < W * a.steps) {
    violation("PS accounting: sent " + std::to_string(total_sent) + ", applied " +
              std::to_string(st.version) + ", rejected " + std::to_string(st.pushes_rejected));
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--steps")
      a.steps = std::stoll(v);
    else if (k == "--strategy")
      a.strategy = v;
    else if (k == "--ps-workers")
      a.ps_workers = std::stoi(v);
    else if (k == "--seed")
      a.seed = std::stoull(v);
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  const std::vector<std::pair<std::string, std::function<void(const Args&)>>> all = {
      {"mirrored", soak_mirrored},
      {"central_storage", soak_central_storage},
      {"multi_worker", soak_multi_worker},
      {"parameter_server", soak_parameter_server}};
  int failures = 0;
  for (const auto& [name, fn] : all) {
    if (a.strategy != "all" && a.strategy != name) continue;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      fn(a);
      std::printf("%s: %lld steps OK (%.1f s)\n", name.c_str(), static_cast<long long>(a.steps),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    } catch (const std::exception& e) {
      std::printf("%s: FAILED: %s\n", name.c_str(), e.what());
      ++failures;
    }
    std::fflush(stdout);
  }
  return failures ? 1 : 0;
}
