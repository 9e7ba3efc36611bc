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
// call's second result; its layout is MakePlan() below, and workspace_size() (nanobind,
// module.cc) returns its total for the Python shape rule. Nothing is allocated here.
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
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../common/errors.h"
#include "flashinfer/trtllm/batched_gemm/trtllmGen_bmm_export/BatchedGemmInterface.h"
#include "flashinfer/trtllm/fused_moe/runner.h"
#include "host_queries.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
// (not "moe": FlashInfer declares namespace moe::dev for its kernels)
namespace tmoe = tensorrt_llm::kernels::trtllmgen_moe;
namespace btg = batchedGemm::trtllm::gen;

namespace jax_moe_trtllm {
namespace {

constexpr int64_t kAlign = 256;  // every sub-buffer starts 256-byte aligned
constexpr int kTileNs[] = {8, 16, 32, 64, 128};
constexpr int64_t kMaxTileNBf16Act = 64;  // FlashInfer has no tile-128 FP4 kernels for BF16 activations

int64_t RoundUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

bool KnownTile(int64_t tile_n) {
  return std::find(std::begin(kTileNs), std::end(kTileNs), tile_n) != std::end(kTileNs);
}

// What a scheme id means to the runner: activation and weight dtypes, and the weights' (and GEMM1
// output's) scale block.
struct SchemeTypes {
  btg::Dtype act, weights;
  int64_t sf_vec;
  bool deepseek = false;  // DeepSeek FP8: 128x128 block scales, BlockMajorK weights, unfused activation
};

SchemeTypes TypesOf(int scheme) {
  switch (scheme) {
    case kSchemeFp8PerTensor: return {btg::Dtype::E4m3, btg::Dtype::E4m3, 0};
    case kSchemeNvfp4: return {btg::Dtype::E2m1, btg::Dtype::E2m1, 16};
    case kSchemeMxfp4Bf16: return {btg::Dtype::Bfloat16, btg::Dtype::MxE2m1, 32};
    case kSchemeMxfp4Mxfp8: return {btg::Dtype::MxE4m3, btg::Dtype::MxE2m1, 32};
    case kSchemeFp8Block: return {btg::Dtype::E4m3, btg::Dtype::E4m3, 128, true};
    default: throw std::invalid_argument("unknown TRT-LLM gen scheme id " + std::to_string(scheme));
  }
}

// A problem as the runner sees it (local experts = all experts: no expert parallelism here).
// hidden and inter are the logical sizes (elements, not bytes).
struct Problem {
  int scheme;
  int64_t tokens, hidden, inter, experts, top_k, activation, tile_n;
};

// The runner for (scheme, tile, activation, device): built once per host thread, as FlashInfer's
// launcher caches it (constructing it filters the whole cubin table). Weights are shuffled
// (useShuffledMatrix) for every scheme here, MajorK except DeepSeek FP8's BlockMajorK; GEMM1
// biases, when given, are per expert (BiasType::None is FlashInfer's choice too: BiasType::Mn is
// its LoRA-delta path).
tmoe::MoE::Runner& GetRunner(int scheme, int64_t tile_n, int64_t activation, int device) {
  SchemeTypes const types = TypesOf(scheme);
  if (!KnownTile(tile_n)) throw std::invalid_argument("tile_n must be one of 8, 16, 32, 64, 128");
  if (types.act == btg::Dtype::Bfloat16 && tile_n > kMaxTileNBf16Act)
    throw std::invalid_argument("tile_n must be at most 64 for BF16 activations");
  using Key = std::tuple<int, int64_t, int64_t, int>;
  static thread_local std::map<Key, tmoe::MoE::Runner> cache;
  Key key{scheme, tile_n, activation, device};
  auto it = cache.find(key);
  if (it == cache.end()) {
    it = cache
             .try_emplace(key, types.act, types.weights, types.deepseek,
                          static_cast<int32_t>(tile_n),
                          static_cast<tmoe::MoE::ActivationType>(activation),
                          /*useShuffledMatrix=*/true,
                          types.deepseek ? batchedGemm::gemm::MatrixLayout::BlockMajorK
                                         : batchedGemm::gemm::MatrixLayout::MajorK,
                          batchedGemm::gemm::BiasType::None)
             .first;
  }
  return it->second;
}

tmoe::MoE::MoERunnerArgs BaseArgs(Problem const& p) {
  tmoe::MoE::MoERunnerArgs args;
  args.num_tokens = static_cast<int32_t>(p.tokens);
  args.num_experts = static_cast<int32_t>(p.experts);
  args.local_expert_offset = 0;
  args.local_num_experts = static_cast<int32_t>(p.experts);
  args.hidden_size = static_cast<int32_t>(p.hidden);
  args.hidden_size_output = static_cast<int32_t>(p.hidden);
  args.intermediate_size = static_cast<int32_t>(p.inter);
  args.top_k = static_cast<int32_t>(p.top_k);
  args.routed_scaling_factor = 1.0f;
  args.activation_type = static_cast<tmoe::MoE::ActivationType>(p.activation);
  args.mDtypeElt = TypesOf(p.scheme).act;
  args.mDtypeExpW = btg::Dtype::Fp32;
  args.mDtypeOut = btg::Dtype::Bfloat16;
  args.mUseDeepSeekFp8 = TypesOf(p.scheme).deepseek;
  args.mUseRoutingScalesOnInput = false;
  args.do_finalize = true;
  return args;
}

int64_t ResolveConfig(tmoe::MoE::Runner& runner, Problem const& p, int64_t config) {
  auto const k = static_cast<int32_t>(p.top_k);
  auto const h = static_cast<int32_t>(p.hidden);
  auto const i = static_cast<int32_t>(p.inter);
  auto const e = static_cast<int32_t>(p.experts);
  auto const t = static_cast<int32_t>(p.tokens);
  if (config < 0) config = runner.getDefaultValidConfigIndex(k, h, i, e, t, h);
  if (!runner.isValidConfigIndex(config, k, h, i, e, t, h))
    throw std::invalid_argument("config " + std::to_string(config) +
                                " is not valid for this shape and tile_n");
  return config;
}

}  // namespace

// Byte offsets of every buffer in the workspace (same order as the MoEWorkspace fields); -1: the
// scheme does not use that buffer (its pointer stays null).
struct Plan {
  int64_t tokens_per_expert, total_padded, expanded_to_permuted, permuted_to_token, histogram,
      cta_to_batch, cta_to_mn_limit, non_exiting_ctas, gemm1_out, gemm1_out_scale,
      activation_out = -1, activation_out_scale = -1, gemm2_out, bmm1, bmm2, total;
  int32_t max_padded;
  int64_t config;
};

Plan MakePlan(Problem const& p, int64_t config, int device) {
  auto& runner = GetRunner(p.scheme, p.tile_n, p.activation, device);
  config = ResolveConfig(runner, p, config);
  SchemeTypes const types = TypesOf(p.scheme);
  auto const e = static_cast<int32_t>(p.experts);
  auto const t = static_cast<int32_t>(p.tokens);
  auto const k = static_cast<int32_t>(p.top_k);
  auto const tile = static_cast<int32_t>(p.tile_n);
  int32_t const max_padded = tmoe::Routing::getMaxPermutedPaddedCount(t, k, e, tile);
  int32_t const max_ctas = tmoe::Routing::getMaxNumCtasInBatchDim(t, k, e, tile);
  auto const args = BaseArgs(p);
  auto const [bmm1, bmm2] = runner.getWorkspaceSizeInBytes(args, config);

  Plan plan{};
  int64_t off = 0;
  auto take = [&off](int64_t bytes) {
    int64_t const at = off;
    off = RoundUp(off + std::max<int64_t>(bytes, 1), kAlign);
    return at;
  };
  plan.tokens_per_expert = take(4 * int64_t{e});
  plan.total_padded = take(4);
  plan.expanded_to_permuted = take(4 * int64_t{t} * k);
  plan.permuted_to_token = take(4 * (int64_t{max_padded} + 1));  // kernels read one past the end
  plan.histogram = take(4 * std::max<int64_t>(2 * int64_t{e}, 512));
  plan.cta_to_batch = take(4 * int64_t{max_ctas});
  plan.cta_to_mn_limit = take(4 * int64_t{max_ctas});
  plan.non_exiting_ctas = take(4);
  if (p.scheme == kSchemeFp8PerTensor) {
    int64_t const padded1 = max_padded + e;  // GEMM1 rows, as FlashInfer's launcher sizes them
    plan.gemm1_out = take(padded1 * 2 * p.inter);                    // fp8
    plan.gemm1_out_scale = take(4 * (2 * p.inter / 128) * padded1);  // float32
    plan.gemm2_out = take(2 * int64_t{max_padded} * p.hidden);       // bf16
  } else if (types.deepseek) {
    // DeepSeek FP8, sized as FlashInfer's FP8 block-scale launcher does: GEMM1 writes both gated
    // halves (fp8, float32 scales [2I/128, max_padded]), a separate kernel the activation (fp8
    // [rows1, I], scales [I/128, rows1]); GEMM2 bf16. Rows: Routing::maybeGetMinTokenCount.
    bool const gated =
        tmoe::MoE::isGatedActivation(static_cast<tmoe::MoE::ActivationType>(p.activation));
    int64_t const n1 = (gated ? 2 : 1) * p.inter;
    int64_t const rows1 = tmoe::Routing::maybeGetMinTokenCount(
        max_padded, static_cast<int32_t>(p.inter), 8);
    int64_t const rows2 = tmoe::Routing::maybeGetMinTokenCount(
        max_padded, static_cast<int32_t>(p.hidden), 16);
    plan.gemm1_out = take(rows1 * n1);
    plan.gemm1_out_scale = take(4 * (n1 / 128) * int64_t{max_padded});
    plan.activation_out = take(rows1 * p.inter);
    plan.activation_out_scale = take(4 * (p.inter / 128) * rows1);
    plan.gemm2_out = take(2 * rows2 * p.hidden);
  } else {
    // FP4 block scale, sized as FlashInfer's FP4 launcher does: GEMM1's output is the activation
    // of GEMM2 (I wide, in the activation dtype: E2M1 pairs, E4M3 bytes or bf16), with its block
    // scales in the 128x4-swizzled layout when quantized ((rows rounded up to 128) x (I/sf
    // rounded up to 4) bytes, computeSwizzledLayoutSFSize); both GEMM outputs have at least the
    // rows that make them 128 KiB (Routing::maybeGetMinTokenCount).
    int64_t const bits = btg::dtypeGetNumBits(types.act);
    int64_t const rows1 = tmoe::Routing::maybeGetMinTokenCount(
        max_padded, static_cast<int32_t>(p.inter), static_cast<int32_t>(bits));
    int64_t const rows2 = tmoe::Routing::maybeGetMinTokenCount(
        max_padded, static_cast<int32_t>(p.hidden), 16);
    plan.gemm1_out = take(rows1 * p.inter * bits / 8);
    plan.gemm1_out_scale = types.act == btg::Dtype::Bfloat16
                               ? -1
                               : take(RoundUp(rows1, 128) * RoundUp(p.inter / types.sf_vec, 4));
    plan.gemm2_out = take(2 * rows2 * p.hidden);  // bf16
  }
  plan.bmm1 = take(bmm1);
  plan.bmm2 = take(bmm2);
  plan.total = off;
  plan.max_padded = max_padded;
  plan.config = config;
  return plan;
}

// ------------------------------------------------------------------------- host queries

int64_t WorkspaceSize(int64_t tokens, int64_t hidden, int64_t inter, int64_t experts, int64_t top_k,
                      int64_t activation, int64_t tile_n, int64_t config, int device, int scheme) {
  return MakePlan({scheme, tokens, hidden, inter, experts, top_k, activation, tile_n}, config, device)
      .total;
}

int64_t DefaultTileN(int64_t tokens, int64_t top_k, int64_t experts) {
  // The smallest tile covering the average tokens per expert (FlashInfer's selectDefaultTileN).
  double const avg = static_cast<double>(tokens) * top_k / std::max<int64_t>(experts, 1);
  for (int tile : kTileNs)
    if (tile >= avg) return tile;
  return kTileNs[std::size(kTileNs) - 1];
}

int64_t DefaultConfig(int64_t tokens, int64_t hidden, int64_t inter, int64_t experts,
                      int64_t top_k, int64_t activation, int64_t tile_n, int device, int scheme) {
  Problem const p{scheme, tokens, hidden, inter, experts, top_k, activation, tile_n};
  return ResolveConfig(GetRunner(scheme, tile_n, activation, device), p, -1);
}

std::string CubinPath(int64_t bmm_index) {
  auto const bmm = batchedGemm::batchedGemm::BatchedGemmInterface();
  if (bmm_index < 0 || static_cast<size_t>(bmm_index) >= bmm.getNumBatchedGemmConfigs())
    throw std::out_of_range("batched GEMM config index out of range");
  std::string name = bmm.getBatchedGemmConfigs()[bmm_index].mFunctionName;
  if (!name.empty()) name[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(name[0])));
  // The same relative path gemm::loadCubinData hands to getCubin (GemmOptions.h).
  return std::string(TLLM_GEN_GEMM_CUBIN_PATH) + "/" + name + ".cubin";
}

