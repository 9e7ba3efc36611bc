// XLA FFI handlers for FlashInfer's CUTLASS fused-MoE runner (TensorRT-LLM CutlassMoeFCRunner),
// SM90, one per quant scheme compiled in (JAX_MOE_FI_WITH_<SCHEME>, see cmake/flashinfer_moe.cmake):
//
//   jax_moe_flashinfer_cutlass_moe        BF16 activations x BF16 weights -> BF16
//   jax_moe_flashinfer_cutlass_moe_fp8    FP8 E4M3 activations (quantized by the caller with a
//                                         per-tensor scale) x FP8 E4M3 weights (per-tensor or
//                                         per-expert scale) -> BF16
//   jax_moe_flashinfer_cutlass_moe_mxfp4  BF16 activations x MXFP4 weights (W4A16, GPT-OSS; the
//                                         SM90 mixed-input GEMMs) -> BF16
//   jax_moe_flashinfer_cutlass_moe_f16    FP16 activations x FP16 weights -> FP16 (opt-in scheme
//                                         f16: bf16's kernels with half; operands as bf16's,
//                                         with float16 wherever bf16 has bfloat16)
//   jax_moe_flashinfer_cutlass_moe_w4a8   BF16 activations, quantized to FP8 E4M3 by the runner
//                                         with per-channel pre-quant scales, x signed int4
//                                         weights with bf16 scales per 128 along K (the SM90
//                                         mixed-input GEMMs) -> BF16; the definition of what it
//                                         computes: jax_moe/backends/flashinfer_cutlass/w4a8.py
//
// Operands (all row-major; "F" is bf16, float16 (f16) or float8_e4m3fn by scheme; for mxfp4 the weights are
// uint8 [.., K/2] (two E2M1 codes per byte) in the mixed-input GEMM's interleaved byte order, see
// jax_moe/layouts/mixed_gemm.py, and H, I are the padded sizes):
//   x            [T, H]        F
//   w13          [E, 2I, H]    F     for gated activations, [E, I, H] otherwise. For gated
//                                    activations the runner reads rows [0, I) as the linear
//                                    ("up", w3) half and rows [I, 2I) as the gate (w1) half:
//                                    out = act(gate) * up. That is the *reverse* of vLLM's
//                                    w13 = [w1 (gate); w3 (up)], so vLLM-layout weights must have
//                                    their halves swapped once at load time
//                                    (jax_moe.backends.flashinfer_cutlass.prepare_weights).
//   w2           [E, H, I]     F
//   topk_ids     [T, k]        int32  expert ids in [0, E)
//   topk_weights [T, k]        float32
//   w13_bias     [E, 2I] or [0]  bf16  GEMM1 bias in w13's row order ([0]: none); f16: float16
//   w2_bias      [E, H] or [0]   bf16  GEMM2 bias, added before the router weight ([0]: none);
//                                      f16: float16 (the runner's ScaleBiasType is its output type)
//   swiglu       [3, E] or [0]   float32  per-expert (alpha, beta, limit) of SwigluBias:
//                                    min(g, limit) * sigmoid(alpha * min(g, limit)) *
//                                    (clamp(u, -limit, limit) + beta); [0] for other activations
//   fp8 only:
//   g1_alphas    [E]           float32  w13_scale[e] * a13_scale: dequantizes GEMM1's accumulator
//   a2_gscale    [] or [E]     float32  1 / a2_scale: quantizes the activation output to FP8
//   g2_alphas    [E]           float32  w2_scale[e] * a2_scale: dequantizes GEMM2's accumulator
//   mxfp4 only (E8M0 bytes, one per 32 weights along K, folded per 64 rows x 128 K):
//   w13_scale    [E, 2I/64, H/128, 16, 16]  uint8
//   w2_scale     [E, H/64, I/128, 16, 16]   uint8
//   w4a8 only (w13/w2 uint8 [.., K/2], two int4 codes per byte, in the mixed-input GEMM's unit order):
//   w13_scale    [E, N1/64, H/128, 8, 8]    bf16   one scale per 128 weights along K, folded
//   w2_scale     [E, H/64, I/128, 8, 8]     bf16
//   fc1_act_scale [H]           bf16   pre-quant scale: GEMM1's FP8 input is fp8(x * fc1_act_scale)
//   fc2_act_scale [I]           bf16   pre-quant scale of GEMM2's input (the activation output)
//   fc1_alpha    [E]            float32  GEMM1's accumulator (after the group scales) times this
//   fc2_alpha    [E]            float32  likewise for GEMM2
// Results:
//   out          [T, Hu]       bf16 (f16: float16)  sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]),
//                                     its first Hu <= H columns (Hu % 8 == 0): the runner's
//                                     unpadded hidden size, for weights padded along H
//   workspace    [W]           uint8  W = WorkspaceSize(T, H, I, E, k, activation, scheme)
// Attributes:
//   activation    int64  TRT-LLM ActivationType (Swiglu 3, Geglu 4, SwigluBias 5, Relu2 6, ...)
//   gemm1_tactic  int64  index into the runner's GEMM1 tactic list, -1 = built-in choice
//   gemm2_tactic  int64  index into the runner's GEMM2 tactic list, -1 = built-in choice
//
// Command buffers (CUDA graphs): the launch path has no host synchronization or host<->device
// copies (those are LoRA-only in the runner), and the runner is created and its tactic lists read
// at trace time (WorkspaceSize), outside any capture; so every handler declares itself
// command-buffer compatible (tests/test_flashinfer_cutlass.py runs them with command buffers on).
//
// The runners, their tactic lists and the per-shape tactic choice are runner_cache.h's; the
// operands and the launch every scheme shares are launch.h's. A handler here decodes and checks
// its scheme's scales, then RunMoe checks the shared operands and launches.

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

