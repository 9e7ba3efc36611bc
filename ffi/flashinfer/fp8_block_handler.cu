// XLA FFI handler for FlashInfer's CUTLASS fused-MoE runner with DeepSeek-V3 FP8 block scales
// (scheme fp8_block, JAX_MOE_FI_WITH_FP8_BLOCK; see cmake/flashinfer_moe.cmake), SM90:
//
//   jax_moe_flashinfer_cutlass_moe_fp8_block
//       BF16 activations x FP8 E4M3 weights with one float32 scale per 128 x 128 block -> BF16.
//       The runner is CutlassMoeFCRunner<bf16, fp8> with use_deepseek_fp8_block_scale: both GEMMs
//       run on TensorRT-LLM's block-scale grouped GEMM (fp8_blockscale_gemm), which quantizes its
//       bf16 input to FP8 itself, per token (row) per 128 columns along K, with a dynamic scale
//       amax / 448, and multiplies FP8 x FP8 with the 1 x 128 activation and 128 x 128 weight
//       scales applied per K block.
//
// Operands (row-major; H and I multiples of kBlock = 128; N1 = 2I for gated activations, I else):
//   x            [T, H]                bf16
//   w13          [E, N1, H]            float8_e4m3fn  rows [0, I) "up" (w3), [I, 2I) gate (w1):
//                                                     the runner computes act(gate) * up (the
//                                                     same row order as every other scheme)
//   w2           [E, H, I]             float8_e4m3fn
//   topk_ids     [T, k]                int32  expert ids in [0, E)
//   topk_weights [T, k]                float32
//   w13_scale    [E, N1/128, H/128]    float32  dequantization scale of block (r, c): rows
//                                               [128 r, 128 r + 128), columns [128 c, 128 c + 128)
//                                               of w13 (rows in w13's order above)
//   w2_scale     [E, H/128, I/128]     float32  the same for w2
//   w13_bias     [E, N1] or [0]        bf16   GEMM1 bias in w13's row order ([0]: none)
//   w2_bias      [E, H] or [0]         bf16   GEMM2 bias ([0]: none)
//   swiglu       [3, E] or [0]         float32  per-expert (alpha, beta, limit) for SwigluBias
// Results:
//   out          [T, H]                bf16   sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])
//   workspace    [W]                   uint8  W = WorkspaceSize(T, H, I, E, k, activation, scheme 3)
// Attributes:
//   activation   int64  TRT-LLM ActivationType (Swiglu 3, Geglu 4, SwigluBias 5, Relu2 6)
//
// The block-scale GEMM has no tactic list: it is one kernel (tile 128 x 64 x 128) whose launch
// FlashInfer's binding configures with a placeholder tactic, as the runner cache does. DeepGEMM's JIT path in
// the same GEMM is never taken (its compiler has no include directories, so it reports itself
// invalid); the driver calls its runtime names are resolved by ffi/flashinfer/deepgemm_stubs.cc.
//
// One runner per device and problem shape (runner_cache.h says why), created at trace time
// (WorkspaceSize in host_queries.cu), outside any capture; the launch path makes no host
// synchronization, so the handler is command-buffer compatible. Without the scheme this file only
// defines the handler symbol (which reports that fp8_block was not compiled) and stays cheap to
// compile: no FlashInfer headers.

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../common/binding.h"
#include "handler_common.h"
#if JAX_MOE_FI_WITH_FP8_BLOCK
#include <mutex>

#include "launch.h"
#endif