std::vector<std::pair<std::string, std::string>> Cubins(int scheme, int64_t activation,
                                                        int64_t tile_n, int64_t config,
                                                        int64_t tokens, int64_t hidden,
                                                        int64_t inter, int64_t experts,
                                                        int64_t top_k, int device) {
  auto const bmm = batchedGemm::batchedGemm::BatchedGemmInterface();
  auto const* configs = bmm.getBatchedGemmConfigs();
  std::vector<std::pair<std::string, std::string>> out;
  auto add = [&](int64_t idx) {
    std::string hash = configs[idx].mHash ? configs[idx].mHash : "";
    auto entry = std::make_pair(CubinPath(idx), hash);
    if (std::find(out.begin(), out.end(), entry) == out.end()) out.push_back(entry);
  };
  bool const bf16_act = TypesOf(scheme).act == btg::Dtype::Bfloat16;
  std::vector<int64_t> tiles;
  if (tile_n > 0) tiles.push_back(tile_n);
  else
    for (int tile : kTileNs)
      if (!bf16_act || tile <= kMaxTileNBf16Act) tiles.push_back(tile);
  for (int64_t tile : tiles) {
    auto& runner = GetRunner(scheme, tile, activation, device);
    if (tokens > 0) {  // the two kernels this call would load
      Problem const p{scheme, tokens, hidden, inter, experts, top_k, activation, tile};
      auto const c = runner.getConfigComponents(ResolveConfig(runner, p, config));
      add(c.gemm1Config);
      add(c.gemm2Config);
    } else {  // every kernel the runner may pick for this scheme, tile and activation
      for (int64_t idx = 0;; ++idx) {
        tmoe::MoE::MoEConfig c;
        try {
          c = runner.getConfigComponents(idx);
        } catch (std::exception const&) {
          break;
        }
        add(c.gemm1Config);
        add(c.gemm2Config);
      }
    }
  }
  return out;
}

