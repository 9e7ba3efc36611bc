// XLA FFI handlers around FlashInfer's TRT-LLM gen fused-MoE runner (SM100: tcgen05 batched GEMMs
// from prebuilt cubins, see cubin_dir.h), with routing done before the call (top-k ids and
// weights come in, as everywhere in jax_moe). Two targets:
//   JaxMoeTrtllmFp8PerTensorMoe   FP8 per-tensor W8A8 (FlashInfer: trtllm_fp8_per_tensor_scale_moe)
//   JaxMoeTrtllmFp4BlockScaleMoe  FP4 block-scale weights (FlashInfer: trtllm_fp4_block_scale_moe):
//                                 NVFP4 x NVFP4, MXFP4 x BF16, MXFP4 x MXFP8 (the scheme ids of
//                                 host_queries.h), told apart by the operands' dtypes
//   JaxMoeTrtllmFp8BlockScaleMoe  DeepSeek FP8 128x128 block scale (FlashInfer:
//                                 trtllm_fp8_block_scale_moe with DeepSeekFp8 quantization)
//
// One call = FlashInfer's routing kernels in precomputed-ids mode (build the expert-sorted
// permutation and the CTA tables) + MoE::Runner::run (permute + GEMM1 with the gated activation
// fused (and, for FP8/NVFP4/MXFP8, the re-quantization of its output), GEMM2, finalize: weighted
// top-k reduce). Every intermediate buffer lives in one uint8 workspace that XLA allocates as the
// call's second result; its layout is workspace_plan.h's, and workspace_size() (nanobind,
// module.cc) returns its total for the Python shape rule. Nothing is allocated here. A handler
// decodes and checks its operands; launch.h plans, routes and runs.
//
// FP8 per tensor (XLA row-major):
//   x            float8_e4m3fn [T, H]          activations quantized with the per-tensor a13 scale
//   topk_ids     int32 [T, k]                   global expert ids
//   topk_weights float32 [T, k]                 router weights (applied in finalize)
//   w13          float8_e4m3fn [E, 2I, H]       rows in the runner's order (jax_moe/backends/
//                                               flashinfer_trtllm/fp8.py: prepare_fp8_weights)
//   w2           float8_e4m3fn [E, H, I]        shuffled (shuffle_matrix_a)
//   out1_scale, out1_gate_scale, out2_scale  float32 [E]  (layouts.trtllm_fp8_output_scales)
//   -> out       bfloat16 [T, H]
//   -> workspace uint8 [total]
//
// FP4 block scale (H, I: the kernel's sizes, padded by Python for MXFP4; sf = 16 for NVFP4, 32 for
// MXFP4; an "absent" optional operand is a zero-element array):
//   x            NVFP4: uint8 [T, H/2] (E2M1 pairs); MXFP4 x BF16: bfloat16 [T, H];
//                MXFP4 x MXFP8: float8_e4m3fn [T, H]
//   x_scale      NVFP4: float8_e4m3fn [T, H/16]; MXFP8: uint8 (E8M0) [T, H/32]; BF16: absent
//                (linear layout, as vLLM's quantizers with is_sf_swizzled_layout=False give them)
//   topk_ids, topk_weights                      as for FP8
//   w13          uint8 [E, 2I, H/2]             (prepare_nvfp4_weights / prepare_mxfp4_weights)
//   w13_scale    NVFP4: float8_e4m3fn, MXFP4: uint8 (E8M0) [E, 2I, H/sf], shuffled and 128x4-tiled
//   w13_bias     float32 [E, 2I] or absent      (GEMM1 rows in the runner's order)
//   swiglu_alpha, swiglu_beta, swiglu_limit  float32 [E] or absent (gemm1_alpha/beta/clamp_limit)
//   w2           uint8 [E, H, I/2]
//   w2_scale     as w13_scale, [E, H, I/sf]
//   w2_bias      float32 [E, H] or absent
//   out1_scale, out1_gate_scale, out2_scale  float32 [E] (NVFP4: required; MXFP4: absent)
//   -> out       bfloat16 [T, H]
//   -> workspace uint8 [total]
//
// FP8 block scale (DeepSeek-V3; weights BlockMajorK, prepare_fp8_block_weights):
//   x            float8_e4m3fn [T, H]           one float32 scale per token per 128 columns:
//   x_scale      float32 [H/128, T]             (transposed, as the runner reads it)
//   topk_ids, topk_weights                      as for FP8
//   w13          float8_e4m3fn [E, H/128, 2I, 128]   w13_scale float32 [E, 2I/128, H/128]
//   w2           float8_e4m3fn [E, I/128, H, 128]    w2_scale  float32 [E, H/128, I/128]
//   -> out       bfloat16 [T, H]
//   -> workspace uint8 [total]   (GEMM1's output and the separate activation's, with their scales)
// Attributes (all): activation (runner ActivationType value), tile_n (tokens per CTA tile, one of
// kTileNs; MXFP4 x BF16: up to 64), config (runner config index; -1: its default for the shape),
// enable_pdl.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "../common/binding.h"
#include "../common/errors.h"
#include "launch.h"

