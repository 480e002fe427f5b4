// The public process group (diststrat/process_group.h) in one process: with
// no launcher it is a one-rank group; its bad arguments; and
// broadcast_tensors over an InProcessGroup (ranks as threads): values,
// packing, and a mismatched list -> the same error on every rank, naming the
// rank and the tensor, with the communicator still usable afterwards.
// (Under mpirun: tests/mpi/process_group_mpi_test.cc.)
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "diststrat/config.h"
#include "diststrat/diststrat.h"
#include "harness.h"
#include "../common/compare.h"

namespace ds = diststrat;

namespace {

using diststrat_test::contains;
// The environment a test of the cluster sources relies on: no TF_CONFIG.
struct NoTfConfig {
  std::string saved;
  bool had;
  NoTfConfig() {
    const char* v = std::getenv("TF_CONFIG");
    had = v != nullptr;
    if (had) saved = v;
    unsetenv("TF_CONFIG");
  }
  ~NoTfConfig() {
    if (had) setenv("TF_CONFIG", saved.c_str(), 1);
  }
};

template <typename E, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("(another error) ") + e.what();
  }
  return "(no error)";
}

ds::Tensor iota(ds::Shape shape, ds::DType dtype, double base) {
  ds::Tensor t(shape, dtype);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    switch (dtype) {
      case ds::DType::kFloat32:
        t.data<float>()[i] = static_cast<float>(base + i);
        break;
      case ds::DType::kFloat64:
        t.data<double>()[i] = base + i;
        break;
      case ds::DType::kInt32:
        t.data<int32_t>()[i] = static_cast<int32_t>(base + i);
        break;
      case ds::DType::kInt64:
        t.data<int64_t>()[i] = static_cast<int64_t>(base + i);
        break;
      default: {
        // 16-bit types: the bytes are what is compared.
        uint16_t* p = static_cast<uint16_t*>(t.data());
        p[i] = static_cast<uint16_t>(static_cast<int64_t>(base) * 7 + i);
      }
    }
  }
  return t;
}

bool same_raw_bytes(const ds::Tensor& a, const ds::Tensor& b) {
  return a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.data(), b.data(), a.nbytes()) == 0);
}

}  // namespace

TEST(ProcessGroup, OneProcessWithoutALauncherIsAOneRankGroup) {
  NoTfConfig env;
  ds::ProcessGroup pg;
  EXPECT_EQ(pg.rank(), 0);
  EXPECT_EQ(pg.size(), 1);
  EXPECT_EQ(pg.cluster().source, ds::ClusterSource::kSingleProcess);
  EXPECT_TRUE(pg.cluster().info.is_chief());
  EXPECT_FALSE(pg.hierarchical());

  ds::Tensor t = iota({5}, ds::DType::kFloat32, 1.0);
  pg.all_reduce(t, ds::ReduceOp::kSum, "t");
  pg.all_reduce(t, ds::ReduceOp::kMean, "t");
  for (int i = 0; i < 5; ++i) EXPECT_EQ(t.data<float>()[i], 1.0f + i);
  int64_t v[3] = {4, 5, 6}, g[3] = {0, 0, 0};
  pg.broadcast(v, 3, 0, "v");
  pg.all_gather(v, g, 3, ds::DType::kInt64, "g");
  EXPECT_EQ(g[2], 6);
  double rs_in[2] = {1.5, 2.5}, rs_out[2] = {0, 0};
  pg.reduce_scatter(rs_in, rs_out, 2, ds::DType::kFloat64, ds::ReduceOp::kSum, "rs");
  EXPECT_EQ(rs_out[1], 2.5);
  pg.barrier("b");

  std::vector<ds::Tensor> params{iota({2, 3}, ds::DType::kFloat32, 0.5),
                                 iota({4}, ds::DType::kInt64, 9)};
  const std::vector<ds::Tensor> before{params[0].clone(), params[1].clone()};
  ds::broadcast_tensors(pg, params, 0, {"w", "step"});
  EXPECT_TRUE(same_raw_bytes(params[0], before[0]));
  EXPECT_TRUE(same_raw_bytes(params[1], before[1]));
}

