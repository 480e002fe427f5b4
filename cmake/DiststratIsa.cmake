# Run-time instruction-set dispatch of the CPU math kernels
# (include/diststrat/cpu_isa.h, src/core/cpu_isa.h).
#
# diststrat_isa_sources(<name> <source>...) compiles the sources once per
# variant into the object libraries diststrat_<name>_<variant>, with
# DISTSTRAT_ISA_NS=isa_<variant> (each copy puts everything it defines in that
# namespace; sources that use Eigen rename Eigen's namespace the same way, so
# no inline template of one variant can stand in for another's at link time)
# and the variant's -m flags; diststrat_isa_link() then adds every variant's
# objects to diststrat. Baseline objects come first and the AVX ones last on
# the link line, so where a library template (std::) is emitted by both, the
# linker keeps the baseline copy (it keeps the first it sees).
# The test isa_baseline_clean (tests/CMakeLists.txt) disassembles the objects.
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  set(DISTSTRAT_ISA_VARIANTS baseline avx2 avx512)
  set(DISTSTRAT_ISA_VARIANTS_ON 1)
else()
  set(DISTSTRAT_ISA_VARIANTS baseline)
  set(DISTSTRAT_ISA_VARIANTS_ON 0)
endif()
set(DISTSTRAT_ISA_FLAGS_baseline "")
set(DISTSTRAT_ISA_FLAGS_avx2 -mavx2 -mfma -mf16c)
# (GCC 12 warns of an uninitialised __Y inside its own avx512fintrin.h under
# Eigen's AVX-512 packets: a false positive in the compiler's header.)
set(DISTSTRAT_ISA_FLAGS_avx512 -mavx512f -mavx512bw -mavx512dq -mavx512vl -mavx2 -mfma -mf16c
    $<$<CXX_COMPILER_ID:GNU>:-Wno-maybe-uninitialized>)

function(diststrat_isa_sources name)
  foreach(isa IN LISTS DISTSTRAT_ISA_VARIANTS)
    set(obj diststrat_${name}_${isa})
    add_library(${obj} OBJECT ${ARGN})
    # The library's own settings (include paths, definitions, warnings,
    # sanitizers, DISTSTRAT_NATIVE), then the variant's.
    target_include_directories(${obj} PRIVATE $<TARGET_PROPERTY:diststrat,INCLUDE_DIRECTORIES>)
    target_compile_definitions(${obj} PRIVATE $<TARGET_PROPERTY:diststrat,COMPILE_DEFINITIONS>
                               DISTSTRAT_ISA_NS=isa_${isa})
    # -ffp-contract=off: no variant fuses a multiply and an add on its own,
    # so the element-wise kernels give bit-identical results on every variant
    # (Eigen's GEMMs use FMA instructions explicitly where the ISA has them).
    target_compile_options(${obj} PRIVATE $<TARGET_PROPERTY:diststrat,COMPILE_OPTIONS>
                           ${DISTSTRAT_ISA_FLAGS_${isa}} -ffp-contract=off)
    target_link_libraries(${obj} PRIVATE Eigen3::Eigen)
    set_property(GLOBAL APPEND PROPERTY DISTSTRAT_ISA_OBJECTS_${isa} ${obj})
  endforeach()
endfunction()

function(diststrat_isa_link)
  foreach(isa IN LISTS DISTSTRAT_ISA_VARIANTS)
    get_property(objs GLOBAL PROPERTY DISTSTRAT_ISA_OBJECTS_${isa})
    foreach(obj IN LISTS objs)
      target_sources(diststrat PRIVATE $<TARGET_OBJECTS:${obj}>)
    endforeach()
  endforeach()
endfunction()
