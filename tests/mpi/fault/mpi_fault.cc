// The multi-process fault and soak driver, run under mpirun by ctest
// (tests/mpi/fault/fault_cell.sh, tests/mpi/CMakeLists.txt).
//
//   diststrat_mpi_fault --strategy multi_worker|multi_worker_fake_gpu|parameter_server
//                       [--steps N] [--timeout-ms T] [--tag WORD]
//                       [--allow-lost-workers 1] [--stop-in-nccl R:N]
//
// multi_worker_fake_gpu: multi_worker with one fake GPU per process, the
// gradients reduced by the fake multi-process NCCL (tests/unit/fake_nccl.h);
// --stop-in-nccl R:N: rank R stops itself (SIGSTOP) inside its N-th NCCL
// collective (0-based), after the ranks' signature exchange, where NCCL
// itself cannot say which peer is missing.
//
// Every rank trains a few small variables with SGD (gradient of ones, so the
// expected values are exact); the fault comes from DISTSTRAT_FAULT
// (kind:rank:step, `mpirun -x DISTSTRAT_FAULT=...`), read by the strategy's
// constructor. multi_worker: one replica per process, the gradients
// all-reduced through the fusion engine. parameter_server: the last rank is
// the PS (it join()s), the others are workers with staleness bound 1, so a
// survivor depends on the faulty worker until the PS declares it gone.
// T (default 2000) is every deadline (communication timeout and the PS's
// worker_timeout; the PS workers' own waits get 3 T so that the PS declares a
// silent worker gone first). --tag is ignored: it marks this job's
// processes so the cell script can look for leftovers afterwards.
//
// Each rank prints "rank R: OK ..." or "rank R: FAILED after S s: <error>"
// and exits 0 or 1. Without a fault the results are checked exactly:
// multi_worker: every value is -lr * replicas * steps (gradients are summed);
// parameter_server (the soak's accounting): every worker sent one push per
// step, the PS applied workers * steps pushes and rejected none, and every
// value is -lr * workers * steps; where a worker was lost from outside (the
// PS declared it gone, the others went on), the same with the steps each
// worker did push. Any violation fails the rank.
#include <csignal>
#include <chrono>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "common/ones_step.h"
#include "core/device_manager_impl.h"
#include "runtime/process_group.h"
#include "unit/fake_nccl.h"
#include "diststrat/diststrat.h"
#include "diststrat/multi_worker_mirrored.h"
#include "diststrat/parameter_server.h"

namespace ds = diststrat;

