# cmake/flashinfer_moe.cmake -- builds FlashInfer's CUTLASS fused-MoE runner (TensorRT-LLM's
# CutlassMoeFCRunner) for SM90 behind thin XLA FFI handlers (ffi/flashinfer/), for the
# quant schemes in JAX_MOE_FI_SCHEMES:
#   bf16   BF16 activations x BF16 weights -> BF16
#   f16    FP16 activations x FP16 weights -> FP16 (opt-in: not in the default list; the same
#          kernels as bf16 with half, built from the same tile/cluster/swap/finalize selection)
#   fp8    FP8 E4M3 activations (per-tensor scale) x FP8 E4M3 weights (per-tensor/expert) -> BF16
#   mxfp4  BF16 activations x MXFP4 weights (E2M1, E8M0 scale per 32) -> BF16: W4A16 (GPT-OSS) on
#          the SM90 mixed-input grouped GEMMs
#   fp8_block  BF16 activations (quantized to FP8 inside, per token per 128 columns) x FP8 E4M3
#          weights with a float32 scale per 128x128 block -> BF16 (DeepSeek-V3), on TensorRT-LLM's
#          block-scale grouped GEMM (opt-in: not in the default list)
#   w4a8   BF16 activations (quantized to FP8 E4M3 inside with a static per-channel pre-quant scale)
#          x signed int4 weights with a bf16 scale per 128 along K -> BF16, on the SM90 mixed-input
#          grouped GEMMs (FP8 x int4; opt-in: not in the default list)
# Two artifacts, installed side by side in jax_moe/:
#   libjax_moe_fi.so           kernels, runner, FFI handlers, host queries; no Python in it, so it
#                              can be built once on any machine with nvcc and reused
#                              (JAX_MOE_FI_PREBUILT=/path/libjax_moe_fi.so links it instead of
#                              compiling anything of FlashInfer)
#   _jax_moe_flashinfer        the nanobind glue (handler capsules, workspace/tactic queries)
#
# FlashInfer's sources are a build input and are never copied into this repository. They are found
#   1. through -DFLASHINFER_SRC_DIR=... or the FLASHINFER_SRC_DIR environment variable, pointing at
#      a directory laid out like the wheel's `flashinfer/` package directory, or
#   2. through the installed `flashinfer-python` package (importlib.util.find_spec, no import).
# Checked against flashinfer-python 0.7.2.post1. If nothing is found the module is skipped with a
# warning and jax_moe.backends.flashinfer_cutlass.available() says why.
#
# ---------------------------------------------------------------------------------------------
# What the build compiles (paths relative to <flashinfer>/data/csrc)
# ---------------------------------------------------------------------------------------------
# From FlashInfer, as they are:
#   nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/moe_gemm_tma_warp_specialized_input.cu
#       TmaWarpSpecializedGroupedGemmInput workspace/stride helpers.
#   nv_internal/tensorrt_llm/kernels/cutlass_kernels/cutlass_heuristic.cpp  (candidate tactics)
#   nv_internal/cpp/common/{envUtils,logger,stringUtils,tllmException}.cpp, memoryUtils.cu
#       (TRT-LLM support code: env knobs, logger, TllmException, string formatting).
# Generated here at configure time (into ${CMAKE_CURRENT_BINARY_DIR}/flashinfer_gen):
#   runner.cu  -- `template class CutlassMoeFCRunner<...>;` for every scheme, over
#       fused_moe/cutlass_backend/cutlass_fused_moe_kernels.cuh (routing/permute, activation,
#       finalize kernels and the runner's host logic). One TU: that header also defines plain
#       functions. bf16: <bf16, bf16>; f16: <half, half>; fp8: <fp8, fp8, bf16 out, fp8 in, bf16 backbone> (the input
#       arrives quantized, as in FlashInfer's binding); mxfp4: <bf16, Fp4Type> (FlashInfer's
#       isWFP4A16Quant runner; Fp4Type is cutlass::float_e2m1_t under COMPILE_HOPPER_TMA_GEMMS).
#   gemm_runner_<scheme>.cu -- `template class MoeGemmRunner<T, W, bf16>;` over
#       moe_gemm/moe_gemm_template_dispatch.h: tactic lists, the SM90 TMA dispatch, and the
#       SM80/SM89-style grouped GEMMs it compiles inline (the slowest TUs, ~4 min on one core;
#       mxfp4's has no SM80 kernels and only names the mixed-input launchers: under a minute).
#   sm90_<scheme>_moe_gemm_*.cu -- INSTANTIATE_TMA_WARP_SPECIALIZED_MOE_GEMM(Sm90, T, W, bf16, void,
#       EpilogueOpDefault, FUSION, M, N, K, CM, CN, 1, false, false, false, SWAP_AB) from
#       moe_gemm/launchers/moe_gemm_tma_ws_launcher.inl, grouped ~2 per TU. K is 128 bytes (64
#       bf16, 128 fp8). The SM90 dispatcher (moe_gemm_template_dispatch_tma_ws.h) can reach 72 per
#       scheme:
#         tiles (M x N): 128x16 128x32 128x64 128x128 128x256 256x128
#         clusters: 1x1x1, 2x1x1 always; 1x2x1 and 2x2x1 only when N >= 128
#         fusion: NONE, FINALIZE (fused top-k reduce in GEMM2's epilogue); swap_ab: false, true
#       -- the lines FlashInfer's generator (jit/gemm/cutlass/generate_kernels.py, "90") writes for
#       these types. Which are compiled is chosen with the cache variables below; the others get
#       throwing stubs (stubs.cu) so the library still links, and the handler only ever selects
#       compiled tactics (it reads the generated jax_moe_fi_kernels.h).
#   sm90_mxfp4_moe_gemm_*.cu (scheme mxfp4) -- `template void sm90_generic_mixed_moe_gemm_kernelLauncher<
#       bf16, Fp4Type, bf16, EpilogueOpDefault, Shape<M, N, K>, Shape<CM, CN, 1>, MAINLOOP,
#       TmaWarpSpecializedCooperative, FINEGRAINED_SCALE_ONLY, kPostMma>(...)` from
#       moe_gemm/launchers/moe_gemm_tma_ws_mixed_input_launcher.inl, one per TU -- the lines
#       FlashInfer's generator writes for bf16 x e2m1 (generate_sm90_mixed_type_grouped_gemm_
#       operations). The mixed-input dispatcher (moe_gemm_template_dispatch_tma_ws_mixed_dtype.h)
#       can reach 184: 29 tiles (M 64: N 16/32/64/128 x K 128/256/512; M 128: the same, plus
#       128x256x128/256; 256x128x128/256; 256x256x128) x 4 clusters x PINGPONG (and COOPERATIVE
#       when M >= 128). The runner's tactic list holds each tile once, with COOPERATIVE where
#       sm90_supports_coop (M >= 128 but not N >= 128 with K 512), else PINGPONG, always swap_ab
#       (the mixed-input GEMM requires it), never finalize-fused. Compiled: the tiles in
#       JAX_MOE_FI_MXFP4_TILES with their tactic-list schedule, for the clusters in
#       JAX_MOE_FI_SM90_CLUSTERS; 128x64x256 1x1x1 cooperative always (the runner sizes the GEMM
#       workspace with it). The default five (~2 min each on one core):
#         128x16x256, 128x32x256, 128x64x256  (few tokens per expert: N runs over tokens)
#         128x128x128, 128x256x128            (many tokens per expert)
#       (FlashInfer's binding skips K 256 with 128x256/256x128 and K 512 with N >= 128 for W4A16.)
#   sm90_w4a8_moe_gemm_*.cu (scheme w4a8) -- the same launcher for <__nv_fp8_e4m3, cutlass::uint4b_t,
#       bf16> (the generator's e4m3 x u4 x bf16 lines, kPostMma), one per TU: the tiles in
#       JAX_MOE_FI_W4A8_TILES (same dispatcher tiles, same tactic-list schedule rule), plus
#       128x64x512 1x1x1 cooperative always (the runner sizes the int4 GEMM workspace with K 512).
#       Default four: 128x16x256, 128x32x256, 128x64x256, 128x128x128. The runner
#       CutlassMoeFCRunner<fp8, uint4b_t, bf16, bf16> quantizes its bf16 input to FP8 with AWQ's
#       per-channel pre-quant scale (in the expand kernel) and the activation output with AWQ's
#       apply_per_channel_scale_kernel_launcher<bf16, fp8>: with w4a8 preQuantScaleKernel.cu is
#       compiled (and the <bf16, bf16> stub below is not emitted). Handler: W4a8Scales in
#       ffi/flashinfer/moe_handlers.cu.
#   fp8_block (KIND blockscale) compiles no MoE GEMM instantiation: the runner
#       CutlassMoeFCRunner<bf16, fp8> with use_deepseek_fp8_block_scale sends both GEMMs to
#       nv_internal/tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm.cu
#       (compiled as it is, with -DENABLE_FP8_BLOCK_SCALE on that file only: its 1x128 activation
#       quantizer and one precompiled 128x64x128 grouped kernel); gemm_runner_fp8_block.cu
#       (MoeGemmRunner<bf16, fp8, bf16>, which the runner names: no SM90 kernels, empty SM80
#       launchers for this type pair) is small. DeepGEMM's JIT path inside that GEMM is never
#       taken (no include directories are given to its compiler; it compiles with nvcc, not
#       NVRTC, so nothing links libnvrtc), and the driver functions its runtime names are hidden
#       stubs (ffi/flashinfer/deepgemm_stubs.cc, which also keeps its load-time cache directory
#       out of $HOME): no libcuda link. nvrtc.h (included by DeepGEMM's headers) is looked up like
#       the cuBLAS headers. Handler: ffi/flashinfer/fp8_block_handler.cu.
#   stubs.cu -- the throwing stubs above, throwing stubs for the 30 bf16 (and with f16, 30 half)
#       sm80_generic_fused_moe_gemm_kernelLauncher instantiations (the SM80 fused gated-GEMM
#       tactics; not used on SM90 unless JAX_MOE_FI_SM80_FUSED=ON), a throwing
#       tensorrt_llm::kernels::Lora_run (LoRA is not used; this avoids lora.cpp and cuBLAS
#       linkage -- cuBLAS *headers* are still needed because cudaUtils.h includes them), and with
#       mxfp4 or fp8_block (and without w4a8) a throwing apply_per_channel_scale_kernel_launcher<bf16, bf16>
#       (AWQ pre-quant scales, which the W4A16 runner names but MXFP4 never uses; avoids
#       preQuantScaleKernel.cu, which w4a8 needs).
# Not needed: FlashInfer's TVM-FFI binding, deepgemm_jit_setup.cu (and so no -lnvrtc),
#   fp8_blockscale_gemm.cu (fp8_block only), moe_gemm_mixed_utils.cu (the weight interleave for the mixed-input GEMM is jnp
#   here: jax_moe/layouts/mixed_gemm.py), preQuantScaleKernel.cu (but w4a8), lora.cpp, FlashInfer's
#   moe_gemm_kernels_<act>_<weight>.cu files (they instantiate output types we do not use), and the
#   generated files of other types and of plain GEMMs.
#
# Include directories: nv_internal, nv_internal/include, nv_internal/tensorrt_llm/cutlass_extensions/
#   include, nv_internal/tensorrt_llm/kernels/cutlass_kernels{,/include}, fused_moe/cutlass_backend,
#   <flashinfer>/data/{cutlass/include, cutlass/tools/util/include, include}, cuBLAS and cuRAND
#   headers (headers only).
# nvcc flags (FlashInfer's gen_cutlass_fused_moe_sm90_module, minus FP8 block scale / DeepGEMM):
#   -gencode=arch=compute_90a,code=sm_90a -std=c++17 --expt-relaxed-constexpr
#   -static-global-template-stub=false -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#   -DCOMPILE_HOPPER_TMA_GEMMS -DCOMPILE_HOPPER_TMA_GROUPED_GEMMS -DENABLE_BF16 -DENABLE_FP8
#   -DENABLE_FP4 -DUSING_OSS_CUTLASS_MOE_GEMM -DCUTLASS_ENABLE_GDC_FOR_SM90=1
#   -DFLASHINFER_ENABLE_FP8_E8M0 -DFLASHINFER_ENABLE_FP4_E2M1
#   ENABLE_FP8/ENABLE_FP4 change the layout of QuantParams and of the runner class, so every TU
#   (ffi/flashinfer/schemes.h and every TU of ours that includes it) must see the same set.
#
# Cache variables (each generated TU is ~1-2 min on one core; fewer tactics build faster):
#   JAX_MOE_FI_SCHEMES        quant schemes: bf16, fp8, mxfp4, fp8_block, f16, w4a8 (default bf16;fp8;mxfp4;
#                             pip passes the JAX_MOE_FI_SCHEMES environment variable)
#   JAX_MOE_FI_MXFP4_TILES    mixed-input tiles MxNxK for mxfp4 (default: the five above)
#   JAX_MOE_FI_W4A8_TILES     mixed-input tiles MxNxK for w4a8 (default: the four above)
#   JAX_MOE_FI_SM90_TILES     "all" or a list of MxN from the tile list above  (default all)
#   JAX_MOE_FI_SM90_CLUSTERS  "all" or a list of 1x1x1;2x1x1;1x2x1;2x2x1     (default 1x1x1)
#   JAX_MOE_FI_SM90_SWAP_AB   compile swap_ab variants (small-token tactics)  (default ON)
#   JAX_MOE_FI_SM90_FINALIZE  compile FINALIZE-fused GEMM2 variants           (default ON)
#   JAX_MOE_FI_SM80_FUSED     compile the SM80 fused gated GEMM launchers     (default OFF)
#   JAX_MOE_FI_INSTS_PER_TU   instantiations per generated TU (auto: ~12 TUs per scheme)
#   JAX_MOE_FI_PREBUILT       a libjax_moe_fi.so to link instead of compiling  (default none)
#   JAX_MOE_FI_NOSTRIP        keep symbols in libjax_moe_fi.so                 (default OFF)
#
# Measured build times: README.md ("FlashInfer CUTLASS build").
# ---------------------------------------------------------------------------------------------

