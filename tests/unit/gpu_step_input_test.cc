// Input on the device (issue 44 item 4) on fake GPUs: prefetch_to_device
// copies the next batches on a copy stream from pinned memory that outlives
// the copies, on_device gathers batches from a dataset placed on the GPU
// once, both giving the plain path's bits; the caching allocator keeps a
// block that another stream used until that stream is past it.
// `ctest -R GpuStep` selects these tests with the others of issue 44.
#if __has_include("fake_gpu_backend.h")

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <map>
#include <thread>
#include <memory>
#include <string>
#include <vector>

#include "core/caching_allocator.h"
#include "core/device_manager_impl.h"
#include "runtime/data_source.h"
#include "diststrat/device_manager.h"
#include "diststrat/diststrat.h"
#include "fake_gpu_backend.h"

namespace ds = diststrat;
using diststrat_test::FakeGpuBackend;
using diststrat_test::LeaseDir;

namespace {

ds::DeadlineClock::time_point input_deadline(int s) {
  return ds::DeadlineClock::now() + std::chrono::seconds(s);
}

// 173 rows: five global batches of 32 and a last one of 13 (7 + 6 rows on
// two replicas).
constexpr int64_t kInputRows = 173;
constexpr int64_t kInputBatch = 32;

// A MirroredStrategy over two fake GPUs training a small MLP on a dataset
// distributed with `options`.
struct InputSetup {
  explicit InputSetup(ds::DistributeOptions options, size_t capacity = 64u << 20,
                      int64_t rows = kInputRows, bool from_function = false) {
    auto backend = std::make_unique<FakeGpuBackend>(2, capacity);
    fake = backend.get();
    ds::MirroredOptions o;
    o.devices = {ds::Device::gpu(0), ds::Device::gpu(1)};
    o.communication.timeout = std::chrono::seconds(60);
    o.device_manager =
        ds::DeviceManagerAccess::shared_with_backend(dir.gpu_options(), std::move(backend));
    strategy = std::make_unique<ds::MirroredStrategy>(o);
    vars = mlp.create_variables(*strategy, 3);
    opt = std::make_unique<ds::SGD>(*strategy, ds::SGDOptions{0.05f, 0.9f});
    x = ds::Tensor(ds::Shape{rows, 24}, ds::DType::kFloat32);
    y = ds::Tensor(ds::Shape{rows}, ds::DType::kInt32);
    ds::init::RandomNormal{0.0, 1.0, 11}(x);
    for (int64_t i = 0; i < rows; ++i) y.data<int32_t>()[i] = static_cast<int32_t>((i * 7) % 10);
    if (from_function) {
      dist = std::make_unique<ds::DistributedDataset>(strategy->distribute_datasets_from_function(
          [&](const ds::InputContext&) { return ds::Dataset(x, y); }, kInputBatch, options));
    } else {
      dist = std::make_unique<ds::DistributedDataset>(
          strategy->distribute(ds::Dataset(x, y), kInputBatch, options));
    }
  }
  ~InputSetup() {
    opt.reset();
    dist.reset();
    strategy.reset();  // releases the leases before the directory goes
  }
  void step(const ds::DistributedBatch& b) {
    const float scale = 1.0f / static_cast<float>(b.global_size());
    strategy->run([&](ds::ReplicaContext& ctx) {
      std::vector<ds::Tensor> p;
      for (const ds::Variable& v : vars) p.push_back(v.read(ctx));
      ds::nn::Mlp::Step st = mlp.forward_backward(p, b.features(ctx), b.labels(ctx), scale);
      std::vector<std::pair<ds::Tensor, ds::Variable>> gv;
      for (size_t k = 0; k < vars.size(); ++k) gv.emplace_back(st.grads[k], vars[k]);
      opt->apply_gradients(ctx, gv);
    });
  }
  // `epochs` passes over the data, every batch one step.
  void train(int epochs) {
    for (int e = 0; e < epochs; ++e) {
      dist->set_epoch(e);
      for (const ds::DistributedBatch& b : *dist) step(b);
    }
  }
  std::vector<float> weights() {
    std::vector<float> out;
    for (const ds::Variable& v : vars) {
      const ds::Tensor t = v.value();
      out.insert(out.end(), t.data<float>(), t.data<float>() + t.num_elements());
    }
    return out;
  }
  void* copy_stream(int r) {
    return ds::DistributedDatasetAccess::source(*dist)->feed->copy_stream(r);
  }
  LeaseDir dir;
  FakeGpuBackend* fake = nullptr;
  std::unique_ptr<ds::MirroredStrategy> strategy;
  ds::nn::Mlp mlp{{24, 16, 16, 10}};
  std::vector<ds::Variable> vars;
  std::unique_ptr<ds::SGD> opt;
  std::unique_ptr<ds::DistributedDataset> dist;
  ds::Tensor x, y;
};

ds::DistributeOptions input_options(bool shuffle, int prefetch, bool on_device) {
  ds::DistributeOptions o;
  o.shuffle = shuffle;
  o.seed = 7;
  o.prefetch_to_device = prefetch;
  o.on_device = on_device;
  return o;
}

}  // namespace

