// Prelude "torch_net": `Net`, a torch::nn::Cloneable MLP 784-32-10 whose
// forward() returns log-probabilities (for nll_loss), and `data`, 512
// Fashion-MNIST rows (features [N, 784] float32, labels [N] int32).
#include <memory>
#include <vector>

#include <diststrat/diststrat.h>
#include <diststrat/torch.h>
namespace ds = diststrat;
namespace dt = diststrat::libtorch;
struct Net : torch::nn::Cloneable<Net> {
  Net() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(784, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 10));
  }
  at::Tensor forward(at::Tensor x) { return torch::log_softmax(fc2(torch::relu(fc1(x))), 1); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
// @body
torch::manual_seed(0);
ds::Dataset data = ds::load_mnist_split(ds::kFashionMnistDir, "train", 512);
