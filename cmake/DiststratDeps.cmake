# Backend resolution: each DISTSTRAT_WITH_<DEP> is AUTO, ON or OFF.
#   ON   -> the dependency is required; configuring fails without it.
#   AUTO -> used when found; the summary says whether it was.
#   OFF  -> never used.
# Results: DISTSTRAT_HAVE_<DEP> (0/1), consumed by config.h.in.

macro(_diststrat_decide dep found)
  string(TOUPPER "${DISTSTRAT_WITH_${dep}}" _mode)
  if(_mode STREQUAL "OFF")
    set(DISTSTRAT_HAVE_${dep} 0)
    set(_DISTSTRAT_WHY_${dep} "off (DISTSTRAT_WITH_${dep}=OFF)")
  elseif(${found})
    set(DISTSTRAT_HAVE_${dep} 1)
    set(_DISTSTRAT_WHY_${dep} "yes")
  elseif(_mode STREQUAL "ON")
    message(FATAL_ERROR "DISTSTRAT_WITH_${dep}=ON but ${dep} was not found")
  else()
    set(DISTSTRAT_HAVE_${dep} 0)
    set(_DISTSTRAT_WHY_${dep} "no (not found)")
  endif()
endmacro()

macro(diststrat_resolve_backends)
  # MPI
  set(_found FALSE)
  if(NOT DISTSTRAT_WITH_MPI STREQUAL "OFF")
    find_package(MPI COMPONENTS C QUIET)
    if(MPI_C_FOUND)
      set(_found TRUE)
    endif()
  endif()
  _diststrat_decide(MPI _found)

  # Gloo (the Gloo transport in src/allreduce; baseline in the benchmarks)
  set(_found FALSE)
  if(NOT DISTSTRAT_WITH_GLOO STREQUAL "OFF")
    find_package(Gloo CONFIG QUIET)
    if(Gloo_FOUND OR TARGET gloo)
      set(_found TRUE)
    endif()
  endif()
  _diststrat_decide(GLOO _found)

  # CUDA (compiles here; runs only where a GPU is)
  set(_found FALSE)
  if(NOT DISTSTRAT_WITH_CUDA STREQUAL "OFF")
    if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
      set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
    endif()
    include(CheckLanguage)
    check_language(CUDA)
    if(CMAKE_CUDA_COMPILER)
      if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
        set(CMAKE_CUDA_ARCHITECTURES 80 90)
      endif()
      # The shared CUDA runtime, once: the library links CUDA::cudart, and
      # nvcc's default (static cudart) would put a second runtime on the line.
      if(NOT DEFINED CMAKE_CUDA_RUNTIME_LIBRARY)
        set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
      endif()
      enable_language(CUDA)
      # What the library's kernels are built for, set on the targets
      # (diststrat_link_backends): a later find_package(Torch) changes the
      # directory-wide CMAKE_CUDA_ARCHITECTURES (see diststrat_resolve_torch).
      set(DISTSTRAT_CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")
      find_package(CUDAToolkit QUIET)
      if(CUDAToolkit_FOUND)
        set(_found TRUE)
      endif()
    endif()
  endif()
  _diststrat_decide(CUDA _found)

  # cuBLAS: CUBLAS_ROOT (a Python wheel's nvidia/cu13 or nvidia/cublas) when
  # given, searched alone, else the CUDA toolkit's. DISTSTRAT_CUBLAS_TARGET is
  # what to link.
  set(_found FALSE)
  if(DISTSTRAT_HAVE_CUDA AND NOT DISTSTRAT_WITH_CUBLAS STREQUAL "OFF")
    set(_cublas_root "${CUBLAS_ROOT}")
    if(NOT _cublas_root AND DEFINED ENV{CUBLAS_ROOT})
      set(_cublas_root "$ENV{CUBLAS_ROOT}")
    endif()
    if(_cublas_root)
      find_path(CUBLAS_INCLUDE_DIR cublas_v2.h HINTS ${_cublas_root}
                PATH_SUFFIXES include NO_DEFAULT_PATH)
      find_library(CUBLAS_LIBRARY NAMES libcublas.so.13 libcublas.so.12 cublas NAMES_PER_DIR
                   HINTS ${_cublas_root} PATH_SUFFIXES lib lib64 NO_DEFAULT_PATH)
      if(CUBLAS_INCLUDE_DIR AND CUBLAS_LIBRARY)
        if(NOT TARGET diststrat_cublas)
          add_library(diststrat_cublas UNKNOWN IMPORTED)
          set_target_properties(diststrat_cublas PROPERTIES IMPORTED_LOCATION ${CUBLAS_LIBRARY}
                                INTERFACE_INCLUDE_DIRECTORIES ${CUBLAS_INCLUDE_DIR})
        endif()
        set(DISTSTRAT_CUBLAS_TARGET diststrat_cublas)
        set(_found TRUE)
        message(STATUS "cuBLAS: ${CUBLAS_INCLUDE_DIR}/cublas_v2.h, ${CUBLAS_LIBRARY} (CUBLAS_ROOT)")
      endif()
    elseif(TARGET CUDA::cublas)
      set(DISTSTRAT_CUBLAS_TARGET CUDA::cublas)
      set(_found TRUE)
      get_target_property(_cublas_loc CUDA::cublas IMPORTED_LOCATION)
      message(STATUS "cuBLAS: ${_cublas_loc} (CUDA toolkit)")
    endif()
  endif()
  _diststrat_decide(CUBLAS _found)

  # NCCL (CUDA toolkit dir, or a Python wheel's nvidia/nccl via NCCL_ROOT).
  # Header, link-time and run-time library must be one NCCL: with NCCL_ROOT
  # set, only that tree is searched (NO_DEFAULT_PATH), and per directory the
  # versioned libnccl.so.2 (all a wheel ships) wins over a toolkit's unversioned
  # libnccl.so (NAMES_PER_DIR). The run-time version is logged (ncclGetVersion).
  set(_found FALSE)
  if(DISTSTRAT_HAVE_CUDA AND NOT DISTSTRAT_WITH_NCCL STREQUAL "OFF")
    set(_nccl_root "${NCCL_ROOT}")
    if(NOT _nccl_root AND DEFINED ENV{NCCL_ROOT})
      set(_nccl_root "$ENV{NCCL_ROOT}")
    endif()
    if(_nccl_root)
      find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_root} PATH_SUFFIXES include NO_DEFAULT_PATH)
      find_library(NCCL_LIBRARY NAMES libnccl.so.2 nccl NAMES_PER_DIR
        HINTS ${_nccl_root} PATH_SUFFIXES lib lib64 NO_DEFAULT_PATH)
    else()
      find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
      find_library(NCCL_LIBRARY NAMES libnccl.so.2 nccl NAMES_PER_DIR
        HINTS ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64)
    endif()
    if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
      set(_found TRUE)
      message(STATUS "NCCL: header ${NCCL_INCLUDE_DIR}/nccl.h, library ${NCCL_LIBRARY}")
    endif()
  endif()
  _diststrat_decide(NCCL _found)

  # DLPack: one header (Debian's libdlpack-dev; DLPACK_ROOT/include or
  # DLPACK_ROOT for a copied header, as scripts/gpu-deps.sh makes). Without it
  # Tensor::from_dlpack / to_dlpack throw UnimplementedError.
  set(_found FALSE)
  if(NOT DISTSTRAT_WITH_DLPACK STREQUAL "OFF")
    set(_dlpack_root "${DLPACK_ROOT}")
    if(NOT _dlpack_root AND DEFINED ENV{DLPACK_ROOT})
      set(_dlpack_root "$ENV{DLPACK_ROOT}")
    endif()
    if(_dlpack_root)
      find_path(DLPACK_INCLUDE_DIR dlpack/dlpack.h HINTS ${_dlpack_root}
                PATH_SUFFIXES include NO_DEFAULT_PATH)
    else()
      find_path(DLPACK_INCLUDE_DIR dlpack/dlpack.h)
    endif()
    if(DLPACK_INCLUDE_DIR)
      # DLPack < 1.0: DLPACK_VERSION 60 (0.6); >= 1.0: DLPACK_MAJOR_VERSION / DLPACK_MINOR_VERSION.
      file(STRINGS "${DLPACK_INCLUDE_DIR}/dlpack/dlpack.h" _dlpack_ver
           REGEX "^#define DLPACK_(VERSION|MAJOR_VERSION|MINOR_VERSION) [0-9]+")
      string(REGEX REPLACE "#define DLPACK_([A-Z_]+) ([0-9]+)" "\\1=\\2" _dlpack_ver "${_dlpack_ver}")
      set(_found TRUE)
      message(STATUS "DLPack: ${DLPACK_INCLUDE_DIR}/dlpack/dlpack.h (${_dlpack_ver})")
    endif()
  endif()
  _diststrat_decide(DLPACK _found)
