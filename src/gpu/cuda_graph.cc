// The CUDA backend's graph capture (issue 44 item 2): a replica's step is
// captured from its stream once and replayed with one cudaGraphLaunch.
//
// Capture is relaxed (cudaStreamCaptureModeRelaxed): each replica captures
// on its own thread and stream, and the caching allocator may, during the
// capture, take a new chunk (cudaMalloc) or ask whether a block freed before
// the capture is done (cudaEventQuery of an event recorded outside it),
// calls that global and thread-local capture forbid on the capturing thread
// (PyTorch relaxes the mode around its cudaMalloc for the same reason). What
// capture cannot hold is refused by the library before it reaches CUDA (a
// read or wait of a capturing scope: refuse_in_capture), and by CUDA on the
// capturing stream itself (a synchronize, a query of an event recorded in
// the capture: cudaErrorStreamCaptureUnsupported / ...Invalidated, which
// check_cuda turns into a diststrat::Error naming the call).
#include "gpu/cuda_backend.h"
#include "gpu/cuda_backend_impl.h"
#include "gpu/kernels.h"

namespace diststrat {
namespace gpu {

void CudaBackend::begin_capture(int ordinal, void* stream) {
  check_ordinal(ordinal);
  DISTSTRAT_CHECK(stream != nullptr, kInvalidArgument,
                  "begin_capture: the legacy default stream cannot be captured");
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  DISTSTRAT_CUDA_CHECK(cudaStreamBeginCapture(as_stream(stream), cudaStreamCaptureModeRelaxed));
}

void* CudaBackend::end_capture(int ordinal, void* stream) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(as_stream(stream), &graph);
  if (ended != cudaSuccess) {
    if (graph) cudaGraphDestroy(graph);
    throw_cuda_error(ended, "cudaStreamEndCapture(stream, &graph)", __FILE__, __LINE__);
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);  // the executable graph keeps what it needs
  if (made != cudaSuccess) {
    throw_cuda_error(made, "cudaGraphInstantiate(&exec, graph, 0)", __FILE__, __LINE__);
  }
  return exec;
}

void CudaBackend::launch_graph(int ordinal, void* graph, void* stream) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  DISTSTRAT_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), as_stream(stream)));
}

void CudaBackend::destroy_graph(int ordinal, void* graph) {
  if (!graph) return;
  cudaSetDevice(ordinal);
  // Returns at once; a launch in flight still completes.
  cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph));
  clear_last_error();  // cleanup: failures are deliberately ignored
}

bool CudaBackend::capturing(int ordinal, void* stream) {
  if (!stream) return false;
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  DISTSTRAT_CUDA_CHECK(cudaStreamIsCapturing(as_stream(stream), &status));
  return status != cudaStreamCaptureStatusNone;
}

void CudaBackend::apply_update_list_at(int ordinal, void* stream, const UpdateRule& rule,
                                       float* const* vars, const float* const* grads,
                                       float* const* slots, const size_t* counts, int n,
                                       const float* rate) {
  DISTSTRAT_CUDA_CHECK(cudaSetDevice(ordinal));
  launch_update_list_at(rule, vars, grads, slots, counts, n, rate, stream);
}

}  // namespace gpu
}  // namespace diststrat
