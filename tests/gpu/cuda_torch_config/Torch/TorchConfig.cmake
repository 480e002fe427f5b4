# A stand-in for a CUDA LibTorch's TorchConfig.cmake, used by
# scripts/gpu-check.sh --dry-run: it does to the caller's scope what PyTorch
# 2.x's Caffe2/public/cuda.cmake does there (CMAKE_CUDA_ARCHITECTURES set to
# OFF, its own -gencode list and nvcc options appended to CMAKE_CUDA_FLAGS),
# and defines an empty `torch` target. The check then reads the kernels'
# compile command: it must carry CUDA_ARCHS, not these.
if(DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES OFF)
endif()
string(APPEND CMAKE_CUDA_FLAGS " -gencode arch=compute_52,code=sm_52 --expt-extended-lambda")
string(APPEND CMAKE_CUDA_FLAGS_RELEASE " -Xcompiler -fstand-in-torch-flag")
if(NOT TARGET torch)
  add_library(torch INTERFACE IMPORTED)
endif()
set(TORCH_LIBRARIES torch)
set(TORCH_INCLUDE_DIRS "")
set(Torch_FOUND TRUE)
