// The CPU baseline of gpu_bench's MLP bar: the same training step (784-256-256-10,
// ReLU, softmax cross-entropy, SGD with momentum) written directly in Eigen and
// compiled with -march=native (native_mlp.cc only), on one thread. The
// library's own CPU step is built for baseline x86-64, so a GPU measured
// against it would look faster than against the core the user has.
#pragma once

#include <cstdint>

// Mean seconds per step after `warmup` steps; `checksum` gets a value of the
// trained weights (so the work cannot be optimised away, and a broken step shows).
double native_mlp_step_seconds(int64_t batch, int warmup, int steps, double* checksum);