namespace {

struct Args {
  std::string strategy = "multi_worker";
  int64_t steps = 8;
  int timeout_ms = 2000;
  bool allow_lost_workers =
      false;  // --allow-lost-workers 1: a worker lost from outside is expected
  // --linger R:MS: rank R works MS longer than the others after training,
  // its strategy alive (as a chief evaluating); --stop-at-exit R: rank R
  // stops itself (SIGSTOP) once it has reported, before its exit.
  int linger_rank = -1, linger_ms = 0, stop_rank = -1;
  // --exit-in-strategy R: rank R calls std::exit(0) after training with its
  // strategy alive (never destroyed); --ps-throws 1: the PS rank throws
  // instead of join()ing (the program failed there).
  int exit_rank = -1;
  bool ps_throws = false;
  int stop_in_nccl_rank = -1, stop_in_nccl_index = -1;  // --stop-in-nccl R:N
};

// The rank's extra work of --linger, and its exit of --exit-in-strategy.
void linger(const Args& a, int rank) {
  if (rank == a.linger_rank) std::this_thread::sleep_for(std::chrono::milliseconds(a.linger_ms));
  if (rank == a.exit_rank) {
    std::printf("rank %d: calls std::exit(0) with its strategy alive\n", rank);
    std::fflush(stdout);
    std::exit(0);
  }
}

constexpr float kLr = 1.0f / 1024;

// Prints a rank's failure at once, while its strategy still exists: the
// strategy's destructor may wait (bounded) for peers that are gone, and the
// launcher may end this process meanwhile.
struct Reporter {
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  int rank = -1;
  bool reported = false;
  double secs() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  void failed(const std::exception& e) {
    if (reported) return;
    reported = true;
    std::fprintf(stderr, "rank %d: FAILED after %.2f s: %s\n", rank, secs(), e.what());
    std::fflush(stderr);
  }
};

std::vector<ds::Variable> make_variables(ds::Strategy& s) {
  std::vector<ds::Variable> vars;
  const int64_t sizes[] = {7, 1000, 33};
  for (int k = 0; k < 3; ++k) {
    vars.push_back(s.create_variable("v" + std::to_string(k), ds::Shape{sizes[k]},
                                     ds::DType::kFloat32, ds::init::Zeros{}));
  }
  return vars;
}

void train(ds::Strategy& s, const std::vector<ds::Variable>& vars, ds::SGD& sgd, int64_t steps) {
  for (int64_t step = 0; step < steps; ++step) {
    s.run([&](ds::ReplicaContext& ctx) {
      if (ctx.device().is_cpu()) {
        ds::testing::apply_gradient_of_ones(ctx, sgd, vars);
        return;
      }
      // The gradients of ones in the replica's GPU memory.
      std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
      for (const ds::Variable& v : vars) {
        ds::Tensor ones(v.shape(), ds::DType::kFloat32);
        ds::init::Constant{1.0}(ones);
        ds::Tensor g(v.shape(), ds::DType::kFloat32, ctx.device());
        g.copy_from(ones);
        gv.emplace_back(g, v);
      }
      sgd.apply_gradients(ctx, gv);
    });
    // Set-up (collective) is over on every rank: the cluster cells strike
    // only after this line (stderr: unbuffered through mpirun).
    if (step == 0) std::fprintf(stderr, "rank %d: training\n", s.cluster().rank);
  }
}

void expect_values(const std::vector<ds::Variable>& vars, float want) {
  for (const ds::Variable& v : vars) {
    const ds::Tensor t = v.value();
    for (int64_t i = 0; i < t.num_elements(); ++i) {
      if (t.data<float>()[i] != want) {
        throw ds::InternalError("INVARIANT VIOLATED: " + v.name() + "[" + std::to_string(i) +
                                "] = " + std::to_string(t.data<float>()[i]) + ", want " +
                                std::to_string(want));
      }
    }
  }
}

// Fills `summary` on success; reports a failure before the strategy goes.
void run_multi_worker(const Args& a, std::string& summary, Reporter& report, bool fake_gpu) {
  ds::MultiWorkerOptions o;
  o.communication.timeout = std::chrono::milliseconds(a.timeout_ms);
  std::unique_ptr<diststrat_test::LeaseDir> lease;
  if (fake_gpu) {
    // One fake GPU of this process's own; the fake NCCL's transport is the
    // library's MPI process group, made as the strategy makes its own.
    const int rank = report.rank;
    auto backend = std::make_unique<diststrat_test::FakeNcclBackend>(
        1, "rank" + std::to_string(rank),
        [](const std::string&, int, int, const ds::CommunicationOptions& c) {
          return std::move(ds::make_process_communicators(
                               ds::resolve_cluster(ds::ClusterConfig{}, c.timeout), c, false)
                               .cross);
        });
    if (rank == a.stop_in_nccl_rank) {
      const int index = a.stop_in_nccl_index;
      backend->before_collective = [rank, index](int i) {
        if (i != index) return;
        std::fprintf(stderr, "rank %d: stops itself (SIGSTOP) inside NCCL collective %d\n", rank,
                     i);
        std::fflush(stderr);
        ::raise(SIGSTOP);
      };
    }
    lease = std::make_unique<diststrat_test::LeaseDir>();
    o.devices = {ds::Device::gpu(0)};
    o.gpu_reduction = ds::GpuReduction::kNccl;
    o.device_manager =
        ds::DeviceManagerAccess::shared_with_backend(lease->gpu_options(), std::move(backend));
  }
  ds::MultiWorkerMirroredStrategy s(o);
  report.rank = s.cluster().rank;
  try {
    std::vector<ds::Variable> vars = make_variables(s);
    ds::SGD sgd(s, {kLr});
    train(s, vars, sgd, a.steps);
    if (!s.fault_injection().active()) {
      // Gradients are summed over the replicas in sync (as TensorFlow's
      // optimizers do): -lr * replicas per step.
      expect_values(vars, -kLr * static_cast<float>(s.num_replicas_in_sync() * a.steps));
    }
    summary = std::to_string(a.steps) + " steps, values exact";
    linger(a, report.rank);
  } catch (const std::exception& e) {
    report.failed(e);
    throw;
  }
}

void run_parameter_server(const Args& a, std::string& summary, Reporter& report) {
  ds::ParameterServerOptions o;
  o.num_ps = 1;
  o.max_staleness = 1;
  o.worker_timeout = std::chrono::milliseconds(a.timeout_ms);
  o.communication.timeout = std::chrono::milliseconds(3 * a.timeout_ms);
  ds::ParameterServerStrategy s(o);
  report.rank = s.cluster().rank;
  try {
    if (s.is_ps()) {
      if (a.ps_throws) throw ds::InternalError("the PS rank's program failed before join()");
      s.join();  // every worker done; DeadlineExceeded naming silent ones
      summary = "PS served every worker";
      return;
    }
    std::vector<ds::Variable> vars = make_variables(s);
    ds::SGD sgd(s, {kLr});
    train(s, vars, sgd, a.steps);
    s.flush();
    s.barrier("fault/done");  // every worker's pushes are applied
    const ds::ParameterServerStats st = s.stats();
    const int workers = s.num_replicas_in_sync();  // one replica per worker
    summary = "pushes sent " + std::to_string(st.pushes_sent) + ", PS applied " +
              std::to_string(st.pushes_applied) + ", rejected " +
              std::to_string(st.pushes_rejected);
    // A worker lost from outside (its host died: tests/cluster/fault_cell.sh,
    // which passes --allow-lost-workers 1) pushed fewer steps than the others;
    // the PS declared it gone and the survivors went on. Then every push that
    // did arrive counts once. Without the flag a lost worker fails the check.
    std::string lost;
    int64_t steps_pushed = 0;
    for (size_t w = 0; w < st.worker_steps.size(); ++w) {
      steps_pushed += st.worker_steps[w];
      if (st.worker_steps[w] < a.steps) {
        lost += (lost.empty() ? "" : ", ") + std::string("worker ") + std::to_string(w) +
                " at step " + std::to_string(st.worker_steps[w]);
      }
    }
    if (!s.fault_injection().active()) {
      // One PS: every step is one push per worker. Nothing lost (unless
      // allowed), nothing applied twice, nothing rejected.
      const bool lost_allowed = !lost.empty() && a.allow_lost_workers;
      const int64_t want = lost_allowed ? steps_pushed : workers * a.steps;
      if (st.pushes_sent != a.steps || st.pushes_applied != want || st.pushes_rejected != 0) {
        throw ds::InternalError(
            "INVARIANT VIOLATED: PS accounting" +
            (lost_allowed ? " with " + lost + " lost" : std::string()) + ": this worker sent " +
            std::to_string(st.pushes_sent) + " (want " + std::to_string(a.steps) +
            "), PS applied " + std::to_string(st.pushes_applied) + " (want " +
            std::to_string(want) + "), rejected " + std::to_string(st.pushes_rejected));
      }
      expect_values(vars, -kLr * static_cast<float>(want));
      if (lost_allowed)
        summary = std::to_string(a.steps) + " steps with " + lost + " lost; " + summary;
      summary += ", values exact";
    }
    linger(a, report.rank);
  } catch (const std::exception& e) {
    report.failed(e);
    throw;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--strategy")
      a.strategy = v;
    else if (k == "--steps")
      a.steps = std::stoll(v);
    else if (k == "--timeout-ms")
      a.timeout_ms = std::stoi(v);
    else if (k == "--allow-lost-workers")
      a.allow_lost_workers = v == "1";
    else if (k == "--linger" && v.find(':') != std::string::npos) {
      a.linger_rank = std::stoi(v.substr(0, v.find(':')));
      a.linger_ms = std::stoi(v.substr(v.find(':') + 1));
    } else if (k == "--stop-at-exit")
      a.stop_rank = std::stoi(v);
    else if (k == "--exit-in-strategy")
      a.exit_rank = std::stoi(v);
    else if (k == "--ps-throws")
      a.ps_throws = v == "1";
    else if (k == "--stop-in-nccl" && v.find(':') != std::string::npos) {
      a.stop_in_nccl_rank = std::stoi(v.substr(0, v.find(':')));
      a.stop_in_nccl_index = std::stoi(v.substr(v.find(':') + 1));
    } else if (k == "--tag")
      continue;
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  Reporter report;
  // For messages before the strategy knows its rank (the launcher's rank).
  const char* env_rank = std::getenv("OMPI_COMM_WORLD_RANK");
  report.rank = env_rank ? std::atoi(env_rank) : -1;
  try {
    std::string summary;
    if (a.strategy == "multi_worker" || a.strategy == "multi_worker_fake_gpu") {
      run_multi_worker(a, summary, report, a.strategy == "multi_worker_fake_gpu");
    } else if (a.strategy == "parameter_server") {
      run_parameter_server(a, summary, report);
    } else {
      std::fprintf(stderr, "unknown --strategy %s\n", a.strategy.c_str());
      return 2;
    }
    std::printf("rank %d: OK after %.2f s: %s\n", report.rank, report.secs(), summary.c_str());
    std::fflush(stdout);
    if (report.rank == a.stop_rank) ::raise(SIGSTOP);
    return 0;
  } catch (const std::exception& e) {
    report.failed(e);
    return 1;
  }
}