// Groups in sequence, and next to a strategy (in-process here; the MPI test
// does the same under mpirun).
TEST(ProcessGroup, GroupsInSequenceAndNextToAStrategy) {
  NoTfConfig env;
  for (int i = 0; i < 3; ++i) {
    ds::ProcessGroup pg;
    ds::MultiWorkerMirroredStrategy s;
    ds::ProcessGroup pg2;
    int32_t x = 3;
    pg.all_reduce(&x, 1, ds::ReduceOp::kSum, "x");
    pg2.all_reduce(&x, 1, ds::ReduceOp::kSum, "x");
    EXPECT_EQ(x, 3);
    EXPECT_EQ(s.num_replicas_in_sync(), 1);
  }
}

TEST(ProcessGroup, AnExplicitOneProcessSpec) {
  NoTfConfig env;
  ds::ProcessGroupOptions o;
  o.cluster.spec.jobs["worker"] = {"localhost:2222"};
  ds::ProcessGroup pg(o);
  EXPECT_EQ(pg.size(), 1);
  EXPECT_EQ(pg.cluster().source, ds::ClusterSource::kExplicit);
}

TEST(ProcessGroup, BadSetUpIsAClearError) {
  NoTfConfig env;
  {
    ds::ProcessGroupOptions o;
    o.communication.timeout = std::chrono::milliseconds(0);
    const std::string e = error_of<ds::InvalidArgumentError>([&] { ds::ProcessGroup pg(o); });
    EXPECT_TRUE(contains(e,
                         "ProcessGroup: options.communication.timeout of 0 ms: a timeout must "
                         "be > 0 ms and at most 30 days"))
        << e;
  }
  {
    // So large that now + timeout would overflow into the past (every wait
    // failed at once, with a false deadline error).
    ds::ProcessGroupOptions o;
    o.communication.timeout = std::chrono::milliseconds::max();
    const std::string e = error_of<ds::InvalidArgumentError>([&] { ds::ProcessGroup pg(o); });
    EXPECT_TRUE(contains(e, "at most 30 days")) << e;
  }
  {
    // Several processes, but no launcher started this one: they meet over
    // TCP at the chief's address, here one that is not this host's (a
    // TEST-NET address), where this process, the chief, cannot serve the
    // store (every build has the TCP transport: it needs no Gloo).
    ds::ProcessGroupOptions o;
    o.cluster.spec.jobs["worker"] = {"192.0.2.1:1", "b:1"};
    const std::string e = error_of<ds::UnavailableError>([&] { ds::ProcessGroup pg(o); });
    EXPECT_TRUE(contains(e,
                         "rank 0 worker[0] (192.0.2.1:1): the chief's store at 192.0.2.1:1: "
                         "cannot listen"))
        << e;
  }
  {
    ds::ProcessGroupOptions o;
    o.cluster.spec.jobs["chief"] = {"a:1"};
    o.cluster.spec.jobs["evaluator"] = {"b:1"};
    o.cluster.spec.task_type = "evaluator";
    const std::string e = error_of<ds::InvalidArgumentError>([&] { ds::ProcessGroup pg(o); });
    EXPECT_TRUE(contains(e, "ProcessGroup: this process is task evaluator[0]")) << e;
  }
  {
    setenv("TF_CONFIG", "[1,", 1);
    const std::string e = error_of<ds::InvalidArgumentError>([&] { ds::ProcessGroup pg; });
    unsetenv("TF_CONFIG");
    EXPECT_TRUE(contains(e, "TF_CONFIG")) << e;
  }
}

