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
// at trace time (WorkspaceSize), outside any capture; so both handlers declare themselves
// command-buffer compatible (tests/test_flashinfer_cutlass.py runs them with command buffers on).
//
// One runner per device and scheme (the runner is stateful, so calls on a device are serialized
// by a mutex around the host-side launch); the tactic pair is chosen once per problem shape and
// cached. Only tactics compiled into this build (jax_moe_fi_kernels.h) are ever selected.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// XLA's FFI headers first: CUTLASS's cute/atom/mma_traits_sm100.hpp (reached through
// moe_kernels.h) turns -Wmissing-field-initializers into an error for everything after it, and
// some jaxlib versions' api.h has such initializers.
#include "xla/ffi/api/ffi.h"
// clang-format off
#include "handler_common.h"
#include "jax_moe_fi_kernels.h"
#include "tensorrt_llm/kernels/cutlass_kernels/include/moe_kernels.h"  // FlashInfer's, by its full path
// clang-format on
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic warning "-Wmissing-field-initializers"
#endif

namespace ffi = xla::ffi;
namespace tk = tensorrt_llm::kernels::cutlass_kernels;
namespace ce = tensorrt_llm::cutlass_extensions;

// The runner classes are instantiated in the generated runner.cu.
// kPack: weight elements per stored element along K (the runner's mInnerDimMultiplier).
// kBias, kBiasName: the biases' dtype (the runner's ScaleBiasType: its backbone type).
struct Bf16Scheme {
  static constexpr int kId = 0;
  static constexpr char const* kName = "bf16";
  static constexpr int kPack = 1;
  static constexpr ffi::DataType kBias = ffi::DataType::BF16;
  static constexpr char const* kBiasName = "bfloat16";
  using Runner = tk::CutlassMoeFCRunner<__nv_bfloat16, __nv_bfloat16>;
};
struct Fp8Scheme {
  static constexpr int kId = 1;
  static constexpr char const* kName = "fp8";
  static constexpr int kPack = 1;
  static constexpr ffi::DataType kBias = ffi::DataType::BF16;
  static constexpr char const* kBiasName = "bfloat16";
  using Runner = tk::CutlassMoeFCRunner<__nv_fp8_e4m3, __nv_fp8_e4m3, __nv_bfloat16,
                                        __nv_fp8_e4m3, __nv_bfloat16>;
};
// FlashInfer's isWFP4A16Quant runner: bf16 activations and output, E2M1 weights two per byte.
struct Mxfp4Scheme {
  static constexpr int kId = 2;
  static constexpr char const* kName = "mxfp4";
  static constexpr int kPack = 2;
  static constexpr ffi::DataType kBias = ffi::DataType::BF16;
  static constexpr char const* kBiasName = "bfloat16";
  using Runner = tk::CutlassMoeFCRunner<__nv_bfloat16, tk::Fp4Type>;
};
// FP16 (opt-in): bf16's runner with half everywhere, biases included. (Id 3 is fp8_block's, in
// cutlass_moe_fp8_block.cu.)
struct F16Scheme {
  static constexpr int kId = 4;
  static constexpr char const* kName = "f16";
  static constexpr int kPack = 1;
  static constexpr ffi::DataType kBias = ffi::DataType::F16;
  static constexpr char const* kBiasName = "float16";
  using Runner = tk::CutlassMoeFCRunner<half, half>;
};
// FlashInfer's isW4AFp8Quant runner with use_w4_group_scaling on bf16 input: FP8 GEMM operands,
// int4 weights two per byte, bf16 in and out. kAwq: its quantizers are AWQ's pre-quant scale
// paths, whose workspace (smoothed_act) exists only when the runner is sized with use_awq.
struct W4a8Scheme {
  static constexpr int kId = 5;
  static constexpr char const* kName = "w4a8";
  static constexpr int kPack = 2;
  static constexpr bool kAwq = true;
  static constexpr ffi::DataType kBias = ffi::DataType::BF16;
  static constexpr char const* kBiasName = "bfloat16";
  using Runner = tk::CutlassMoeFCRunner<__nv_fp8_e4m3, cutlass::uint4b_t, __nv_bfloat16, __nv_bfloat16>;
};
#if JAX_MOE_FI_WITH_BF16
extern template class tk::CutlassMoeFCRunner<__nv_bfloat16, __nv_bfloat16>;
#endif
#if JAX_MOE_FI_WITH_FP8
extern template class tk::CutlassMoeFCRunner<__nv_fp8_e4m3, __nv_fp8_e4m3, __nv_bfloat16,
                                             __nv_fp8_e4m3, __nv_bfloat16>;
#endif
#if JAX_MOE_FI_WITH_MXFP4
extern template class tk::CutlassMoeFCRunner<__nv_bfloat16, tk::Fp4Type>;
#endif
#if JAX_MOE_FI_WITH_F16
extern template class tk::CutlassMoeFCRunner<half, half>;
#endif
#if JAX_MOE_FI_WITH_W4A8
extern template class tk::CutlassMoeFCRunner<__nv_fp8_e4m3, cutlass::uint4b_t, __nv_bfloat16,
                                             __nv_bfloat16>;
#endif

