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
//   workspace    [W]                   uint8  W = Fp8BlockWorkspaceSize(T, H, I, E, k, activation)
// Attributes:
//   activation   int64  TRT-LLM ActivationType (Swiglu 3, Geglu 4, SwigluBias 5, Relu2 6)
//
// The block-scale GEMM has no tactic list: it is one kernel (tile 128 x 64 x 128) whose launch
// FlashInfer's binding configures with a placeholder tactic, as done here. DeepGEMM's JIT path in
// the same GEMM is never taken (its compiler has no include directories, so it reports itself
// invalid); the driver calls its runtime names are resolved by ffi/flashinfer/deepgemm_stubs.cc.
//
// One runner per device and problem shape: the block-scale GEMM runner keeps the largest row
// count it was sized for and lays its workspace out by it, so a runner shared between shapes
// would need more workspace for a small shape after a large one than XLA allocated at trace time.
// The runner of a shape is created at trace time (Fp8BlockWorkspaceSize), outside any capture; the
// launch path makes no host synchronization, so the handler is command-buffer compatible.

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>

// XLA's FFI headers first (see cutlass_moe.cu: CUTLASS headers turn
// -Wmissing-field-initializers into an error for everything after them).
#include "xla/ffi/api/ffi.h"
#include "cutlass_moe_fp8_block.h"
#include "handler_common.h"

namespace ffi = xla::ffi;

// Without the scheme this file only defines the handler symbol (which reports that fp8_block was
// not compiled) and the host queries, and stays cheap to compile: no FlashInfer headers.
#if JAX_MOE_FI_WITH_FP8_BLOCK
// clang-format off
#include "tensorrt_llm/kernels/cutlass_kernels/include/moe_kernels.h"  // FlashInfer's, by its full path
// clang-format on
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic warning "-Wmissing-field-initializers"
#endif

namespace tk = tensorrt_llm::kernels::cutlass_kernels;
namespace ce = tensorrt_llm::cutlass_extensions;

// Instantiated in the generated runner.cu.
extern template class tk::CutlassMoeFCRunner<__nv_bfloat16, __nv_fp8_e4m3>;
extern "C" void JaxMoeDeepGemmRestoreEnv();  // ffi/flashinfer/deepgemm_stubs.cc
#endif