namespace jax_moe_trtllm {
namespace {

using jax_moe::InvalidArgument;

bool TopkShapesFit(ffi::Buffer<ffi::S32> const& ids, ffi::Buffer<ffi::F32> const& w,
                   int64_t tokens) {
  auto const idd = ids.dimensions(), wd = w.dimensions();
  return idd.size() == 2 && wd.size() == 2 && idd[0] == tokens && wd[0] == tokens &&
         wd[1] == idd[1];
}

ffi::Error Fp8PerTensorImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::S32> topk_ids, ffi::Buffer<ffi::F32> topk_weights,
                            ffi::AnyBuffer w13, ffi::AnyBuffer w2,
                            ffi::Buffer<ffi::F32> out1_scale, ffi::Buffer<ffi::F32> out1_gate_scale,
                            ffi::Buffer<ffi::F32> out2_scale, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::U8>> workspace, int64_t activation,
                            int64_t tile_n, int64_t config, bool enable_pdl) {
  auto const xd = x.dimensions(), w13d = w13.dimensions(), w2d = w2.dimensions();
  auto const idd = topk_ids.dimensions();
  if (xd.size() != 2 || w13d.size() != 3 || w2d.size() != 3 || idd.size() != 2)
    return InvalidArgument("trtllm fp8: x [T,H], w13 [E,2I,H], w2 [E,H,I], topk_ids [T,k] ranks");
  if (x.element_type() != ffi::F8E4M3FN || w13.element_type() != ffi::F8E4M3FN ||
      w2.element_type() != ffi::F8E4M3FN || out->element_type() != ffi::BF16)
    return InvalidArgument("trtllm fp8: x, w13, w2 must be float8_e4m3fn and out bfloat16");
  Problem const p{kSchemeFp8PerTensor, xd[0], xd[1], w2d[2], w13d[0], idd[1], activation, tile_n};
  bool const gated = tmoe::MoE::isGatedActivation(static_cast<tmoe::MoE::ActivationType>(activation));
  if (w13d[1] != (gated ? 2 : 1) * p.inter || w13d[2] != p.hidden || w2d[0] != p.experts ||
      w2d[1] != p.hidden || !TopkShapesFit(topk_ids, topk_weights, p.tokens))
    return InvalidArgument("trtllm fp8: inconsistent shapes of x, w13, w2, topk_ids/weights");
  for (auto const* s : {&out1_scale, &out1_gate_scale, &out2_scale})
    if (s->dimensions().size() != 1 || s->dimensions()[0] != p.experts)
      return InvalidArgument("trtllm fp8: the three output scales must be float32 [E]");
  if (p.tokens == 0) return ffi::Error::Success();

  auto args = BaseArgs(p);
  args.output1_scales_scalar = out1_scale.typed_data();
  args.output1_scales_gate_scalar = out1_gate_scale.typed_data();
  args.output2_scales_scalar = out2_scale.typed_data();
  MoeData const data{x.untyped_data(), nullptr, w13.untyped_data(), nullptr, w2.untyped_data(), nullptr,
                     out->untyped_data()};
  return Launch("trtllm fp8", p, args, data, config, device, stream, enable_pdl, topk_ids,
                topk_weights, workspace);
}

// An optional float32 operand: absent (zero elements) -> null; else it must have `dims`.
bool OptionalF32(ffi::Buffer<ffi::F32>& b, std::initializer_list<int64_t> dims, float** ptr) {
  if (b.element_count() == 0) {
    *ptr = nullptr;
    return true;
  }
  auto const d = b.dimensions();
  if (d.size() != dims.size() || !std::equal(d.begin(), d.end(), dims.begin())) return false;
  *ptr = b.typed_data();
  return true;
}

ffi::Error Fp4BlockScaleImpl(
    cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer x_scale,
    ffi::Buffer<ffi::S32> topk_ids, ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::U8> w13,
    ffi::AnyBuffer w13_scale, ffi::Buffer<ffi::F32> w13_bias, ffi::Buffer<ffi::F32> swiglu_alpha,
    ffi::Buffer<ffi::F32> swiglu_beta, ffi::Buffer<ffi::F32> swiglu_limit, ffi::Buffer<ffi::U8> w2,
    ffi::AnyBuffer w2_scale, ffi::Buffer<ffi::F32> w2_bias, ffi::Buffer<ffi::F32> out1_scale,
    ffi::Buffer<ffi::F32> out1_gate_scale, ffi::Buffer<ffi::F32> out2_scale,
    ffi::Result<ffi::Buffer<ffi::BF16>> out, ffi::Result<ffi::Buffer<ffi::U8>> workspace,
    int64_t activation, int64_t tile_n, int64_t config, bool enable_pdl) {
  // The scheme from the dtypes (x, x_scale, weight scales), as FlashInfer's launcher tells them.
  int scheme = -1;
  auto const xt = x.element_type(), xst = x_scale.element_type(), wst = w13_scale.element_type();
  if (xt == ffi::U8 && xst == ffi::F8E4M3FN && wst == ffi::F8E4M3FN) scheme = kSchemeNvfp4;
  else if (xt == ffi::BF16 && x_scale.element_count() == 0 && wst == ffi::U8) scheme = kSchemeMxfp4Bf16;
  else if (xt == ffi::F8E4M3FN && xst == ffi::U8 && wst == ffi::U8) scheme = kSchemeMxfp4Mxfp8;
  if (scheme < 0 || w2_scale.element_type() != wst)
    return InvalidArgument(
        "trtllm fp4: (x, x_scale, w13_scale/w2_scale) must be (uint8 E2M1 pairs, float8_e4m3fn, "
        "float8_e4m3fn) for NVFP4, (bfloat16, absent, uint8 E8M0) for MXFP4 x BF16, or "
        "(float8_e4m3fn, uint8 E8M0, uint8 E8M0) for MXFP4 x MXFP8");
  SchemeTypes const types = TypesOf(scheme);
  int64_t const sf = types.sf_vec;

  auto const xd = x.dimensions(), w13d = w13.dimensions(), w2d = w2.dimensions();
  auto const s13d = w13_scale.dimensions(), s2d = w2_scale.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || w13d.size() != 3 || w2d.size() != 3 || s13d.size() != 3 ||
      s2d.size() != 3 || topk_ids.dimensions().size() != 2 || od.size() != 2)
    return InvalidArgument("trtllm fp4: x [T,H or H/2], w13/w13_scale [E,2I,*], w2/w2_scale "
                           "[E,H,*], topk_ids [T,k], out [T,H] ranks");
  int64_t const hidden = scheme == kSchemeNvfp4 ? 2 * xd[1] : xd[1];
  Problem const p{scheme, xd[0], hidden, 2 * w2d[2], w13d[0], topk_ids.dimensions()[1],
                  activation, tile_n};
  bool const gated = tmoe::MoE::isGatedActivation(static_cast<tmoe::MoE::ActivationType>(activation));
  int64_t const n1 = (gated ? 2 : 1) * p.inter;
  if (p.hidden % sf || p.inter % sf)
    return InvalidArgument("trtllm fp4: H and I must be multiples of the scale block " +
                           std::to_string(sf));
  if (w13d[1] != n1 || w13d[2] != p.hidden / 2 || w2d[0] != p.experts || w2d[1] != p.hidden ||
      s13d[0] != p.experts || s13d[1] != n1 || s13d[2] != p.hidden / sf || s2d[0] != p.experts ||
      s2d[1] != p.hidden || s2d[2] != p.inter / sf || od[0] != p.tokens || od[1] != p.hidden ||
      !TopkShapesFit(topk_ids, topk_weights, p.tokens))
    return InvalidArgument("trtllm fp4: inconsistent shapes of x, w13, w13_scale, w2, w2_scale, "
                           "topk_ids/weights, out");
  if (scheme != kSchemeMxfp4Bf16) {
    auto const xsd = x_scale.dimensions();
    if (xsd.size() != 2 || xsd[0] != p.tokens || xsd[1] != p.hidden / (scheme == kSchemeNvfp4 ? 16 : 32))
      return InvalidArgument("trtllm fp4: x_scale must be [T, H/16] (NVFP4) or [T, H/32] (MXFP8), "
                             "linear layout");
  }