namespace jax_moe_fi {
namespace {

using Config = ce::CutlassGemmConfig;

constexpr size_t kAlign = 128;  // tensorrt_llm::common::kCudaMemAlign

// Whether scheme S runs the runner's AWQ pre-quant scale paths (use_awq: W4A8's quantizers).
template <typename S, typename = void>
struct UsesAwq : std::false_type {};
template <typename S>
struct UsesAwq<S, std::void_t<decltype(S::kAwq)>> : std::bool_constant<S::kAwq> {};
size_t AlignUp(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

bool AnyFinalizeCompiled(int scheme) {
  for (auto const& t : kCompiledSm90Tactics)
    if (t.scheme == scheme && t.finalize) return true;
  return false;
}

// Whether `c` names a kernel of `scheme` that this build compiled (not a throwing stub).
bool IsCompiled(int scheme, Config const& c) {
  if (!c.is_tma_warp_specialized)  // the SM80 fused gated GEMMs exist for bf16 and f16 only
    return (scheme == Bf16Scheme::kId || scheme == F16Scheme::kId) && kSm80FusedCompiled &&
           c.sm_version < 90;
  if (c.sm_version != 90) return false;
  auto const [tm, tn, tile_k] = ce::enum_to_shape_tuple(c.tile_config_sm90);
  auto const [cm, cn, ck] = ce::enum_to_shape_tuple(c.cluster_shape);
  int const fin = c.epilogue_fusion_type == Config::EpilogueFusionType::FINALIZE ? 1 : 0;
  if (ck != 1) return false;
  for (auto const& t : kCompiledSm90Tactics) {
    if (t.scheme == scheme && t.tile_m == tm && t.tile_n == tn && t.tile_k == tile_k &&
        t.cluster_m == cm && t.cluster_n == cn && t.finalize == fin &&
        t.swap_ab == (c.swap_ab ? 1 : 0) &&
        (t.mainloop < 0 || t.mainloop == static_cast<int>(c.mainloop_schedule)))
      return true;
  }
  return false;
}

template <typename S>
struct DeviceState {
  using Scheme = S;
  std::mutex mu;
  std::unique_ptr<typename S::Runner> runner;
  std::vector<Config> gemm1, gemm2;        // the runner's full tactic lists
  std::map<ShapeKey, std::pair<int, int>> chosen;  // shape -> (gemm1 idx, gemm2 idx)
};

template <typename S>
DeviceState<S>& GetState(int device) {
  static std::mutex states_mu;
  static std::map<int, std::unique_ptr<DeviceState<S>>> states;
  std::lock_guard<std::mutex> lock(states_mu);
  auto& slot = states[device];
  if (!slot) {
    DeviceGuard guard(device);
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    if (major != 9 || minor != 0) {
      std::ostringstream msg;
      msg << "jax_moe FlashInfer CUTLASS MoE is built for SM90 (sm_90a) only; device " << device
          << " is sm_" << major << minor;
      throw std::runtime_error(msg.str());
    }
    auto state = std::make_unique<DeviceState<S>>();
    state->runner = std::make_unique<typename S::Runner>();
    // Finalize fusion (GEMM2 epilogue does the top-k reduce) only when its kernels exist.
    state->runner->use_fused_finalize_ = AnyFinalizeCompiled(S::kId);
    state->gemm1 = state->runner->getTactics(tk::MoeGemmId::GEMM_1);
    state->gemm2 = state->runner->getTactics(tk::MoeGemmId::GEMM_2);
    slot = std::move(state);
  }
  return *slot;
}

std::pair<int, int> TileMN(Config const& c) {
  auto const [m, n, k] = ce::enum_to_shape_tuple(c.tile_config_sm90);
  return {m, n};
}

bool IsPlain(Config const& c) {  // 1x1x1 cluster, no epilogue fusion
  return c.cluster_shape == ce::ClusterShape::ClusterShape_1x1x1 &&
         c.epilogue_fusion_type == Config::EpilogueFusionType::NONE;
}

// Deterministic built-in choice for one GEMM: with few rows per expert, swap A/B so that the
// narrow N tile runs over tokens; otherwise a 128x128 (or the widest compiled) tile.
// gemm_k: the GEMM's K; for w4a8 only tiles whose K divides it are taken (as FlashInfer's
// profiler filters its tactics; a K residue inside a scale group is not something to rely on).
int DefaultTactic(int scheme, std::vector<Config> const& list, int64_t rows_per_expert,
                  int64_t gemm_k) {
  int best = -1;
  int64_t best_score = INT64_MAX;
  for (int idx = 0; idx < static_cast<int>(list.size()); ++idx) {
    Config const& c = list[idx];
    if (!c.is_tma_warp_specialized || !IsCompiled(scheme, c) || !IsPlain(c)) continue;
    if (scheme == W4a8Scheme::kId && gemm_k % std::get<2>(ce::enum_to_shape_tuple(c.tile_config_sm90)) != 0)
      continue;
    auto const [tm, tn] = TileMN(c);
    int64_t score;
    if (rows_per_expert <= 64) {
      // prefer swap_ab with the smallest N tile covering the rows
      score = c.swap_ab ? (tn >= rows_per_expert ? tn : 1000 + (rows_per_expert - tn)) : 100000;
      score = score * 1000 + tm;
    } else {
      // prefer no swap, 128x128, then closest
      score = c.swap_ab ? 100000 : 0;
      score += std::abs(tm - 128) + std::abs(tn - 128);
    }
    if (score < best_score) {
      best_score = score;
      best = idx;
    }
  }
  if (best < 0) {  // fall back to the first compiled tactic of any kind
    for (int idx = 0; idx < static_cast<int>(list.size()); ++idx)
      if (IsCompiled(scheme, list[idx])) return idx;
  }
  return best;
}

template <typename S>
std::pair<int, int> ChooseTactics(DeviceState<S>& st, ShapeKey const& key, int64_t g1, int64_t g2) {
  auto check = [](std::vector<Config> const& list, int64_t idx, char const* which) {
    if (idx < 0 || idx >= static_cast<int64_t>(list.size()))
      throw std::invalid_argument(std::string("jax_moe: ") + which + " tactic index " +
                                  std::to_string(idx) + " out of range [0, " +
                                  std::to_string(list.size()) + ")");
    if (!IsCompiled(S::kId, list[idx]))
      throw std::invalid_argument(std::string("jax_moe: ") + which + " tactic " +
                                  std::to_string(idx) + " was not compiled into this build");
    return static_cast<int>(idx);
  };
  if (g1 >= 0 && g2 >= 0) return {check(st.gemm1, g1, "gemm1"), check(st.gemm2, g2, "gemm2")};
  auto it = st.chosen.find(key);
  std::pair<int, int> pick;
  if (it != st.chosen.end()) {
    pick = it->second;
  } else {
    int64_t const rows_per_expert = (key.t * key.k + key.e - 1) / key.e;
    pick = {DefaultTactic(S::kId, st.gemm1, rows_per_expert, key.h),
            DefaultTactic(S::kId, st.gemm2, rows_per_expert, key.i)};
    if (pick.first < 0 || pick.second < 0)
      throw std::runtime_error("jax_moe: no compiled SM90 MoE GEMM tactic available");
    st.chosen.emplace(key, pick);
  }
  if (g1 >= 0) pick.first = check(st.gemm1, g1, "gemm1");
  if (g2 >= 0) pick.second = check(st.gemm2, g2, "gemm2");
  return pick;
}

template <typename R>
size_t RunnerWorkspaceBytes(R& r, int64_t t, int64_t h, int64_t i, int e, int k,
                            tk::ActivationType act, bool awq) {
  return r.getWorkspaceSize(t, h, i, e, k, act, tk::MOEParallelismConfig{}, /*use_lora=*/false,
                            /*use_deepseek_fp8_block_scale=*/false,
                            /*use_mxfp8_act_scaling=*/false, /*min_latency_mode=*/false, awq);
}

template <typename R>
size_t TotalWorkspaceBytes(R& r, int64_t t, int64_t h, int64_t i, int e, int k,
                           tk::ActivationType act, bool awq) {
  // [runner workspace | unpermuted_row_to_permuted_row (T*k int32)], each 128-byte aligned.
  return AlignUp(RunnerWorkspaceBytes(r, t, h, i, e, k, act, awq)) +
         AlignUp(static_cast<size_t>(t) * k * sizeof(int));
}

bool IsGated(tk::ActivationType a) {
  return a == tk::ActivationType::Swiglu || a == tk::ActivationType::Geglu ||
         a == tk::ActivationType::SwigluBias || a == tk::ActivationType::SwigluStep ||
         a == tk::ActivationType::GegluTanh || a == tk::ActivationType::Situ;
}

bool IsSupportedActivation(int64_t a) {
  using A = tk::ActivationType;
  switch (static_cast<A>(a)) {
    case A::Gelu:
    case A::Relu:
    case A::Silu:
    case A::Swiglu:
    case A::Geglu:
    case A::Relu2:
    case A::Identity:
    case A::SwigluBias:  // with the swiglu operand
      return true;
    default:  // the others need per-expert parameters this handler does not take
      return false;
  }
}

std::string DescribeTactic(int scheme, Config const& c) {
  char buf[192];
  if (c.is_tma_warp_specialized) {
    auto const [tm, tn, tkb] = ce::enum_to_shape_tuple(c.tile_config_sm90);
    auto const [cm, cn, ck] = ce::enum_to_shape_tuple(c.cluster_shape);
    bool const fin = c.epilogue_fusion_type == Config::EpilogueFusionType::FINALIZE;
    bool const auto_sched = c.mainloop_schedule == ce::MainloopScheduleType::AUTO;
    std::snprintf(buf, sizeof(buf), "sm%d tma_ws tile=%dx%dx%dB cluster=%dx%dx%d fusion=%s swap_ab=%d%s%s%s",
                  c.sm_version, tm, tn, tkb, cm, cn, ck, fin ? "finalize" : "none",
                  c.swap_ab ? 1 : 0, auto_sched ? "" : " mainloop=",
                  auto_sched ? "" : ce::get_mainloop_schedule_name(c.mainloop_schedule),
                  IsCompiled(scheme, c) ? "" : " (not compiled)");
  } else {
    std::snprintf(buf, sizeof(buf), "sm80 tile_id=%d stages=%d%s",
                  static_cast<int>(c.tile_config_sm80), c.stages,
                  IsCompiled(scheme, c) ? "" : " (not compiled)");
  }
  return std::string(buf);
}

// Shapes, validation and the launch, common to every scheme. `quant` carries the scheme's
// scale pointers (empty for bf16).
template <typename S>
ffi::Error RunMoe(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                  ffi::AnyBuffer w2, ffi::Buffer<ffi::S32> topk_ids,
                  ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer w13_bias, ffi::AnyBuffer w2_bias,
                  ffi::Buffer<ffi::F32> swiglu, ffi::Result<ffi::AnyBuffer> out,
                  ffi::ResultBuffer<ffi::U8> workspace, int64_t activation, int64_t gemm1_tactic,
                  int64_t gemm2_tactic, tk::QuantParams const& quant, int64_t align) {
  auto bad = [](std::string const& m) {
    return ffi::Error::InvalidArgument(std::string("jax_moe flashinfer_cutlass_moe (") + S::kName +
                                       "): " + m);
  };
  auto xd = x.dimensions();
  auto w13d = w13.dimensions();
  auto w2d = w2.dimensions();
  auto idd = topk_ids.dimensions();
  auto twd = topk_weights.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || w13d.size() != 3 || w2d.size() != 3 || idd.size() != 2 ||
      twd.size() != 2 || od.size() != 2 || workspace->dimensions().size() != 1)
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
  if (w13d[0] != e || w13d[1] != n1 || w13d[2] * S::kPack != h)
    return bad("w13 must be [E, " + std::string(IsGated(act) ? "2I" : "I") + ", H" + packed + "]");
  if (w2d[1] != h) return bad("w2 must be [E, H, I" + packed + "]");
  if (idd[0] != t || twd[0] != t || twd[1] != k) return bad("topk_ids/topk_weights must be [T,k]");
  // The runner writes the first Hu columns of each row (its unpadded hidden size), 16 bytes at a
  // time (finalizeMoeRoutingKernel).
  int64_t const hu = od[1];
  if (od[0] != t || hu < 1 || hu > h || hu % 8 != 0)
    return bad("out must be [T, Hu] with Hu <= H and Hu a multiple of 8");
  if (h % align != 0 || i % align != 0)
    return bad("H and I must be multiples of " + std::to_string(align) + " (TMA alignment)");
  // Optional operands: an empty buffer means "none".
  auto present = [](ffi::AnyBuffer const& b) { return b.element_count() > 0; };
  auto is_2d = [](ffi::AnyBuffer const& b, int64_t d0, int64_t d1) {
    auto d = b.dimensions();
    return d.size() == 2 && d[0] == d0 && d[1] == d1;
  };
  bool const has_b13 = present(w13_bias), has_b2 = present(w2_bias);
  if (has_b13 && (!is_2d(w13_bias, e, n1) || w13_bias.element_type() != S::kBias))
    return bad("w13_bias must be [E, " + std::string(IsGated(act) ? "2I" : "I") + "] " +
               S::kBiasName + " or empty");
  if (has_b2 && (!is_2d(w2_bias, e, h) || w2_bias.element_type() != S::kBias))
    return bad(std::string("w2_bias must be [E, H] ") + S::kBiasName + " or empty");
  bool const is_swiglu_bias = act == tk::ActivationType::SwigluBias;
  auto sd = swiglu.dimensions();
  if (is_swiglu_bias && !(sd.size() == 2 && sd[0] == 3 && sd[1] == e))
    return bad("SwigluBias needs swiglu [3, E] float32 (alpha, beta, limit per expert)");
  if (!is_swiglu_bias && swiglu.element_count() != 0)
    return bad("swiglu parameters are only taken with the SwigluBias activation");
  if (t == 0) return ffi::Error::Success();

  try {
    DeviceState<S>& st = GetState<S>(device);
    std::lock_guard<std::mutex> lock(st.mu);
    DeviceGuard guard(device);
    auto& r = *st.runner;

    size_t const moe_ws = RunnerWorkspaceBytes(r, t, h, i, static_cast<int>(e),
                                               static_cast<int>(k), act, UsesAwq<S>::value);
    size_t const need = AlignUp(moe_ws) + AlignUp(static_cast<size_t>(t) * k * sizeof(int));
    if (workspace->size_bytes() < need)
      return bad("workspace has " + std::to_string(workspace->size_bytes()) + " bytes, needs " +
                 std::to_string(need) + " (use workspace_size())");
    auto* ws = static_cast<char*>(workspace->untyped_data());
    if (reinterpret_cast<uintptr_t>(ws) % kAlign != 0) return bad("workspace is not 128-byte aligned");

    ShapeKey key{t, h, i, static_cast<int>(e), static_cast<int>(k), static_cast<int>(activation)};
    auto const [g1, g2] = ChooseTactics(st, key, gemm1_tactic, gemm2_tactic);
    r.setTactic(st.gemm1[g1], st.gemm2[g2]);

    float const* sw = swiglu.typed_data();
    tk::ActivationParams act_params =
        is_swiglu_bias ? tk::ActivationParams(act, sw, sw + e, sw + 2 * e)
                       : tk::ActivationParams(act);
    ::tensorrt_llm::kernels::LoraParams lora{};
    tk::MoeMinLatencyParams min_latency{};
    r.runMoe(x.untyped_data(), /*input_sf=*/nullptr, /*swizzled_input_sf=*/false,
             topk_ids.typed_data(), topk_weights.typed_data(), w13.untyped_data(),
             has_b13 ? w13_bias.untyped_data() : nullptr, act_params, w2.untyped_data(),
             has_b2 ? w2_bias.untyped_data() : nullptr, quant, t, h, /*unpadded_hidden_size=*/hu, i,
             static_cast<int>(e), static_cast<int>(k), ws, out->untyped_data(),
             reinterpret_cast<int*>(ws + AlignUp(moe_ws)), tk::MOEParallelismConfig{},
             /*enable_alltoall=*/false, /*use_lora=*/false, lora,
             /*use_deepseek_fp8_block_scale=*/false, /*use_mxfp8_act_scaling=*/false,
             /*min_latency_mode=*/false, min_latency, /*enable_pdl=*/false, stream);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
      return ffi::Error::Internal(std::string("jax_moe flashinfer_cutlass_moe: CUDA error: ") +
                                  cudaGetErrorString(err));
  } catch (std::invalid_argument const& ex) {
    return ffi::Error::InvalidArgument(ex.what());
  } catch (std::exception const& ex) {
    return ffi::Error::Internal(std::string("jax_moe flashinfer_cutlass_moe: ") + ex.what());
  }
  return ffi::Error::Success();
}

ffi::Error NotCompiled(char const* scheme) {
  return ffi::Error::InvalidArgument(std::string("jax_moe flashinfer_cutlass_moe: scheme ") + scheme +
                                   " was not compiled into this build (JAX_MOE_FI_SCHEMES)");
}

ffi::Error Bf16Impl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                    ffi::AnyBuffer w2, ffi::Buffer<ffi::S32> topk_ids,
                    ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer w13_bias,
                    ffi::AnyBuffer w2_bias, ffi::Buffer<ffi::F32> swiglu,
                    ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::U8> workspace,
                    int64_t activation, int64_t gemm1_tactic, int64_t gemm2_tactic) {
#if JAX_MOE_FI_WITH_BF16
  for (auto dt : {x.element_type(), w13.element_type(), w2.element_type(), out->element_type()})
    if (dt != ffi::DataType::BF16)
      return ffi::Error::InvalidArgument("jax_moe flashinfer_cutlass_moe (bf16): x, w13, w2 and out must be bfloat16");
  return RunMoe<Bf16Scheme>(stream, device, x, w13, w2, topk_ids, topk_weights, w13_bias, w2_bias,
                            swiglu, out, workspace,
                            activation, gemm1_tactic, gemm2_tactic, tk::QuantParams{}, 8);
#else
  return NotCompiled("bf16");
#endif
}

// bf16's handler with float16 for x, w13, w2, the biases and out.
ffi::Error F16Impl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                   ffi::AnyBuffer w2, ffi::Buffer<ffi::S32> topk_ids,
                   ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer w13_bias,
                   ffi::AnyBuffer w2_bias, ffi::Buffer<ffi::F32> swiglu,
                   ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::U8> workspace,
                   int64_t activation, int64_t gemm1_tactic, int64_t gemm2_tactic) {
#if JAX_MOE_FI_WITH_F16
  for (auto dt : {x.element_type(), w13.element_type(), w2.element_type(), out->element_type()})
    if (dt != ffi::DataType::F16)
      return ffi::Error::InvalidArgument("jax_moe flashinfer_cutlass_moe (f16): x, w13, w2 and out must be float16");
  return RunMoe<F16Scheme>(stream, device, x, w13, w2, topk_ids, topk_weights, w13_bias, w2_bias,
                           swiglu, out, workspace,
                           activation, gemm1_tactic, gemm2_tactic, tk::QuantParams{}, 8);
#else
  return NotCompiled("f16");
#endif
}

