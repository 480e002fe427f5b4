// Prelude "elastic_state" (compile only): an elastic strategy, its
// ElasticState `state`, a Checkpoint `checkpoint` and the rest of an elastic
// loop, as parameters.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <diststrat/diststrat.h>
namespace ds = diststrat;
// @params: ds::MultiWorkerMirroredStrategy& strategy, ds::ElasticState& state, ds::Checkpoint& checkpoint, ds::SGD& opt, ds::DistributedDataset& dist, const std::string& dir, int64_t epochs, int64_t every, const std::function<void(ds::ReplicaContext&)>& step_fn
// @body
