# cmake/cutlass_gemm.cmake -- jax_moe's own CUTLASS kernels (issue 5): the SM90 bf16 grouped GEMM
# (ffi/cutlass_grouped_gemm*.cu) behind the XLA FFI target jax_moe_cutlass_grouped_gemm, in the nanobind
# module jax_moe._jax_moe_cutlass. Included from CMakeLists.txt once the CUDA language is enabled.
#
# CUTLASS is a header-only build dependency, looked up in this order (first hit wins):
#   1. CUTLASS_DIR (cache variable or environment): a CUTLASS checkout (include/, tools/util/include/)
#   2. FLASHINFER_SRC_DIR (cache variable or environment): <dir>/data/cutlass/{include,tools/util/include}
#   3. the installed flashinfer-python package (importlib.util.find_spec, no import): the same data dir
# JAX_MOE_WITH_CUTLASS (default ON) builds it when the headers are found and JAX_MOE_CUDA_ARCHS
# includes 90a; otherwise the module is skipped with a status line and jax_moe.backends.cutlass says why.
# Only sm_90a code is generated for these TUs, whatever else the other CUDA targets build for.
# Tiles: one TU per CUTLASS instantiation (ffi/cutlass_grouped_gemm_tile<N>.cu, see CutlassTile in
# ffi/cutlass_grouped_gemm.h), so they compile in parallel (~1 min each on one core).
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

set(JAX_MOE_CUTLASS_STATUS "")
if(NOT JAX_MOE_WITH_CUTLASS)
  set(JAX_MOE_CUTLASS_STATUS "skipped: JAX_MOE_WITH_CUTLASS=OFF")
elseif(NOT "90a" IN_LIST _archs)
  set(JAX_MOE_CUTLASS_STATUS "skipped: JAX_MOE_CUDA_ARCHS (${_archs}) does not include 90a")
else()
  jax_moe_find_cutlass(_cutlass_inc _cutlass_util)
  if(NOT _cutlass_inc)
    set(JAX_MOE_CUTLASS_STATUS
        "skipped: CUTLASS headers not found (set CUTLASS_DIR or FLASHINFER_SRC_DIR, or install flashinfer-python)")
  else()
    add_library(jax_moe_cutlass_kernels STATIC
      ffi/cutlass_grouped_gemm.cu ffi/cutlass_grouped_gemm_tile0.cu ffi/cutlass_grouped_gemm_tile1.cu)
    set_target_properties(jax_moe_cutlass_kernels PROPERTIES CUDA_ARCHITECTURES OFF CUDA_STANDARD 17)
    target_include_directories(jax_moe_cutlass_kernels PRIVATE "${XLA_FFI_INCLUDE_DIR}" ffi)
    target_include_directories(jax_moe_cutlass_kernels SYSTEM PRIVATE "${_cutlass_inc}" "${_cutlass_util}")
    target_compile_options(jax_moe_cutlass_kernels PRIVATE
      -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -diag-suppress=940,2473)

    nanobind_add_module(_jax_moe_cutlass NB_STATIC ffi/cutlass_module.cc)
    target_include_directories(_jax_moe_cutlass PRIVATE "${XLA_FFI_INCLUDE_DIR}" ffi)
    target_link_libraries(_jax_moe_cutlass PRIVATE jax_moe_cutlass_kernels CUDA::cudart_static)
    install(TARGETS _jax_moe_cutlass LIBRARY DESTINATION jax_moe)
    set(JAX_MOE_CUTLASS_STATUS "cutlass grouped gemm (sm_90a; headers ${_cutlass_inc})")
  endif()
endif()
