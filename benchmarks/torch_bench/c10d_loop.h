// The baseline of torch_bench: LibTorch's own c10d ProcessGroupGloo, used the
// way pytorch/examples' C++ dist-mnist uses its process group (after
// backward, one all-reduce per gradient, wait for all of them, divide by the
// world size, then the optimizer step). Kept apart from main.cc so that the
// Gloo/c10d headers are compiled in one file only.
#pragma once

#include <cstdint>
#include <string>

#include <torch/torch.h>

namespace torch_bench {

// What every mode trains: the same CNN, the same batches, the same SGD.
struct Config {
  int64_t batch = 64;  // rows per process and step
  int steps = 200;     // timed steps
  int warmup = 20;     // untimed steps before them
  float lr = 0.05f;
  float momentum = 0.9f;
  uint64_t seed = 1;
  double timeout_s = 300;  // for every wait on a peer
  int threads = 1;         // LibTorch intra-op threads per process
};

// The training rows (x float32 [N, 784], y int64 [N]); N a multiple of
// `batch` and at least batch * world_size. Process r's batch at step s is
// block (s * world_size + r) mod (N / batch), so every process of one step
// reads other rows and a 1-process run reads the same rows in the same order
// as a 2-process run's rank 0 and 1 (interleaved).
struct Data {
  torch::Tensor x, y;
  torch::Tensor batch_x(const Config& c, int step, int rank, int world) const;
  torch::Tensor batch_y(const Config& c, int step, int rank, int world) const;
};

struct Result {
  double seconds = 0;    // the timed steps, from a barrier to a barrier
  double mean_loss = 0;  // over every process's rows of the timed steps
};

// Trains Config::warmup + Config::steps steps as rank `rank` of `world`
// processes that meet through a c10d::FileStore at `store_path` (the same
// path on every process; a file that does not exist yet). Blocking;
// collective over the `world` processes.
Result run_c10d_gloo(const Config& config, const Data& data, int rank, int world,
                     const std::string& store_path);

}  // namespace torch_bench
