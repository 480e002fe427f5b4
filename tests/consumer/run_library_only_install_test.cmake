# `cmake --install` of a tree where only the library was built (issue 43:
# it failed with "file INSTALL cannot find .../examples/embedding_ps"; and
# with the examples off, on the tools). A fresh tree is configured (tests
# and benchmarks off; examples as the main build has them, then off), and
# the main build's library files stand in for building its `diststrat`
# target: the same sources and flags, and `cmake --install` only copies
# what is there. Compiling the library again would cost CI minutes for no
# more coverage. Then the install must succeed, install the library, and
# put no program without the project's prefix into bin/.
#
# -DSOURCE_DIR, -DWORK_DIR, -DLIBRARY=<the main build's libdiststrat file>,
# -DBUILD_DIR (the main build), -DSHARED=<BUILD_SHARED_LIBS>, -DEXAMPLES, -DGENERATOR.
file(REMOVE_RECURSE ${WORK_DIR})
set(tree ${WORK_DIR}/build)

function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGV}\n${out}\n${err}")
  endif()
endfunction()

# The installed tree as a library-only build leaves it: the library, and no
# program in bin/ unless it is named diststrat-...
function(check_prefix prefix)
  file(GLOB libs ${prefix}/lib*/libdiststrat*)
  if(NOT libs)
    message(FATAL_ERROR "no libdiststrat installed under ${prefix}")
  endif()
  if(NOT EXISTS ${prefix}/include/diststrat/config.h)
    message(FATAL_ERROR "no include/diststrat/config.h under ${prefix}")
  endif()
  file(GLOB programs RELATIVE ${prefix}/bin ${prefix}/bin/*)
  foreach(p ${programs})
    if(NOT p MATCHES "^diststrat-")
      message(FATAL_ERROR "bin/${p} installed without the diststrat- prefix")
    endif()
  endforeach()
endfunction()

# GPU backends and LibTorch off: the test is about what is installed, and a
# CUDA configure takes a minute.
set(args -DDISTSTRAT_BUILD_TESTS=OFF -DDISTSTRAT_BUILD_BENCHMARKS=OFF -DBUILD_SHARED_LIBS=${SHARED}
    -DDISTSTRAT_WITH_CUDA=OFF -DDISTSTRAT_WITH_NCCL=OFF -DDISTSTRAT_WITH_CUBLAS=OFF
    -DDISTSTRAT_WITH_TORCH=OFF -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${tree} -G ${GENERATOR} ${args}
    -DDISTSTRAT_BUILD_EXAMPLES=${EXAMPLES})

# The library's files (libdiststrat.so and its version links, or the .a) where
# the fresh tree's own build would put them.
get_filename_component(lib_dir ${LIBRARY} DIRECTORY)
file(RELATIVE_PATH rel ${BUILD_DIR} ${lib_dir})
file(GLOB lib_files ${lib_dir}/libdiststrat.*)
file(COPY ${lib_files} DESTINATION ${tree}/${rel})

run(${CMAKE_COMMAND} --install ${tree} --prefix ${WORK_DIR}/prefix)
check_prefix(${WORK_DIR}/prefix)

# The library-only configuration (examples off too): the tools are not built.
if(EXAMPLES)
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${tree} -DDISTSTRAT_BUILD_EXAMPLES=OFF)
  run(${CMAKE_COMMAND} --install ${tree} --prefix ${WORK_DIR}/prefix_no_examples)
  check_prefix(${WORK_DIR}/prefix_no_examples)
endif()
