// The quant schemes jax_moe builds FlashInfer's CUTLASS fused-MoE runner (TensorRT-LLM's
// CutlassMoeFCRunner) for, as compile-time traits, and the activations the handlers take.
//
// A scheme: its id (jax_moe.backends.flashinfer_cutlass.SCHEME_IDS, the generated tactic table's
// scheme column), name, runner type (instantiated in the generated runner.cu, see
// cmake/flashinfer_moe.cmake), kPack (weight elements per stored element along K: the runner's
// mInnerDimMultiplier), kBias (the biases' dtype: the runner's ScaleBiasType, its backbone type),
// kAwq (the runner's AWQ pre-quant scale paths, W4A8's quantizers, whose workspace exists only
// when sized with use_awq) and kCompiled (JAX_MOE_FI_WITH_<SCHEME>: in JAX_MOE_FI_SCHEMES).
//
// Every TU including this sees the runner class, so it must be compiled with the runner's
// ENABLE_* definitions (cmake/flashinfer_moe.cmake gives all of libjax_moe_fi.so's TUs the same).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <tuple>

// XLA's FFI headers first (handler_common.h includes them): CUTLASS's
// cute/atom/mma_traits_sm100.hpp (reached through moe_kernels.h) turns -Wmissing-field-initializers
// into an error for everything after it, and some jaxlib versions' api.h has such initializers.
#include "exports.h"
#include "handler_common.h"
// clang-format off
#include "tensorrt_llm/kernels/cutlass_kernels/include/moe_kernels.h"  // FlashInfer's, by its full path
// clang-format on
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic warning "-Wmissing-field-initializers"
#endif

#ifndef JAX_MOE_FI_WITH_BF16
#define JAX_MOE_FI_WITH_BF16 0
#endif
#ifndef JAX_MOE_FI_WITH_FP8
#define JAX_MOE_FI_WITH_FP8 0
#endif
#ifndef JAX_MOE_FI_WITH_MXFP4
#define JAX_MOE_FI_WITH_MXFP4 0
#endif
#ifndef JAX_MOE_FI_WITH_FP8_BLOCK
#define JAX_MOE_FI_WITH_FP8_BLOCK 0
#endif
#ifndef JAX_MOE_FI_WITH_F16
#define JAX_MOE_FI_WITH_F16 0
#endif
#ifndef JAX_MOE_FI_WITH_W4A8
#define JAX_MOE_FI_WITH_W4A8 0
#endif