// A job started without a launcher: a rank whose set-up fails (here worker[1],
// whose listed address is not this host's) says why in the chief's store, and
// the others stop at once naming it, instead of waiting out the deadline for
// an address that never comes (outside trial of issue 46).
TEST(ProcessGroup, ARankWhoseTcpSetUpFailsStopsTheOthersAtOnceSayingWhy) {
  const int port =
      20000 + static_cast<int>(std::chrono::steady_clock::now().time_since_epoch().count() % 20000);
  const auto options = [&](int rank) {
    ds::ProcessGroupOptions o;
    o.communication.timeout = std::chrono::seconds(12);
    o.cluster.spec.jobs["worker"] = {"127.0.0.1:" + std::to_string(port),
                                     "192.0.2.9:" + std::to_string(port + 1),
                                     "127.0.0.1:" + std::to_string(port + 2)};
    o.cluster.spec.task_type = "worker";
    o.cluster.spec.task_index = rank;
    return o;
  };
  // Rank 1 in a child forked from this state (a process makes its groups'
  // names in order: both make the same one next).
  std::fflush(nullptr);
  const pid_t child = ::fork();
  if (child == 0) {
    const std::string e = error_of<ds::UnavailableError>([&] { ds::ProcessGroup pg(options(1)); });
    ::_exit(contains(e, "cannot listen on 192.0.2.9") ? 0 : 1);
  }
  ASSERT_GT(child, 0);
  // Rank 2 comes a second late, when rank 1 has long failed: it still learns
  // why at once (the chief keeps its store up until every rank knows).
  const pid_t late = ::fork();
  if (late == 0) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    const auto t = std::chrono::steady_clock::now();
    const std::string e = error_of<ds::AbortedError>([&] { ds::ProcessGroup pg(options(2)); });
    const bool quick = std::chrono::steady_clock::now() - t < std::chrono::seconds(6);
    ::_exit(!contains(e, "cannot listen on 192.0.2.9") ? 1 : quick ? 0 : 2);
  }
  ASSERT_GT(late, 0);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = error_of<ds::AbortedError>([&] { ds::ProcessGroup pg(options(0)); });
  const auto took = std::chrono::steady_clock::now() - t0;
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "rank 1: status " << status;
  ASSERT_EQ(::waitpid(late, &status, 0), late);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "rank 2, started late: exit " << WEXITSTATUS(status) << " (1: not told why; 2: slow)";
  EXPECT_TRUE(contains(e, "[kAborted] rank 0 (TCP transport, group 'world"));
  EXPECT_TRUE(contains(e,
                       "failed: the job's set-up failed on another process: rank 1 (TCP "
                       "transport, group 'world"))
      << e;
  EXPECT_TRUE(contains(e, "cannot listen on 192.0.2.9")) << e;
  EXPECT_LT(took, std::chrono::seconds(6)) << "rank 0 waited for the deadline: " << e;
}

TEST(ProcessGroup, BroadcastTensorsRejectsBadArguments) {
  NoTfConfig env;
  ds::ProcessGroup pg;
  std::vector<ds::Tensor> ts{iota({3}, ds::DType::kFloat32, 0), ds::Tensor()};
  std::string e = error_of<ds::InvalidArgumentError>([&] {
    ds::broadcast_tensors(pg, ts, 0, {"a", "b"});
  });
  EXPECT_TRUE(contains(e, "rank 0: broadcast_tensors: tensor #1 'b' is undefined")) << e;
  e = error_of<ds::InvalidArgumentError>([&] { ds::broadcast_tensors(pg, ts); });
  EXPECT_TRUE(contains(e, "tensor #1 is undefined")) << e;
  ts[1] = iota({2}, ds::DType::kFloat32, 0);
  e = error_of<ds::InvalidArgumentError>([&] { ds::broadcast_tensors(pg, ts, 0, {"a"}); });
  EXPECT_TRUE(contains(e, "names has 1 entries for 2 tensors")) << e;
  e = error_of<ds::InvalidArgumentError>([&] { ds::broadcast_tensors(pg, ts, 1); });
  EXPECT_TRUE(contains(e, "root 1 is not a rank of this group of 1")) << e;
  e = error_of<ds::InvalidArgumentError>([&] { ds::broadcast_tensors(pg, ts, -1); });
  EXPECT_TRUE(contains(e, "root -1 is not a rank")) << e;
  float gpu_memory[4] = {};
  ts[1] = ds::Tensor::wrap(gpu_memory, {4}, ds::DType::kFloat32, ds::Device::gpu(0));
  e = error_of<ds::InvalidArgumentError>([&] {
    ds::broadcast_tensors(pg, ts, 0, {"a", "on_gpu"});
  });
  EXPECT_TRUE(contains(
      e, "tensor #1 'on_gpu' is float32[4] on /device:GPU:0; broadcast_tensors moves host memory"))
      << e;
  std::vector<ds::Tensor> none;
  ds::broadcast_tensors(pg, none);  // an empty list is fine
}