ffi::Error Fp8Impl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                   ffi::AnyBuffer w2, ffi::Buffer<ffi::S32> topk_ids,
                   ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::F32> g1_alphas,
                   ffi::Buffer<ffi::F32> a2_gscale, ffi::Buffer<ffi::F32> g2_alphas,
                   ffi::AnyBuffer w13_bias, ffi::AnyBuffer w2_bias, ffi::Buffer<ffi::F32> swiglu,
                   ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::U8> workspace,
                   int64_t activation, int64_t gemm1_tactic, int64_t gemm2_tactic) {
#if JAX_MOE_FI_WITH_FP8
  auto bad = [](std::string const& m) {
    return ffi::Error::InvalidArgument("jax_moe flashinfer_cutlass_moe (fp8): " + m);
  };
  for (auto dt : {x.element_type(), w13.element_type(), w2.element_type()})
    if (dt != ffi::DataType::F8E4M3FN) return bad("x, w13 and w2 must be float8_e4m3fn");
  if (out->element_type() != ffi::DataType::BF16) return bad("out must be bfloat16");
  if (w2.dimensions().size() != 3) return bad("w2 must be [E, H, I]");
  int64_t const e = w2.dimensions()[0];
  auto is_e = [e](ffi::Buffer<ffi::F32> const& b) {
    return b.dimensions().size() == 1 && b.dimensions()[0] == e;
  };
  if (!is_e(g1_alphas) || !is_e(g2_alphas)) return bad("g1_alphas and g2_alphas must be [E] float32");
  bool const per_expert_a2 = a2_gscale.dimensions().size() == 1;
  if (!(a2_gscale.dimensions().size() == 0 || (per_expert_a2 && is_e(a2_gscale))))
    return bad("a2_gscale must be [] or [E] float32");
  auto const quant = tk::QuantParams::FP8(g1_alphas.typed_data(), a2_gscale.typed_data(),
                                          g2_alphas.typed_data(), /*quant_final=*/nullptr,
                                          /*dequant_input=*/nullptr, per_expert_a2);
  return RunMoe<Fp8Scheme>(stream, device, x, w13, w2, topk_ids, topk_weights, w13_bias, w2_bias,
                           swiglu, out, workspace,
                           activation, gemm1_tactic, gemm2_tactic, quant, 16);
#else
  return NotCompiled("fp8");
#endif
}