// record_stream: a block allocated for stream 1 and also used by stream 2
// is, once freed, handed out again (to stream 1 itself too) only after
// stream 2's work queued before the free. Without the record, stream order
// alone lets stream 1 take it back at once, under stream 2's pending write.
TEST(GpuStepAllocator, ABlockUsedOnAnotherStreamIsNotHandedOutBeforeThatStreamIsPastIt) {
  for (bool recorded : {true, false}) {
    auto fake = std::make_shared<FakeGpuBackend>(1);
    ds::CachingAllocator a(fake, 0, 0, true, "gpu0");
    void* s1 = fake->create_stream(0);  // the owner (a copy stream)
    void* s2 = fake->create_stream(0);  // the reader (a replica's stream)
    const size_t bytes = 4096;
    void* x = a.allocate(bytes, s1);
    if (recorded) a.record_stream(static_cast<char*>(x) + 100, s2);  // any address in it
    fake->hold(0, s2);
    fake->memset_async(0, x, 2, bytes, s2);  // the reader's work, still queued at the free
    a.deallocate(x);
    void* y = a.allocate(bytes, s1);
    if (!recorded) {
      EXPECT_EQ(y, x) << "stream order alone: the owner takes the block back at once";
      fake->release(0, s2);
      a.deallocate(y);
      fake->synchronize_device(0, input_deadline(5), "end");
      fake->destroy_stream(0, s1);
      fake->destroy_stream(0, s2);
      continue;
    }
    EXPECT_NE(y, x) << "a block stream 2 still uses was handed out";
    void* z = a.allocate(bytes, s2);
    EXPECT_NE(z, x) << "... to stream 2 itself, before its own queued work";
    fake->memset_async(0, y, 1, bytes, s1);
    fake->synchronize(0, s1, input_deadline(5), "s1");
    fake->release(0, s2);
    fake->synchronize(0, s2, input_deadline(5), "s2");
    EXPECT_EQ(fake->read<char>(0, y, bytes)[0], 1);
    // Past stream 2's work the block is reused.
    a.deallocate(z);
    void* again = a.allocate(bytes, s1);
    EXPECT_EQ(again, x);
    a.deallocate(again);
    a.deallocate(y);
    EXPECT_THROW(a.record_stream(reinterpret_cast<char*>(x) + (64u << 20), s2),
                 ds::InvalidArgumentError);
    fake->synchronize_device(0, input_deadline(5), "end");
    fake->destroy_stream(0, s1);
    fake->destroy_stream(0, s2);
  }
}

// Prefetched and on-device input train bit for bit as the plain path, over
// two epochs with a short last batch, shuffled or not, with the launches
// slowed so that copies, gathers and steps overlap.
TEST(GpuStepPrefetch, TrainingIsBitIdenticalToThePlainPathOverEpochsWithAPartialLastBatch) {
  for (bool shuffle : {true, false}) {
    InputSetup plain(input_options(shuffle, 0, false));
    plain.train(2);
    const std::vector<float> expected = plain.weights();
    for (const auto& [prefetch, on_device] :
         std::vector<std::pair<int, bool>>{{1, false}, {3, false}, {0, true}}) {
      InputSetup s(input_options(shuffle, prefetch, on_device));
      s.fake->set_launch_delay(std::chrono::microseconds(200));
      s.train(2);
      EXPECT_EQ(s.weights(), expected)
          << "shuffle " << shuffle << ", prefetch " << prefetch << ", on_device " << on_device;
      if (prefetch) {
        EXPECT_GT(s.fake->stream_waits.load(), 0) << "the steps did not wait for the copies";
      }
      EXPECT_EQ(s.fake->pinned_frees_with_pending_reads.load(), 0);
    }
  }
}

