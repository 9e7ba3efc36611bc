# cmake/cutlass_gemm.cmake -- jax_moe's own CUTLASS kernels: the SM90 bf16 and fp8 grouped GEMMs
# (ffi/cutlass/grouped_gemm*) behind the XLA FFI targets jax_moe_cutlass_grouped_gemm and
# jax_moe_cutlass_grouped_gemm_fp8, in the nanobind module jax_moe._jax_moe_cutlass. Included from
# CMakeLists.txt once the CUDA language is enabled.
#
# CUTLASS is a header-only build dependency, looked up in this order (first hit wins):
#   1. CUTLASS_DIR (cache variable or environment): a CUTLASS checkout (include/, tools/util/include/)
#   2. FLASHINFER_SRC_DIR (cache variable or environment): <dir>/data/cutlass/{include,tools/util/include}
#   3. the installed flashinfer-python package (importlib.util.find_spec, no import): the same data dir
#   4. the nvidia-cutlass package (a build requirement in pyproject.toml; cutlass_library/source/...),
#      so a plain `pip install .` on a machine with nvcc builds this backend without FlashInfer
# JAX_MOE_WITH_CUTLASS (default ON) builds it when the headers are found and JAX_MOE_CUDA_ARCHS
# includes 90a; otherwise the module is skipped with a status line and jax_moe.backends.cutlass says why.
# Only sm_90a code is generated for these TUs, whatever else the other CUDA targets build for.
# Instantiations: every (kind, tile) of ffi/cutlass/grouped_gemm.h (CutlassGemmKind x CutlassTile), one
# object file per range of consecutive kinds (the kind count is read from that header):
# ffi/cutlass/grouped_gemm_kind.cu compiled with JAX_MOE_CUTLASS_KIND_FIRST and _LAST, holding all of
# those kinds' tiles; the ranges compile in parallel. A range is one kind where the cores allow a job
# per kind, and up to three kinds where they do not (below).
#
# Why whole kinds per TU, not a (kind, tile) per TU: most of a TU's time is a fixed cost of the CUTLASS/CuTe
# headers (cudafe++ 6-10 s, cicc's parse, the host compile 5 s), paid once per TU. nvcc 13.0, one TU
# alone on an idle 2-core machine, wall: kind 0 (bf16) one tile 32-41 s each, its five tiles in five
# TUs 179 s, the same five in one TU 74 s (cicc 52 s where one tile's is 18-24 s; peak memory 6.1 GB
# against 3.3-3.7 GB). Per kind, five tiles in one TU: bf16 74 s, fp8 75 s, dgrad 68 s, wgrad 64 s,
# the three act kinds 41-44 s (3.7-4.0 GB): 409 s for all 35 instantiations, where kind 0 alone took
# 179 s as five TUs; the three scatter kinds added since, 38-46 s each (3.7-4.0 GB). The kernels are
# the same either way (their sm_90a code byte for byte). On many cores the 10 TUs run at once, so the
# build takes about as long as the slowest kind (~75 s); 50 one-tile TUs (32-41 s each) would finish
# sooner only with more than ~50 cores.
include_guard(GLOBAL)
include("${CMAKE_CURRENT_LIST_DIR}/find_flashinfer.cmake")

option(JAX_MOE_WITH_CUTLASS "Build jax_moe's CUTLASS SM90 grouped GEMM (needs CUTLASS headers and 90a)" ON)
set(CUTLASS_DIR "" CACHE PATH "A CUTLASS checkout (include/ and tools/util/include/) for jax_moe's CUTLASS kernels")

