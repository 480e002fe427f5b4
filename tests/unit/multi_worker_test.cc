// MultiWorkerMirroredStrategy with its workers played by threads of this
// process (one InProcessGroup as the cross-process communicator), so the
// whole strategy is checked without MPI; tests/mpi/ runs it under mpirun.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "runtime/variable_impl.h"
#include "diststrat/diststrat.h"
#include "training_util.h"
#include "../common/temp_dir.h"

namespace ds = diststrat;

namespace {

using diststrat::testing::cpu_devices;
// Runs fn(worker, options) on `workers` threads, each with options wired to
// its rank of an in-process group; node_size > 0 adds node-local and
// cross-node groups (the hierarchical path). Returns each worker's exception.
std::vector<std::exception_ptr> run_workers(
    int workers, int node_size, ds::CommunicationOptions comm,
    const std::function<void(int, ds::MultiWorkerOptions&)>& fn) {
  ds::InProcessGroup flat(workers, comm);
  std::vector<std::unique_ptr<ds::InProcessGroup>> nodes, cross;
  if (node_size > 0) {
    for (int n = 0; n < workers / node_size; ++n)
      nodes.push_back(std::make_unique<ds::InProcessGroup>(node_size, comm));
    for (int l = 0; l < node_size; ++l)
      cross.push_back(std::make_unique<ds::InProcessGroup>(workers / node_size, comm));
  }
  std::vector<std::exception_ptr> errors(workers);
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      ds::MultiWorkerOptions o;
      o.communication = comm;
      o.communicator = &flat.at(w);
      if (node_size > 0) {
        o.node_communicator = &nodes[w / node_size]->at(w % node_size);
        o.cross_node_communicator = &cross[w % node_size]->at(w / node_size);
      }
      try {
        fn(w, o);
      } catch (...) {
        errors[w] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

void rethrow_first(const std::vector<std::exception_ptr>& errors) {
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

struct EquivalenceCase {
  int workers, local, node_size;
};

class MultiWorkerEquivalence : public ::testing::TestWithParam<EquivalenceCase> {};

TEST_P(MultiWorkerEquivalence, SameWeightsAsSingleDeviceAfter20Steps) {
  const EquivalenceCase c = GetParam();
  const ds::nn::Mlp mlp({784, 64, 32, 10});
  // 20 full global batches of 64, then a short one of 3 rows: fewer rows than
  // replicas, so some replicas get none and still take part.
  const ds::Dataset data = ds::testing::synthetic(64 * 20 + 3, 11);
  const auto ref = ds::testing::reference_training(mlp, data, 64, 21, 0.05f, 0.9f);
  ds::CommunicationOptions comm;
  comm.bytes_per_pack = 16 << 10;  // several packs per step
  comm.timeout = std::chrono::seconds(60);
  std::vector<std::vector<ds::Tensor>> finals(c.workers);
  rethrow_first(run_workers(c.workers, c.node_size, comm, [&](int w, ds::MultiWorkerOptions& o) {
    o.devices = cpu_devices(c.local);
    ds::MultiWorkerMirroredStrategy s(o);
    EXPECT_EQ(s.num_replicas_in_sync(), c.workers * c.local);
    EXPECT_EQ(s.first_local_replica(), w * c.local);
    EXPECT_EQ(s.hierarchical(), c.node_size > 1 && c.node_size < c.workers);
    std::vector<ds::Variable> vars;
    ds::testing::train_under(s, mlp, data, 64, 21, 0.05f, 0.9f, &vars);
    for (auto& v : vars) {
      for (const ds::Tensor& copy : v.impl().copies) finals[w].push_back(copy.clone());
    }
    EXPECT_EQ(s.variable("optimizer/iterations").value().data<int64_t>()[0], 21);
    EXPECT_GT(s.stats().packs, 21);
  }));
  for (int w = 0; w < c.workers; ++w) {
    ASSERT_EQ(finals[w].size(), ref.size() * c.local);
    for (size_t i = 0; i < finals[w].size(); ++i) {
      EXPECT_LE(ds::testing::max_abs_diff(finals[w][i], ref[i / c.local]), 1e-4)
          << "worker " << w << " copy " << i;
      // Every copy on every worker is bit-identical to worker 0's.
      EXPECT_EQ(0, std::memcmp(finals[w][i].data(), finals[0][i].data(), finals[0][i].nbytes()));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    WorkersByLocalDevices, MultiWorkerEquivalence,
    ::testing::Values(EquivalenceCase{2, 1, 0}, EquivalenceCase{2, 2, 0}, EquivalenceCase{4, 1, 0},
                      EquivalenceCase{4, 2, 0}, EquivalenceCase{4, 1, 2}, EquivalenceCase{4, 2, 2}),
    [](const auto& info) {
      return std::to_string(info.param.workers) + "w_" + std::to_string(info.param.local) + "dev" +
             (info.param.node_size ? "_nodes_of_" + std::to_string(info.param.node_size) : "");
    });

// Closed-form check of the fused all-reduce: worker w, replica r fills tensor
// k element i with (w + 1) * (r + 1) + k + i (mod a small range).
double value(int replica, int k, int64_t i) { return (replica + 1) + (k % 5) + (i % 7); }

TEST(MultiWorkerFusion, OddSizesMixedDtypesEveryPackSize) {
  const std::vector<int64_t> sizes = {1, 7, 0, 1000, 3, 4097, 17, 1, 64, 255, 2, 9};
  const ds::DType dtypes[] = {ds::DType::kFloat32, ds::DType::kFloat64, ds::DType::kInt32,
                              ds::DType::kInt64};
  for (size_t bpp : {size_t{0}, size_t{12}, size_t{1} << 30}) {
    SCOPED_TRACE("bytes_per_pack " + std::to_string(bpp));
    ds::CommunicationOptions comm;
    comm.bytes_per_pack = bpp;
    comm.timeout = std::chrono::seconds(30);
    const int W = 3, L = 2, R = W * L;
    rethrow_first(run_workers(W, 0, comm, [&](int w, ds::MultiWorkerOptions& o) {
      o.devices = cpu_devices(L);
      ds::MultiWorkerMirroredStrategy s(o);
      for (int rep = 0; rep < 3; ++rep) {
        s.run([&](ds::ReplicaContext& ctx) {
          std::vector<ds::Tensor> ts;
          std::vector<std::string> names;
          for (size_t k = 0; k < sizes.size(); ++k) {
            ds::Tensor t(ds::Shape{sizes[k]}, dtypes[(k / 3 + rep) % 4]);  // runs of 3
            for (int64_t i = 0; i < sizes[k]; ++i) {
              const double v = value(ctx.replica_id(), static_cast<int>(k), i);
              ds::testing::set_element(t, i, v);
            }
            ts.push_back(t);
            names.push_back("t" + std::to_string(k));
          }
          ds::Work work = ctx.all_reduce_async(ds::ReduceOp::kSum, ts, names);
          work.wait();
          for (size_t k = 0; k < sizes.size(); ++k) {
            for (int64_t i = 0; i < sizes[k]; ++i) {
              double expect = 0;
              for (int r = 0; r < R; ++r) expect += value(r, static_cast<int>(k), i);
              const double got = ds::testing::get_element(ts[k], i);
              ASSERT_EQ(got, expect) << "tensor " << k << " element " << i;
            }
          }
          // kMean and kMax over the same replicas.
          ds::Tensor m(ds::Shape{5}, ds::DType::kFloat32);
          for (int i = 0; i < 5; ++i) m.data<float>()[i] = static_cast<float>(ctx.replica_id());
          std::vector<ds::Tensor> mv{m};
          ctx.all_reduce(ds::ReduceOp::kMean, mv, {"mean"});
          EXPECT_FLOAT_EQ(m.data<float>()[4], (R - 1) / 2.0f);
          ds::Tensor x = ctx.all_reduce(ds::ReduceOp::kMax, m, "max");
          EXPECT_FLOAT_EQ(x.data<float>()[0], (R - 1) / 2.0f);
        });
      }
      const ds::MultiWorkerStats st = s.stats();
      // Buffers are allocated on first use and reused afterwards.
      EXPECT_LE(st.buffer_allocations, 2) << "worker " << w;
      // One pack per dtype run (4 per call) + the two single-tensor calls.
      if (bpp == 0) EXPECT_EQ(st.packs, 3 * (4 + 2));
      if (bpp == 12) EXPECT_GT(st.packs, 3 * (12 + 2) - 6);
    }));
  }
}

TEST(MultiWorkerFusion, WireCompressionStaysWithinTolerance) {
  for (auto comp : {ds::Compression::kFloat16, ds::Compression::kBFloat16}) {
    ds::CommunicationOptions comm;
    comm.compression = comp;
    comm.timeout = std::chrono::seconds(30);
    const double tol = comp == ds::Compression::kFloat16 ? 1e-3 : 8e-3;  // relative
    rethrow_first(run_workers(2, 0, comm, [&](int w, ds::MultiWorkerOptions& o) {
      ds::MultiWorkerMirroredStrategy s(o);
      s.run([&](ds::ReplicaContext& ctx) {
        ds::Tensor t(ds::Shape{1000}, ds::DType::kFloat32);
        for (int i = 0; i < 1000; ++i) t.data<float>()[i] = 0.001f * (i + 1) * (w + 1) + 0.1234567f;
        std::vector<ds::Tensor> v{t};
        ctx.all_reduce(ds::ReduceOp::kSum, v, {"g"});
        double worst = 0;
        bool inexact = false;
        for (int i = 0; i < 1000; ++i) {
          const double exact = 0.001 * (i + 1) * 3 + 2 * 0.1234567;
          const double rel = std::fabs(t.data<float>()[i] - exact) / exact;
          worst = std::max(worst, rel);
          inexact = inexact || rel > 1e-6;
        }
        EXPECT_LE(worst, tol);
        EXPECT_TRUE(inexact) << "compression did not reach the wire";
      });
    }));
  }
}

// Each rank enqueues different tensors: every rank gets InvalidArgumentError
// naming the first differing tensor and the ranks; the strategy stays usable.
TEST(MultiWorkerSafety, MismatchedCallsAreAnErrorOnEveryRankNamingTheTensor) {
  struct Variant {
    const char* what;
    const char* expected;
  };
  const Variant variants[] = {{"name", "'b/grad' float32[4]"},
                              {"shape", "'w/grad' float32[5]"},
                              {"fewer", "enqueued no tensor #1"}};
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.what);
    ds::CommunicationOptions comm;
    comm.timeout = std::chrono::seconds(20);
    comm.bytes_per_pack = 8;  // several packs: the check still runs before any moves
    std::vector<std::string> messages(3);
    auto errors = run_workers(3, 0, comm, [&](int w, ds::MultiWorkerOptions& o) {
      ds::MultiWorkerMirroredStrategy s(o);
      try {
        s.run([&](ds::ReplicaContext& ctx) {
          const bool odd = w == 2;
          std::vector<ds::Tensor> ts{ds::Tensor(ds::Shape{3}, ds::DType::kFloat32)};
          std::vector<std::string> names{"a/grad"};
          if (!(odd && std::string(v.what) == "fewer")) {
            ts.emplace_back(ds::Shape{odd && std::string(v.what) == "shape" ? 5 : 4},
                            ds::DType::kFloat32);
            names.push_back(odd && std::string(v.what) == "name" ? "b/grad" : "w/grad");
          }
          ctx.all_reduce(ds::ReduceOp::kSum, ts, names);
        });
        ADD_FAILURE() << "worker " << w << " did not throw";
      } catch (const ds::InvalidArgumentError& e) {
        messages[w] = e.message();
      }
      // Still usable: the check ran before any data moved, on every rank.
      auto ones = s.run([](ds::ReplicaContext& ctx) {
        ds::Tensor t(ds::Shape{2}, ds::DType::kInt32);
        t.data<int32_t>()[1] = 1;
        return ctx.all_reduce(ds::ReduceOp::kSum, t, "after").data<int32_t>()[1];
      });
      EXPECT_EQ(ones[0], 3);
    });
    rethrow_first(errors);
    for (int w = 0; w < 3; ++w) {
      EXPECT_NE(messages[w].find(v.expected), std::string::npos) << messages[w];
      EXPECT_NE(messages[w].find("rank 2"), std::string::npos) << messages[w];
      EXPECT_NE(messages[w].find("ranks 0, 1"), std::string::npos) << messages[w];
    }
  }
}

// Issue 43 item 8: one rank makes no collective call in step 3 (the same
// tensor names every step). Its step-4 gradients must not be reduced with
// the others' step-3 gradients: the first mispaired call is the error, on
// every rank (ranks 0 and 2 in step 3, rank 1 in step 4), naming the rank,
// the operation, the tensor and both steps, and no mispaired gradient is
// applied. Without the step in the call signature the calls paired up until
// the others' last step found no partner.
// The step's first call is the gradients' fused all_reduce, or a barrier
// (a task on the communication thread, compared by the communicator).
TEST(MultiWorkerSafety, ARankThatSkipsAStepIsAnErrorAtTheFirstMispairedCall) {
  for (const auto& [local, barrier_first] :
       {std::pair{1, false}, std::pair{2, false}, std::pair{2, true}}) {
    SCOPED_TRACE("local replicas " + std::to_string(local) + (barrier_first ? ", barrier" : ""));
    constexpr int kWorkers = 3, kSteps = 8, kSkipper = 1, kSkipped = 3;
    ds::CommunicationOptions comm;
    comm.timeout = std::chrono::seconds(5);
    std::vector<std::string> messages(kWorkers);
    std::vector<int64_t> failed_at(kWorkers, -1);
    std::vector<float> weights(kWorkers);
    rethrow_first(run_workers(kWorkers, 0, comm, [&](int w, ds::MultiWorkerOptions& o) {
      o.devices = cpu_devices(local);
      ds::MultiWorkerMirroredStrategy s(o);
      ds::Variable v = s.create_variable("w", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
      ds::SGD sgd(s, {0.5f});
      for (int step = 0; step < kSteps; ++step) {
        try {
          s.run([&](ds::ReplicaContext& ctx) {
            if (w == kSkipper && step == kSkipped) return;  // skips the whole step
            // Step k's gradient is k + 1, so a mispaired reduction shows.
            ds::Tensor g(ds::Shape{2}, ds::DType::kFloat32);
            g.data<float>()[0] = g.data<float>()[1] = float(step + 1);
            if (barrier_first) ctx.barrier("sync");
            sgd.apply_gradients(ctx, {{g, v}});
          });
        } catch (const ds::InvalidArgumentError& e) {
          failed_at[w] = step;
          messages[w] = e.message();
          break;
        } catch (const ds::Error& e) {
          failed_at[w] = step;
          messages[w] = "(" + std::string(ds::error_code_name(e.code())) + ") " + e.message();
          break;
        }
      }
      weights[w] = v.value().data<float>()[0];
    }));
    for (int w = 0; w < kWorkers; ++w) {
      SCOPED_TRACE("worker " + std::to_string(w) + ": " + messages[w]);
      EXPECT_EQ(failed_at[w], w == kSkipper ? kSkipped + 1 : kSkipped);
      const std::vector<std::string> parts =
          barrier_first
              ? std::vector<std::string>{"rank 1 called barrier 'sync (step 4)'",
                                         "barrier 'sync (step 3)'"}
              : std::vector<std::string>{"rank 1 is in step 4", "ranks 0, 2 are in step 3",
                                         "fused all_reduce", "'w"};
      for (const std::string& part : parts) {
        EXPECT_NE(messages[w].find(part), std::string::npos) << part;
      }
      // Steps 0-2 applied (each a sum of kWorkers * local gradients 1, 2, 3),
      // nothing after: -0.5 * 6 per replica. (Mispaired, they were -44 and
      // -88 here: later steps' gradients reduced with earlier ones.)
      EXPECT_EQ(weights[w], -3.0f * float(kWorkers * local));
    }
  }
}

TEST(MultiWorkerSafety, LocalReplicasThatDisagreeAreNamedOnEveryRank) {
  ds::CommunicationOptions comm;
  comm.timeout = std::chrono::seconds(20);
  std::vector<std::string> messages(2);
  rethrow_first(run_workers(2, 0, comm, [&](int w, ds::MultiWorkerOptions& o) {
    o.devices = cpu_devices(2);
    ds::MultiWorkerMirroredStrategy s(o);
    try {
      s.run([&](ds::ReplicaContext& ctx) {
        ds::Tensor t(ds::Shape{ctx.replica_id() == 3 ? 6 : 4}, ds::DType::kFloat32);
        std::vector<ds::Tensor> v{t};
        ctx.all_reduce(ds::ReduceOp::kSum, v, {"k/grad"});
      });
      ADD_FAILURE();
    } catch (const ds::InvalidArgumentError& e) {
      messages[w] = e.message();
    }
  }));
  for (const auto& m : messages) {
    EXPECT_NE(m.find("rank 1: local replicas disagree"), std::string::npos) << m;
    EXPECT_NE(m.find("'k/grad' float32[6]"), std::string::npos) << m;
  }
}

TEST(MultiWorkerSafety, ARankThatStopsIsDeadlineExceededNamingItWithinTheDeadline) {
  ds::CommunicationOptions comm;
  comm.timeout = std::chrono::milliseconds(300);
  std::vector<std::string> messages(3);
  std::vector<double> seconds(3);
  rethrow_first(run_workers(3, 0, comm, [&](int w, ds::MultiWorkerOptions& o) {
    ds::MultiWorkerMirroredStrategy s(o);
    if (w == 1) return;  // stops participating
    const auto t0 = std::chrono::steady_clock::now();
    try {
      s.run([&](ds::ReplicaContext& ctx) {
        std::vector<ds::Tensor> v{ds::Tensor(ds::Shape{8}, ds::DType::kFloat32)};
        ctx.all_reduce(ds::ReduceOp::kSum, v, {"dense/kernel/grad"});
      });
      ADD_FAILURE();
    } catch (const ds::DeadlineExceededError& e) {
      messages[w] = e.message();
    } catch (const ds::AbortedError& e) {
      messages[w] = e.message();  // the first rank to time out aborts the group
    }
    seconds[w] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // Later calls fail at once instead of hanging.
    EXPECT_THROW(s.barrier("after"), ds::AbortedError);
  }));
  bool someone_named_it = false;
  for (int w : {0, 2}) {
    EXPECT_LT(seconds[w], 2.0);
    someone_named_it |= messages[w].find("rank 1 did not arrive") != std::string::npos;
    EXPECT_NE(messages[w].find("fused all_reduce call #0"), std::string::npos) << messages[w];
  }
  EXPECT_TRUE(someone_named_it) << messages[0] << "\n" << messages[2];
}

TEST(MultiWorkerSafety, ALocalReplicaThatNeverEnqueuesIsNamed) {
  ds::CommunicationOptions comm;
  comm.timeout = std::chrono::milliseconds(200);
  rethrow_first(run_workers(1, 0, comm, [&](int, ds::MultiWorkerOptions& o) {
    o.devices = cpu_devices(2);
    ds::MultiWorkerMirroredStrategy s(o);
    try {
      s.run([&](ds::ReplicaContext& ctx) {
        if (ctx.local_replica_id() == 1) return;
        std::vector<ds::Tensor> v{ds::Tensor(ds::Shape{8}, ds::DType::kFloat32)};
        ctx.all_reduce(ds::ReduceOp::kSum, v, {"g"});
      });
      ADD_FAILURE();
    } catch (const ds::DeadlineExceededError& e) {
      EXPECT_NE(e.message().find("local replica 1 did not enqueue"), std::string::npos)
          << e.message();
    }
  }));
}

TEST(MultiWorker, ChiefInitialValuesReduceGatherBroadcastAndTimeline) {
  const diststrat_test::TempDir tmp("diststrat_mw_timeline_");
  const std::string path = tmp / "mw_timeline.json";
  ds::CommunicationOptions comm;
  comm.timeout = std::chrono::seconds(30);
  rethrow_first(run_workers(2, 0, comm, [&](int w, ds::MultiWorkerOptions& o) {
    o.devices = cpu_devices(2);
    o.timeline_path = path;
    ds::MultiWorkerMirroredStrategy s(o);
    EXPECT_EQ(s.cluster().worker_index, w);
    EXPECT_EQ(s.cluster().is_chief(), w == 0);
    // Different seeds per worker: the chief's value wins everywhere.
    ds::Variable v = s.create_variable("v", ds::Shape{3}, ds::DType::kFloat32,
                                       ds::init::RandomNormal{0.0, 1.0, 100u + w});
    ds::Tensor chief(ds::Shape{3}, ds::DType::kFloat32);
    ds::init::RandomNormal{0.0, 1.0, 100u}(chief);
    for (const auto& c : v.impl().copies) {
      EXPECT_EQ(0, std::memcmp(c.data(), chief.data(), 12));
    }
    auto ids = s.run([](ds::ReplicaContext& ctx) {
      std::vector<ds::Tensor> g{ds::Tensor(ds::Shape{10}, ds::DType::kFloat32),
                                ds::Tensor(ds::Shape{3}, ds::DType::kFloat32)};
      ctx.all_reduce(ds::ReduceOp::kSum, g, {"g0", "g1"});
      return float(ctx.replica_id());
    });
    EXPECT_EQ(s.reduce(ds::ReduceOp::kSum, ids), 6.0f);
    EXPECT_EQ(s.reduce(ds::ReduceOp::kMean, ids), 1.5f);
    EXPECT_EQ(s.reduce(ds::ReduceOp::kMax, ids), 3.0f);
    auto rows = s.run([](ds::ReplicaContext& ctx) {
      ds::Tensor t(ds::Shape{ctx.replica_id() % 2 + 1, 1}, ds::DType::kInt32);
      for (int64_t i = 0; i < t.num_elements(); ++i) t.data<int32_t>()[i] = ctx.replica_id();
      return t;
    });
    const ds::Tensor g = s.gather(rows);
    ASSERT_EQ(g.shape(), ds::Shape({6, 1}));
    const int32_t expect[] = {0, 1, 1, 2, 3, 3};
    for (int i = 0; i < 6; ++i) EXPECT_EQ(g.data<int32_t>()[i], expect[i]);
    auto gathered = s.run([](ds::ReplicaContext& ctx) {
      ds::Tensor t(ds::Shape{1, 2}, ds::DType::kFloat32);
      t.data<float>()[1] = float(ctx.replica_id());
      ctx.barrier("mid");
      return ctx.all_gather(t, "pairs");
    });
    for (const auto& t : gathered) EXPECT_EQ(t.data<float>()[7], 3.0f);
    ds::Tensor b(ds::Shape{2}, ds::DType::kInt64);
    b.data<int64_t>()[0] = 10 + w;
    s.broadcast(b, 1, "b");
    EXPECT_EQ(b.data<int64_t>()[0], 11);
    s.barrier("end");
  }));
  std::ifstream f(path);
  ASSERT_TRUE(f.good()) << path;
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string json = ss.str();
  for (const char* phase :
       {"\"queue\"", "\"pack\"", "\"memcpy-in\"", "\"reduce\"", "\"memcpy-out\"", "\"step 0\"",
        "\"pid\":1", "\"pid\":0", "traceEvents"}) {
    EXPECT_NE(json.find(phase), std::string::npos) << phase;
  }
}

}  // namespace
