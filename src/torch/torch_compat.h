// The one place for what differs between the LibTorch versions that
// diststrat::torch builds against from one source: Debian's LibTorch 1.13
// (the CPU build here) and the 2.x of PyTorch's wheels (the GPU machine's).
// scripts/torch-syntax-check.sh compiles every src/torch and tests/torch
// translation unit against a 2.x's headers; add a difference here, not as an
// #if in the file that meets it. Internal: the tests include it too.
#pragma once

#include <torch/torch.h>
#include <torch/version.h>

#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include "diststrat/error.h"

// A CUDA build of LibTorch: ATen/cuda/CUDAConfig.h is generated only for one
// (Debian's CPU LibTorch ships c10/cuda headers, but no CUDA to run them),
// and the CUDA runtime's headers are on the include path (a CUDA LibTorch's
// CMake target adds them). Code that needs c10/cuda compiles only then, and
// still asks torch::cuda::is_available() at run time.
#if defined(__has_include)
#if __has_include(<ATen/cuda/CUDAConfig.h>) && __has_include(<c10/cuda/CUDAStream.h>) && \
    __has_include(<cuda_runtime_api.h>)
#define DISTSTRAT_TORCH_HAS_CUDA_HEADERS 1
#endif
#endif
#ifndef DISTSTRAT_TORCH_HAS_CUDA_HEADERS
#define DISTSTRAT_TORCH_HAS_CUDA_HEADERS 0
#endif

#if DISTSTRAT_TORCH_HAS_CUDA_HEADERS
#include <c10/core/Event.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace diststrat::libtorch::compat {

// LibTorch's version, for messages ("1.13.0").
inline std::string version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

// Optimizer::state() maps a parameter to its state. The key was the
// parameter's TensorImpl address as text (c10::guts::to_string, removed in
// 2.2) up to 2.0 and is the address itself (void*) since; deduced from the
// map, not from the version number, so a third spelling fails to compile here.
using OptimizerStateMap = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;
using OptimizerStateKey = typename OptimizerStateMap::key_type;

// The key of parameter `p` in Optimizer::state(): the one the optimizer's
// own step() uses (c10::guts::to_string was ostringstream << pointer).
template <class Key = OptimizerStateKey>
Key optimizer_state_key(const at::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream os;
    os << p.unsafeGetTensorImpl();
    return os.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

// The state `opt` keeps for parameter `p`, or nullptr when it has none yet.
inline torch::optim::OptimizerParamState* optimizer_state(torch::optim::Optimizer& opt,
                                                          const at::Tensor& p) {
  auto& state = opt.state();
  auto it = state.find(optimizer_state_key(p));
  return it == state.end() ? nullptr : it->second.get();
}

// ---- CUDA streams ------------------------------------------------------------
// torch queues a thread's kernels on its current stream of the device (and
// autograd's backward ends ordered with the calling thread's current
// stream); the library queues a replica's work, its collectives included, on
// the replica's stream (ReplicaContext::stream(), a cudaStream_t; null = the
// legacy default stream). Where memory crosses from one to the other, the
// reader's stream waits for the writer's on the device (an event; the host
// does not block).
enum class StreamOrder {
  kTorchThenLibrary,  // the library reads what torch wrote (gradients)
  kLibraryThenTorch,  // torch reads what the library wrote (reduced gradients)
};

// Orders torch's current stream of `device` (on this thread) and
// `library_stream` as `order` says. A CPU device: nothing to order. A CUDA
// device in a LibTorch without CUDA: UnimplementedError.
inline void order_streams(const torch::Device& device, void* library_stream, StreamOrder order) {
  if (!device.is_cuda()) return;
#if DISTSTRAT_TORCH_HAS_CUDA_HEADERS
  const c10::DeviceIndex index = device.index();
  c10::cuda::CUDAGuard guard(index);
  const c10::Stream torch_stream = c10::cuda::getCurrentCUDAStream(index).unwrap();
  const c10::Stream library =
      library_stream != nullptr
          ? c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(library_stream), index)
                .unwrap()
          : c10::cuda::getDefaultCUDAStream(index).unwrap();
  if (torch_stream == library) return;  // one stream: already in order
  c10::Event event(c10::DeviceType::CUDA);
  if (order == StreamOrder::kTorchThenLibrary) {
    event.record(torch_stream);
    event.block(library);
  } else {
    event.record(library);
    event.block(torch_stream);
  }
#else
  (void)library_stream;
  (void)order;
  throw_error(ErrorCode::kUnimplemented, "a CUDA tensor on " + device.str() + " in a LibTorch " +
                                             version() + " built without CUDA");
#endif
}

}  // namespace diststrat::libtorch::compat