include_guard(GLOBAL)

set(FLASHINFER_SRC_DIR "" CACHE PATH "FlashInfer package dir (laid out like the wheel's flashinfer/)")
set(JAX_MOE_FI_SM90_TILES "all" CACHE STRING "SM90 bf16 MoE GEMM tiles to compile (all or MxN list)")
set(JAX_MOE_FI_SM90_CLUSTERS "1x1x1" CACHE STRING "SM90 cluster shapes to compile (all or list)")
option(JAX_MOE_FI_SM90_SWAP_AB "Compile swap_ab SM90 MoE GEMM variants" ON)
option(JAX_MOE_FI_SM90_FINALIZE "Compile FINALIZE-fused SM90 MoE GEMM2 variants" ON)
option(JAX_MOE_FI_SM80_FUSED "Compile the SM80 fused gated-activation MoE GEMMs" OFF)
set(JAX_MOE_FI_INSTS_PER_TU "auto" CACHE STRING "MoE GEMM instantiations per generated TU (auto: ~12 TUs)")

set(JAX_MOE_FI_SCHEMES_DEFAULT "bf16;fp8;mxfp4")
set(JAX_MOE_FI_SCHEMES "${JAX_MOE_FI_SCHEMES_DEFAULT}" CACHE STRING
    "Quant schemes to build the runner for (bf16, fp8, mxfp4, fp8_block, f16, w4a8; empty: ${JAX_MOE_FI_SCHEMES_DEFAULT})")