endmacro()

function(diststrat_link_backends target)
  if(DISTSTRAT_HAVE_MPI)
    target_link_libraries(${target} PRIVATE MPI::MPI_C)
  endif()
  if(DISTSTRAT_HAVE_CUDA)
    target_link_libraries(${target} PRIVATE CUDA::cudart)
    set_target_properties(${target} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF
                                               CUDA_ARCHITECTURES "${DISTSTRAT_CUDA_ARCHITECTURES}")
  endif()
  if(DISTSTRAT_HAVE_CUBLAS)
    target_link_libraries(${target} PRIVATE ${DISTSTRAT_CUBLAS_TARGET})
  endif()
  if(DISTSTRAT_HAVE_DLPACK)
    target_include_directories(${target} PRIVATE ${DLPACK_INCLUDE_DIR})
  endif()
  if(DISTSTRAT_HAVE_NCCL)
    target_include_directories(${target} PRIVATE ${NCCL_INCLUDE_DIR})
    target_link_libraries(${target} PRIVATE ${NCCL_LIBRARY})
  endif()
endfunction()

function(diststrat_apply_sanitizers target)
  if(DISTSTRAT_SANITIZE)
    string(REPLACE "," ";" _list "${DISTSTRAT_SANITIZE}")
    string(REPLACE ";" "," _flags "${_list}")
    target_compile_options(${target} PUBLIC
      $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${_flags} -fno-omit-frame-pointer -fno-sanitize-recover=undefined>)
    target_link_options(${target} PUBLIC -fsanitize=${_flags})
  endif()
