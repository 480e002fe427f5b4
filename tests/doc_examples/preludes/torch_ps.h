// Prelude "torch_ps" (compile only): a ParameterServerStrategy's `options`,
// an SGDOptions `so`, a module `net` of type `Net` (an embedding table
// "emb.weight" and a `head`), a batch with `ids`, `x`, `y`, `rows_here`, and
// loss_of(embeddings, y), as parameters.
#include <cstdint>
#include <functional>
#include <memory>

#include <diststrat/diststrat.h>
#include <diststrat/torch.h>
namespace ds = diststrat;
namespace dt = diststrat::libtorch;
using torch::nn::functional::cross_entropy;
struct Net : torch::nn::Cloneable<Net> {
  void reset() override {
    emb = register_module("emb", torch::nn::Embedding(1000, 8));
    head = register_module("head", torch::nn::Linear(8, 2));
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear head{nullptr};
};
// @params: const ds::ParameterServerOptions& options, const ds::SGDOptions& so, std::shared_ptr<Net> net, const ds::DistributedBatch& batch, const at::Tensor& ids, const at::Tensor& x, const at::Tensor& y, int64_t rows_here, const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& loss_of
// @body