if(NOT JAX_MOE_FI_SCHEMES)  # pip passes the JAX_MOE_FI_SCHEMES environment variable, "" if unset
  set(JAX_MOE_FI_SCHEMES "${JAX_MOE_FI_SCHEMES_DEFAULT}")
endif()
set(JAX_MOE_FI_MXFP4_TILES "128x16x256;128x32x256;128x64x256;128x128x128;128x256x128" CACHE STRING
    "SM90 mixed-input (mxfp4) MoE GEMM tiles MxNxK to compile (128x64x256 always is)")
set(JAX_MOE_FI_W4A8_TILES "128x16x256;128x32x256;128x64x256;128x128x128" CACHE STRING
    "SM90 mixed-input (w4a8: FP8 x int4) MoE GEMM tiles MxNxK to compile (128x64x512 always is)")
option(JAX_MOE_FI_NOSTRIP "Keep symbols in libjax_moe_fi.so (debugging)" OFF)
set(JAX_MOE_FI_PREBUILT "" CACHE FILEPATH
    "A libjax_moe_fi.so built before (same FlashInfer, schemes and options): link it, compile nothing of FlashInfer")

# The nanobind module jax_moe._jax_moe_flashinfer: only the Python glue (handler capsules, host
# queries); everything else lives in libjax_moe_fi.so next to it.
function(jax_moe_add_fi_module)
  if(NOT COMMAND nanobind_add_module)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -m nanobind --cmake_dir
      OUTPUT_VARIABLE _nb_dir OUTPUT_STRIP_TRAILING_WHITESPACE)
    find_package(nanobind CONFIG REQUIRED HINTS "${_nb_dir}")
  endif()
  nanobind_add_module(_jax_moe_flashinfer NB_STATIC "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/../ffi/flashinfer/module.cc")
  target_link_libraries(_jax_moe_flashinfer PRIVATE jax_moe_fi)
  set_target_properties(_jax_moe_flashinfer PROPERTIES INSTALL_RPATH "$ORIGIN" BUILD_RPATH "$<TARGET_FILE_DIR:jax_moe_fi>")
  install(TARGETS _jax_moe_flashinfer LIBRARY DESTINATION jax_moe)
endfunction()

if(JAX_MOE_FI_PREBUILT)
  if(NOT EXISTS "${JAX_MOE_FI_PREBUILT}")
    message(FATAL_ERROR "jax_moe: JAX_MOE_FI_PREBUILT=${JAX_MOE_FI_PREBUILT} does not exist")
  endif()
  message(STATUS "jax_moe: FlashInfer MoE: linking the prebuilt ${JAX_MOE_FI_PREBUILT}")
  add_library(jax_moe_fi SHARED IMPORTED)
  set_target_properties(jax_moe_fi PROPERTIES IMPORTED_LOCATION "${JAX_MOE_FI_PREBUILT}"
                                              IMPORTED_SONAME "libjax_moe_fi.so")
  jax_moe_add_fi_module()
  install(FILES "${JAX_MOE_FI_PREBUILT}" DESTINATION jax_moe RENAME libjax_moe_fi.so)
  return()
endif()

# ---------------------------------------------------------------------------- locate sources
if(NOT Python_EXECUTABLE)
  find_package(Python 3.10 COMPONENTS Interpreter Development.Module REQUIRED)
endif()

include("${CMAKE_CURRENT_LIST_DIR}/find_flashinfer.cmake")
jax_moe_find_flashinfer_dir(_fi_dir)
get_filename_component(_fi_dir "${_fi_dir}" ABSOLUTE)
set(_fi_csrc "${_fi_dir}/data/csrc")
set(_fi_runner_cuh "${_fi_csrc}/fused_moe/cutlass_backend/cutlass_fused_moe_kernels.cuh")
if(NOT _fi_dir OR NOT EXISTS "${_fi_runner_cuh}")
  message(WARNING "jax_moe: FlashInfer sources not found (set FLASHINFER_SRC_DIR or install "
                  "flashinfer-python); skipping jax_moe._jax_moe_flashinfer")
  return()
endif()
message(STATUS "jax_moe: FlashInfer sources: ${_fi_dir}")

# ---------------------------------------------------------------------------- toolchain bits
include(CheckLanguage)
get_property(_langs GLOBAL PROPERTY ENABLED_LANGUAGES)
if(NOT "CUDA" IN_LIST _langs)
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    message(WARNING "jax_moe: no CUDA compiler; skipping jax_moe._jax_moe_flashinfer")
    return()
  endif()
  enable_language(CUDA)
endif()
find_package(CUDAToolkit REQUIRED)
if(CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.8)
  message(WARNING "jax_moe: FlashInfer's SM90 MoE needs nvcc >= 12.8; skipping")
  return()
endif()

# cuBLAS and cuRAND headers: cudaUtils.h includes cublas_v2.h / cublasLt.h, the runner's kernels
# include curand_kernel.h. Headers only -- nothing links against cuBLAS or cuRAND. Looked up in
# $CUBLAS_INCLUDE_DIR / $CURAND_INCLUDE_DIR, the CUDA toolkit, pip's nvidia-* wheels, and
# <FLASHINFER_SRC_DIR>/../cuda_extra/include.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import importlib.util as u, glob, os\ns = u.find_spec('nvidia')\nfor d in (s.submodule_search_locations if s else []):\n    for p in sorted(glob.glob(os.path.join(d, '*', 'include'))): print(p)"
  OUTPUT_VARIABLE _py_nv_inc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
string(REPLACE "\n" ";" _py_nv_inc "${_py_nv_inc}")
set(_hdr_pairs "CUBLAS,cublas_v2.h" "CURAND,curand_kernel.h")
if("fp8_block" IN_LIST JAX_MOE_FI_SCHEMES)  # DeepGEMM's headers (fp8_blockscale_gemm.cu) include it
  list(APPEND _hdr_pairs "NVRTC,nvrtc.h")
