# Builds and runs the consumer project against the installed package in
# PREFIX (test package_install put it there), both through find_package and
# pkg-config.
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${PREFIX})

function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGV}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
endfunction()

run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${CMAKE_COMMAND} -E env LD_LIBRARY_PATH=${prefix}/lib ${WORK_DIR}/build/consumer)

# diststrat::torch through the package config (which finds LibTorch), when
# this build has it.
if(WITH_TORCH)
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer/torch -B ${WORK_DIR}/build_torch
      -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)
  run(${CMAKE_COMMAND} --build ${WORK_DIR}/build_torch)
  run(${CMAKE_COMMAND} -E env LD_LIBRARY_PATH=${prefix}/lib ${WORK_DIR}/build_torch/torch_consumer)
endif()

# pkg-config: compile the same program with the flags diststrat.pc gives.
find_program(PKG_CONFIG pkg-config REQUIRED)
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env PKG_CONFIG_PATH=${prefix}/lib/pkgconfig
          ${PKG_CONFIG} --cflags --libs diststrat
  OUTPUT_VARIABLE flags OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "pkg-config --cflags --libs diststrat failed")
endif()
separate_arguments(flags UNIX_COMMAND "${flags}")
run(c++ ${SOURCE_DIR}/tests/consumer/main.cc -o ${WORK_DIR}/consumer_pc ${flags})
run(${CMAKE_COMMAND} -E env LD_LIBRARY_PATH=${prefix}/lib ${WORK_DIR}/consumer_pc)

# The installed examples and tools run from the prefix as they are, without
# LD_LIBRARY_PATH (their install RPATH finds the library): --help for each,
# and diststrat-smi for real.
file(GLOB installed_programs ${prefix}/bin/*)
list(LENGTH installed_programs n_programs)
if(n_programs EQUAL 0)
  message(FATAL_ERROR "nothing was installed into ${prefix}/bin")
endif()
foreach(program ${installed_programs})
  # bin/ is shared with every other package: a program there carries the
  # project's name (issue 43: `predict`, `fashion_mnist` were installed so).
  get_filename_component(name ${program} NAME)
  if(NOT name MATCHES "^diststrat-")
    message(FATAL_ERROR "bin/${name} is installed without the diststrat- prefix")
  endif()
  run(${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH ${program} --help)
endforeach()
file(MAKE_DIRECTORY ${WORK_DIR}/leases)
run(${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH ${prefix}/bin/diststrat-smi
    --lease-dir ${WORK_DIR}/leases)