// The E8M0 weight scales of the mixed-input GEMM: one byte per 32 weights along K, folded per
// block of 64 rows x 128 K into 16 lines of 16 bytes (jax_moe/layouts/mixed_gemm.py,
// interleave_scales_for_sm90_mixed_gemm; FlashInfer's interleave_moe_scales_for_sm90_mixed_gemm).
constexpr int64_t kMxScaleBlock = 32;       // weights per E8M0 scale (QuantParams group size)
constexpr int64_t kMixedScaleRows = 64;     // rows per folded scale block
constexpr int64_t kMixedScaleK = 128;       // K (weights) per folded scale block
constexpr int64_t kMixedScaleLine = 16;     // bytes per line of a folded block

ffi::Error Mxfp4Impl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                     ffi::AnyBuffer w2, ffi::Buffer<ffi::S32> topk_ids,
                     ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::U8> w13_scale,
                     ffi::Buffer<ffi::U8> w2_scale, ffi::AnyBuffer w13_bias, ffi::AnyBuffer w2_bias,
                     ffi::Buffer<ffi::F32> swiglu, ffi::Result<ffi::AnyBuffer> out,
                     ffi::ResultBuffer<ffi::U8> workspace, int64_t activation, int64_t gemm1_tactic,
                     int64_t gemm2_tactic) {
#if JAX_MOE_FI_WITH_MXFP4
  auto bad = [](std::string const& m) {
    return ffi::Error::InvalidArgument("jax_moe flashinfer_cutlass_moe (mxfp4): " + m);
  };
  if (x.element_type() != ffi::DataType::BF16 || out->element_type() != ffi::DataType::BF16)
    return bad("x and out must be bfloat16");
  if (w13.element_type() != ffi::DataType::U8 || w2.element_type() != ffi::DataType::U8)
    return bad("w13 and w2 must be uint8 (two E2M1 codes per byte)");
  // The scale shapes; RunMoe checks the weights' against x and each other.
  auto w13d = w13.dimensions();
  auto w2d = w2.dimensions();
  if (w13d.size() != 3 || w2d.size() != 3) return bad("w13 and w2 must have rank 3");
  int64_t const e = w2d[0], h = w2d[1], k2 = w2d[2] * Mxfp4Scheme::kPack;
  int64_t const n1 = w13d[1], k1 = w13d[2] * Mxfp4Scheme::kPack;
  auto is_folded = [](ffi::Buffer<ffi::U8> const& s, int64_t e, int64_t rows, int64_t kk) {
    auto d = s.dimensions();
    return d.size() == 5 && d[0] == e && d[1] * kMixedScaleRows == rows &&
           d[2] * kMixedScaleK == kk && d[3] == kMixedScaleLine && d[4] == kMixedScaleLine;
  };
  if (!is_folded(w13_scale, e, n1, k1))
    return bad("w13_scale must be uint8 [E, N1/64, H/128, 16, 16] for w13 [E, N1, H/2]");
  if (!is_folded(w2_scale, e, h, k2))
    return bad("w2_scale must be uint8 [E, H/64, I/128, 16, 16] for w2 [E, H, I/2]");
  auto const quant = tk::QuantParams::GroupWise(static_cast<int>(kMxScaleBlock),
                                                w13_scale.untyped_data(), w2_scale.untyped_data());
  return RunMoe<Mxfp4Scheme>(stream, device, x, w13, w2, topk_ids, topk_weights, w13_bias, w2_bias,
                             swiglu, out, workspace, activation, gemm1_tactic, gemm2_tactic, quant,
                             kMixedScaleK);
#else
  return NotCompiled("mxfp4");
#endif
}

