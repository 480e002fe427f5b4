// MirroredStrategy: one process, many devices, synchronous. Every variable has
// a copy on every device; each step's gradients are all-reduced across the
// replicas and every copy applies the same update, so copies stay identical.
// On CPU a "device" is a persistent worker thread; replicas all-reduce in the
// shared address space (each reduces its slice straight out of its peers').
#pragma once

#include <memory>
#include <vector>

#include "diststrat/strategy.h"

namespace diststrat {

struct MirroredOptions {
  // Replica devices. Empty = every visible GPU, or one CPU device if none.
  std::vector<Device> devices;
  // Timeout, algorithm and fusion settings for the replicas' collectives.
  CommunicationOptions communication;
  // Logger level (DISTSTRAT_LOG_LEVEL overrides).
  LogLevel log_level = LogLevel::kWarning;
};

class MirroredStrategy : public Strategy {
 public:
  explicit MirroredStrategy(MirroredOptions options = {});
  explicit MirroredStrategy(std::vector<Device> devices);
  ~MirroredStrategy() override;

  std::string name() const override { return "mirrored"; }
  int num_replicas_in_sync() const override;
  const std::vector<Device>& devices() const override;
  void apply_gradients(ReplicaContext& ctx, Optimizer& optimizer,
                       const std::vector<std::pair<Tensor, Variable>>& grads_and_vars) override;

  struct Impl;

 protected:
  void run_replicas(const std::function<void(ReplicaContext&)>& fn) override;
  void place_variable(Variable::Impl& var, const Initializer& init) override;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace diststrat