// Values: every dtype, empty tensors, packs of several sizes (small packs,
// tensors larger than a pack sent on their own, one pack for all), every
// root, and tensors that wrap user memory.
TEST(ProcessGroup, BroadcastTensorsCopiesTheRootsValuesInEveryPacking) {
  const int n = 3;
  for (size_t bytes_per_pack : {size_t{0}, size_t{16}, size_t{100}, size_t{4} << 20}) {
    ds::CommunicationOptions o;
    o.bytes_per_pack = bytes_per_pack;
    o.timeout = std::chrono::seconds(30);
    ds::InProcessGroup group(n, o);
    for (int root = 0; root < n; ++root) {
      SCOPED_TRACE("bytes_per_pack " + std::to_string(bytes_per_pack) + " root " +
                   std::to_string(root));
      auto make = [&](int rank) {
        const double b = rank * 1000.0;
        std::vector<ds::Tensor> ts{
            iota({}, ds::DType::kFloat32, b),   iota({0}, ds::DType::kFloat64, b),
            iota({7}, ds::DType::kFloat16, b),  iota({3, 5}, ds::DType::kFloat64, b),
            iota({1}, ds::DType::kBFloat16, b), iota({40}, ds::DType::kInt32, b),
            iota({2, 0}, ds::DType::kInt32, b), iota({9}, ds::DType::kInt64, b)};
        return ts;
      };
      std::vector<std::vector<int32_t>> user(n, std::vector<int32_t>(11));
      ds::testing::run_ranks(group, [&](ds::Communicator& c) {
        std::vector<ds::Tensor> ts = make(c.rank());
        for (int i = 0; i < 11; ++i) user[c.rank()][i] = c.rank() * 100 + i;
        ts.push_back(ds::Tensor::wrap(user[c.rank()].data(), {11}, ds::DType::kInt32));
        ds::broadcast_tensors(c, ts, root);
        std::vector<ds::Tensor> want = make(root);
        for (size_t i = 0; i < want.size(); ++i) {
          EXPECT_TRUE(same_raw_bytes(ts[i], want[i])) << "rank " << c.rank() << " tensor " << i;
        }
        for (int i = 0; i < 11; ++i) EXPECT_EQ(user[c.rank()][i], root * 100 + i);
      });
    }
  }
}

namespace {

// Runs broadcast_tensors on 3 ranks where rank `odd` passes `odd_list`
// (others `list`); returns every rank's error (all must throw).
std::vector<std::string> mismatch(
    int odd,
    const std::function<void(int rank, std::vector<ds::Tensor>*, std::vector<std::string>*, int*)>&
        edit) {
  const int n = 3;
  ds::CommunicationOptions o;
  o.timeout = std::chrono::seconds(30);
  ds::InProcessGroup group(n, o);
  std::vector<std::string> errors(n);
  std::atomic<int> written{0};
  ds::testing::run_ranks(group, [&](ds::Communicator& c) {
    std::vector<ds::Tensor> ts{iota({4}, ds::DType::kFloat32, c.rank()),
                               iota({4}, ds::DType::kFloat32, c.rank()),
                               iota({2, 2}, ds::DType::kInt64, c.rank())};
    std::vector<std::string> names{"fc/kernel", "fc/bias", "step"};
    int root = 0;
    if (c.rank() == odd) edit(c.rank(), &ts, &names, &root);
    try {
      ds::broadcast_tensors(c, ts, root, names);
      errors[c.rank()] = "(no error)";
    } catch (const ds::InvalidArgumentError& e) {
      errors[c.rank()] = e.what();
    }
    // Nothing was written on an error.
    if (ts.size() > 1 && ts[1].defined() && ts[1].dtype() == ds::DType::kFloat32 &&
        ts[1].num_elements() > 0 && ts[1].data<float>()[0] != static_cast<float>(c.rank())) {
      ++written;
    }
    // The communicator is still in step and usable.
    std::vector<ds::Tensor> ok{iota({3}, ds::DType::kFloat32, c.rank())};
    ds::broadcast_tensors(c, ok, 0, {"after"});
    EXPECT_EQ(ok[0].data<float>()[2], 2.0f);
  });
  EXPECT_EQ(written.load(), 0);
  return errors;
}

}  // namespace