function(jax_moe_find_cutlass out_inc out_util)
  set(_cands "")
  if(CUTLASS_DIR)
    list(APPEND _cands "${CUTLASS_DIR}")
  elseif(DEFINED ENV{CUTLASS_DIR} AND NOT "$ENV{CUTLASS_DIR}" STREQUAL "")
    list(APPEND _cands "$ENV{CUTLASS_DIR}")
  endif()
  jax_moe_find_flashinfer_dir(_fi)
  if(_fi)
    list(APPEND _cands "${_fi}/data/cutlass")
  endif()
  if(Python_EXECUTABLE)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
        "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source') if s and s.submodule_search_locations else '')"
      OUTPUT_VARIABLE _nv OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_nv)
      list(APPEND _cands "${_nv}")
    endif()
  endif()
  foreach(_c IN LISTS _cands)
    if(EXISTS "${_c}/include/cutlass/gemm/group_array_problem_shape.hpp")
      set(${out_inc} "${_c}/include" PARENT_SCOPE)
      set(${out_util} "${_c}/tools/util/include" PARENT_SCOPE)
      return()
    endif()
  endforeach()
  set(${out_inc} "" PARENT_SCOPE)
  set(${out_util} "" PARENT_SCOPE)
endfunction()

# The value of `NAME = <int>` in ffi/cutlass/grouped_gemm.h (one place for the tile and kind counts).
function(jax_moe_header_count out name)
  file(STRINGS "${CMAKE_CURRENT_SOURCE_DIR}/ffi/cutlass/grouped_gemm.h" _line REGEX "${name} = [0-9]+")
  string(REGEX MATCH "${name} = ([0-9]+)" _m "${_line}")
  if(NOT CMAKE_MATCH_1)
    message(FATAL_ERROR "jax_moe: ${name} not found in ffi/cutlass/grouped_gemm.h")
  endif()
  set(${out} "${CMAKE_MATCH_1}" PARENT_SCOPE)
endfunction()

set(JAX_MOE_CUTLASS_STATUS "")
if(NOT JAX_MOE_WITH_CUTLASS)
  set(JAX_MOE_CUTLASS_STATUS "skipped: JAX_MOE_WITH_CUTLASS=OFF")
elseif(NOT "90a" IN_LIST _archs)
  set(JAX_MOE_CUTLASS_STATUS "skipped: JAX_MOE_CUDA_ARCHS (${_archs}) does not include 90a")
