// Prelude "ps_metric" (compile only): a ParameterServerStrategy (`strategy`,
// also called `ps`) and the per-replica float64 tensors {loss sum, rows} a
// step returned, as parameters; names unqualified as inside namespace
// diststrat, or with ds::.
#include <diststrat/diststrat.h>
namespace ds = diststrat;
using namespace diststrat;
// @params: ParameterServerStrategy& strategy, ParameterServerStrategy& ps, const PerReplica<Tensor>& per_replica
// @body
