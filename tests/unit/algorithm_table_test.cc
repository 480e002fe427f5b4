// Every strategy and communicator that takes CommunicationOptions, for every
// Algorithm value: either the all-reduce runs that algorithm (a custom one is
// called) and the numbers are right, or construction fails with
// InvalidArgumentError naming the algorithm and the strategy/communicator.
// Never silently something else.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <set>
#include <thread>

#include "core/device_manager_impl.h"
#include "allreduce/transport.h"
#include "allreduce/transport_communicator.h"
#include "diststrat/algorithm_registry.h"
#include "diststrat/diststrat.h"
#include "diststrat/multi_worker_mirrored.h"
#include "fake_gpu_backend.h"
#include "harness.h"
#include "parameter_server/strategy_impl.h"
#include "training_util.h"

namespace ds = diststrat;
using A = ds::Algorithm;

namespace {

const auto cpus = ds::testing::cpu_devices;

const std::vector<A> kAll = {A::kAuto,      A::kDirect,      A::kRing,         A::kHalvingDoubling,
                             A::kTree,      A::kReduceToOne, A::kHierarchical, A::kNccl,
                             A::kMpiNative, A::kCustom,      A::kSharedMemory};

// A custom all-reduce that counts its calls: everyone sends to rank 0, rank 0
// reduces and sends the result back.
std::shared_ptr<ds::AlgorithmRegistry> counting_registry(std::atomic<int>* calls) {
  auto registry = std::make_shared<ds::AlgorithmRegistry>();
  registry->add("gather_to_zero", [calls](ds::PeerChannel& ch, void* data, size_t count,
                                          ds::DType dtype, ds::ReduceOp) {
    calls->fetch_add(1);
    const size_t bytes = count * ds::dtype_size(dtype);
    if (ch.rank() == 0) {
      std::vector<char> got(bytes);
      for (int r = 1; r < ch.size(); ++r) {
        ch.recv(r, got.data(), bytes);
        ch.reduce_into(data, got.data(), count);
      }
      for (int r = 1; r < ch.size(); ++r) ch.send(r, data, bytes);
    } else {
      ch.send(0, data, bytes);
      ch.recv(0, data, bytes);
    }
  });
  return registry;
}

// One subject: runs a sum all-reduce of {replica_id + 1, 2 * (replica_id + 1)}
// (in float32) on every rank/replica and returns the number of ranks whose
// result was exact, or throws what construction or the call threw.
struct Subject {
  const char* name;      // what the error must name
  std::set<A> accepted;  // what it must honour
  std::function<int(const ds::CommunicationOptions&)> run;
};

bool exact(const float* v, int n) {
  const float s = float(n * (n + 1) / 2);
  return v[0] == s && v[1] == 2 * s;
}

int run_strategy(ds::Strategy& s) {
  std::atomic<int> ok{0};
  const int n = s.num_replicas_in_sync();
  s.run([&](ds::ReplicaContext& ctx) {
    ds::Tensor t(ds::Shape{2}, ds::DType::kFloat32);
    t.data<float>()[0] = float(ctx.replica_id() + 1);
    t.data<float>()[1] = float(2 * (ctx.replica_id() + 1));
    std::vector<ds::Tensor> v{t};
    ctx.all_reduce(ds::ReduceOp::kSum, v, {"table/x"});
    if (exact(v[0].data<float>(), n)) ok.fetch_add(1);
  });
  return ok.load();
}

const std::set<A> kInProcess = {A::kAuto, A::kDirect,      A::kRing,         A::kHalvingDoubling,
                                A::kTree, A::kReduceToOne, A::kHierarchical, A::kCustom};

std::vector<Subject> subjects() {
  std::vector<Subject> out;
  out.push_back({"InProcessGroup", kInProcess, [](const ds::CommunicationOptions& o) {
                   ds::InProcessGroup group(3, o);
                   std::atomic<int> ok{0};
                   ds::testing::run_ranks(group, [&](ds::Communicator& c) {
                     float v[2] = {float(c.rank() + 1), float(2 * (c.rank() + 1))};
                     c.all_reduce(v, v, 2, ds::DType::kFloat32, ds::ReduceOp::kSum, "table/x");
                     if (exact(v, 3)) ok.fetch_add(1);
                   });
                   return ok.load();
                 }});
  out.push_back({"TransportCommunicator",
                 {A::kAuto, A::kRing, A::kHalvingDoubling, A::kTree, A::kReduceToOne,
                  A::kHierarchical, A::kCustom},
                 [](const ds::CommunicationOptions& o) {
                   ds::InProcessTransportGroup group(3);
                   std::atomic<int> ok{0};
                   ds::testing::run_threads(
                       3,
                       [&](int r) {
                         ds::TransportCommunicator c(group.at(r), o);
                         float v[2] = {float(r + 1), float(2 * (r + 1))};
                         c.all_reduce(v, v, 2, ds::DType::kFloat32, ds::ReduceOp::kSum, "table/x");
                         if (exact(v, 3)) ok.fetch_add(1);
                       },
                       [&](int r) { group.at(r).abort("failed"); });
                   return ok.load();
                 }});
  out.push_back({"MirroredStrategy", kInProcess, [](const ds::CommunicationOptions& o) {
                   ds::MirroredOptions mo;
                   mo.devices = cpus(3);
                   mo.communication = o;
                   ds::MirroredStrategy s(mo);
                   return run_strategy(s);
                 }});
  out.push_back({"CentralStorageStrategy", kInProcess, [](const ds::CommunicationOptions& o) {
                   ds::CentralStorageOptions co;
                   co.devices = cpus(3);
                   co.communication = o;
                   ds::CentralStorageStrategy s(co);
                   return run_strategy(s);
                 }});
  // Two workers of two replicas, the workers' communicator an InProcessGroup
  // built with the same options (as a user would).
  out.push_back({"InProcessGroup", kInProcess, [](const ds::CommunicationOptions& o) {
                   ds::InProcessGroup group(2, o);
                   std::atomic<int> ok{0};
                   ds::testing::run_ranks(group, [&](ds::Communicator& c) {
                     ds::MultiWorkerOptions mo;
                     mo.devices = cpus(2);
                     mo.communication = o;
                     mo.communicator = &c;
                     ds::MultiWorkerMirroredStrategy s(mo);
                     ok.fetch_add(run_strategy(s));
                   });
                   return ok.load() == 4 ? 3 : ok.load();
                 }});
  // A parameter-server worker's local replicas all-reduce among themselves.
  out.push_back({"ParameterServerStrategy", kInProcess, [](const ds::CommunicationOptions& o) {
                   ds::ParameterServerOptions po;
                   po.num_ps = 1;
                   po.devices = cpus(3);
                   po.communication = o;
                   ds::InProcessTransportGroup group(2);
                   auto ps = ds::ps::make_strategy(group.at(1), po);
                   int ok = 0;
                   {
                     auto worker = ds::ps::make_strategy(group.at(0), po);
                     ok = run_strategy(*worker);
                   }
                   ps->join();
                   return ok;
                 }});
  // GPU replicas (fake GPUs in host memory): the device communicator runs
  // NCCL across GPUs, the device kernel (direct) on logical GPUs of one GPU.
  for (bool shared : {false, true}) {
    out.push_back(
        {"MirroredStrategy on GPU replicas",
         {A::kAuto, shared ? A::kDirect : A::kNccl},
         [shared](const ds::CommunicationOptions& o) {
           diststrat_test::LeaseDir dir;
           ds::GpuOptions go;
           go.lease = dir.options();
           auto dm = ds::DeviceManagerAccess::shared_with_backend(
               go, std::make_unique<diststrat_test::FakeGpuBackend>(shared ? 1 : 3));
           if (shared)
             dm->set_logical_device_configuration(0, {{8u << 20}, {8u << 20}, {8u << 20}});
           ds::MirroredOptions mo;
           mo.devices = {ds::Device::gpu(0), ds::Device::gpu(1), ds::Device::gpu(2)};
           mo.device_manager = dm;
           mo.communication = o;
           ds::MirroredStrategy s(mo);
           std::atomic<int> ok{0};
           s.run([&](ds::ReplicaContext& ctx) {
             float host[2] = {float(ctx.replica_id() + 1), float(2 * (ctx.replica_id() + 1))};
             ds::Tensor t(ds::Shape{2}, ds::DType::kFloat32, ctx.device());
             t.copy_from(ds::Tensor::wrap(host, ds::Shape{2}, ds::DType::kFloat32));
             std::vector<ds::Tensor> v{t};
             ctx.all_reduce(ds::ReduceOp::kSum, v, {"table/x"});
             ds::Tensor back(ds::Shape{2}, ds::DType::kFloat32);
             back.copy_from(v[0]);
             if (exact(back.data<float>(), 3)) ok.fetch_add(1);
           });
           return ok.load();
         }});
  }
  return out;
}

}  // namespace