endfunction()

# LibTorch (Debian's libtorch-dev: TorchConfig.cmake), for diststrat::torch.
# Torch_DIR points at another LibTorch.
# A CUDA LibTorch's CMake (Caffe2/public/cuda.cmake) sets
# CMAKE_CUDA_ARCHITECTURES to OFF and appends its own -gencode list and nvcc
# options to CMAKE_CUDA_FLAGS in the caller's scope, which is the top level
# here: the library's kernels would be built for PyTorch's architectures
# (whatever TORCH_CUDA_ARCH_LIST or its detection gave), not for
# CMAKE_CUDA_ARCHITECTURES. The lookup keeps every CUDA setting as it was.
set(_DISTSTRAT_CUDA_SETTINGS CMAKE_CUDA_ARCHITECTURES CMAKE_CUDA_FLAGS CMAKE_CUDA_FLAGS_DEBUG
    CMAKE_CUDA_FLAGS_RELEASE CMAKE_CUDA_FLAGS_RELWITHDEBINFO CMAKE_CUDA_FLAGS_MINSIZEREL)
macro(diststrat_resolve_torch)
  set(_found FALSE)
  if(NOT DISTSTRAT_WITH_TORCH STREQUAL "OFF")
    foreach(_v IN LISTS _DISTSTRAT_CUDA_SETTINGS)
      set(_diststrat_saved_${_v} "${${_v}}")
    endforeach()
    find_package(Torch CONFIG QUIET)
    foreach(_v IN LISTS _DISTSTRAT_CUDA_SETTINGS)
      if(NOT "${${_v}}" STREQUAL "${_diststrat_saved_${_v}}")
        message(STATUS "LibTorch's CMake changed ${_v} to '${${_v}}': kept '${_diststrat_saved_${_v}}'")
        set(${_v} "${_diststrat_saved_${_v}}")
      endif()
    endforeach()
    if(Torch_FOUND AND TARGET torch)
      set(_found TRUE)
      message(STATUS "LibTorch: ${Torch_DIR} (${Torch_VERSION})")
    endif()
  endif()
  _diststrat_decide(TORCH _found)
endmacro()

function(diststrat_print_summary)
  message(STATUS "")
  message(STATUS "diststrat ${PROJECT_VERSION} configuration summary")
  message(STATUS "  build type     : ${CMAKE_BUILD_TYPE}")
  list(JOIN DISTSTRAT_ISA_VARIANTS ", " _isa_list)
  if(DISTSTRAT_NATIVE)
    message(STATUS "  cpu kernels    : ${_isa_list}, all with -march=native (DISTSTRAT_NATIVE=ON)")
  else()
    message(STATUS "  cpu kernels    : ${_isa_list} (picked at run time)")
  endif()
  foreach(dep MPI GLOO CUDA CUBLAS NCCL DLPACK TORCH)
    string(LENGTH "${dep}" _len)
    math(EXPR _n "9 - ${_len}")
    string(REPEAT " " ${_n} _pad)
    message(STATUS "  with ${dep}${_pad}: ${_DISTSTRAT_WHY_${dep}}")
  endforeach()
  if(DISTSTRAT_HAVE_CUDA)
    message(STATUS "  CUDA kernels   : architectures ${DISTSTRAT_CUDA_ARCHITECTURES}, CMAKE_CUDA_FLAGS '${CMAKE_CUDA_FLAGS}'")
  endif()
  if(DISTSTRAT_SANITIZE)
    message(STATUS "  sanitizers     : ${DISTSTRAT_SANITIZE}")
  endif()
  message(STATUS "")
endfunction()