namespace jax_moe_fi {

namespace tk = tensorrt_llm::kernels::cutlass_kernels;
namespace ce = tensorrt_llm::cutlass_extensions;

template <int kId_, char const* kName_, typename Runner_, int kPack_, ffi::DataType kBias_,
          bool kCompiled_, bool kAwq_ = false>
struct Scheme {
  static constexpr int kId = kId_;
  static constexpr char const* kName = kName_;
  using Runner = Runner_;
  static constexpr int kPack = kPack_;
  static constexpr ffi::DataType kBias = kBias_;
  static constexpr char const* kBiasName = kBias_ == ffi::DataType::F16 ? "float16" : "bfloat16";
  static constexpr bool kCompiled = kCompiled_;
  static constexpr bool kAwq = kAwq_;
};

inline constexpr char kBf16Name[] = "bf16", kFp8Name[] = "fp8", kMxfp4Name[] = "mxfp4",
                      kFp8BlockName[] = "fp8_block", kF16Name[] = "f16", kW4a8Name[] = "w4a8";
constexpr auto kBF16 = ffi::DataType::BF16;

// BF16 x BF16 -> BF16.
using Bf16Scheme = Scheme<0, kBf16Name, tk::CutlassMoeFCRunner<__nv_bfloat16, __nv_bfloat16>, 1, kBF16,
                          JAX_MOE_FI_WITH_BF16>;
// FP8 x FP8 (per-tensor scales) -> BF16: FlashInfer's binding for FP8 per-tensor with bf16 output.
using Fp8Scheme = Scheme<1, kFp8Name,
                         tk::CutlassMoeFCRunner<__nv_fp8_e4m3, __nv_fp8_e4m3, __nv_bfloat16,
                                                __nv_fp8_e4m3, __nv_bfloat16>,
                         1, kBF16, JAX_MOE_FI_WITH_FP8>;
// FlashInfer's isWFP4A16Quant runner: bf16 activations and output, E2M1 weights two per byte.
using Mxfp4Scheme = Scheme<2, kMxfp4Name, tk::CutlassMoeFCRunner<__nv_bfloat16, tk::Fp4Type>, 2, kBF16,
                           JAX_MOE_FI_WITH_MXFP4>;
// DeepSeek-V3 FP8 block scale: bf16 activations (quantized inside the block-scale GEMM) x FP8.
using Fp8BlockScheme = Scheme<kFp8BlockSchemeId, kFp8BlockName,
                              tk::CutlassMoeFCRunner<__nv_bfloat16, __nv_fp8_e4m3>, 1, kBF16,
                              JAX_MOE_FI_WITH_FP8_BLOCK>;
// FP16 (opt-in): bf16's runner with half everywhere, biases included.
using F16Scheme = Scheme<4, kF16Name, tk::CutlassMoeFCRunner<half, half>, 1, ffi::DataType::F16,
                         JAX_MOE_FI_WITH_F16>;
// FlashInfer's isW4AFp8Quant runner with use_w4_group_scaling on bf16 input: FP8 GEMM operands,
// int4 weights two per byte, bf16 in and out.
using W4a8Scheme = Scheme<5, kW4a8Name,
                          tk::CutlassMoeFCRunner<__nv_fp8_e4m3, cutlass::uint4b_t, __nv_bfloat16,
                                                 __nv_bfloat16>,
                          2, kBF16, JAX_MOE_FI_WITH_W4A8, /*kAwq=*/true>;

// The schemes with a tactic list (every one but fp8_block), in id order.
using TacticSchemes = std::tuple<Bf16Scheme, Fp8Scheme, Mxfp4Scheme, F16Scheme, W4a8Scheme>;

// Gated activations: GEMM1 has 2I rows (linear half, then gate half).
inline bool IsGated(tk::ActivationType a) {
  using A = tk::ActivationType;
  return a == A::Swiglu || a == A::Geglu || a == A::SwigluBias || a == A::SwigluStep ||
         a == A::GegluTanh || a == A::Situ;
}

// The activations the tactic schemes' handler takes (the others need per-expert parameters it
// does not take; SwigluBias comes with the swiglu operand).
inline bool IsSupportedActivation(int64_t a) {
  using A = tk::ActivationType;
  switch (static_cast<A>(a)) {
    case A::Gelu: case A::Relu: case A::Silu: case A::Swiglu: case A::Geglu: case A::Relu2:
    case A::Identity: case A::SwigluBias:
      return true;
    default:
      return false;
  }
}

// The activations fp8_block's handler takes (the codes jax_moe.backends.flashinfer_cutlass sends).
inline bool IsSupportedFp8BlockActivation(int64_t a) {
  using A = tk::ActivationType;
  switch (static_cast<A>(a)) {
    case A::Swiglu: case A::Geglu: case A::SwigluBias: case A::Relu2:
      return true;
    default:
      return false;
  }
}

}  // namespace jax_moe_fi

// The runners of the schemes compiled in are instantiated in the generated runner.cu; an
// uncompiled scheme's runner is never used (every use is behind its kCompiled), so declaring its
// instantiation here needs none.
namespace tensorrt_llm::kernels::cutlass_kernels {
extern template class CutlassMoeFCRunner<__nv_bfloat16, __nv_bfloat16>;
extern template class CutlassMoeFCRunner<__nv_fp8_e4m3, __nv_fp8_e4m3, __nv_bfloat16, __nv_fp8_e4m3, __nv_bfloat16>;
extern template class CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>;
extern template class CutlassMoeFCRunner<__nv_bfloat16, __nv_fp8_e4m3>;
extern template class CutlassMoeFCRunner<half, half>;
extern template class CutlassMoeFCRunner<__nv_fp8_e4m3, cutlass::uint4b_t, __nv_bfloat16, __nv_bfloat16>;
}  // namespace tensorrt_llm::kernels::cutlass_kernels