#include "../common/binding.h"
#include "launch.h"

namespace jax_moe_fi {
namespace {

// Shapes, validation and the launch, common to every scheme. `quant` carries the scheme's scale
// pointers (empty for bf16); H and I must be multiples of `align`.
template <typename S>
ffi::Error RunMoe(cudaStream_t stream, int32_t device, MoeOperands& b, int64_t activation,
                  int64_t gemm1_tactic, int64_t gemm2_tactic, tk::QuantParams const& quant,
                  int64_t align) {
  auto bad = [](std::string const& m) { return Bad(S::kName, m); };
  auto xd = b.x.dimensions();
  auto w13d = b.w13.dimensions();
  auto w2d = b.w2.dimensions();
  auto idd = b.topk_ids.dimensions();
  auto twd = b.topk_weights.dimensions();
  auto od = b.out->dimensions();
  if (xd.size() != 2 || w13d.size() != 3 || w2d.size() != 3 || idd.size() != 2 ||
      twd.size() != 2 || od.size() != 2 || b.workspace->dimensions().size() != 1)
    return bad("expected x [T,H], w13 [E,N,H], w2 [E,H,I], topk_ids/topk_weights [T,k], "
               "out [T,Hu], workspace [W]");
  if (!IsSupportedActivation(activation))
    return bad("unsupported activation type " + std::to_string(activation));
  auto const act = static_cast<tk::ActivationType>(activation);
  int64_t const t = xd[0], h = xd[1];
  int64_t const e = w2d[0], i = w2d[2] * S::kPack;  // K axes hold kPack weights per element
  int64_t const k = idd[1];
  int64_t const n1 = IsGated(act) ? 2 * i : i;
  std::string const packed = S::kPack == 1 ? "" : "/" + std::to_string(S::kPack);
  std::string const n1_name = IsGated(act) ? "2I" : "I";
  if (w13d[0] != e || w13d[1] != n1 || w13d[2] * S::kPack != h)
    return bad("w13 must be [E, " + n1_name + ", H" + packed + "]");
  if (w2d[1] != h) return bad("w2 must be [E, H, I" + packed + "]");
  if (idd[0] != t || twd[0] != t || twd[1] != k) return bad("topk_ids/topk_weights must be [T,k]");
  // The runner writes the first Hu columns of each row (its unpadded hidden size), 16 bytes at a
  // time (finalizeMoeRoutingKernel).
  int64_t const hu = od[1];
  if (od[0] != t || hu < 1 || hu > h || hu % 8 != 0)
    return bad("out must be [T, Hu] with Hu <= H and Hu a multiple of 8");
  if (h % align != 0 || i % align != 0)
    return bad("H and I must be multiples of " + std::to_string(align) + " (TMA alignment)");
  bool const swiglu_bias = act == tk::ActivationType::SwigluBias;
  if (auto why = CheckOptionalOperands<S>(b, e, n1, h, swiglu_bias, n1_name)) return bad(*why);
  if (t == 0) return ffi::Error::Success();

  return Guarded("flashinfer_cutlass_moe", [&]() -> ffi::Error {
    DeviceState<S>& st = GetState<S>(device);
    std::lock_guard<std::mutex> lock(st.mu);
    DeviceGuard guard(device);
    ShapeKey const key{t, h, i, static_cast<int>(e), static_cast<int>(k), static_cast<int>(activation)};
    return RunFused<S>(*st.runner, "flashinfer_cutlass_moe", b, key, hu, quant, /*deepseek=*/false,
                       stream, [&] {
                         auto const [g1, g2] = ChooseTactics(st, key, gemm1_tactic, gemm2_tactic);
                         st.runner->setTactic(st.gemm1[g1], st.gemm2[g2]);
                       });
  });
}

// ---- Each scheme's scale operands: Scales (their types, in operand order), Decode (checks them,
// and the dtypes, and fills the runner's QuantParams) and kAlign (what H and I are multiples of).

// bf16 and f16: no scales; x, w13, w2 and out in the scheme's float dtype (its bias dtype).
template <typename S>
struct FloatScales {
  using Scheme = S;
  using Scales = std::tuple<>;
  static constexpr int64_t kAlign = 8;
  static ffi::Error Decode(MoeOperands& b, tk::QuantParams&) {
    for (auto dt : {b.x.element_type(), b.w13.element_type(), b.w2.element_type(), b.out->element_type()})
      if (dt != S::kBias) return Bad(S::kName, std::string("x, w13, w2 and out must be ") + S::kBiasName);
    return ffi::Error::Success();
  }
};

// fp8: g1_alphas [E], a2_gscale [] or [E], g2_alphas [E], float32.
struct Fp8Scales {
  using Scheme = Fp8Scheme;
  using F32 = ffi::Buffer<ffi::F32>;
  using Scales = std::tuple<F32, F32, F32>;
  static constexpr int64_t kAlign = 16;
  static ffi::Error Decode(MoeOperands& b, F32 g1_alphas, F32 a2_gscale, F32 g2_alphas,
                           tk::QuantParams& quant) {
    auto bad = [](std::string const& m) { return Bad(Scheme::kName, m); };
    for (auto dt : {b.x.element_type(), b.w13.element_type(), b.w2.element_type()})
      if (dt != ffi::DataType::F8E4M3FN) return bad("x, w13 and w2 must be float8_e4m3fn");
    if (b.out->element_type() != ffi::DataType::BF16) return bad("out must be bfloat16");
    if (b.w2.dimensions().size() != 3) return bad("w2 must be [E, H, I]");
    int64_t const e = b.w2.dimensions()[0];
    auto is_e = [e](F32 const& s) { return s.dimensions().size() == 1 && s.dimensions()[0] == e; };
    if (!is_e(g1_alphas) || !is_e(g2_alphas)) return bad("g1_alphas and g2_alphas must be [E] float32");
    bool const per_expert_a2 = a2_gscale.dimensions().size() == 1;
    if (!(a2_gscale.dimensions().size() == 0 || (per_expert_a2 && is_e(a2_gscale))))
      return bad("a2_gscale must be [] or [E] float32");
    quant = tk::QuantParams::FP8(g1_alphas.typed_data(), a2_gscale.typed_data(), g2_alphas.typed_data(),
                                 /*quant_final=*/nullptr, /*dequant_input=*/nullptr, per_expert_a2);
    return ffi::Error::Success();
  }
};

// The weight scales of the mixed-input GEMMs (mxfp4, w4a8), folded per block of 64 rows x 128 K
// into `line` lines of `line` scales (16 bytes each; jax_moe/layouts/mixed_gemm.py,
// interleave_scales_for_sm90_mixed_gemm; FlashInfer's interleave_moe_scales_for_sm90_mixed_gemm):
// [E, rows/64, K/128, line, line].
constexpr int64_t kMixedScaleRows = 64;  // rows per folded scale block
constexpr int64_t kMixedScaleK = 128;    // K (weights) per folded scale block
template <typename B>
bool IsFolded(B const& s, int64_t e, int64_t rows, int64_t kk, int64_t line) {
  auto d = s.dimensions();
  return d.size() == 5 && d[0] == e && d[1] * kMixedScaleRows == rows && d[2] * kMixedScaleK == kk &&
         d[3] == line && d[4] == line;
}

// The operands of a mixed-input scheme: x and out bfloat16, w13 [E, N1, K1/2] and w2 [E, H, I/2]
// uint8 (two 4-bit `codes` per byte). Sets e, h, i, n1, k1; the reason they are refused, if so.
std::optional<std::string> PackedWeights(MoeOperands& b, char const* codes, int64_t* e,
                                         int64_t* h, int64_t* i, int64_t* n1, int64_t* k1) {
  if (b.x.element_type() != ffi::DataType::BF16 || b.out->element_type() != ffi::DataType::BF16)
    return std::string("x and out must be bfloat16");
  if (b.w13.element_type() != ffi::DataType::U8 || b.w2.element_type() != ffi::DataType::U8)
    return std::string("w13 and w2 must be uint8 (two ") + codes + " codes per byte)";
  auto w13d = b.w13.dimensions();
  auto w2d = b.w2.dimensions();
  if (w13d.size() != 3 || w2d.size() != 3) return std::string("w13 and w2 must have rank 3");
  *e = w2d[0], *h = w2d[1], *i = w2d[2] * 2, *n1 = w13d[1], *k1 = w13d[2] * 2;
  return std::nullopt;
}

// mxfp4: E8M0 weight scales, one byte per 32 weights along K, folded into 16 lines of 16:
// w13_scale [E, 2I/64, H/128, 16, 16], w2_scale [E, H/64, I/128, 16, 16] uint8. (RunMoe checks
// the weights' shapes against x and each other.)
struct Mxfp4Scales {
  using Scheme = Mxfp4Scheme;
  using U8 = ffi::Buffer<ffi::U8>;
  using Scales = std::tuple<U8, U8>;
  static constexpr int64_t kAlign = kMixedScaleK;
  static constexpr int64_t kScaleBlock = 32;  // weights per E8M0 scale (QuantParams group size)
  static ffi::Error Decode(MoeOperands& b, U8 w13_scale, U8 w2_scale, tk::QuantParams& quant) {
    int64_t e, h, i, n1, k1;
    if (auto why = PackedWeights(b, "E2M1", &e, &h, &i, &n1, &k1)) return Bad(Scheme::kName, *why);
    if (!IsFolded(w13_scale, e, n1, k1, 16))
      return Bad(Scheme::kName, "w13_scale must be uint8 [E, N1/64, H/128, 16, 16] for w13 [E, N1, H/2]");
    if (!IsFolded(w2_scale, e, h, i, 16))
      return Bad(Scheme::kName, "w2_scale must be uint8 [E, H/64, I/128, 16, 16] for w2 [E, H, I/2]");
    quant = tk::QuantParams::GroupWise(static_cast<int>(kScaleBlock), w13_scale.untyped_data(),
                                       w2_scale.untyped_data());
    return ffi::Error::Success();
  }
};

// w4a8 (jax_moe/backends/flashinfer_cutlass/w4a8.py): bf16 weight scales, one per 128 int4
// weights along K, folded as mxfp4's into 8 lines of 8 (w13_scale [E, N1/64, H/128, 8, 8],
// w2_scale [E, H/64, I/128, 8, 8]); the FP8 quantizers' per-channel pre-quant scales
// fc1_act_scale [H], fc2_act_scale [I] (bf16, shared by the experts); per-expert fc1_alpha,
// fc2_alpha [E] float32. Both act scales present: the runner's use_awq; no zeros.
struct W4a8Scales {
  using Scheme = W4a8Scheme;
  using Any = ffi::AnyBuffer;
  using F32 = ffi::Buffer<ffi::F32>;
  using Scales = std::tuple<Any, Any, Any, Any, F32, F32>;
  static constexpr int64_t kGroup = 128;  // weights per scale (QuantParams group size)
  static constexpr int64_t kAlign = kGroup;
  static ffi::Error Decode(MoeOperands& b, Any w13_scale, Any w2_scale, Any fc1_act_scale,
                           Any fc2_act_scale, F32 fc1_alpha, F32 fc2_alpha, tk::QuantParams& quant) {
    auto bad = [](std::string const& m) { return Bad(Scheme::kName, m); };
    int64_t e, h, i, n1, k1;
    if (auto why = PackedWeights(b, "int4", &e, &h, &i, &n1, &k1)) return bad(*why);
    auto is_bf16 = [](Any const& s) { return s.element_type() == ffi::DataType::BF16; };
    if (!is_bf16(w13_scale) || !IsFolded(w13_scale, e, n1, k1, 8))
      return bad("w13_scale must be bfloat16 [E, N1/64, H/128, 8, 8] for w13 [E, N1, H/2]");
    if (!is_bf16(w2_scale) || !IsFolded(w2_scale, e, h, i, 8))
      return bad("w2_scale must be bfloat16 [E, H/64, I/128, 8, 8] for w2 [E, H, I/2]");
    auto is_vec = [&](Any const& s, int64_t n) {
      return is_bf16(s) && s.dimensions().size() == 1 && s.dimensions()[0] == n;
    };
    if (!is_vec(fc1_act_scale, k1)) return bad("fc1_act_scale must be bfloat16 [H]");
    if (!is_vec(fc2_act_scale, i)) return bad("fc2_act_scale must be bfloat16 [I]");
    auto is_e = [e](F32 const& s) { return s.dimensions().size() == 1 && s.dimensions()[0] == e; };
    if (!is_e(fc1_alpha) || !is_e(fc2_alpha)) return bad("fc1_alpha and fc2_alpha must be [E] float32");
    quant = tk::QuantParams::GroupWise(
        static_cast<int>(kGroup), w13_scale.untyped_data(), w2_scale.untyped_data(),
        fc1_act_scale.untyped_data(), fc2_act_scale.untyped_data(), /*fc1_weight_zeros=*/nullptr,
        /*fc2_weight_zeros=*/nullptr, fc1_alpha.typed_data(), fc2_alpha.typed_data());
    return ffi::Error::Success();
  }
};

}  // namespace

// The handler of scheme D::Scheme: x, w13, w2, topk_ids, topk_weights, the scheme's scales,
// w13_bias, w2_bias, swiglu -> out, workspace; attributes activation, gemm1_tactic, gemm2_tactic.
// Decode, check, launch; a scheme left out of the build answers that it is.
template <typename D, typename Scales = typename D::Scales>
struct Handler;
template <typename D, typename... Q>
struct Handler<D, std::tuple<Q...>> {
  using S = typename D::Scheme;
  static ffi::Error Call(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                         ffi::AnyBuffer w2, ffi::Buffer<ffi::S32> topk_ids,
                         ffi::Buffer<ffi::F32> topk_weights, Q... scales, ffi::AnyBuffer w13_bias,
                         ffi::AnyBuffer w2_bias, ffi::Buffer<ffi::F32> swiglu,
                         ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::U8> workspace,
                         int64_t activation, int64_t gemm1_tactic, int64_t gemm2_tactic) {
    if constexpr (!S::kCompiled) {
      return NotCompiled(S::kName);
    } else {
      MoeOperands b{x, w13, w2, topk_ids, topk_weights, w13_bias, w2_bias, swiglu, out, workspace};
      tk::QuantParams quant{};
      if (ffi::Error err = D::Decode(b, scales..., quant); err.failure()) return err;
      return RunMoe<S>(stream, device, b, activation, gemm1_tactic, gemm2_tactic, quant, D::kAlign);
    }
  }
  // The binding, read off Call's signature (common/binding.h).
  static auto Binding() {
    return jax_moe::BindHandler<decltype(&Call), ffi::PlatformStream<cudaStream_t>, ffi::DeviceOrdinal>(
        "activation", "gemm1_tactic", "gemm2_tactic");
  }
};

using Bf16Handler = Handler<FloatScales<Bf16Scheme>>;
using F16Handler = Handler<FloatScales<F16Scheme>>;
using Fp8Handler = Handler<Fp8Scales>;
using Mxfp4Handler = Handler<Mxfp4Scales>;
using W4a8Handler = Handler<W4a8Scales>;

}  // namespace jax_moe_fi

#define JAX_MOE_FI_DEFINE_HANDLER(symbol, handler)                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, jax_moe_fi::handler::Call, jax_moe_fi::handler::Binding(), \
                                {xla::ffi::Traits::kCmdBufferCompatible})
JAX_MOE_FI_DEFINE_HANDLER(JaxMoeFlashinferCutlassMoe, Bf16Handler);
JAX_MOE_FI_DEFINE_HANDLER(JaxMoeFlashinferCutlassMoeF16, F16Handler);
JAX_MOE_FI_DEFINE_HANDLER(JaxMoeFlashinferCutlassMoeFp8, Fp8Handler);
JAX_MOE_FI_DEFINE_HANDLER(JaxMoeFlashinferCutlassMoeMxfp4, Mxfp4Handler);
JAX_MOE_FI_DEFINE_HANDLER(JaxMoeFlashinferCutlassMoeW4a8, W4a8Handler);