  // The optional operands go straight into the runner's arguments (null: absent).
  auto args = BaseArgs(p);
  float* b13 = nullptr;
  int64_t const e = p.experts;
  if (!OptionalF32(w13_bias, {e, n1}, &b13) || !OptionalF32(w2_bias, {e, p.hidden}, &args.gemm2_bias))
    return InvalidArgument("trtllm fp4: w13_bias must be float32 [E, 2I] and w2_bias [E, H] (or "
                           "zero-element arrays: absent)");
  args.gemm1_bias = b13;
  if (!OptionalF32(swiglu_alpha, {e}, &args.gemm1_alpha) || !OptionalF32(swiglu_beta, {e}, &args.gemm1_beta) ||
      !OptionalF32(swiglu_limit, {e}, &args.gemm1_clamp_limit))
    return InvalidArgument("trtllm fp4: swiglu_alpha/beta/limit must be float32 [E] (or absent)");
  if (!OptionalF32(out1_scale, {e}, &args.output1_scales_scalar) ||
      !OptionalF32(out1_gate_scale, {e}, &args.output1_scales_gate_scalar) ||
      !OptionalF32(out2_scale, {e}, &args.output2_scales_scalar))
    return InvalidArgument("trtllm fp4: out1_scale/out1_gate_scale/out2_scale must be float32 [E] "
                           "(or absent)");
  if (scheme == kSchemeNvfp4 &&
      (!args.output1_scales_scalar || !args.output1_scales_gate_scalar || !args.output2_scales_scalar))
    return InvalidArgument("trtllm fp4: NVFP4 needs out1_scale, out1_gate_scale and out2_scale");
  if (p.tokens == 0) return ffi::Error::Success();