// The same for the input a user's function makes (distribute_datasets_from_function).
TEST(GpuStepPrefetch, InputFromAFunctionTrainsBitIdenticalToThePlainPath) {
  InputSetup plain(input_options(true, 0, false), 64u << 20, kInputRows, true);
  plain.train(2);
  for (const auto& [prefetch, on_device] :
       std::vector<std::pair<int, bool>>{{2, false}, {0, true}}) {
    InputSetup s(input_options(true, prefetch, on_device), 64u << 20, kInputRows, true);
    s.fake->set_launch_delay(std::chrono::microseconds(200));
    s.train(2);
    EXPECT_EQ(s.weights(), plain.weights())
        << "prefetch " << prefetch << ", on_device " << on_device;
  }
}

// The copies of prefetched batches are held back (their stream is held),
// so each reads its pinned buffer long after batch() returned: every
// buffer must stay unchanged until its copy ran. A pool that hands a buffer
// out again before its copy ran gives later batches' rows to earlier
// batches (different weights). Meanwhile a step on a batch whose copy has
// not run is enqueued without the host waiting, and its work waits on the
// device.
TEST(GpuStepPrefetch, APrefetchedBatchsHostBufferOutlivesItsCopy) {
  InputSetup plain(input_options(true, 0, false));
  plain.train(1);
  InputSetup s(input_options(true, 2, false));
  s.fake->set_launch_delay(std::chrono::microseconds(200));
  for (int r = 0; r < 2; ++r) s.fake->hold(r, s.copy_stream(r));
  const int pinned = s.fake->host_allocs.load();
  std::vector<ds::DistributedBatch> held;
  for (int64_t i = 0; i < 4; ++i) held.push_back(s.dist->batch(i));  // stages batches 0 .. 5
  // Six batches staged, two replicas each, no copy run: twelve buffers.
  EXPECT_GE(s.fake->host_allocs.load() - pinned, 12);
  // A kernel on batch 0's rows is enqueued without the host waiting; its
  // stream waits for the held copy on the device. (A whole step would wait
  // on the host: the fake's collectives drain the stream first.)
  const int ran = s.fake->kernels_run.load();
  s.strategy->run([&](ds::ReplicaContext& ctx) {
    const ds::Tensor& f = held[0].features(ctx);
    ds::Tensor out = ds::Tensor::uninitialized(f.shape(), f.dtype(), ctx.device());
    ds::nn::relu_forward(f, out);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(s.fake->kernels_run.load(), ran) << "a kernel ran before its input was copied";
  for (int r = 0; r < 2; ++r) s.fake->release(r, s.copy_stream(r));
  for (const ds::DistributedBatch& b : held) s.step(b);
  held.clear();
  for (int64_t i = 4; i < s.dist->num_batches(); ++i) s.step(s.dist->batch(i));
  EXPECT_EQ(s.weights(), plain.weights());
  EXPECT_EQ(s.fake->pinned_frees_with_pending_reads.load(), 0);
}

// A prefetched slice's memory belongs to the copy stream; a replica's
// stream reads it. Once the batch is dropped (right after run() returned,
// its kernel still queued behind slowed launches) the copy stream must not
// take that memory back for a later batch's copy before the kernel ran
// (record_stream): each kernel sees its own batch's rows.
TEST(GpuStepPrefetch, ASlicesMemoryIsNotReusedBeforeTheStepsThatReadItAreDone) {
  const auto relu_of_every_batch = [](InputSetup& s) {
    const size_t batches = static_cast<size_t>(s.dist->num_batches());
    std::vector<ds::Tensor> outs(2 * batches);
    for (size_t i = 0; i < batches; ++i) {
      const ds::DistributedBatch b = s.dist->batch(static_cast<int64_t>(i));
      s.strategy->run([&](ds::ReplicaContext& ctx) {
        const ds::Tensor& f = b.features(ctx);
        ds::Tensor out = ds::Tensor::uninitialized(f.shape(), f.dtype(), ctx.device());
        ds::nn::relu_forward(f, out);
        outs[2 * i + static_cast<size_t>(ctx.local_replica_id())] = out;
      });
    }
    std::vector<std::vector<float>> host(outs.size());
    s.strategy->run([&](ds::ReplicaContext& ctx) {
      for (size_t i = static_cast<size_t>(ctx.local_replica_id()); i < outs.size(); i += 2) {
        ds::Tensor h(outs[i].shape(), outs[i].dtype());
        h.copy_from(outs[i]);
        host[i].assign(h.data<float>(), h.data<float>() + h.num_elements());
      }
    });
    return host;
  };
  InputSetup plain(input_options(true, 0, false));
  InputSetup s(input_options(true, 1, false));
  s.fake->set_launch_delay(std::chrono::milliseconds(2));
  EXPECT_EQ(relu_of_every_batch(s), relu_of_every_batch(plain));
}

// on_device: the dataset is copied once; a step then copies no rows from
// the host (the epoch's order goes to each GPU once per epoch) and gathers
// its rows on the device; without shuffling a batch is a view (no launch).
TEST(GpuStepOnDevice, StepsCopyNoRowsFromTheHost) {
  for (bool shuffle : {true, false}) {
    InputSetup s(input_options(shuffle, 0, true));
    const ds::DistributedDataset& d = *s.dist;
    s.step(d.batch(0));  // warm-up; shuffled: the epoch's order goes to the GPUs
    const std::map<std::string, int> before = s.fake->launched();
    for (int64_t i = 1; i < 5; ++i) s.step(d.batch(i));
    std::map<std::string, int> after = s.fake->launched();
    auto delta = [&](const char* what) {
      const auto it = before.find(what);
      return after[what] - (it == before.end() ? 0 : it->second);
    };
    EXPECT_EQ(delta("memcpy h2d"), 0) << "shuffle " << shuffle;
    EXPECT_EQ(delta("gather_rows"), shuffle ? 4 * 2 * 2 : 0);  // features + labels per replica
  }
}

TEST(GpuStepOnDevice, ADatasetThatDoesNotFitIsAClearError) {
  try {
    InputSetup s(input_options(true, 0, true), /*capacity=*/4u << 20, /*rows=*/60000);
    FAIL() << "a 5.8 MB dataset was placed on a 4 MiB GPU";
  } catch (const ds::ResourceExhaustedError& e) {
    EXPECT_NE(std::string(e.what()).find("on_device"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("features"), std::string::npos) << e.what();
  }
}

// As tf.distribute: prefetch_to_device (and on_device) are no-ops on CPU
// replicas, whose rows are in host memory already; a negative count is an
// error everywhere.
TEST(GpuStepPrefetch, CpuReplicasAcceptAndIgnoreTheOptions) {
  ds::MirroredOptions o;
  o.devices = {ds::Device::cpu(0), ds::Device::cpu(1)};
  ds::MirroredStrategy strategy(o);
  ds::Tensor x(ds::Shape{10, 3}, ds::DType::kFloat32), y(ds::Shape{10}, ds::DType::kInt32);
  for (int i = 0; i < 30; ++i) x.data<float>()[i] = static_cast<float>(i);
  const ds::DistributedDataset plain =
      strategy.distribute(ds::Dataset(x, y), 4, input_options(true, 0, false));
  const ds::DistributedDataset fast =
      strategy.distribute(ds::Dataset(x, y), 4, input_options(true, 2, true));
  for (int64_t i = 0; i < plain.num_batches(); ++i) {
    const ds::DistributedBatch a = plain.batch(i), b = fast.batch(i);
    strategy.run([&](ds::ReplicaContext& ctx) {
      const ds::Tensor& fa = a.features(ctx);
      const ds::Tensor& fb = b.features(ctx);
      ASSERT_TRUE(fb.device().is_cpu());
      ASSERT_EQ(fa.nbytes(), fb.nbytes());
      EXPECT_EQ(std::memcmp(fa.data(), fb.data(), fa.nbytes()), 0);
    });
  }
  EXPECT_THROW(strategy.distribute(ds::Dataset(x, y), 4, input_options(true, -1, false)),
               ds::InvalidArgumentError);
}

#endif  // __has_include("fake_gpu_backend.h")