namespace jax_moe_fi {

#if JAX_MOE_FI_WITH_FP8_BLOCK
namespace {

using Runner = tk::CutlassMoeFCRunner<__nv_bfloat16, __nv_fp8_e4m3>;
constexpr int64_t kBlock = 128;   // weight scale block (rows and columns), activation group
constexpr size_t kAlign = 128;    // tensorrt_llm::common::kCudaMemAlign
size_t AlignUp(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// The activations this handler takes (the codes jax_moe.backends.flashinfer_cutlass sends).
bool IsSupportedActivation(int64_t a) {
  using A = tk::ActivationType;
  switch (static_cast<A>(a)) {
    case A::Swiglu:
    case A::Geglu:
    case A::SwigluBias:
    case A::Relu2:
      return true;
    default:
      return false;
  }
}

bool IsGated(tk::ActivationType a) { return a != tk::ActivationType::Relu2; }

struct DeviceState {
  std::mutex mu;
  std::map<ShapeKey, std::unique_ptr<Runner>> runners;
};

DeviceState& GetState(int device) {
  static std::mutex states_mu;
  static std::map<int, std::unique_ptr<DeviceState>> states;
  std::lock_guard<std::mutex> lock(states_mu);
  auto& slot = states[device];
  if (!slot) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    if (major != 9 || minor != 0) {
      std::ostringstream msg;
      msg << "jax_moe FlashInfer CUTLASS MoE (fp8_block) is built for SM90 (sm_90a) only; device "
          << device << " is sm_" << major << minor;
      throw std::runtime_error(msg.str());
    }
    slot = std::make_unique<DeviceState>();
  }
  return *slot;
}

// The runner of one problem shape (call with st.mu held and the device current).
Runner& RunnerFor(DeviceState& st, ShapeKey const& key) {
  auto& r = st.runners[key];
  if (!r) {
    r = std::make_unique<Runner>();
    r->use_fused_finalize_ = false;
    // The block-scale GEMMs ignore the tactic, but the runner asks for one to be set; FlashInfer's
    // binding sets this one.
    ce::CutlassGemmConfig const placeholder(ce::CutlassTileConfigSM90::CtaShape128x16x128B,
                                            ce::MainloopScheduleType::AUTO,
                                            ce::EpilogueScheduleType::AUTO,
                                            ce::ClusterShape::ClusterShape_1x1x1);
    r->setTactic(placeholder, placeholder);
  }
  return *r;
}

size_t RunnerWorkspaceBytes(Runner& r, ShapeKey const& key) {
  return r.getWorkspaceSize(key.t, key.h, key.i, key.e, key.k,
                            static_cast<tk::ActivationType>(key.act), tk::MOEParallelismConfig{},
                            /*use_lora=*/false, /*use_deepseek_fp8_block_scale=*/true,
                            /*use_mxfp8_act_scaling=*/false, /*min_latency_mode=*/false,
                            /*use_awq=*/false);
}

// [runner workspace | unpermuted_row_to_permuted_row (T*k int32)], each 128-byte aligned.
size_t TotalWorkspaceBytes(Runner& r, ShapeKey const& key) {
  return AlignUp(RunnerWorkspaceBytes(r, key)) + AlignUp(static_cast<size_t>(key.t) * key.k * sizeof(int));
}

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

ffi::Error Bad(std::string const& m) {
  return ffi::Error::InvalidArgument("jax_moe flashinfer_cutlass_moe (fp8_block): " + m);
}

}  // namespace
#endif  // JAX_MOE_FI_WITH_FP8_BLOCK

namespace {

ffi::Error Fp8BlockImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                        ffi::AnyBuffer w2, ffi::Buffer<ffi::S32> topk_ids,
                        ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer w13_scale,
                        ffi::AnyBuffer w2_scale, ffi::AnyBuffer w13_bias, ffi::AnyBuffer w2_bias,
                        ffi::Buffer<ffi::F32> swiglu, ffi::Result<ffi::AnyBuffer> out,
                        ffi::ResultBuffer<ffi::U8> workspace, int64_t activation) {
#if JAX_MOE_FI_WITH_FP8_BLOCK
  // ---- decode and check
  using DT = ffi::DataType;
  if (x.element_type() != DT::BF16 || out->element_type() != DT::BF16)
    return Bad("x and out must be bfloat16");
  if (w13.element_type() != DT::F8E4M3FN || w2.element_type() != DT::F8E4M3FN)
    return Bad("w13 and w2 must be float8_e4m3fn");
  if (w13_scale.element_type() != DT::F32 || w2_scale.element_type() != DT::F32)
    return Bad("w13_scale and w2_scale must be float32");
  if (!IsSupportedActivation(activation)) return Bad("unsupported activation type " + std::to_string(activation));
  auto const act = static_cast<tk::ActivationType>(activation);
  auto xd = x.dimensions(), w2d = w2.dimensions(), idd = topk_ids.dimensions();
  if (xd.size() != 2 || w2d.size() != 3 || idd.size() != 2)
    return Bad("expected x [T, H], w2 [E, H, I], topk_ids [T, k]");
  int64_t const t = xd[0], h = xd[1], e = w2d[0], i = w2d[2], k = idd[1];
  int64_t const n1 = IsGated(act) ? 2 * i : i;
  if (h % kBlock != 0 || i % kBlock != 0) return Bad("H and I must be multiples of 128");
  if (w2d[1] != h) return Bad("w2 must be [E, H, I]");
  if (!Is3d(w13, e, n1, h)) return Bad(std::string("w13 must be [E, ") + (IsGated(act) ? "2I" : "I") + ", H]");
  if (!Is3d(w13_scale, e, n1 / kBlock, h / kBlock)) return Bad("w13_scale must be [E, N1/128, H/128]");
  if (!Is3d(w2_scale, e, h / kBlock, i / kBlock)) return Bad("w2_scale must be [E, H/128, I/128]");
  if (idd[0] != t || !Is2d(topk_weights, t, k)) return Bad("topk_ids/topk_weights must be [T, k]");
  if (!Is2d(*out, t, h)) return Bad("out must be [T, H]");
  bool const has_b13 = w13_bias.element_count() > 0, has_b2 = w2_bias.element_count() > 0;
  if (has_b13 && (!Is2d(w13_bias, e, n1) || w13_bias.element_type() != DT::BF16))
    return Bad("w13_bias must be [E, N1] bfloat16 or empty");
  if (has_b2 && (!Is2d(w2_bias, e, h) || w2_bias.element_type() != DT::BF16))
    return Bad("w2_bias must be [E, H] bfloat16 or empty");
  bool const is_swiglu_bias = act == tk::ActivationType::SwigluBias;
  auto sd = swiglu.dimensions();
  if (is_swiglu_bias && !(sd.size() == 2 && sd[0] == 3 && sd[1] == e))
    return Bad("SwigluBias needs swiglu [3, E] float32 (alpha, beta, limit per expert)");
  if (!is_swiglu_bias && swiglu.element_count() != 0)
    return Bad("swiglu parameters are only taken with the SwigluBias activation");
  if (t == 0) return ffi::Error::Success();

  // ---- launch
  try {
    DeviceState& st = GetState(device);
    std::lock_guard<std::mutex> lock(st.mu);
    DeviceGuard guard(device);
    ShapeKey const key{t, h, i, static_cast<int>(e), static_cast<int>(k), static_cast<int>(activation)};
    Runner& r = RunnerFor(st, key);
    size_t const moe_ws = RunnerWorkspaceBytes(r, key);
    size_t const need = AlignUp(moe_ws) + AlignUp(static_cast<size_t>(t) * k * sizeof(int));
    if (workspace->size_bytes() < need)
      return Bad("workspace has " + std::to_string(workspace->size_bytes()) + " bytes, needs " +
                 std::to_string(need) + " (use workspace_size())");
    auto* ws = static_cast<char*>(workspace->untyped_data());
    if (reinterpret_cast<uintptr_t>(ws) % kAlign != 0) return Bad("workspace is not 128-byte aligned");

    auto const quant = tk::QuantParams::FP8BlockScaling(static_cast<float const*>(w13_scale.untyped_data()),
                                                        static_cast<float const*>(w2_scale.untyped_data()));
    float const* sw = swiglu.typed_data();
    tk::ActivationParams act_params = is_swiglu_bias ? tk::ActivationParams(act, sw, sw + e, sw + 2 * e)
                                                     : tk::ActivationParams(act);
    ::tensorrt_llm::kernels::LoraParams lora{};
    tk::MoeMinLatencyParams min_latency{};
    r.runMoe(x.untyped_data(), /*input_sf=*/nullptr, /*swizzled_input_sf=*/false, topk_ids.typed_data(),
             topk_weights.typed_data(), w13.untyped_data(), has_b13 ? w13_bias.untyped_data() : nullptr,
             act_params, w2.untyped_data(), has_b2 ? w2_bias.untyped_data() : nullptr, quant, t, h,
             /*unpadded_hidden_size=*/h, i, static_cast<int>(e), static_cast<int>(k), ws,
             out->untyped_data(), reinterpret_cast<int*>(ws + AlignUp(moe_ws)), tk::MOEParallelismConfig{},
             /*enable_alltoall=*/false, /*use_lora=*/false, lora, /*use_deepseek_fp8_block_scale=*/true,
             /*use_mxfp8_act_scaling=*/false, /*min_latency_mode=*/false, min_latency,
             /*enable_pdl=*/false, stream);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
      return ffi::Error::Internal(std::string("jax_moe flashinfer_cutlass_moe (fp8_block): CUDA error: ") +
                                  cudaGetErrorString(err));
  } catch (std::invalid_argument const& ex) {
    return ffi::Error::InvalidArgument(ex.what());
  } catch (std::exception const& ex) {
    return ffi::Error::Internal(std::string("jax_moe flashinfer_cutlass_moe (fp8_block): ") + ex.what());
  }
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument(
      "jax_moe flashinfer_cutlass_moe: scheme fp8_block was not compiled into this build (JAX_MOE_FI_SCHEMES)");
#endif
}

}  // namespace