else()
  jax_moe_find_cutlass(_cutlass_inc _cutlass_util)
  if(NOT _cutlass_inc)
    set(JAX_MOE_CUTLASS_STATUS
        "skipped: CUTLASS headers not found (install nvidia-cutlass, or set CUTLASS_DIR or FLASHINFER_SRC_DIR)")
  else()
    # Ninja runs cores + 2 jobs at once by default. Each TU below holds a core and 3.7-6.8 GB for about
    # a minute, so they share a pool of one job per core and per 8 GB of memory (on 2 cores, 2 at a time
    # beat Ninja's default 3: 199 s against 232 s for six one-tile TUs; on many cores, memory bounds it).
    cmake_host_system_information(RESULT _cores QUERY NUMBER_OF_LOGICAL_CORES)
    cmake_host_system_information(RESULT _mem_mib QUERY TOTAL_PHYSICAL_MEMORY)
    math(EXPR _jobs "${_mem_mib} / 8192")
    if(_cores LESS _jobs)
      set(_jobs ${_cores})
    endif()
    if(_jobs LESS 1)
      set(_jobs 1)
    endif()
    set_property(GLOBAL APPEND PROPERTY JOB_POOLS jax_moe_cutlass_tus=${_jobs})
    jax_moe_header_count(_n_kinds kNumCutlassGemmKinds)
    jax_moe_header_count(_n_tiles kNumCutlassTiles)
    add_library(jax_moe_cutlass_kernels STATIC ffi/cutlass/grouped_gemm.cu ffi/cutlass/grouped_gemm_grad.cu)
    set(_cutlass_targets jax_moe_cutlass_kernels)
    # The kinds' TUs. With a job for each kind (many cores), a TU per kind: the build takes as long as
    # the slowest kind. With fewer jobs, consecutive kinds share a TU (at most three, and at least one
    # TU per job), which pays the headers' fixed cost once for them. On the 2-core machine (nvcc 13.0,
    # two compiles at a time) kind 4 took 126 s alone, 57 s with one tile, and kinds 4 and 6 in one TU
    # 184 s, where the two apart take about 250 s (peak memory 4.7 GB against 3.7 GB).
    # JAX_MOE_CUTLASS_TUS sets the count.
    set(JAX_MOE_CUTLASS_TUS "" CACHE STRING "TUs for the CUTLASS kinds (empty: from the cores and memory)")
    if(JAX_MOE_CUTLASS_TUS)
      set(_n_tus ${JAX_MOE_CUTLASS_TUS})
    elseif(_jobs LESS _n_kinds)
      math(EXPR _n_tus "(${_n_kinds} + 2) / 3")
      if(_n_tus LESS _jobs)
        set(_n_tus ${_jobs})
      endif()
    else()
      set(_n_tus ${_n_kinds})
    endif()
    if(_n_tus LESS 1 OR _n_tus GREATER _n_kinds)
      message(FATAL_ERROR "jax_moe: JAX_MOE_CUTLASS_TUS=${JAX_MOE_CUTLASS_TUS}: needs 1 to ${_n_kinds} (the kinds)")
    endif()
    # TU u holds kinds first..last, consecutive; the last (n_kinds % n_tus) TUs hold one kind more, as the
    # first kinds (bf16, FP8, dgrad, wgrad) are the slowest to compile.
    math(EXPR _per "${_n_kinds} / ${_n_tus}")
    math(EXPR _fuller_from "${_n_tus} - ${_n_kinds} % ${_n_tus}")
    set(_first 0)
    math(EXPR _last_tu "${_n_tus} - 1")
    foreach(_u RANGE ${_last_tu})
      set(_size ${_per})
      if(NOT _u LESS _fuller_from)
        math(EXPR _size "${_per} + 1")
      endif()
      math(EXPR _last "${_first} + ${_size} - 1")
      set(_t jax_moe_cutlass_gemm_k${_first})
      if(_last GREATER _first)
        set(_t jax_moe_cutlass_gemm_k${_first}_${_last})
      endif()
      add_library(${_t} OBJECT ffi/cutlass/grouped_gemm_kind.cu)
      target_compile_definitions(${_t} PRIVATE JAX_MOE_CUTLASS_KIND_FIRST=${_first} JAX_MOE_CUTLASS_KIND_LAST=${_last})
      set_target_properties(${_t} PROPERTIES JOB_POOL_COMPILE jax_moe_cutlass_tus)
      target_sources(jax_moe_cutlass_kernels PRIVATE $<TARGET_OBJECTS:${_t}>)
      list(APPEND _cutlass_targets ${_t})
      math(EXPR _first "${_last} + 1")
    endforeach()
    foreach(_t IN LISTS _cutlass_targets)
      set_target_properties(${_t} PROPERTIES CUDA_ARCHITECTURES OFF CUDA_STANDARD 17 POSITION_INDEPENDENT_CODE ON)
      target_include_directories(${_t} PRIVATE "${XLA_FFI_INCLUDE_DIR}")
      target_include_directories(${_t} SYSTEM PRIVATE "${_cutlass_inc}" "${_cutlass_util}")
      target_compile_options(${_t} PRIVATE
        -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -diag-suppress=940,2473)
    endforeach()

    nanobind_add_module(_jax_moe_cutlass NB_STATIC ffi/cutlass/module.cc)
    target_include_directories(_jax_moe_cutlass PRIVATE "${XLA_FFI_INCLUDE_DIR}")
    target_link_libraries(_jax_moe_cutlass PRIVATE jax_moe_cutlass_kernels CUDA::cudart_static)
    install(TARGETS _jax_moe_cutlass LIBRARY DESTINATION jax_moe)
    set(JAX_MOE_CUTLASS_STATUS
        "cutlass grouped gemms: ${_n_kinds} kinds x ${_n_tiles} tiles in ${_n_tus} TUs (sm_90a, ${_jobs} at a time; headers ${_cutlass_inc})")
  endif()
endif()
