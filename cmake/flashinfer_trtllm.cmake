# cmake/flashinfer_trtllm.cmake -- FlashInfer's TRT-LLM gen fused MoE (SM100) behind a thin XLA FFI
# handlers (ffi/trtllm/handlers.cu): FP8 per-tensor, FP4 block scale (NVFP4 x NVFP4, MXFP4 x
# BF16, MXFP4 x MXFP8: one target) and DeepSeek FP8 block scale. Included by CMakeLists.txt when
# JAX_MOE_WITH_TRTLLM is ON (its default: ON when sm_100a, sm_100f or sm_103a is among the archs).
#
# Artifacts, installed side by side in jax_moe/ (the SM90 build is untouched):
#   libjax_moe_trtllm.so   FlashInfer's routing kernels, MoE runner, batched-GEMM runner, its support
#                          code, our handler and our cubin loader (ffi/trtllm/cubin_dir.cc)
#   _jax_moe_trtllm        nanobind glue (handler capsule, workspace / tile / config / cubin queries)
#
# Three inputs, none copied into this repository:
#   1. FlashInfer's sources (FLASHINFER_SRC_DIR or the installed flashinfer-python, as for the
#      CUTLASS build: cmake/find_flashinfer.cmake); checked against 0.7.2.post1.
#   2. The TRT-LLM gen batched-GEMM artifact pack: the directory FlashInfer downloads into its cubin
#      cache (<cubin root>/<ArtifactPath.TRTLLM_GEN_BMM>, the path read from FlashInfer's
#      artifacts.py). The build needs its include/flashinferMetaInfo.h (the kernel table) and
#      include/trtllmGen_bmm_export/*.h (the kernel parameter structs); they must be the pack the
#      cubins come from, so they are taken from there and never from anywhere else. Set
#      JAX_MOE_TRTLLM_BMM_DIR to the pack directory, or a cubin root (JAX_MOE_TRTLLM_CUBIN_DIR,
#      FLASHINFER_CUBIN_DIR, default ~/.cache/flashinfer/cubins) holding it. FlashInfer fills its
#      cache the first time it JIT-builds its own TRT-LLM MoE module (or `flashinfer download-cubin`).
#   3. At run time, the cubins of that pack, read from the cubin root by ffi/trtllm/cubin_dir.cc
#      (no download); jax_moe.backends.flashinfer_trtllm.missing_cubins() lists those missing.
# When (1) or (2) is missing the module is skipped with a status line saying why.
#
# Sources (paths relative to <flashinfer>/data/csrc), as FlashInfer's
# gen_trtllm_gen_fused_moe_sm100_module compiles them, minus its TVM-FFI launcher
# (trtllm_fused_moe_kernel_launcher.cu) and cubin_loader.h:
#   trtllm_fused_moe_runner.cu, trtllm_batched_gemm_runner.cu,
#   fused_moe/trtllm_backend/trtllm_fused_moe_{routing_runner,routing_deepseek,routing_llama4,
#     routing_custom_block,routing_custom_cluster,routing_custom_cluster_large,routing_custom_entry,
#     routing_common,dev_kernel}.cu,
#   nv_internal/cpp/kernels/quantization.cu, nv_internal/cpp/common/{envUtils,logger,stringUtils,
#     tllmException}.cpp, memoryUtils.cu (TRT-LLM support code, as cmake/flashinfer_moe.cmake).
# nvcc flags: -gencode for each SM100-family arch in JAX_MOE_CUDA_ARCHS, -DTLLM_GEN_EXPORT_INTERFACE
#   -DTLLM_GEN_EXPORT_FLASHINFER -DTLLM_ENABLE_CUDA -DENABLE_BF16 -DENABLE_FP8 -DENABLE_FP4
#   -DCUTLASS_ENABLE_GDC_FOR_SM100=1 -DTLLM_GEN_GEMM_CUBIN_PATH="<pack path relative to the root>".
#
# Result: JAX_MOE_TRTLLM_STATUS (a sentence, printed by CMakeLists.txt).
#
# Compile check (no GPU; 2-core machine, nvcc 13.0, FlashInfer 0.7.2.post1's wheel sources,
# bench/check_trtllm_build.sh). FlashInfer 0.7.2.post1 pins the pack
# 8ee504560a86b6c72b8c941d3003e8fb1804b1b6/batched_gemm-fdba669-16ba8ed, which no machine here has
# and no public place holds: FlashInfer's git dropped the export headers in March 2026 (the last
# in-tree copy, 8b0cf4bb0, lacks what 0.7.2 uses) and PyPI's newest flashinfer-cubin is 0.6.13. The
# stand-in was that wheel's pack, d2c5915bf45ae64308a947824c14966c2718a292/batched_gemm-91e0ba0-
# 896b90b (export 7.0.4.0.4.0, 2108 kernels), kept outside the repository, with one line added to
# its GemmGatedActOptions.h: gemmGatedAct::ActType::SiTuGlu before None (0.6.13's pack predates it;
# 0.7.2's KernelRunner.h static_asserts SiTuGlu == 2, None == 3). With it, for sm_100a, every TU
# compiles: the handler (163 s), trtllm_batched_gemm_runner (274 s), trtllm_fused_moe_runner (8 s),
# the routing TUs (custom_cluster 718 s, custom_cluster_large 520 s, custom_block 414 s,
# custom_entry 266 s, deepseek 192 s, llama4 43 s, dev_kernel 42 s, common 37 s, runner 9 s),
# quantization.cu (133 s), the support code (< 20 s each): 1363 s wall with ninja -j2 (times per
# TU from that run, two at a time). That link left TVMFFIBacktrace undefined (TVM_FFI_ICHECK in the
# custom routing); with ffi/trtllm/tvm_ffi_backtrace.cc added (relinked, batched-GEMM runner rebuilt
# alone in 140 s) the only undefined symbols left are the CUDA driver API (cuModuleLoadData,
# cuLaunchKernelEx, cuTensorMapEncodeTiled, ...; no libcuda stub here, they resolve from the driver
# JAX loads) and, in _jax_moe_trtllm, Python's C API and what libjax_moe_trtllm.so defines. The
# stand-in checks the build only: its kernel table is not 0.7.2's, so nothing built from it may run.
# With the FP4 block-scale handler added to the same TU, it recompiled alone in 204 s (ninja on a
# copy of that build tree reconfigured for the new checkout; FlashInfer's objects reused as built,
# the two libraries relinked with the commands ninja gives), and with the FP8 block-scale handler
# added too in 164 s; both times the link check above gave the same result: no undefined symbols
# beyond the driver API and Python's.