// ----------------------------------------------------------------- host-side queries (nanobind)

int CompiledSchemesFp8Block() {
#if JAX_MOE_FI_WITH_FP8_BLOCK
  return 1 << kFp8BlockSchemeId;
#else
  return 0;
#endif
}

void Fp8BlockAfterLoad() {
#if JAX_MOE_FI_WITH_FP8_BLOCK
  JaxMoeDeepGemmRestoreEnv();
#endif
}

size_t Fp8BlockWorkspaceSize(int64_t num_tokens, int64_t hidden, int64_t inter, int64_t num_experts,
                             int64_t top_k, int64_t activation, int device) {
#if JAX_MOE_FI_WITH_FP8_BLOCK
  if (!IsSupportedActivation(activation))
    throw std::invalid_argument("fp8_block: unsupported activation type " + std::to_string(activation));
  if (device < 0) cudaGetDevice(&device);
  DeviceState& st = GetState(device);
  std::lock_guard<std::mutex> lock(st.mu);
  DeviceGuard guard(device);
  ShapeKey const key{std::max<int64_t>(num_tokens, 1), hidden, inter, static_cast<int>(num_experts),
                     static_cast<int>(top_k), static_cast<int>(activation)};
  return TotalWorkspaceBytes(RunnerFor(st, key), key);
#else
  throw std::invalid_argument("scheme fp8_block is not compiled into this build (JAX_MOE_FI_SCHEMES)");
#endif
}

}  // namespace jax_moe_fi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFlashinferCutlassMoeFp8Block, jax_moe_fi::Fp8BlockImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()          // x (bf16) [T, H]
                                  .Arg<ffi::AnyBuffer>()          // w13 (fp8) [E, N1, H]
                                  .Arg<ffi::AnyBuffer>()          // w2 (fp8) [E, H, I]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_ids
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights
                                  .Arg<ffi::AnyBuffer>()          // w13_scale (f32) [E, N1/128, H/128]
                                  .Arg<ffi::AnyBuffer>()          // w2_scale (f32) [E, H/128, I/128]
                                  .Arg<ffi::AnyBuffer>()          // w13_bias [E, N1] or [0]
                                  .Arg<ffi::AnyBuffer>()          // w2_bias [E, H] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // swiglu [3, E] or [0]
                                  .Ret<ffi::AnyBuffer>()          // out (bf16) [T, H]
                                  .Ret<ffi::Buffer<ffi::U8>>()    // workspace
                                  .Attr<int64_t>("activation"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
