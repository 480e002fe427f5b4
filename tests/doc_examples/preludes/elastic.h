// Prelude "elastic" (compile only: an elastic job needs a rendezvous store and
// several workers): what the loop of an elastic program uses, as parameters.
#include <cstdint>
#include <functional>

#include <diststrat/diststrat.h>
namespace ds = diststrat;
// @params: ds::SGD& opt, ds::DistributedDataset& dist, int64_t epochs, const std::function<void(ds::ReplicaContext&)>& step_fn
// @body
