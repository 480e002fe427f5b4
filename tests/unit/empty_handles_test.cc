// Objects that a public constructor makes without data (default-constructed,
// or from a null pointer) are safe: they are empty, or every use throws a
// diststrat::Error. None crashes.
#include <gtest/gtest.h>

#include <memory>

#include "runtime/variable_impl.h"
#include "diststrat/diststrat.h"
#include "training_util.h"

namespace ds = diststrat;

TEST(EmptyHandles, DistributedDatasetFromNullOrDefaultIsEmpty) {
  for (int variant = 0; variant < 2; ++variant) {
    ds::DistributedDataset d =
        variant == 0 ? ds::DistributedDataset(nullptr) : ds::DistributedDataset();
    EXPECT_EQ(d.num_batches(), 0);
    EXPECT_EQ(d.global_batch_size(), 0);
    EXPECT_FALSE(d.begin() != d.end());
    int batches = 0;
    for (const ds::DistributedBatch& b : d) batches += b.global_size() >= 0;
    EXPECT_EQ(batches, 0);
    d.set_epoch(3);
    EXPECT_EQ(d.epoch(), 3);
    EXPECT_THROW(d.batch(0), ds::InvalidArgumentError);
    ds::DistributedDataset copy = d;  // copies stay empty
    EXPECT_EQ(copy.num_batches(), 0);
  }
}

TEST(EmptyHandles, DefaultDatasetAndBatchThrowInsteadOfCrashing) {
  ds::Dataset empty;
  EXPECT_EQ(empty.size(), 0);
  EXPECT_THROW(empty.slice(0, 0), ds::InvalidArgumentError);
  ds::MirroredStrategy s(ds::testing::cpu_devices(2));
  EXPECT_THROW(s.distribute(empty, 4), ds::InvalidArgumentError);
  ds::DistributedBatch batch;
  EXPECT_EQ(batch.global_size(), 0);
  EXPECT_THROW(s.run([&](ds::ReplicaContext& ctx) { (void)batch.features(ctx); }), ds::Error);
  EXPECT_THROW(s.run([&](ds::ReplicaContext& ctx) { (void)batch.labels(ctx); }), ds::Error);
}

TEST(EmptyHandles, UndefinedVariableAndHandMadeImplThrowFailedPrecondition) {
  ds::Variable v;
  EXPECT_FALSE(v.defined());
  EXPECT_THROW(v.name(), ds::FailedPreconditionError);
  EXPECT_THROW(v.shape(), ds::FailedPreconditionError);
  EXPECT_THROW(v.value(), ds::FailedPreconditionError);
  EXPECT_THROW(v.assign(ds::Tensor(ds::Shape{1}, ds::DType::kFloat32)),
               ds::FailedPreconditionError);
  ds::Variable null_impl{std::shared_ptr<ds::Variable::Impl>()};
  EXPECT_THROW(null_impl.value(), ds::FailedPreconditionError);
  // An Impl made by hand belongs to no strategy.
  auto impl = std::make_shared<ds::Variable::Impl>();
  impl->name = "orphan";
  ds::Variable orphan(impl);
  try {
    orphan.value();
    ADD_FAILURE() << "value() of an orphan variable returned";
  } catch (const ds::FailedPreconditionError& e) {
    EXPECT_NE(std::string(e.what()).find("orphan"), std::string::npos) << e.what();
  }
  EXPECT_THROW(orphan.assign(ds::Tensor(ds::Shape{}, ds::DType::kFloat32)),
               ds::FailedPreconditionError);
  ds::MirroredStrategy s(ds::testing::cpu_devices(1));
  EXPECT_THROW(s.run([&](ds::ReplicaContext& ctx) { (void)orphan.read(ctx); }),
               ds::FailedPreconditionError);
}

TEST(EmptyHandles, UndefinedTensorThrowsOnEveryDataAccess) {
  ds::Tensor t;
  EXPECT_FALSE(t.defined());
  EXPECT_EQ(t.debug_string(), "<undefined tensor>");
  EXPECT_THROW(t.data(), ds::FailedPreconditionError);
  EXPECT_THROW(t.clone(), ds::FailedPreconditionError);
  EXPECT_THROW(t.zero(), ds::FailedPreconditionError);
  EXPECT_THROW(t.slice_rows(0, 0), ds::InvalidArgumentError);
  ds::Tensor other;
  EXPECT_THROW(t.copy_from(other), ds::FailedPreconditionError);
  EXPECT_THROW(ds::Tensor::wrap(nullptr, ds::Shape{4}, ds::DType::kFloat32),
               ds::InvalidArgumentError);
  EXPECT_THROW(ds::Tensor::adopt(nullptr, ds::Shape{4}, ds::DType::kFloat32, ds::Device::cpu()),
               ds::InvalidArgumentError);
}

TEST(EmptyHandles, DefaultWorkAndPerReplicaAreUsable) {
  ds::Work w;
  EXPECT_TRUE(w.done());
  EXPECT_NO_THROW(w.wait());
  ds::Work null_state{std::shared_ptr<ds::Work::State>()};
  EXPECT_TRUE(null_state.done());
  EXPECT_NO_THROW(null_state.wait());
  ds::PerReplica<float> none;
  EXPECT_EQ(none.size(), 0u);
  EXPECT_TRUE(none.begin() == none.end());
  ds::MirroredStrategy s(ds::testing::cpu_devices(2));
  EXPECT_THROW(s.reduce(ds::ReduceOp::kSum, none), ds::InvalidArgumentError);
  EXPECT_THROW(s.reduce(ds::ReduceOp::kSum, ds::PerReplica<ds::Tensor>()),
               ds::InvalidArgumentError);
  EXPECT_THROW(
      s.reduce(ds::ReduceOp::kSum, ds::PerReplica<ds::Tensor>({ds::Tensor(), ds::Tensor()})),
      ds::Error);
  EXPECT_THROW(s.gather(ds::PerReplica<ds::Tensor>({ds::Tensor(), ds::Tensor()})), ds::Error);
}