// ------------------------------------------------------------------------- the handlers

namespace {

using jax_moe::InvalidArgument;

// The routing half of the workspace and the GEMM buffers, pointed into `base` by `plan`.
tmoe::MoE::MoEWorkspace BindWorkspace(Plan const& plan, Problem const& p, uint8_t* base,
                                      int32_t* topk_ids, float* topk_weights) {
  auto at = [base](int64_t off) { return off < 0 ? nullptr : static_cast<void*>(base + off); };
  auto i32 = [&at](int64_t off) { return static_cast<int32_t*>(at(off)); };
  tmoe::MoE::MoEWorkspace ws;
  // Read only: with precomputed ids and no logits, FlashInfer 0.7.2's routing kernels never write
  // mPtrTopKPacked (only the DeepSeek and Llama4 kernels do, when they take the top-k from logits),
  // and FlashInfer's own precomputed-ids launcher passes topk_ids the same way.
  ws.routing_expert_indexes = topk_ids;
  ws.permuted_idx_size = i32(plan.total_padded);
  ws.total_num_padded_tokens = i32(plan.total_padded);
  ws.total_max_padded_tokens = plan.max_padded;
  ws.ProjUpTileN = static_cast<int32_t>(p.tile_n);
  ws.expanded_idx_to_permuted_idx = i32(plan.expanded_to_permuted);
  ws.permuted_idx_to_token_idx = i32(plan.permuted_to_token);
  ws.expert_weights = topk_weights;
  ws.cta_idx_xy_to_batch_idx = i32(plan.cta_to_batch);
  ws.cta_idx_xy_to_mn_limit = i32(plan.cta_to_mn_limit);
  ws.num_non_exiting_ctas = i32(plan.non_exiting_ctas);
  ws.hidden_states_scale_linear = nullptr;  // the FP4 activations' scales come in linear already
  ws.gemm1_output = at(plan.gemm1_out);
  ws.gemm1_output_scale = static_cast<float*>(at(plan.gemm1_out_scale));
  ws.activation_output = at(plan.activation_out);
  ws.activation_output_scale = static_cast<float*>(at(plan.activation_out_scale));
  ws.gemm2_output = at(plan.gemm2_out);
  ws.bmm1_workspace = at(plan.bmm1);
  ws.bmm2_workspace = at(plan.bmm2);
  return ws;
}

// Routing from precomputed ids: no logits; the kernels build the permutation and CTA tables.
void RunRouting(Problem const& p, Plan const& plan, uint8_t* base, tmoe::MoE::MoERunnerArgs const& args,
                tmoe::MoE::MoEWorkspace const& ws, int32_t* topk_ids, cudaStream_t stream,
                bool enable_pdl) {
  auto i32 = [base](int64_t off) { return reinterpret_cast<int32_t*>(base + off); };
  tmoe::Routing::Runner routing(static_cast<int32_t>(p.tile_n));
  routing.run(/*routingLogits=*/nullptr, /*routingBias=*/nullptr, args.num_tokens,
              args.num_experts, args.top_k, /*numFusedSharedExpert=*/0, /*nGroups=*/0,
              /*topkGroups=*/0, args.local_expert_offset, args.local_num_experts,
              args.routed_scaling_factor, ws.routing_expert_indexes, i32(plan.histogram),
              ws.permuted_idx_size, ws.expanded_idx_to_permuted_idx,
              /*permutedIdxToExpandedIdx=*/nullptr, ws.permuted_idx_to_token_idx,
              /*expertIds=*/topk_ids, ws.expert_weights, i32(plan.tokens_per_expert),
              ws.cta_idx_xy_to_batch_idx, ws.cta_idx_xy_to_mn_limit, ws.num_non_exiting_ctas,
              args.mDtypeElt, btg::Dtype::Bfloat16, /*useRoutingScalesOnInput=*/false,
              args.mUseDeepSeekFp8, tmoe::Routing::RoutingMethodType::TopK, stream,
              btg::Dtype::Fp32, /*normTopkProb=*/false, /*routing_replay_out=*/nullptr, enable_pdl);
}

// Plan, check the workspace, route, run: shared by both handlers once their args are filled.
ffi::Error Launch(char const* who, Problem const& p, tmoe::MoE::MoERunnerArgs const& args,
                  int64_t config, int device, cudaStream_t stream, bool enable_pdl,
                  ffi::Buffer<ffi::S32>& topk_ids, ffi::Buffer<ffi::F32>& topk_weights,
                  ffi::Result<ffi::Buffer<ffi::U8>>& workspace) {
  try {
    Plan const plan = MakePlan(p, config, device);
    if (static_cast<int64_t>(workspace->size_bytes()) < plan.total)
      return InvalidArgument(std::string(who) + ": workspace is " +
                             std::to_string(workspace->size_bytes()) + " bytes, the plan needs " +
                             std::to_string(plan.total));
    auto* base = static_cast<uint8_t*>(workspace->untyped_data());
    auto const ws = BindWorkspace(plan, p, base, topk_ids.typed_data(), topk_weights.typed_data());
    RunRouting(p, plan, base, args, ws, topk_ids.typed_data(), stream, enable_pdl);
    GetRunner(p.scheme, p.tile_n, p.activation, device)
        .run(args, ws, device, stream, plan.config, enable_pdl);
  } catch (std::invalid_argument const& ex) {
    return InvalidArgument(std::string(who) + ": " + ex.what());
  } catch (std::exception const& ex) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_moe: ") + who + ": " + ex.what());
  }
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

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
  args.hidden_states = x.untyped_data();
  args.gemm1_weights = w13.untyped_data();
  args.gemm2_weights = w2.untyped_data();
  args.output1_scales_scalar = out1_scale.typed_data();
  args.output1_scales_gate_scalar = out1_gate_scale.typed_data();
  args.output2_scales_scalar = out2_scale.typed_data();
  args.output = out->untyped_data();
  return Launch("trtllm fp8", p, args, config, device, stream, enable_pdl, topk_ids, topk_weights,
                workspace);
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