  MoeData const data{x.untyped_data(), scheme == kSchemeMxfp4Bf16 ? nullptr : x_scale.untyped_data(),
                     w13.typed_data(), w13_scale.untyped_data(), w2.typed_data(),
                     w2_scale.untyped_data(), out->typed_data()};
  return Launch("trtllm fp4", p, args, data, config, device, stream, enable_pdl, topk_ids,
                topk_weights, workspace);
}

ffi::Error Fp8BlockScaleImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                             ffi::Buffer<ffi::F32> x_scale, ffi::Buffer<ffi::S32> topk_ids,
                             ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer w13,
                             ffi::Buffer<ffi::F32> w13_scale, ffi::AnyBuffer w2,
                             ffi::Buffer<ffi::F32> w2_scale, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                             ffi::Result<ffi::Buffer<ffi::U8>> workspace, int64_t activation,
                             int64_t tile_n, int64_t config, bool enable_pdl) {
  constexpr int64_t B = 128;  // the block of the scales and of BlockMajorK
  auto const xd = x.dimensions(), xsd = x_scale.dimensions(), w13d = w13.dimensions();
  auto const w2d = w2.dimensions(), s13d = w13_scale.dimensions(), s2d = w2_scale.dimensions();
  auto const od = out->dimensions();
  if (xd.size() != 2 || xsd.size() != 2 || w13d.size() != 4 || w2d.size() != 4 ||
      s13d.size() != 3 || s2d.size() != 3 || od.size() != 2 || topk_ids.dimensions().size() != 2)
    return InvalidArgument("trtllm fp8 block: x [T,H], x_scale [H/128,T], w13 [E,H/128,2I,128], "
                           "w2 [E,I/128,H,128], w13_scale/w2_scale [E,*,*], out [T,H] ranks");
  if (x.element_type() != ffi::F8E4M3FN || w13.element_type() != ffi::F8E4M3FN ||
      w2.element_type() != ffi::F8E4M3FN)
    return InvalidArgument("trtllm fp8 block: x, w13, w2 must be float8_e4m3fn");
  Problem const p{kSchemeFp8Block, xd[0], xd[1], w2d[1] * w2d[3], w2d[0], topk_ids.dimensions()[1],
                  activation, tile_n};
  bool const gated = tmoe::MoE::isGatedActivation(static_cast<tmoe::MoE::ActivationType>(activation));
  int64_t const n1 = (gated ? 2 : 1) * p.inter;
  if (p.hidden % B || w2d[3] != B || w13d[3] != B)
    return InvalidArgument("trtllm fp8 block: H must be a multiple of 128 and the weights' last "
                           "dimension 128 (BlockMajorK)");
  if (w13d[0] != p.experts || w13d[1] != p.hidden / B || w13d[2] != n1 || w2d[2] != p.hidden ||
      xsd[0] != p.hidden / B || xsd[1] != p.tokens || s13d[0] != p.experts || s13d[1] != n1 / B ||
      s13d[2] != p.hidden / B || s2d[0] != p.experts || s2d[1] != p.hidden / B ||
      s2d[2] != p.inter / B || od[0] != p.tokens || od[1] != p.hidden ||
      !TopkShapesFit(topk_ids, topk_weights, p.tokens))
    return InvalidArgument("trtllm fp8 block: inconsistent shapes of x, x_scale, w13, w13_scale, "
                           "w2, w2_scale, topk_ids/weights, out");
  if (p.tokens == 0) return ffi::Error::Success();

  MoeData const data{x.untyped_data(), x_scale.typed_data(), w13.untyped_data(), w13_scale.typed_data(),
                     w2.untyped_data(), w2_scale.typed_data(), out->typed_data()};
  return Launch("trtllm fp8 block", p, BaseArgs(p), data, config, device, stream, enable_pdl,
                topk_ids, topk_weights, workspace);
}

// The binding of a handler, read off its signature (common/binding.h).
template <typename Fn>
auto Binding() {
  return jax_moe::BindHandler<Fn, ffi::PlatformStream<cudaStream_t>, ffi::DeviceOrdinal>(
      "activation", "tile_n", "config", "enable_pdl");
}

}  // namespace
}  // namespace jax_moe_trtllm

// Not kCmdBufferCompatible: the first call per (scheme, tile, activation) builds the runner and
// loads cubins (cuModuleLoadData), which must not happen during graph capture.
#define JAX_MOE_TRTLLM_DEFINE_HANDLER(symbol, impl) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, jax_moe_trtllm::impl, jax_moe_trtllm::Binding<decltype(&jax_moe_trtllm::impl)>())
JAX_MOE_TRTLLM_DEFINE_HANDLER(JaxMoeTrtllmFp8PerTensorMoe, Fp8PerTensorImpl);
JAX_MOE_TRTLLM_DEFINE_HANDLER(JaxMoeTrtllmFp4BlockScaleMoe, Fp4BlockScaleImpl);
JAX_MOE_TRTLLM_DEFINE_HANDLER(JaxMoeTrtllmFp8BlockScaleMoe, Fp8BlockScaleImpl);
