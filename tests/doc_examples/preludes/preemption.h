// Prelude "preemption": a two-CPU MirroredStrategy `strategy`, a
// CheckpointManager `manager` (directory ckpt, of a Checkpoint of `opt`),
// `kSteps` (3), train_one_step(step) (a stand-in that does nothing) and
// `md`, metadata to save. Nothing sends SIGTERM: the loop runs to its end.
#include <cstdint>
#include <string>

#include <diststrat/diststrat.h>
namespace ds = diststrat;
// @body
ds::MirroredStrategy strategy({ds::Device::cpu(0), ds::Device::cpu(1)});
ds::Variable w = strategy.create_variable("w", {4}, ds::DType::kFloat32, ds::init::Zeros{});
ds::SGD opt(strategy, {0.05f});
ds::Checkpoint checkpoint(strategy, {&opt});
ds::CheckpointManager manager(checkpoint, "ckpt");
[[maybe_unused]] const int64_t kSteps = 3;
[[maybe_unused]] auto train_one_step = [](int64_t) {};
[[maybe_unused]] ds::CheckpointMetadata md{{"note", "preempted"}};