TEST(AlgorithmTable, EveryAlgorithmIsHonouredOrRejectedByName) {
  int subject_index = 0;
  for (const Subject& subject : subjects()) {
    const std::string label =
        std::string(subject.name) + " (#" + std::to_string(subject_index++) + ")";
    for (A a : kAll) {
      std::atomic<int> calls{0};
      ds::CommunicationOptions o;
      o.timeout = std::chrono::seconds(20);
      o.algorithm = a;
      o.custom_algorithm = "gather_to_zero";
      o.algorithm_registry = counting_registry(&calls);
      o.hierarchical_group_size = 1;
      const std::string what = label + " with algorithm '" + ds::algorithm_name(a) + "'";
      if (subject.accepted.count(a)) {
        int ok = -1;
        try {
          ok = subject.run(o);
        } catch (const std::exception& e) {
          ADD_FAILURE() << what << " should run but threw: " << e.what();
          continue;
        }
        EXPECT_EQ(ok, 3) << what << ": wrong sums";
        if (a == A::kCustom)
          EXPECT_GT(calls.load(), 0) << what << ": the custom algorithm was never called";
      } else {
        try {
          subject.run(o);
          ADD_FAILURE() << what << " was accepted (custom calls: " << calls.load()
                        << ") but cannot run it";
        } catch (const ds::InvalidArgumentError& e) {
          const std::string msg = e.what();
          EXPECT_NE(msg.find(std::string("'") + ds::algorithm_name(a) + "'"), std::string::npos)
              << what << ": " << msg;
          EXPECT_NE(msg.find(subject.name), std::string::npos) << what << ": " << msg;
        } catch (const std::exception& e) {
          ADD_FAILURE() << what << ": expected InvalidArgumentError, got " << e.what();
        }
      }
    }
  }
}

