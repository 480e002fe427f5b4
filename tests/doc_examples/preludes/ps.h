// Prelude "ps" (compile only: a parameter-server job needs PS and worker
// processes): the strategy's `options`, a parameter.
#include <diststrat/diststrat.h>
namespace ds = diststrat;
// @params: const ds::ParameterServerOptions& options
// @body