namespace jax_moe_fi {
namespace {

#if JAX_MOE_FI_WITH_FP8_BLOCK
constexpr int64_t kBlock = 128;  // weight scale block (rows and columns), activation group

template <typename B>
bool Is3d(B const& b, int64_t d0, int64_t d1, int64_t d2) {
  auto d = b.dimensions();
  return d.size() == 3 && d[0] == d0 && d[1] == d1 && d[2] == d2;
}

template <typename B>
bool Is2d(B const& b, int64_t d0, int64_t d1) {
  auto d = b.dimensions();
  return d.size() == 2 && d[0] == d0 && d[1] == d1;
}
#endif  // JAX_MOE_FI_WITH_FP8_BLOCK

ffi::Error Fp8BlockImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                        ffi::AnyBuffer w2, ffi::Buffer<ffi::S32> topk_ids,
                        ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer w13_scale,
                        ffi::AnyBuffer w2_scale, ffi::AnyBuffer w13_bias, ffi::AnyBuffer w2_bias,
                        ffi::Buffer<ffi::F32> swiglu, ffi::Result<ffi::AnyBuffer> out,
                        ffi::ResultBuffer<ffi::U8> workspace, int64_t activation) {
#if JAX_MOE_FI_WITH_FP8_BLOCK
  using S = Fp8BlockScheme;
  auto bad = [](std::string const& m) { return Bad(S::kName, m); };
  // ---- decode and check
  using DT = ffi::DataType;
  if (x.element_type() != DT::BF16 || out->element_type() != DT::BF16)
    return bad("x and out must be bfloat16");
  if (w13.element_type() != DT::F8E4M3FN || w2.element_type() != DT::F8E4M3FN)
    return bad("w13 and w2 must be float8_e4m3fn");
  if (w13_scale.element_type() != DT::F32 || w2_scale.element_type() != DT::F32)
    return bad("w13_scale and w2_scale must be float32");
  if (!IsSupportedFp8BlockActivation(activation))
    return bad("unsupported activation type " + std::to_string(activation));
  auto const act = static_cast<tk::ActivationType>(activation);
  auto xd = x.dimensions(), w2d = w2.dimensions(), idd = topk_ids.dimensions();
  if (xd.size() != 2 || w2d.size() != 3 || idd.size() != 2)
    return bad("expected x [T, H], w2 [E, H, I], topk_ids [T, k]");
  int64_t const t = xd[0], h = xd[1], e = w2d[0], i = w2d[2], k = idd[1];
  bool const gated = act != tk::ActivationType::Relu2;  // of the activations taken, Relu2 alone is not
  int64_t const n1 = gated ? 2 * i : i;
  if (h % kBlock != 0 || i % kBlock != 0) return bad("H and I must be multiples of 128");
  if (w2d[1] != h) return bad("w2 must be [E, H, I]");
  if (!Is3d(w13, e, n1, h)) return bad(std::string("w13 must be [E, ") + (gated ? "2I" : "I") + ", H]");
  if (!Is3d(w13_scale, e, n1 / kBlock, h / kBlock)) return bad("w13_scale must be [E, N1/128, H/128]");
  if (!Is3d(w2_scale, e, h / kBlock, i / kBlock)) return bad("w2_scale must be [E, H/128, I/128]");
  if (idd[0] != t || !Is2d(topk_weights, t, k)) return bad("topk_ids/topk_weights must be [T, k]");
  if (!Is2d(*out, t, h)) return bad("out must be [T, H]");
  MoeOperands b{x, w13, w2, topk_ids, topk_weights, w13_bias, w2_bias, swiglu, out, workspace};
  bool const swiglu_bias = act == tk::ActivationType::SwigluBias;
  if (auto why = CheckOptionalOperands<S>(b, e, n1, h, swiglu_bias, "N1")) return bad(*why);
  if (t == 0) return ffi::Error::Success();

  // ---- launch
  return Guarded("flashinfer_cutlass_moe (fp8_block)", [&]() -> ffi::Error {
    Fp8BlockState& st = GetFp8BlockState(device);
    std::lock_guard<std::mutex> lock(st.mu);
    DeviceGuard guard(device);
    ShapeKey const key{t, h, i, static_cast<int>(e), static_cast<int>(k), static_cast<int>(activation)};
    auto const quant = tk::QuantParams::FP8BlockScaling(static_cast<float const*>(w13_scale.untyped_data()),
                                                        static_cast<float const*>(w2_scale.untyped_data()));
    return RunFused<S>(Fp8BlockRunnerFor(st, key), "flashinfer_cutlass_moe (fp8_block)", b, key,
                       /*hu=*/h, quant, /*deepseek=*/true, stream, [] {});
  });
#else
  return NotCompiled("fp8_block");
#endif
}

}  // namespace
}  // namespace jax_moe_fi

// Binding read off Fp8BlockImpl's signature (common/binding.h).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFlashinferCutlassMoeFp8Block, jax_moe_fi::Fp8BlockImpl,
                              (jax_moe::BindHandler<decltype(&jax_moe_fi::Fp8BlockImpl),
                                                    xla::ffi::PlatformStream<cudaStream_t>,
                                                    xla::ffi::DeviceOrdinal>("activation")),
                              {xla::ffi::Traits::kCmdBufferCompatible});
