// Prelude "coordinator" (compile only: a coordinator job needs PS and worker
// processes): the strategy's `options` and the number of `steps` as
// parameters; encode_step / decode_step stand for the program's own encoding
// of a function's arguments, use() for what it does with a result.
#include <cstdint>
#include <cstring>
#include <vector>

#include <diststrat/diststrat.h>
namespace ds = diststrat;
inline ds::Bytes encode_step(int64_t step) {
  ds::Bytes b(sizeof step);
  std::memcpy(b.data(), &step, sizeof step);
  return b;
}
inline int64_t decode_step(const ds::Bytes& b) {
  int64_t step = 0;
  if (b.size() == sizeof step) std::memcpy(&step, b.data(), sizeof step);
  return step;
}
inline void use(const std::vector<ds::Tensor>&) {}
// @params: const ds::ParameterServerOptions& options, int64_t steps
// @body