  auto args = BaseArgs(p);
  float *b13 = nullptr, *b2 = nullptr, *alpha = nullptr, *beta = nullptr, *limit = nullptr;
  float *o1 = nullptr, *o1g = nullptr, *o2 = nullptr;
  int64_t const e = p.experts;
  if (!OptionalF32(w13_bias, {e, n1}, &b13) || !OptionalF32(w2_bias, {e, p.hidden}, &b2))
    return InvalidArgument("trtllm fp4: w13_bias must be float32 [E, 2I] and w2_bias [E, H] (or "
                           "zero-element arrays: absent)");
  if (!OptionalF32(swiglu_alpha, {e}, &alpha) || !OptionalF32(swiglu_beta, {e}, &beta) ||
      !OptionalF32(swiglu_limit, {e}, &limit))
    return InvalidArgument("trtllm fp4: swiglu_alpha/beta/limit must be float32 [E] (or absent)");
  if (!OptionalF32(out1_scale, {e}, &o1) || !OptionalF32(out1_gate_scale, {e}, &o1g) ||
      !OptionalF32(out2_scale, {e}, &o2))
    return InvalidArgument("trtllm fp4: out1_scale/out1_gate_scale/out2_scale must be float32 [E] "
                           "(or absent)");
  if (scheme == kSchemeNvfp4 && (!o1 || !o1g || !o2))
    return InvalidArgument("trtllm fp4: NVFP4 needs out1_scale, out1_gate_scale and out2_scale");
  if (p.tokens == 0) return ffi::Error::Success();

