// Prelude "central_storage": forward_backward(w), a stand-in model: the
// gradient of a loss for the variable's value `w` (here: zeros shaped like w).
#include <diststrat/diststrat.h>
namespace ds = diststrat;
inline ds::Tensor forward_backward(const ds::Tensor& w) {
  return ds::Tensor(w.shape(), w.dtype(), w.device());  // zero-filled
}
// @body