include_guard(GLOBAL)

set(JAX_MOE_TRTLLM_BMM_DIR "" CACHE PATH
    "FlashInfer's TRT-LLM gen batched-GEMM artifact pack (or a cubin root holding it)")
set(JAX_MOE_TRTLLM_STATUS "not configured")

function(_jax_moe_trtllm_skip why)
  set(JAX_MOE_TRTLLM_STATUS "skipped: ${why}" PARENT_SCOPE)
endfunction()

# ---------------------------------------------------------------- archs
set(_trtllm_archs "")
foreach(_a IN LISTS _archs)
  if(_a MATCHES "^(100a|100f|103a)$")
    list(APPEND _trtllm_archs "${_a}")
  endif()
endforeach()

macro(_trtllm_return why)  # a macro, so that return() leaves this file
  _jax_moe_trtllm_skip("${why}")
  return()
endmacro()

if(NOT _trtllm_archs)
  _trtllm_return("no SM100-family arch (100a, 100f, 103a) in JAX_MOE_CUDA_ARCHS")
endif()

# ---------------------------------------------------------------- FlashInfer sources
include("${CMAKE_CURRENT_LIST_DIR}/find_flashinfer.cmake")
jax_moe_find_flashinfer_dir(_tfi_dir)
if(_tfi_dir)
  get_filename_component(_tfi_dir "${_tfi_dir}" ABSOLUTE)
endif()
set(_tfi_csrc "${_tfi_dir}/data/csrc")
if(NOT _tfi_dir OR NOT EXISTS "${_tfi_csrc}/trtllm_fused_moe_runner.cu")
  _trtllm_return("FlashInfer sources not found (set FLASHINFER_SRC_DIR or install flashinfer-python)")