  args.hidden_states = x.untyped_data();
  args.hidden_states_scale = scheme == kSchemeMxfp4Bf16 ? nullptr : x_scale.untyped_data();
  args.gemm1_weights = w13.typed_data();
  args.gemm1_weights_scale = w13_scale.untyped_data();
  args.gemm1_bias = b13;
  args.gemm1_alpha = alpha;
  args.gemm1_beta = beta;
  args.gemm1_clamp_limit = limit;
  args.gemm2_weights = w2.typed_data();
  args.gemm2_weights_scale = w2_scale.untyped_data();
  args.gemm2_bias = b2;
  args.output1_scales_scalar = o1;
  args.output1_scales_gate_scalar = o1g;
  args.output2_scales_scalar = o2;
  args.output = out->typed_data();
  return Launch("trtllm fp4", p, args, config, device, stream, enable_pdl, topk_ids, topk_weights,
                workspace);
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

  auto args = BaseArgs(p);
  args.hidden_states = x.untyped_data();
  args.hidden_states_scale = x_scale.typed_data();
  args.gemm1_weights = w13.untyped_data();
  args.gemm1_weights_scale = w13_scale.typed_data();
  args.gemm2_weights = w2.untyped_data();
  args.gemm2_weights_scale = w2_scale.typed_data();
  args.output = out->typed_data();
  return Launch("trtllm fp8 block", p, args, config, device, stream, enable_pdl, topk_ids,
                topk_weights, workspace);
}

}  // namespace
}  // namespace jax_moe_trtllm