// W4A8 (jax_moe/backends/flashinfer_cutlass/w4a8.py): bf16 weight scales, one per 128 int4
// weights along K, folded per 64 rows x 128 K into 8 lines of 8 (the same fold as MXFP4's, for
// 2-byte scales); the FP8 quantizers' per-channel pre-quant scales (bf16, shared by the experts)
// and the per-expert alphas.
constexpr int64_t kInt4Group = 128;      // weights per scale (QuantParams group size)
constexpr int64_t kW4a8ScaleLine = 8;    // bf16 scales per 16-byte line; 64 / 8 lines per block

ffi::Error W4a8Impl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                    ffi::AnyBuffer w2, ffi::Buffer<ffi::S32> topk_ids,
                    ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer w13_scale,
                    ffi::AnyBuffer w2_scale, ffi::AnyBuffer fc1_act_scale,
                    ffi::AnyBuffer fc2_act_scale, ffi::Buffer<ffi::F32> fc1_alpha,
                    ffi::Buffer<ffi::F32> fc2_alpha, ffi::AnyBuffer w13_bias, ffi::AnyBuffer w2_bias,
                    ffi::Buffer<ffi::F32> swiglu, ffi::Result<ffi::AnyBuffer> out,
                    ffi::ResultBuffer<ffi::U8> workspace, int64_t activation, int64_t gemm1_tactic,
                    int64_t gemm2_tactic) {
#if JAX_MOE_FI_WITH_W4A8
  auto bad = [](std::string const& m) {
    return ffi::Error::InvalidArgument("jax_moe flashinfer_cutlass_moe (w4a8): " + m);
  };
  if (x.element_type() != ffi::DataType::BF16 || out->element_type() != ffi::DataType::BF16)
    return bad("x and out must be bfloat16");
  if (w13.element_type() != ffi::DataType::U8 || w2.element_type() != ffi::DataType::U8)
    return bad("w13 and w2 must be uint8 (two int4 codes per byte)");
  auto w13d = w13.dimensions();
  auto w2d = w2.dimensions();
  if (w13d.size() != 3 || w2d.size() != 3) return bad("w13 and w2 must have rank 3");
  int64_t const e = w2d[0], h = w2d[1], i = w2d[2] * W4a8Scheme::kPack;
  int64_t const n1 = w13d[1], k1 = w13d[2] * W4a8Scheme::kPack;
  auto is_folded = [](ffi::AnyBuffer const& s, int64_t e, int64_t rows, int64_t kk) {
    auto d = s.dimensions();
    return s.element_type() == ffi::DataType::BF16 && d.size() == 5 && d[0] == e &&
           d[1] * kMixedScaleRows == rows && d[2] * kMixedScaleK == kk &&
           d[3] == kMixedScaleRows / kW4a8ScaleLine && d[4] == kW4a8ScaleLine;
  };
  if (!is_folded(w13_scale, e, n1, k1))
    return bad("w13_scale must be bfloat16 [E, N1/64, H/128, 8, 8] for w13 [E, N1, H/2]");
  if (!is_folded(w2_scale, e, h, i))
    return bad("w2_scale must be bfloat16 [E, H/64, I/128, 8, 8] for w2 [E, H, I/2]");
  auto is_vec = [](ffi::AnyBuffer const& b, int64_t n) {
    return b.element_type() == ffi::DataType::BF16 && b.dimensions().size() == 1 &&
           b.dimensions()[0] == n;
  };
  if (!is_vec(fc1_act_scale, k1)) return bad("fc1_act_scale must be bfloat16 [H]");
  if (!is_vec(fc2_act_scale, i)) return bad("fc2_act_scale must be bfloat16 [I]");
  auto is_e = [e](ffi::Buffer<ffi::F32> const& b) {
    return b.dimensions().size() == 1 && b.dimensions()[0] == e;
  };
  if (!is_e(fc1_alpha) || !is_e(fc2_alpha)) return bad("fc1_alpha and fc2_alpha must be [E] float32");
  // Both act scales present: the runner's use_awq (its FP8 quantizers); no zeros.
  auto const quant = tk::QuantParams::GroupWise(
      static_cast<int>(kInt4Group), w13_scale.untyped_data(), w2_scale.untyped_data(),
      fc1_act_scale.untyped_data(), fc2_act_scale.untyped_data(), /*fc1_weight_zeros=*/nullptr,
      /*fc2_weight_zeros=*/nullptr, fc1_alpha.typed_data(), fc2_alpha.typed_data());
  return RunMoe<W4a8Scheme>(stream, device, x, w13, w2, topk_ids, topk_weights, w13_bias, w2_bias,
                            swiglu, out, workspace, activation, gemm1_tactic, gemm2_tactic, quant,
                            kInt4Group);
#else
  return NotCompiled("w4a8");
#endif
}

