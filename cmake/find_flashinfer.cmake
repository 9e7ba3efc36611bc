# jax_moe_find_flashinfer_dir(<out_var>): the FlashInfer package directory (laid out like the
# wheel's flashinfer/: data/csrc, data/include, data/cutlass/...), from the FLASHINFER_SRC_DIR
# cache variable, else the FLASHINFER_SRC_DIR environment variable, else the installed
# flashinfer-python (found without importing it). Empty when none is found.
include_guard(GLOBAL)

function(jax_moe_find_flashinfer_dir out_var)
  set(_dir "")
  if(FLASHINFER_SRC_DIR)
    set(_dir "${FLASHINFER_SRC_DIR}")
  elseif(DEFINED ENV{FLASHINFER_SRC_DIR} AND NOT "$ENV{FLASHINFER_SRC_DIR}" STREQUAL "")
    set(_dir "$ENV{FLASHINFER_SRC_DIR}")
  elseif(Python_EXECUTABLE)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
        "import importlib.util as u; s = u.find_spec('flashinfer'); print(list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else '')"
      OUTPUT_VARIABLE _dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
  set(${out_var} "${_dir}" PARENT_SCOPE)
endfunction()

# jax_moe_cccl_dirs(<out_var>): CUDA 13 keeps CCCL (cuda/std/..., cub, thrust) in include/cccl,
# which nvcc adds by itself but the host compiler (TUs of FlashInfer's support code that include
# CUTLASS headers) does not: the toolkit's include/cccl directories that exist, else empty.
function(jax_moe_cccl_dirs out_var)
  set(_dirs "")
  foreach(_d ${CUDAToolkit_INCLUDE_DIRS})
    if(EXISTS "${_d}/cccl/cuda/std/utility")
      list(APPEND _dirs "${_d}/cccl")
    endif()
  endforeach()
  set(${out_var} "${_dirs}" PARENT_SCOPE)
endfunction()
