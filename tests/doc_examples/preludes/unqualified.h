// Prelude "unqualified": for a header's example written from inside namespace
// diststrat (names without ds::), with a two-CPU MirroredStrategy `strategy`
// and a small Fashion-MNIST `dataset` (512 rows); `optimizer` is an SGD and
// forward_backward(w, x, y) a stand-in model: a zero gradient shaped like w
// and a zero loss.
#include <cstdint>
#include <utility>
#include <vector>

#include <diststrat/diststrat.h>
namespace ds = diststrat;
using namespace diststrat;
inline std::pair<Tensor, float> forward_backward(const Tensor& w, const Tensor&, const Tensor&) {
  Tensor grad(w.shape(), w.dtype(), w.device());  // zero-filled
  return {grad, 0.0f};
}
// @body
MirroredStrategy strategy({Device::cpu(0), Device::cpu(1)});
Dataset dataset = load_mnist_split(kFashionMnistDir, "train", 512);
SGD optimizer(strategy, {0.05f});