endif()

# ---------------------------------------------------------------- the BMM artifact pack
set(_bmm_rel "")
if(EXISTS "${_tfi_dir}/artifacts.py")
  file(STRINGS "${_tfi_dir}/artifacts.py" _art_lines)
  set(_in_bmm OFF)
  foreach(_l IN LISTS _art_lines)  # TRTLLM_GEN_BMM: str = ( "<hash>/batched_gemm-.../" )
    if(_l MATCHES "TRTLLM_GEN_BMM: str")
      set(_in_bmm ON)
    endif()
    if(_in_bmm AND _l MATCHES "\"([0-9a-f]+/batched_gemm[^\"]*)\"")
      set(_bmm_rel "${CMAKE_MATCH_1}")
      break()
    endif()
  endforeach()
endif()
string(REGEX REPLACE "/+$" "" _bmm_rel "${_bmm_rel}")

set(_bmm_candidates "")
foreach(_root "${JAX_MOE_TRTLLM_BMM_DIR}" "$ENV{JAX_MOE_TRTLLM_BMM_DIR}" "$ENV{JAX_MOE_TRTLLM_CUBIN_DIR}"
              "$ENV{FLASHINFER_CUBIN_DIR}" "$ENV{HOME}/.cache/flashinfer/cubins")
  if(_root)
    list(APPEND _bmm_candidates "${_root}")
    if(_bmm_rel)
      list(APPEND _bmm_candidates "${_root}/${_bmm_rel}")
    endif()
  endif()
endforeach()
set(_bmm_dir "")
foreach(_c IN LISTS _bmm_candidates)
  if(EXISTS "${_c}/include/flashinferMetaInfo.h" AND
     EXISTS "${_c}/include/trtllmGen_bmm_export/BatchedGemmInterface.h")
    set(_bmm_dir "${_c}")
    break()
  endif()
endforeach()
if(NOT _bmm_dir)
  _trtllm_return("the TRT-LLM gen batched-GEMM headers (include/flashinferMetaInfo.h, "
                 "include/trtllmGen_bmm_export/) were not found in the cubin pack "
                 "'${_bmm_rel}' under ${_bmm_candidates}; set JAX_MOE_TRTLLM_BMM_DIR")
endif()
# The cubin path relative to the cubin root is the found pack's own last two parts
# (<hash>/batched_gemm-...): its kernel table names the cubins, so they must come from the same pack,
# also when it is not the one this FlashInfer pins (said in the status line).
get_filename_component(_p1 "${_bmm_dir}" NAME)
get_filename_component(_p0 "${_bmm_dir}" DIRECTORY)
get_filename_component(_p0 "${_p0}" NAME)
set(_bmm_pin "${_bmm_rel}")
set(_bmm_rel "${_p0}/${_p1}")
set(_bmm_note "")
if(_bmm_pin AND NOT _bmm_pin STREQUAL _bmm_rel)
  set(_bmm_note "; NOT the pack this FlashInfer pins (${_bmm_pin})")
endif()
message(STATUS "jax_moe: TRT-LLM gen BMM pack: ${_bmm_dir} (cubin path '${_bmm_rel}'${_bmm_note})")

# ---------------------------------------------------------------- toolchain
get_property(_langs GLOBAL PROPERTY ENABLED_LANGUAGES)
if(NOT "CUDA" IN_LIST _langs)
  _trtllm_return("no CUDA compiler")
endif()
if(CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.8)
  _trtllm_return("nvcc >= 12.8 is needed for sm_100a")
endif()

# cuBLAS / cuRAND headers (headers only: FlashInfer's trtllm/common/cudaUtils.h includes cublasLt.h),
# looked up as cmake/flashinfer_moe.cmake does: $CUBLAS_INCLUDE_DIR / $CURAND_INCLUDE_DIR, the
# toolkit, pip's nvidia-* wheels; only those headers are copied into the build tree.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import importlib.util as u, glob, os\ns = u.find_spec('nvidia')\nfor d in (s.submodule_search_locations if s else []):\n    for p in sorted(glob.glob(os.path.join(d, '*', 'include'))): print(p)"
  OUTPUT_VARIABLE _tpy_nv_inc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