// A multi-worker strategy over a communicator the user built runs that
// communicator's algorithm: asking the strategy for another is refused.
TEST(AlgorithmTable, MultiWorkerRefusesAnAlgorithmItsCommunicatorDoesNotRun) {
  ds::InProcessGroup group(1);  // kAuto
  ds::MultiWorkerOptions mo;
  mo.communicator = &group.at(0);
  mo.communication.algorithm = A::kRing;
  try {
    ds::MultiWorkerMirroredStrategy s(mo);
    ADD_FAILURE() << "accepted";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("'ring'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("MultiWorkerMirroredStrategy"), std::string::npos)
        << e.what();
  }
  mo.communication.algorithm = A::kAuto;  // defers to the communicator
  EXPECT_NO_THROW(ds::MultiWorkerMirroredStrategy{mo});
}

// A custom algorithm that names no registered function is refused by every
// in-process subject too, naming it.
TEST(AlgorithmTable, UnknownCustomAlgorithmIsRejectedInProcess) {
  ds::CommunicationOptions o;
  o.algorithm = A::kCustom;
  o.custom_algorithm = "nope";
  try {
    ds::InProcessGroup group(2, o);
    ADD_FAILURE() << "accepted";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("'nope'"), std::string::npos) << e.what();
  }
  ds::MirroredOptions mo;
  mo.devices = cpus(2);
  mo.communication = o;
  try {
    ds::MirroredStrategy s(mo);
    ADD_FAILURE() << "accepted";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("'nope'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("MirroredStrategy"), std::string::npos) << e.what();
  }
}