endif()
foreach(_pair ${_hdr_pairs})
  string(REPLACE "," ";" _pair "${_pair}")
  list(GET _pair 0 _lib)
  list(GET _pair 1 _hdr)
  set(_hints ${CUDAToolkit_INCLUDE_DIRS} ${_py_nv_inc} "${_fi_dir}/../cuda_extra/include")
  if(DEFINED ENV{${_lib}_INCLUDE_DIR})
    list(PREPEND _hints "$ENV{${_lib}_INCLUDE_DIR}")
  endif()
  find_path(JAX_MOE_${_lib}_INCLUDE_DIR ${_hdr} HINTS ${_hints} NO_DEFAULT_PATH)
  if(NOT JAX_MOE_${_lib}_INCLUDE_DIR)
    find_path(JAX_MOE_${_lib}_INCLUDE_DIR ${_hdr})
  endif()
  if(NOT JAX_MOE_${_lib}_INCLUDE_DIR)
    message(WARNING "jax_moe: ${_hdr} not found; set ${_lib}_INCLUDE_DIR (headers come with the "
                    "nvidia-${_lib} pip wheels); skipping jax_moe._jax_moe_flashinfer")
    return()
  endif()
  message(STATUS "jax_moe: ${_hdr} in ${JAX_MOE_${_lib}_INCLUDE_DIR}")
  # Copy just this library's headers, so that a pip include dir (which also holds cuda_runtime.h
  # etc. of some other CUDA minor version) never shadows the toolkit's headers.
  string(TOLOWER "${_lib}" _lower)
  file(GLOB _hdrs "${JAX_MOE_${_lib}_INCLUDE_DIR}/${_lower}*.h")
  file(COPY ${_hdrs} DESTINATION "${CMAKE_CURRENT_BINARY_DIR}/flashinfer_extra_include")
endforeach()
set(_extra_inc_dirs "${CMAKE_CURRENT_BINARY_DIR}/flashinfer_extra_include")
jax_moe_cccl_dirs(_cccl_dirs)

# XLA FFI headers: from the root CMakeLists when it already found them, else from jax.
if(NOT JAX_MOE_XLA_FFI_INCLUDE_DIR)
  foreach(_v XLA_FFI_INCLUDE_DIR XLA_INCLUDE_DIR JAX_FFI_INCLUDE_DIR)
    if(${_v})
      set(JAX_MOE_XLA_FFI_INCLUDE_DIR "${${_v}}")
      break()
    endif()
  endforeach()