string(REPLACE "\n" ";" _tpy_nv_inc "${_tpy_nv_inc}")
set(_textra "${CMAKE_CURRENT_BINARY_DIR}/trtllm_extra_include")
foreach(_pair "CUBLAS;cublasLt.h" "CURAND;curand_kernel.h")
  list(GET _pair 0 _lib)
  list(GET _pair 1 _hdr)
  find_path(JAX_MOE_TRTLLM_${_lib}_INCLUDE_DIR ${_hdr}
            HINTS "$ENV{${_lib}_INCLUDE_DIR}" ${CUDAToolkit_INCLUDE_DIRS} ${_tpy_nv_inc} NO_DEFAULT_PATH)
  if(NOT JAX_MOE_TRTLLM_${_lib}_INCLUDE_DIR)
    _trtllm_return("${_hdr} not found (set ${_lib}_INCLUDE_DIR; the nvidia-${_lib} pip wheels ship it)")
  endif()
  string(TOLOWER "${_lib}" _lower)
  file(GLOB _hdrs "${JAX_MOE_TRTLLM_${_lib}_INCLUDE_DIR}/${_lower}*.h")
  file(COPY ${_hdrs} DESTINATION "${_textra}")
endforeach()

# TVM-FFI headers (headers only): FlashInfer's custom-routing kernels
# (fused_moe/trtllm_backend/trtllm_fused_moe_routing_custom.cuh) include tvm_ffi_utils.h and check
# their arguments with TVM_FFI_ICHECK. apache-tvm-ffi is a dependency of flashinfer-python; its
# wheel ships the headers (tvm_ffi.libinfo.find_include_path(), which also holds dlpack/). The one
# runtime symbol those checks reach, TVMFFIBacktrace, is defined by ffi/trtllm/tvm_ffi_backtrace.cc,
# so libtvm_ffi.so is neither linked nor needed at run time.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import tvm_ffi.libinfo as l; print(l.find_include_path())"
  OUTPUT_VARIABLE _ttvm_inc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT _ttvm_inc OR NOT EXISTS "${_ttvm_inc}/tvm/ffi/error.h")
  _trtllm_return("TVM-FFI headers not found (pip install apache-tvm-ffi, a flashinfer-python dependency)")
endif()

# FlashInfer includes "flashinfer/trtllm/batched_gemm/trtllmGen_bmm_export/...": link the pack's
# export headers there, in the build tree (FlashInfer's JIT does the same with a symlink).
set(_tgen "${CMAKE_CURRENT_BINARY_DIR}/trtllm_gen")
file(MAKE_DIRECTORY "${_tgen}/flashinfer/trtllm/batched_gemm")
file(CREATE_LINK "${_bmm_dir}/include/trtllmGen_bmm_export"
     "${_tgen}/flashinfer/trtllm/batched_gemm/trtllmGen_bmm_export" SYMBOLIC)

set(_tfi_sources
  "${_tfi_csrc}/trtllm_fused_moe_runner.cu"
  "${_tfi_csrc}/trtllm_batched_gemm_runner.cu"
  "${_tfi_csrc}/nv_internal/cpp/kernels/quantization.cu"
  "${_tfi_csrc}/nv_internal/cpp/common/envUtils.cpp"
  "${_tfi_csrc}/nv_internal/cpp/common/logger.cpp"
  "${_tfi_csrc}/nv_internal/cpp/common/stringUtils.cpp"
  "${_tfi_csrc}/nv_internal/cpp/common/tllmException.cpp"
  "${_tfi_csrc}/nv_internal/cpp/common/memoryUtils.cu")
foreach(_s routing_runner routing_deepseek routing_llama4 routing_custom_block routing_custom_cluster
           routing_custom_cluster_large routing_custom_entry routing_common dev_kernel)
  list(APPEND _tfi_sources "${_tfi_csrc}/fused_moe/trtllm_backend/trtllm_fused_moe_${_s}.cu")
endforeach()

jax_moe_cccl_dirs(_cccl_dirs)