// Runs `f(DeviceState<S>&)` for the scheme with id `scheme`. R is spelled out: a build with no
// scheme of this file (fp8_block alone) has no branch to deduce it from.
template <typename R, typename F>
R WithState(int scheme, int device, F&& f) {
  if (device < 0) cudaGetDevice(&device);
#if JAX_MOE_FI_WITH_BF16
  if (scheme == Bf16Scheme::kId) return f(GetState<Bf16Scheme>(device), Bf16Scheme::kId);
#endif
#if JAX_MOE_FI_WITH_FP8
  if (scheme == Fp8Scheme::kId) return f(GetState<Fp8Scheme>(device), Fp8Scheme::kId);
#endif
#if JAX_MOE_FI_WITH_MXFP4
  if (scheme == Mxfp4Scheme::kId) return f(GetState<Mxfp4Scheme>(device), Mxfp4Scheme::kId);
#endif
#if JAX_MOE_FI_WITH_F16
  if (scheme == F16Scheme::kId) return f(GetState<F16Scheme>(device), F16Scheme::kId);
#endif
#if JAX_MOE_FI_WITH_W4A8
  if (scheme == W4a8Scheme::kId) return f(GetState<W4a8Scheme>(device), W4a8Scheme::kId);
#endif
  throw std::invalid_argument("scheme " + std::to_string(scheme) + " is not compiled into this build");
}

}  // namespace

