// Prelude "torch_elastic" (compile only): an elastic strategy, a module
// `net`, its DistributedDataParallel `ddp` and an optimizer `opt0`, as
// parameters (Net as in "torch_net").
#include <memory>

#include <diststrat/diststrat.h>
#include <diststrat/torch.h>
namespace ds = diststrat;
namespace dt = diststrat::libtorch;
struct Net : torch::nn::Cloneable<Net> {
  void reset() override { fc = register_module("fc", torch::nn::Linear(784, 10)); }
  at::Tensor forward(at::Tensor x) { return fc(x); }
  torch::nn::Linear fc{nullptr};
};
// @params: ds::MultiWorkerMirroredStrategy& strategy, std::shared_ptr<Net> net, dt::DistributedDataParallel& ddp, std::unique_ptr<torch::optim::SGD>& opt0
// @body