TEST(ProcessGroup, AMismatchedListIsAnErrorOnEveryRankNamingTheTensor) {
  struct Case {
    const char* what;
    std::function<void(int, std::vector<ds::Tensor>*, std::vector<std::string>*, int*)> edit;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"extra tensor",
       [](int, std::vector<ds::Tensor>* ts, std::vector<std::string>* names, int*) {
         ts->push_back(iota({6}, ds::DType::kFloat32, 0));
         names->push_back("extra/w");
       },
       "rank 2 has 4 tensors, root 0 has 3: rank 2's tensor #3 'extra/w' float32[6] is extra"},
      {"missing tensor",
       [](int, std::vector<ds::Tensor>* ts, std::vector<std::string>* names, int*) {
         ts->pop_back();
         names->pop_back();
       },
       "rank 2 has 2 tensors, root 0 has 3: rank 2 has no tensor #2 'step' int64[2, 2]"},
      {"shape",
       [](int, std::vector<ds::Tensor>* ts, std::vector<std::string>*, int*) {
         (*ts)[1] = iota({5}, ds::DType::kFloat32, 2);
       },
       "rank 2 has #1 'fc/bias' float32[5], root 0 has #1 'fc/bias' float32[4]"},
      {"dtype",
       [](int, std::vector<ds::Tensor>* ts, std::vector<std::string>*, int*) {
         (*ts)[2] = iota({2, 2}, ds::DType::kInt32, 2);
       },
       "rank 2 has #2 'step' int32[2, 2], root 0 has #2 'step' int64[2, 2]"},
      {"name",
       [](int, std::vector<ds::Tensor>*, std::vector<std::string>* names, int*) {
         (*names)[0] = "fc/w";
       },
       "rank 2 has #0 'fc/w' float32[4], root 0 has #0 'fc/kernel' float32[4]"},
      {"root",
       [](int, std::vector<ds::Tensor>*, std::vector<std::string>*, int* root) { *root = 1; },
       "the ranks disagree on the root: rank 0 passed root 0, rank 2 root 1"},
      {"undefined tensor",
       [](int, std::vector<ds::Tensor>* ts, std::vector<std::string>*, int*) {
         (*ts)[1] = ds::Tensor();
       },
       "rank 2 was called with invalid arguments: tensor #1 'fc/bias' is undefined"},
      {"root out of range",
       [](int, std::vector<ds::Tensor>*, std::vector<std::string>*, int* root) { *root = 3; },
       "rank 2 was called with invalid arguments: root 3 is not a rank of this group of 3"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::vector<std::string> errors = mismatch(2, c.edit);
    for (int r = 0; r < 3; ++r) {
      EXPECT_TRUE(contains(errors[r], "rank " + std::to_string(r) + ": broadcast_tensors: "))
          << errors[r];
      EXPECT_TRUE(contains(errors[r], c.expected)) << errors[r];
    }
  }
}

// A rank that never calls: the others fail within the deadline, naming it.
TEST(ProcessGroup, BroadcastTensorsWithARankThatNeverComesIsDeadlineExceeded) {
  ds::CommunicationOptions o;
  o.timeout = std::chrono::milliseconds(300);
  ds::InProcessGroup group(3, o);
  std::vector<std::string> errors(3);
  const auto t0 = std::chrono::steady_clock::now();
  ds::testing::run_threads(
      3,
      [&](int r) {
        if (r == 2) return;
        std::vector<ds::Tensor> ts{iota({4}, ds::DType::kFloat32, r)};
        try {
          ds::broadcast_tensors(group.at(r), ts, 0, {"w"});
        } catch (const ds::Error& e) {
          errors[r] = std::string(ds::error_code_name(e.code())) + " " + e.what();
        }
      },
      [](int) {});
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 5.0);
  for (int r = 0; r < 2; ++r) {
    // The first to time out says so; the other may see the abort it raised.
    EXPECT_TRUE(contains(errors[r], "rank 2 did not arrive")) << errors[r];
    EXPECT_TRUE(contains(errors[r], "broadcast_tensors/signatures")) << errors[r];
  }
}
