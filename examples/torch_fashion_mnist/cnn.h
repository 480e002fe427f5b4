// The LibTorch CNN of examples/torch_fashion_mnist, also what
// benchmarks/torch_bench trains (one definition, so that both run the same
// model):
//
//   [N, 784] in [0, 1] -> view [N, 1, 28, 28], standardized with the
//                          training set's pixel mean and deviation
//   conv1 5x5, 1 -> 16 channels, padding 2, batch norm, ReLU, max-pool 2   -> [N, 16, 14, 14]
//   conv2 5x5, 16 -> 32 channels, padding 2, batch norm, ReLU, max-pool 2  -> [N, 32, 7, 7]
//   fc1 1568 -> 128, ReLU
//   fc2 128 -> 10 (logits)
//
// 215,466 float32 parameters (12 tensors, 862 KB of gradients a step) and the
// batch norms' running statistics (6 buffers, each replica's own: they are
// not reduced, as torch's own DDP with broadcast_buffers=False). The batch
// norms made 3 epochs reach test accuracy 0.90 (without them ~0.895). The
// names (conv1.weight, bn1.running_mean, ..., fc2.bias) are what the
// equivalent Python torch.nn.Module would have, so checkpoints load there by
// name. Call eval() before inference (the batch norms then use the running
// statistics).
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace torch_fashion_mnist {

// A torch::nn::Cloneable, so that one clone per local replica can be made.
struct CnnImpl : torch::nn::Cloneable<CnnImpl> {
  CnnImpl() { reset(); }

  // (Re)creates the layers; Cloneable::clone() calls it, then copies the values.
  void reset() override {
    namespace nn = torch::nn;
    conv1 = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(1, 16, 5).padding(2)));
    bn1 = register_module("bn1", nn::BatchNorm2d(16));
    conv2 = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(16, 32, 5).padding(2)));
    bn2 = register_module("bn2", nn::BatchNorm2d(32));
    fc1 = register_module("fc1", nn::Linear(32 * 7 * 7, 128));
    fc2 = register_module("fc2", nn::Linear(128, 10));
  }

  // x: float32 [N, 784] (or [N, 1, 28, 28]); returns the logits [N, 10].
  torch::Tensor forward(torch::Tensor x) {
    x = (x.reshape({-1, 1, 28, 28}) - kPixelMean) / kPixelStd;
    x = torch::max_pool2d(torch::relu(bn1->forward(conv1->forward(x))), 2);
    x = torch::max_pool2d(torch::relu(bn2->forward(conv2->forward(x))), 2);
    x = torch::relu(fc1->forward(x.flatten(1)));
    return fc2->forward(x);
  }

  // Fashion-MNIST's training pixels (in [0, 1]): mean 0.2860, deviation 0.3530.
  static constexpr double kPixelMean = 0.2860, kPixelStd = 0.3530;

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Cnn);

// The mean cross-entropy of `logits` [N, 10] against integer labels [N]
// (int32 as diststrat's datasets hold them, or int64).
inline torch::Tensor mean_cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels) {
  return torch::nn::functional::cross_entropy(logits, labels.to(torch::kLong));
}

// How many rows of `logits` [N, 10] have their argmax equal to `labels`.
inline int64_t count_correct(const torch::Tensor& logits, const torch::Tensor& labels) {
  return logits.argmax(1).eq(labels.to(torch::kLong)).sum().item<int64_t>();
}

// LibTorch's intra-op threads (OpenMP's are per thread) for the calling
// thread, set once per thread: a strategy may run a replica on a thread of
// its own, where the setting of main() does not reach. One replica = one core
// unless asked otherwise (DESIGN: one replica = one worker thread).
inline void use_intra_op_threads(int n) {
  thread_local int set = 0;
  if (set != n) {
    at::set_num_threads(n);
    set = n;
  }
}

}  // namespace torch_fashion_mnist