// ----------------------------------------------------------------- host-side queries (nanobind)

// Bit (1 << scheme id) for each scheme compiled in.
int CompiledSchemes() {
  int m = 0;
#if JAX_MOE_FI_WITH_BF16
  m |= 1 << Bf16Scheme::kId;
#endif
#if JAX_MOE_FI_WITH_FP8
  m |= 1 << Fp8Scheme::kId;
#endif
#if JAX_MOE_FI_WITH_MXFP4
  m |= 1 << Mxfp4Scheme::kId;
#endif
#if JAX_MOE_FI_WITH_F16
  m |= 1 << F16Scheme::kId;
#endif
#if JAX_MOE_FI_WITH_W4A8
  m |= 1 << W4a8Scheme::kId;
#endif
  return m;
}

size_t WorkspaceSize(int64_t num_tokens, int64_t hidden, int64_t inter, int64_t num_experts,
                     int64_t top_k, int64_t activation, int scheme, int device) {
  if (!IsSupportedActivation(activation))
    throw std::invalid_argument("unsupported activation type " + std::to_string(activation));
  if (device < 0) cudaGetDevice(&device);
  return WithState<size_t>(scheme, device, [&](auto& st, int) {
    std::lock_guard<std::mutex> lock(st.mu);
    DeviceGuard guard(device);
    using S = typename std::decay_t<decltype(st)>::Scheme;
    return TotalWorkspaceBytes(*st.runner, std::max<int64_t>(num_tokens, 1), hidden, inter,
                               static_cast<int>(num_experts), static_cast<int>(top_k),
                               static_cast<tk::ActivationType>(activation), UsesAwq<S>::value);
  });
}

// Tactic-list queries use only C types across the library boundary to the nanobind module, which
// builds the Python list itself.
int NumTactics(int gemm_id, int scheme, int device) {
  return WithState<int>(scheme, device, [&](auto& st, int) {
    std::lock_guard<std::mutex> lock(st.mu);
    return static_cast<int>((gemm_id == 1 ? st.gemm1 : st.gemm2).size());
  });
}

// Writes tactic `idx`'s description (NUL-terminated, truncated to buf_len) and returns whether
// that tactic is compiled into this build (1) or not (0).
int TacticInfo(int gemm_id, int idx, int scheme, int device, char* buf, size_t buf_len) {
  return WithState<int>(scheme, device, [&](auto& st, int id) {
    std::lock_guard<std::mutex> lock(st.mu);
    auto const& list = gemm_id == 1 ? st.gemm1 : st.gemm2;
    if (idx < 0 || idx >= static_cast<int>(list.size()))
      throw std::out_of_range("tactic index out of range");
    std::string const d = DescribeTactic(id, list[idx]);
    if (buf_len > 0) {
      size_t const n = std::min(d.size(), buf_len - 1);
      std::memcpy(buf, d.data(), n);
      buf[n] = '\0';
    }
    return IsCompiled(id, list[idx]) ? 1 : 0;
  });
}