set(_tgencode "")
foreach(_a IN LISTS _trtllm_archs)
  list(APPEND _tgencode "-gencode=arch=compute_${_a},code=sm_${_a}")
endforeach()

# Ours: the handlers, the runner cache, the workspace plan, the launch, the host queries, the cubin
# loader and the TVM-FFI backtrace stand-in.
set(_tjax_sources "")
foreach(_f handlers.cu runner.cu workspace_plan.cu launch.cu host_queries.cu cubin_dir.cc tvm_ffi_backtrace.cc)
  list(APPEND _tjax_sources "${CMAKE_CURRENT_LIST_DIR}/../ffi/trtllm/${_f}")
endforeach()
add_library(jax_moe_trtllm SHARED ${_tfi_sources} ${_tjax_sources})
target_compile_definitions(jax_moe_trtllm PRIVATE
  TLLM_GEN_EXPORT_INTERFACE TLLM_GEN_EXPORT_FLASHINFER TLLM_ENABLE_CUDA ENABLE_BF16 ENABLE_FP8
  ENABLE_FP4 CUTLASS_ENABLE_GDC_FOR_SM100=1 "TLLM_GEN_GEMM_CUBIN_PATH=\"${_bmm_rel}\"")
target_include_directories(jax_moe_trtllm PRIVATE
  "${_tgen}" "${_bmm_dir}/include" "${XLA_FFI_INCLUDE_DIR}"
  "${_tfi_csrc}" "${_tfi_csrc}/nv_internal" "${_tfi_csrc}/nv_internal/include")
target_include_directories(jax_moe_trtllm SYSTEM PRIVATE
  "${_tfi_dir}/data/include" "${_tfi_dir}/data/cutlass/include" "${_tfi_dir}/data/spdlog/include"
  ${CUDAToolkit_INCLUDE_DIRS} "${_textra}" "${_ttvm_inc}")
foreach(_d ${_cccl_dirs})
  target_include_directories(jax_moe_trtllm SYSTEM PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${_d}>)
endforeach()
target_compile_options(jax_moe_trtllm PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:${_tgencode} --expt-relaxed-constexpr -static-global-template-stub=false
    -diag-suppress=20012,177,550,186 -Xcompiler=-Wno-missing-field-initializers>
  $<$<COMPILE_LANGUAGE:CXX>:-Wno-deprecated-declarations>)
set_target_properties(jax_moe_trtllm PROPERTIES CUDA_ARCHITECTURES OFF CUDA_STANDARD 17
                                                CUDA_SEPARABLE_COMPILATION OFF)
target_link_libraries(jax_moe_trtllm PRIVATE CUDA::cudart_static)
# The batched-GEMM runner loads cubins through the driver API (cuModuleLoadData, cuLaunchKernelEx).
# Without the toolkit's libcuda stub (a CUDA-only container) the symbols stay undefined in the .so
# and resolve from the driver jaxlib loads; with it they are linked as usual.
if(TARGET CUDA::cuda_driver)
  target_link_libraries(jax_moe_trtllm PRIVATE CUDA::cuda_driver)
endif()
target_link_options(jax_moe_trtllm PRIVATE "-s")
install(TARGETS jax_moe_trtllm LIBRARY DESTINATION jax_moe)

nanobind_add_module(_jax_moe_trtllm NB_STATIC "${CMAKE_CURRENT_LIST_DIR}/../ffi/trtllm/module.cc")
target_link_libraries(_jax_moe_trtllm PRIVATE jax_moe_trtllm)
set_target_properties(_jax_moe_trtllm PROPERTIES INSTALL_RPATH "$ORIGIN"
                                                 BUILD_RPATH "$<TARGET_FILE_DIR:jax_moe_trtllm>")
install(TARGETS _jax_moe_trtllm LIBRARY DESTINATION jax_moe)

string(REPLACE ";" "," _tarch_str "${_trtllm_archs}")
set(JAX_MOE_TRTLLM_STATUS "building for ${_tarch_str} (FP8 per-tensor, FP4 and FP8 block scale; cubins from ${_bmm_rel}${_bmm_note})")