endif()
if(NOT JAX_MOE_XLA_FFI_INCLUDE_DIR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import jax.ffi; print(jax.ffi.include_dir())"
    OUTPUT_VARIABLE JAX_MOE_XLA_FFI_INCLUDE_DIR OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()
if(NOT EXISTS "${JAX_MOE_XLA_FFI_INCLUDE_DIR}/xla/ffi/api/ffi.h")
  message(WARNING "jax_moe: XLA FFI headers not found; skipping jax_moe._jax_moe_flashinfer")
  return()
endif()

# ---------------------------------------------------------------------------- common settings
add_library(jax_moe_fi_config INTERFACE)
target_compile_definitions(jax_moe_fi_config INTERFACE
  CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED COMPILE_HOPPER_TMA_GEMMS COMPILE_HOPPER_TMA_GROUPED_GEMMS
  ENABLE_BF16 ENABLE_FP8 ENABLE_FP4 USING_OSS_CUTLASS_MOE_GEMM CUTLASS_ENABLE_GDC_FOR_SM90=1
  FLASHINFER_ENABLE_FP8_E8M0 FLASHINFER_ENABLE_FP4_E2M1)
target_include_directories(jax_moe_fi_config INTERFACE
  "${_fi_csrc}/nv_internal"
  "${_fi_csrc}/nv_internal/include"
  "${_fi_csrc}/nv_internal/tensorrt_llm/cutlass_extensions/include"
  "${_fi_csrc}/nv_internal/tensorrt_llm/kernels/cutlass_kernels/include"
  "${_fi_csrc}/nv_internal/tensorrt_llm/kernels/cutlass_kernels"
  "${_fi_csrc}/fused_moe/cutlass_backend"
  "${CMAKE_CURRENT_BINARY_DIR}/flashinfer_gen")
target_include_directories(jax_moe_fi_config SYSTEM INTERFACE
  "${_fi_dir}/data/cutlass/include"
  "${_fi_dir}/data/cutlass/tools/util/include"
  "${_fi_dir}/data/include"
  ${CUDAToolkit_INCLUDE_DIRS}
  ${_extra_inc_dirs})
target_compile_features(jax_moe_fi_config INTERFACE cxx_std_17 cuda_std_17)
target_compile_options(jax_moe_fi_config INTERFACE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -static-global-template-stub=false
    -diag-suppress=20012,177,550,186>
  $<$<COMPILE_LANGUAGE:CXX>:-Wno-deprecated-declarations>)
foreach(_d ${_cccl_dirs})
  target_include_directories(jax_moe_fi_config SYSTEM INTERFACE $<$<COMPILE_LANGUAGE:CXX>:${_d}>)
endforeach()

# ---------------------------------------------------------------------------- generated sources
set(_gen "${CMAKE_CURRENT_BINARY_DIR}/flashinfer_gen")
file(MAKE_DIRECTORY "${_gen}")

set(_all_tiles "128x16" "128x32" "128x64" "128x128" "128x256" "256x128")
if(JAX_MOE_FI_SM90_TILES STREQUAL "all")
  set(_tiles ${_all_tiles})
else()
  set(_tiles ${JAX_MOE_FI_SM90_TILES})
endif()
if(JAX_MOE_FI_SM90_CLUSTERS STREQUAL "all")
  set(_clusters "1x1x1" "2x1x1" "1x2x1" "2x2x1")
else()
  set(_clusters ${JAX_MOE_FI_SM90_CLUSTERS})
endif()

# Per scheme: activation type, weight type, output type, runner template arguments, K tile in
# elements (128 bytes), and its id in the generated tactic table (Scheme::kId, ffi/flashinfer/schemes.h).
set(_scheme_bf16_T "__nv_bfloat16")
set(_scheme_bf16_W "__nv_bfloat16")
set(_scheme_bf16_O "__nv_bfloat16")
set(_scheme_bf16_RUNNER "__nv_bfloat16, __nv_bfloat16")
set(_scheme_bf16_K 64)
set(_scheme_bf16_ID 0)
set(_scheme_fp8_T "__nv_fp8_e4m3")
set(_scheme_fp8_W "__nv_fp8_e4m3")
set(_scheme_fp8_O "__nv_bfloat16")
# FlashInfer's binding for FP8 per-tensor with bf16 output: the input arrives quantized (FP8).
set(_scheme_fp8_RUNNER "__nv_fp8_e4m3, __nv_fp8_e4m3, __nv_bfloat16, __nv_fp8_e4m3, __nv_bfloat16")
set(_scheme_fp8_K 128)
set(_scheme_fp8_ID 1)
# W4A16 (GPT-OSS): bf16 activations x MXFP4 weights (E2M1 codes, E8M0 scales per 32 along K)
# -> bf16, FlashInfer's isWFP4A16Quant runner. Its GEMMs are the SM90 mixed-input ones
# (KIND mixed, see the header comment), not the TMA WS ones of the other schemes.
set(_scheme_mxfp4_T "__nv_bfloat16")
set(_scheme_mxfp4_W "tensorrt_llm::kernels::cutlass_kernels::Fp4Type")
set(_scheme_mxfp4_O "__nv_bfloat16")
set(_scheme_mxfp4_RUNNER "__nv_bfloat16, Fp4Type")
set(_scheme_mxfp4_KIND "mixed")
set(_scheme_mxfp4_ID 2)
set(_scheme_mxfp4_TILES ${JAX_MOE_FI_MXFP4_TILES})
# calcMaxWorkspaceSizeTmaWarpSpecializedMixedInput sizes the GEMM workspace with this kernel (FP4
# weights: K tile 256, cooperative, 1x1x1), so it is always compiled.
set(_scheme_mxfp4_WS_TILE "128x64x256")
# DeepSeek-V3 FP8 block scale: bf16 activations (the block-scale GEMM quantizes them) x FP8
# weights -> bf16, FlashInfer's use_deepseek_fp8_block_scale runner (KIND blockscale, see the
# header comment: no MoE GEMM instantiations).
set(_scheme_fp8_block_T "__nv_bfloat16")
set(_scheme_fp8_block_W "__nv_fp8_e4m3")
set(_scheme_fp8_block_O "__nv_bfloat16")
set(_scheme_fp8_block_RUNNER "__nv_bfloat16, __nv_fp8_e4m3")
set(_scheme_fp8_block_KIND "blockscale")
set(_scheme_fp8_block_ID 3)
# FP16 activations x FP16 weights -> FP16 (opt-in): bf16's kernels with half (FlashInfer's
# CutlassMoeFCRunner<half, half>, MoeGemmRunner<half, half, half>; K tile 64, 128 bytes). Its
# biases are half too (the runner's ScaleBiasType is its output type).
set(_scheme_f16_T "half")
set(_scheme_f16_W "half")
set(_scheme_f16_O "half")
set(_scheme_f16_RUNNER "half, half")
set(_scheme_f16_K 64)
set(_scheme_f16_ID 4)
# W4A8: FP8 E4M3 activations x signed int4 weights with bf16 scales per
# 128 along K -> bf16, FlashInfer's isW4AFp8Quant runner with use_w4_group_scaling on bf16 input:
# CutlassMoeFCRunner<fp8, uint4b_t, bf16 out, bf16 in> (the runner quantizes the bf16 input itself,
# with the AWQ pre-quant scale). Its GEMMs are the SM90 mixed-input ones (KIND mixed); int4 weights:
# the workspace kernel has K tile 512.
set(_scheme_w4a8_T "__nv_fp8_e4m3")
set(_scheme_w4a8_W "cutlass::uint4b_t")
set(_scheme_w4a8_O "__nv_bfloat16")
set(_scheme_w4a8_RUNNER "__nv_fp8_e4m3, cutlass::uint4b_t, __nv_bfloat16, __nv_bfloat16")
set(_scheme_w4a8_KIND "mixed")
set(_scheme_w4a8_ID 5)
set(_scheme_w4a8_TILES ${JAX_MOE_FI_W4A8_TILES})
set(_scheme_w4a8_WS_TILE "128x64x512")
foreach(_s ${JAX_MOE_FI_SCHEMES})
  if(NOT DEFINED _scheme_${_s}_T)
    message(FATAL_ERROR "jax_moe: JAX_MOE_FI_SCHEMES: unknown scheme '${_s}' (known: bf16, fp8, mxfp4, fp8_block, f16, w4a8)")
  endif()
endforeach()

# The SM90 mixed-input dispatcher (moe_gemm_template_dispatch_tma_ws_mixed_dtype.h) reaches these
# tiles (M x N x K as in CutlassTileConfigSM90's names, the template's CTA shape) with every
# cluster 1x1x1, 2x1x1, 1x2x1, 2x2x1, and with the PINGPONG and (M >= 128) COOPERATIVE mainloop.
# The runner's tactic list (cutlass_heuristic.cpp, WEIGHT_ONLY | GROUPED_GEMM) offers each tile
# with one schedule: COOPERATIVE where sm90_supports_coop (M >= 128 except N >= 128 with K = 512),
# else PINGPONG; every mixed-input tactic is swap_ab and none is finalize-fused.
set(_mixed_all_tiles "")
foreach(_m 64 128)
  foreach(_n 16 32 64 128)
    foreach(_k 128 256 512)
      list(APPEND _mixed_all_tiles "${_m}x${_n}x${_k}")
    endforeach()
  endforeach()
endforeach()
list(APPEND _mixed_all_tiles "128x256x128" "128x256x256" "256x128x128" "256x128x256" "256x256x128")
# Per mixed scheme: its tile list (JAX_MOE_FI_<SCHEME>_TILES) plus the workspace-sizing tile.
foreach(_s mxfp4 w4a8)
  set(_scheme_${_s}_MIXED_TILES ${_scheme_${_s}_TILES})
  if(NOT _scheme_${_s}_WS_TILE IN_LIST _scheme_${_s}_MIXED_TILES)
    list(APPEND _scheme_${_s}_MIXED_TILES "${_scheme_${_s}_WS_TILE}")
  endif()
  foreach(_t ${_scheme_${_s}_MIXED_TILES})
    if(NOT _t IN_LIST _mixed_all_tiles)
      string(TOUPPER "${_s}" _S)
      message(FATAL_ERROR "jax_moe: JAX_MOE_FI_${_S}_TILES: '${_t}' is not a tile the mixed-input "
                          "dispatcher knows (${_mixed_all_tiles})")
    endif()
  endforeach()
endforeach()
set(_mixed_sched_coop "cutlass::gemm::KernelTmaWarpSpecializedCooperative")
set(_mixed_sched_ping "cutlass::gemm::KernelTmaWarpSpecializedPingpong")
# tensorrt_llm::cutlass_extensions::MainloopScheduleType values (gemm_configs.h)
set(_mainloop_enum_ping 1)  # PINGPONG
set(_mainloop_enum_coop 2)  # COOPERATIVE

set(_spec_args "(TmaWarpSpecializedGroupedGemmInput, int, int, cudaStream_t, int*, size_t*, cute::Shape<int32_t, int32_t, cute::_1>, cute::Shape<int32_t, int32_t, cute::_1>)")
set(_compiled_rows "")
set(_stub_body "")
set(_gen_sources "")
set(_big_sources "")
set(_n_compiled_all 0)
set(_n_stubbed 0)
set(_scheme_defs "")
set(_runner_insts "")

# The grouped-GEMM runner of scheme _s (tactic lists, SM90 TMA dispatch, and the SM80/SM89-style
# kernels it compiles inline) and its fused-MoE runner (routing, permute, activation, finalize).
macro(_jax_moe_fi_add_runner _s)
  file(CONFIGURE OUTPUT "${_gen}/gemm_runner_${_s}.cu" CONTENT
"// Generated by cmake/flashinfer_moe.cmake -- do not edit.
#include \"tensorrt_llm/kernels/cutlass_kernels/moe_gemm/moe_gemm_template_dispatch.h\"
namespace tensorrt_llm::kernels::cutlass_kernels {
template class MoeGemmRunner<${_T}, ${_W}, ${_O}>;
}
" @ONLY)
  string(APPEND _runner_insts "template class CutlassMoeFCRunner<${_scheme_${_s}_RUNNER}>;\n")
  list(APPEND _big_sources "${_gen}/gemm_runner_${_s}.cu")
endmacro()

foreach(_s ${JAX_MOE_FI_SCHEMES})
  set(_T "${_scheme_${_s}_T}")
  set(_W "${_scheme_${_s}_W}")
  set(_O "${_scheme_${_s}_O}")
  set(_K "${_scheme_${_s}_K}")
  set(_id "${_scheme_${_s}_ID}")
  string(TOUPPER "${_s}" _S)
  list(APPEND _scheme_defs "JAX_MOE_FI_WITH_${_S}=1")
  if(_scheme_${_s}_KIND STREQUAL "blockscale")  # both GEMMs on the block-scale GEMM
    _jax_moe_fi_add_runner(${_s})
    message(STATUS "jax_moe: FlashInfer SM90 ${_s}: the FP8 block-scale grouped GEMM (no MoE GEMM instantiations)")
    continue()
  endif()
  set(_insts "")
  if(_scheme_${_s}_KIND STREQUAL "mixed")
    set(_mixed_tiles ${_scheme_${_s}_MIXED_TILES})
    set(_mixed_workspace_tile "${_scheme_${_s}_WS_TILE}")
    # sm90_generic_mixed_moe_gemm_kernelLauncher<T, W, Out, EpilogueOpDefault, CTA, cluster,
    # mainloop, TmaWarpSpecializedCooperative epilogue, FINEGRAINED_SCALE_ONLY, kPostMma>, the
    # lines FlashInfer's generator writes for bf16 x e2m1 and e4m3 x u4 (generate_kernels.py,
    # generate_sm90_mixed_type_grouped_gemm_operations) for moe_gemm_tma_ws_mixed_input_launcher.inl.
    set(_inl "moe_gemm_tma_ws_mixed_input_launcher.inl")
    set(_head "void sm90_generic_mixed_moe_gemm_kernelLauncher<${_T}, ${_W}, ${_O}, tensorrt_llm::cutlass_extensions::EpilogueOpDefault")
    set(_tail "cutlass::epilogue::TmaWarpSpecializedCooperative, cutlass::WeightOnlyQuantOp::FINEGRAINED_SCALE_ONLY, cutlass::gemm::collective::MixedInputScaleMode::kPostMma>(tensorrt_llm::kernels::cutlass_kernels::GroupedGemmInput<${_T}, ${_W}, ${_O}, ${_O}> inputs, TmaWarpSpecializedGroupedGemmInput hopper_inputs, int sm_count_, size_t* workspace_size)")
    foreach(_tile ${_mixed_all_tiles})
      string(REPLACE "x" ";" _mnk "${_tile}")
      list(GET _mnk 0 _tm)
      list(GET _mnk 1 _tn)
      list(GET _mnk 2 _tk)
      # the tactic list's schedule for this tile
      set(_tactic_sched "ping")
      if(_tm GREATER_EQUAL 128 AND NOT (_tn GREATER_EQUAL 128 AND _tk EQUAL 512))
        set(_tactic_sched "coop")
      endif()
      foreach(_cl "1x1x1" "2x1x1" "1x2x1" "2x2x1")
        string(REPLACE "x" ";" _c "${_cl}")
        list(GET _c 0 _cm)
        list(GET _c 1 _cn)
        set(_scheds "ping")
        if(_tm GREATER_EQUAL 128)
          list(APPEND _scheds "coop")
        endif()
        foreach(_sched ${_scheds})
          set(_shapes "cute::Shape<cute::Int<${_tm}>, cute::Int<${_tn}>, cute::Int<${_tk}>>, cute::Shape<cute::Int<${_cm}>, cute::Int<${_cn}>, cute::Int<1>>, ${_mixed_sched_${_sched}}")
          set(_want FALSE)
          if(_tile IN_LIST _mixed_tiles AND _sched STREQUAL _tactic_sched AND
             (_cl IN_LIST _clusters OR (_tile STREQUAL _mixed_workspace_tile AND _cl STREQUAL "1x1x1")))
            set(_want TRUE)
          endif()
          if(_want)
            list(APPEND _insts "template ${_head}, ${_shapes}, ${_tail}")
            string(APPEND _compiled_rows "    {${_id}, ${_tm}, ${_tn}, ${_tk}, ${_cm}, ${_cn}, 0, 1, ${_mainloop_enum_${_sched}}},\n")
          else()
            string(APPEND _stub_body "template <> ${_head}, ${_shapes}, ${_tail} {\n  TLLM_THROW(\"jax_moe: SM90 ${_s} mixed-input MoE GEMM ${_tm}x${_tn}x${_tk} cluster ${_cl} ${_sched} was not compiled (see cmake/flashinfer_moe.cmake)\");\n}\n")
            math(EXPR _n_stubbed "${_n_stubbed} + 1")
          endif()
        endforeach()
      endforeach()
    endforeach()
    set(_per_tu_auto 1)  # ~3-4 min per instantiation on one core: one per TU
  else()
    set(_inl "moe_gemm_tma_ws_launcher.inl")
    set(_inst_prefix "INSTANTIATE_TMA_WARP_SPECIALIZED_MOE_GEMM(Sm90, ${_T}, ${_W}, ${_O}, void, EpilogueOpDefault")
    set(_spec_prefix "template <> void tma_warp_specialized_generic_moe_gemm_kernelLauncher<cutlass::arch::Sm90, ${_T}, ${_W}, ${_O}, void, tensorrt_llm::cutlass_extensions::EpilogueOpDefault")
    foreach(_fusion NONE FINALIZE)
      foreach(_tile ${_all_tiles})
        string(REPLACE "x" ";" _mn "${_tile}")
        list(GET _mn 0 _tm)
        list(GET _mn 1 _tn)
        foreach(_cl "1x1x1" "2x1x1" "1x2x1" "2x2x1")
          string(REPLACE "x" ";" _c "${_cl}")
          list(GET _c 0 _cm)
          list(GET _c 1 _cn)
          if((_cn EQUAL 2) AND (_tn LESS 128))
            continue()  # the dispatcher never reaches it (are_tile_shapes_supported)
          endif()
          foreach(_swap false true)
            set(_want TRUE)
            if(NOT _tile IN_LIST _tiles OR NOT _cl IN_LIST _clusters)
              set(_want FALSE)
            endif()
            if(_fusion STREQUAL "FINALIZE" AND NOT JAX_MOE_FI_SM90_FINALIZE)
              set(_want FALSE)
            endif()
            if(_swap STREQUAL "true" AND NOT JAX_MOE_FI_SM90_SWAP_AB)
              set(_want FALSE)
            endif()
            if(_want)
              list(APPEND _insts
                "${_inst_prefix}, ${_fusion}, ${_tm}, ${_tn}, ${_K}, ${_cm}, ${_cn}, 1, false, false, false, ${_swap})")
              set(_fz 0)
              if(_fusion STREQUAL "FINALIZE")
                set(_fz 1)
              endif()
              set(_sw 0)
              if(_swap STREQUAL "true")
                set(_sw 1)
              endif()
              string(APPEND _compiled_rows "    {${_id}, ${_tm}, ${_tn}, 128, ${_cm}, ${_cn}, ${_fz}, ${_sw}, -1},\n")
            else()
              string(APPEND _stub_body
                "${_spec_prefix}, TmaWarpSpecializedGroupedGemmInput::EpilogueFusion::${_fusion}, cute::Shape<cute::Int<${_tm}>, cute::Int<${_tn}>, cute::Int<${_K}>>, cute::Shape<cute::Int<${_cm}>, cute::Int<${_cn}>, cute::Int<1>>, false, false, false, ${_swap}>${_spec_args} {\n  TLLM_THROW(\"jax_moe: SM90 ${_s} MoE GEMM ${_fusion} ${_tm}x${_tn}x${_K} cluster ${_cl} swap_ab=${_swap} was not compiled (see cmake/flashinfer_moe.cmake)\");\n}\n")
              math(EXPR _n_stubbed "${_n_stubbed} + 1")
            endif()
          endforeach()
        endforeach()
      endforeach()
    endforeach()
    # Header parsing dominates (~1 min per TU, ~10 s per extra instantiation on one core), so
    # group the instantiations into about 12 TUs per scheme: enough to keep 16 cores busy.
    list(LENGTH _insts _n)
    math(EXPR _per_tu_auto "(${_n} + 11) / 12")
  endif()
  list(LENGTH _insts _n_compiled)
  if(_n_compiled EQUAL 0)
    message(FATAL_ERROR "jax_moe: the JAX_MOE_FI_SM90_* selection compiles no ${_s} MoE GEMM at all")
  endif()
  math(EXPR _n_compiled_all "${_n_compiled_all} + ${_n_compiled}")
  if(JAX_MOE_FI_INSTS_PER_TU STREQUAL "auto")
    set(_per_tu "${_per_tu_auto}")
  else()
    set(_per_tu "${JAX_MOE_FI_INSTS_PER_TU}")
  endif()
  set(_pending "")
  set(_pending_n 0)
  set(_tu_idx 0)
  set(_i 0)
  foreach(_line IN LISTS _insts)
    string(APPEND _pending "${_line};\n")
    math(EXPR _pending_n "${_pending_n} + 1")
    math(EXPR _i "${_i} + 1")
    if(_pending_n GREATER_EQUAL _per_tu OR _i EQUAL _n_compiled)
      set(_f "${_gen}/sm90_${_s}_moe_gemm_${_tu_idx}.cu")
      file(CONFIGURE OUTPUT "${_f}" CONTENT
"// Generated by cmake/flashinfer_moe.cmake -- do not edit.
#include \"tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/${_inl}\"
namespace tensorrt_llm::kernels::cutlass_kernels_oss {
${_pending}}
" @ONLY)
      list(APPEND _gen_sources "${_f}")
      math(EXPR _tu_idx "${_tu_idx} + 1")
      set(_pending "")
      set(_pending_n 0)
    endif()
  endforeach()
  message(STATUS "jax_moe: FlashInfer SM90 ${_s} MoE GEMMs: ${_n_compiled} compiled in ${_tu_idx} TUs")

  _jax_moe_fi_add_runner(${_s})
endforeach()
# One TU for every scheme's fused-MoE runner: cutlass_fused_moe_kernels.cuh also defines plain
# (non-template) functions, so it may be compiled only once per library.
file(CONFIGURE OUTPUT "${_gen}/runner.cu" CONTENT
"// Generated by cmake/flashinfer_moe.cmake -- do not edit.
#include \"cutlass_fused_moe_kernels.cuh\"
namespace tensorrt_llm::kernels::cutlass_kernels {
${_runner_insts}}
" @ONLY)
list(PREPEND _big_sources "${_gen}/runner.cu")
message(STATUS "jax_moe: FlashInfer SM90 MoE GEMMs: ${_n_compiled_all} compiled, ${_n_stubbed} stubbed")

# SM80 fused gated-activation launchers (bf16 and f16: the runner names them for 16-bit types):
# compiled or stubbed, for each of those schemes that is built.
set(_sm80_body "")
set(_sm80_shapes "16 128 64" "16 256 64" "32 128 64" "64 128 64" "128 128 64")
set(_sm80_type_bf16 "cutlass::bfloat16_t")
set(_sm80_type_f16 "cutlass::half_t")
set(_sm80_note_bf16 "")  # the bf16 messages as they always were
set(_sm80_note_f16 "f16 ")
foreach(_s16 bf16 f16)
  if(NOT _s16 IN_LIST JAX_MOE_FI_SCHEMES)
    continue()
  endif()
  set(_e "${_sm80_type_${_s16}}")
  set(_body16 "")
  foreach(_shape ${_sm80_shapes})
    string(REPLACE " " ";" _s "${_shape}")
    list(GET _s 0 _m)
    list(GET _s 1 _n)
    list(GET _s 2 _k)
    foreach(_stages 2 3 4)
      foreach(_epi EpilogueOpDefaultSilu EpilogueOpDefaultFtGelu)
        set(_head "void sm80_generic_fused_moe_gemm_kernelLauncher<${_e}, ${_e}, ${_m}, ${_n}, ${_k}, ${_stages}, tensorrt_llm::cutlass_extensions::${_epi}>(${_e} const* A, ${_e} const* B, ${_e} const* biases, bool bias_is_broadcast, ${_e}* C, int64_t const* total_tokens_including_expert, int64_t num_rows, int64_t gemm_n, int64_t gemm_k, int num_experts, int multi_processor_count, cudaStream_t stream, int* kernel_occupancy)")
        if(JAX_MOE_FI_SM80_FUSED)
          string(APPEND _body16 "template ${_head};\n")
        else()
          string(APPEND _body16 "template <> ${_head} {\n  TLLM_THROW(\"jax_moe: SM80 fused MoE GEMM ${_sm80_note_${_s16}}${_m}x${_n}x${_k} stages=${_stages} ${_epi} was not compiled\");\n}\n")
        endif()
      endforeach()
    endforeach()
  endforeach()
  if(JAX_MOE_FI_SM80_FUSED)
    file(CONFIGURE OUTPUT "${_gen}/sm80_${_s16}_fused_moe_gemm.cu" CONTENT
"// Generated by cmake/flashinfer_moe.cmake -- do not edit.
#include \"tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/fused_moe_gemm_launcher_sm80.inl\"
namespace tensorrt_llm::kernels::cutlass_kernels_oss {
${_body16}}
" @ONLY)
    list(APPEND _gen_sources "${_gen}/sm80_${_s16}_fused_moe_gemm.cu")
  else()
    string(APPEND _sm80_body "${_body16}")
  endif()
endforeach()

set(_mixed_include "")
set(_awq_stub "")
if("mxfp4" IN_LIST JAX_MOE_FI_SCHEMES OR "w4a8" IN_LIST JAX_MOE_FI_SCHEMES)
  set(_mixed_include "#include \"tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/moe_gemm_tma_ws_mixed_input_launcher.h\"
#include \"tensorrt_llm/kernels/preQuantScaleKernel.h\"
#include \"cutlass/gemm/dispatch_policy.hpp\"
#include \"cutlass/epilogue/dispatch_policy.hpp\"\n")
elseif("fp8_block" IN_LIST JAX_MOE_FI_SCHEMES)
  set(_mixed_include "#include \"tensorrt_llm/kernels/preQuantScaleKernel.h\"\n")
endif()
if(("mxfp4" IN_LIST JAX_MOE_FI_SCHEMES OR "fp8_block" IN_LIST JAX_MOE_FI_SCHEMES) AND
   NOT "w4a8" IN_LIST JAX_MOE_FI_SCHEMES)
  # The <bf16, Fp4Type> and <bf16, fp8> runners name AWQ's pre-quant scale kernel
  # (applyPrequantScale), reached only with activation pre-quant scales, which neither W4A16 MXFP4
  # nor FP8 block scale ever has (preQuantScaleKernel.cu is not compiled; with w4a8 it is, and
  # defines it).
  set(_awq_stub "template <>
void apply_per_channel_scale_kernel_launcher<__nv_bfloat16, __nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16 const*,
                                                                         __nv_bfloat16 const*, int, int,
                                                                         int64_t const*, cudaStream_t) {
  TLLM_THROW(\"jax_moe: AWQ pre-quant activation scales are not supported by this build\");
}
")
endif()
file(CONFIGURE OUTPUT "${_gen}/stubs.cu" CONTENT
"// Generated by cmake/flashinfer_moe.cmake -- do not edit.
// Throwing definitions for kernels the runner's dispatch can name but this build does not compile,
// and for LoRA (unused). TllmException is caught by the runner's workspace sizing and reported by
// the jax_moe handler otherwise.
#include \"tensorrt_llm/common/assert.h\"
#include \"tensorrt_llm/kernels/cutlass_kernels/include/moe_kernels.h\"
#include \"tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/moe_gemm_tma_ws_launcher.h\"
#include \"tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/fused_moe_gemm_launcher_sm80.h\"
${_mixed_include}#include \"cutlass/arch/arch.h\"
#include \"cutlass_extensions/epilogue_helpers.h\"

namespace tensorrt_llm::kernels {
int Lora_run(LoraImpl*, int64_t, int64_t, void const*, int32_t const*, void const* const*, int,
             void* const*, void*, cudaStream_t) {
  TLLM_THROW(\"jax_moe: LoRA is not supported by this build of the FlashInfer CUTLASS MoE runner\");
}
${_awq_stub}}  // namespace tensorrt_llm::kernels

namespace tensorrt_llm::kernels::cutlass_kernels_oss {
${_stub_body}${_sm80_body}}
" @ONLY)
list(APPEND _gen_sources "${_gen}/stubs.cu")

if(JAX_MOE_FI_SM80_FUSED)
  set(_sm80_flag "true")
else()
  set(_sm80_flag "false")
endif()
set(_scheme_ids_note "0 bf16, 1 fp8, 2 mxfp4")
if("f16" IN_LIST JAX_MOE_FI_SCHEMES)
  string(APPEND _scheme_ids_note ", 4 f16")
endif()
if("w4a8" IN_LIST JAX_MOE_FI_SCHEMES)
  string(APPEND _scheme_ids_note ", 5 w4a8")
endif()
if(NOT _compiled_rows)  # e.g. fp8_block alone: a row that matches no scheme (no empty array)
  set(_compiled_rows "    {-1, 0, 0, 0, 0, 0, 0, 0, -1},\n")
endif()
file(CONFIGURE OUTPUT "${_gen}/jax_moe_fi_kernels.h" CONTENT
"// Generated by cmake/flashinfer_moe.cmake -- do not edit.
// The SM90 MoE GEMM tactics compiled into this build: scheme id (${_scheme_ids_note}), tile
// M, N, K (as in CutlassTileConfigSM90's names), cluster M, N, finalize fusion, swap_ab, and the
// MainloopScheduleType value the kernel was compiled for (-1: any; the mixed-input dispatcher
// selects by schedule). The handler only selects tactics listed here.
#pragma once
namespace jax_moe_fi {
struct CompiledSm90Tactic { int scheme, tile_m, tile_n, tile_k, cluster_m, cluster_n, finalize, swap_ab, mainloop; };
inline constexpr CompiledSm90Tactic kCompiledSm90Tactics[] = {
${_compiled_rows}};
inline constexpr bool kSm80FusedCompiled = ${_sm80_flag};
}  // namespace jax_moe_fi
" @ONLY)

# ---------------------------------------------------------------------------- targets
set(_fi_small_sources
  "${_fi_csrc}/nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/moe_gemm_tma_warp_specialized_input.cu"
  "${_fi_csrc}/nv_internal/tensorrt_llm/kernels/cutlass_kernels/cutlass_heuristic.cpp"
  "${_fi_csrc}/nv_internal/cpp/common/envUtils.cpp"
  "${_fi_csrc}/nv_internal/cpp/common/logger.cpp"
  "${_fi_csrc}/nv_internal/cpp/common/stringUtils.cpp"
  "${_fi_csrc}/nv_internal/cpp/common/tllmException.cpp"
  "${_fi_csrc}/nv_internal/cpp/common/memoryUtils.cu")
# libjax_moe_fi.so: the kernels, the runner and our FFI handlers. No Python in it, so it can be
# built once (on any machine with nvcc, see JAX_MOE_FI_PREBUILT) and reused by every interpreter.
# The slowest TUs first, so that a parallel build starts them early.
set(_fp8_block_sources "")
if("fp8_block" IN_LIST JAX_MOE_FI_SCHEMES)
  set(_fi_blockscale_cu "${_fi_csrc}/nv_internal/tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm.cu")
  set_source_files_properties("${_fi_blockscale_cu}" PROPERTIES COMPILE_DEFINITIONS ENABLE_FP8_BLOCK_SCALE)
  set(_fp8_block_sources "${_fi_blockscale_cu}" "${CMAKE_CURRENT_LIST_DIR}/../ffi/flashinfer/deepgemm_stubs.cc")
endif()
set(_w4a8_sources "")
if("w4a8" IN_LIST JAX_MOE_FI_SCHEMES)  # AWQ's per-channel pre-quant scale kernels (W4A8's FP8 quantizers)
  set(_w4a8_sources "${_fi_csrc}/nv_internal/tensorrt_llm/kernels/preQuantScaleKernel.cu")
endif()
# Our TUs that see the runner class: the handlers, the runner cache and the host queries.
set(_fi_jax_moe_sources "")
foreach(_f moe_handlers.cu fp8_block_handler.cu runner_cache.cu host_queries.cu)
  list(APPEND _fi_jax_moe_sources "${CMAKE_CURRENT_LIST_DIR}/../ffi/flashinfer/${_f}")
endforeach()
add_library(jax_moe_fi SHARED ${_big_sources} ${_fp8_block_sources} ${_w4a8_sources} ${_gen_sources} ${_fi_small_sources}
  ${_fi_jax_moe_sources})
target_link_libraries(jax_moe_fi PRIVATE jax_moe_fi_config CUDA::cudart_static)
if(TARGET CUDA::cuda_driver)
  target_link_libraries(jax_moe_fi PRIVATE CUDA::cuda_driver)
endif()
target_compile_definitions(jax_moe_fi PRIVATE ${_scheme_defs})
target_include_directories(jax_moe_fi PRIVATE "${JAX_MOE_XLA_FFI_INCLUDE_DIR}")
# Some jaxlib releases' api.h trips -Werror=missing-field-initializers under the host compiler.
set_source_files_properties(${_fi_jax_moe_sources} PROPERTIES
  COMPILE_OPTIONS "-Xcompiler=-Wno-missing-field-initializers,-Wno-error=missing-field-initializers")
set_target_properties(jax_moe_fi PROPERTIES
  CUDA_ARCHITECTURES "90a"
  CUDA_SEPARABLE_COMPILATION OFF)
if(NOT JAX_MOE_FI_NOSTRIP)
  target_link_options(jax_moe_fi PRIVATE "-s")
endif()
jax_moe_add_fi_module()
install(TARGETS jax_moe_fi LIBRARY DESTINATION jax_moe)