// Not kCmdBufferCompatible: the first call per (scheme, tile, activation) builds the runner and
// loads cubins (cuModuleLoadData), which must not happen during graph capture.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeTrtllmFp8PerTensorMoe, jax_moe_trtllm::Fp8PerTensorImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()          // x fp8 [T, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_ids [T, k]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights [T, k]
                                  .Arg<ffi::AnyBuffer>()          // w13 fp8 [E, 2I, H]
                                  .Arg<ffi::AnyBuffer>()          // w2 fp8 [E, H, I]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // output1_scales_scalar [E]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // output1_scales_gate_scalar [E]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // output2_scales_scalar [E]
                                  .Ret<ffi::AnyBuffer>()          // out bf16 [T, H]
                                  .Ret<ffi::Buffer<ffi::U8>>()    // workspace
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("tile_n")
                                  .Attr<int64_t>("config")
                                  .Attr<bool>("enable_pdl"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeTrtllmFp4BlockScaleMoe, jax_moe_trtllm::Fp4BlockScaleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()          // x [T, H/2] u8 | [T, H] bf16/e4m3
                                  .Arg<ffi::AnyBuffer>()          // x_scale [T, H/sf] or absent
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_ids [T, k]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights [T, k]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // w13 [E, 2I, H/2]
                                  .Arg<ffi::AnyBuffer>()          // w13_scale [E, 2I, H/sf]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w13_bias [E, 2I] or absent
                                  .Arg<ffi::Buffer<ffi::F32>>()   // swiglu_alpha [E] or absent
                                  .Arg<ffi::Buffer<ffi::F32>>()   // swiglu_beta [E] or absent
                                  .Arg<ffi::Buffer<ffi::F32>>()   // swiglu_limit [E] or absent
                                  .Arg<ffi::Buffer<ffi::U8>>()    // w2 [E, H, I/2]
                                  .Arg<ffi::AnyBuffer>()          // w2_scale [E, H, I/sf]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w2_bias [E, H] or absent
                                  .Arg<ffi::Buffer<ffi::F32>>()   // output1_scales_scalar [E] or absent
                                  .Arg<ffi::Buffer<ffi::F32>>()   // output1_scales_gate_scalar
                                  .Arg<ffi::Buffer<ffi::F32>>()   // output2_scales_scalar
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // out bf16 [T, H]
                                  .Ret<ffi::Buffer<ffi::U8>>()    // workspace
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("tile_n")
                                  .Attr<int64_t>("config")
                                  .Attr<bool>("enable_pdl"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeTrtllmFp8BlockScaleMoe, jax_moe_trtllm::Fp8BlockScaleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()          // x fp8 [T, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x_scale [H/128, T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_ids [T, k]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights [T, k]
                                  .Arg<ffi::AnyBuffer>()          // w13 fp8 [E, H/128, 2I, 128]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w13_scale [E, 2I/128, H/128]
                                  .Arg<ffi::AnyBuffer>()          // w2 fp8 [E, I/128, H, 128]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w2_scale [E, H/128, I/128]
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // out bf16 [T, H]
                                  .Ret<ffi::Buffer<ffi::U8>>()    // workspace
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("tile_n")
                                  .Attr<int64_t>("config")
                                  .Attr<bool>("enable_pdl"));