// The (gemm1, gemm2) tactic indices the handler picks for a shape when given -1.
std::pair<int, int> DefaultTactics(int64_t num_tokens, int64_t hidden, int64_t inter,
                                   int64_t num_experts, int64_t top_k, int64_t activation,
                                   int scheme, int device) {
  return WithState<std::pair<int, int>>(scheme, device, [&](auto& st, int) {
    std::lock_guard<std::mutex> lock(st.mu);
    ShapeKey key{num_tokens, hidden, inter, static_cast<int>(num_experts),
                 static_cast<int>(top_k), static_cast<int>(activation)};
    return ChooseTactics(st, key, -1, -1);
  });
}

int NumCompiledSm90Tactics(int scheme) {
  int n = 0;
  for (auto const& t : kCompiledSm90Tactics) n += t.scheme == scheme;
  return n;
}

}  // namespace jax_moe_fi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFlashinferCutlassMoe, jax_moe_fi::Bf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::AnyBuffer>()          // w13
                                  .Arg<ffi::AnyBuffer>()          // w2
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_ids
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights
                                  .Arg<ffi::AnyBuffer>()          // w13_bias [E,2I] or [0]
                                  .Arg<ffi::AnyBuffer>()          // w2_bias [E,H] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // swiglu [3,E] or [0]
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Ret<ffi::Buffer<ffi::U8>>()    // workspace
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("gemm1_tactic")
                                  .Attr<int64_t>("gemm2_tactic"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFlashinferCutlassMoeF16, jax_moe_fi::F16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()          // x (f16)
                                  .Arg<ffi::AnyBuffer>()          // w13 (f16)
                                  .Arg<ffi::AnyBuffer>()          // w2 (f16)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_ids
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights
                                  .Arg<ffi::AnyBuffer>()          // w13_bias [E,2I] (f16) or [0]
                                  .Arg<ffi::AnyBuffer>()          // w2_bias [E,H] (f16) or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // swiglu [3,E] or [0]
                                  .Ret<ffi::AnyBuffer>()          // out (f16)
                                  .Ret<ffi::Buffer<ffi::U8>>()    // workspace
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("gemm1_tactic")
                                  .Attr<int64_t>("gemm2_tactic"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFlashinferCutlassMoeFp8, jax_moe_fi::Fp8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()          // x (fp8)
                                  .Arg<ffi::AnyBuffer>()          // w13 (fp8)
                                  .Arg<ffi::AnyBuffer>()          // w2 (fp8)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_ids
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights
                                  .Arg<ffi::Buffer<ffi::F32>>()   // g1_alphas [E]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // a2_gscale [] or [E]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // g2_alphas [E]
                                  .Arg<ffi::AnyBuffer>()          // w13_bias [E,2I] or [0]
                                  .Arg<ffi::AnyBuffer>()          // w2_bias [E,H] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // swiglu [3,E] or [0]
                                  .Ret<ffi::AnyBuffer>()          // out (bf16)
                                  .Ret<ffi::Buffer<ffi::U8>>()    // workspace
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("gemm1_tactic")
                                  .Attr<int64_t>("gemm2_tactic"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFlashinferCutlassMoeMxfp4, jax_moe_fi::Mxfp4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()          // x (bf16) [T, H]
                                  .Arg<ffi::AnyBuffer>()          // w13 (uint8) [E, 2I, H/2]
                                  .Arg<ffi::AnyBuffer>()          // w2 (uint8) [E, H, I/2]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_ids
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights
                                  .Arg<ffi::Buffer<ffi::U8>>()    // w13_scale [E, 2I/64, H/128, 16, 16]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // w2_scale [E, H/64, I/128, 16, 16]
                                  .Arg<ffi::AnyBuffer>()          // w13_bias [E,2I] or [0]
                                  .Arg<ffi::AnyBuffer>()          // w2_bias [E,H] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // swiglu [3,E] or [0]
                                  .Ret<ffi::AnyBuffer>()          // out (bf16) [T, Hu]
                                  .Ret<ffi::Buffer<ffi::U8>>()    // workspace
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("gemm1_tactic")
                                  .Attr<int64_t>("gemm2_tactic"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFlashinferCutlassMoeW4a8, jax_moe_fi::W4a8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()          // x (bf16) [T, H]
                                  .Arg<ffi::AnyBuffer>()          // w13 (uint8) [E, N1, H/2]
                                  .Arg<ffi::AnyBuffer>()          // w2 (uint8) [E, H, I/2]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_ids
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights
                                  .Arg<ffi::AnyBuffer>()          // w13_scale (bf16) [E, N1/64, H/128, 8, 8]
                                  .Arg<ffi::AnyBuffer>()          // w2_scale (bf16) [E, H/64, I/128, 8, 8]
                                  .Arg<ffi::AnyBuffer>()          // fc1_act_scale (bf16) [H]
                                  .Arg<ffi::AnyBuffer>()          // fc2_act_scale (bf16) [I]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // fc1_alpha [E]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // fc2_alpha [E]
                                  .Arg<ffi::AnyBuffer>()          // w13_bias [E,N1] or [0]
                                  .Arg<ffi::AnyBuffer>()          // w2_bias [E,H] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // swiglu [3,E] or [0]
                                  .Ret<ffi::AnyBuffer>()          // out (bf16) [T, H]
                                  .Ret<ffi::Buffer<ffi::U8>>()    // workspace
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("gemm1_tactic")
                                  .Attr<int64_t>("gemm2_tactic"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
