// XLA FFI handler around FlashInfer's TRT-LLM gen fused-MoE runner (SM100: tcgen05 batched GEMMs
// from prebuilt cubins, see trtllm_cubin_dir.h), scheme FP8 per-tensor (W8A8), with routing done
// before the call (top-k ids and weights come in, as everywhere in jax_moe).
//
// One call = FlashInfer's routing kernels in precomputed-ids mode (build the expert-sorted
// permutation and the CTA tables) + MoE::Runner::run (permute + GEMM1 with fused gated
// activation and FP8 re-quantization, GEMM2, finalize: weighted top-k reduce). Every intermediate
// buffer lives in one uint8 workspace that XLA allocates as the call's second result; its layout
// is Plan() below, and workspace_size() (nanobind, trtllm_module.cc) returns Plan().total for the
// Python shape rule. Nothing is allocated here.
//
// Buffers (XLA row-major):
//   x            float8_e4m3fn [T, H]          activations quantized with the per-tensor a13 scale
//   topk_ids     int32 [T, k]                   global expert ids
//   topk_weights float32 [T, k]                 router weights (applied in finalize)
//   w13          float8_e4m3fn [E, 2I, H]       rows in the runner's order (jax_moe/backends/
//                                               flashinfer_trtllm.py: prepare_fp8_weights)
//   w2           float8_e4m3fn [E, H, I]        shuffled (shuffle_matrix_a)
//   out1_scale, out1_gate_scale, out2_scale  float32 [E]  (layouts.trtllm_fp8_output_scales)
//   -> out       bfloat16 [T, H]
//   -> workspace uint8 [Plan().total]
// Attributes: activation (runner ActivationType value), tile_n (tokens per CTA tile, one of
// kTileNs), config (runner config index; -1: its default for the shape), enable_pdl.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"
#include "flashinfer/trtllm/batched_gemm/trtllmGen_bmm_export/BatchedGemmInterface.h"
#include "flashinfer/trtllm/fused_moe/runner.h"
#include "trtllm_module.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
// (not "moe": FlashInfer declares namespace moe::dev for its kernels)
namespace tmoe = tensorrt_llm::kernels::trtllmgen_moe;
namespace btg = batchedGemm::trtllm::gen;

namespace jax_moe_trtllm {
namespace {

constexpr int64_t kAlign = 256;  // every sub-buffer starts 256-byte aligned
constexpr int kTileNs[] = {8, 16, 32, 64, 128};

int64_t RoundUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

bool KnownTile(int64_t tile_n) {
  return std::find(std::begin(kTileNs), std::end(kTileNs), tile_n) != std::end(kTileNs);
}

// A problem as the runner sees it (local experts = all experts: no expert parallelism here).
struct Problem {
  int64_t tokens, hidden, inter, experts, top_k, activation, tile_n;
};

// The runner for (scheme, tile, activation, device): built once per host thread, as FlashInfer's
// launcher caches it (constructing it filters the whole cubin table).
tmoe::MoE::Runner& GetRunner(int scheme, int64_t tile_n, int64_t activation, int device) {
  if (scheme != kSchemeFp8PerTensor) throw std::invalid_argument("unknown TRT-LLM gen scheme id");
  if (!KnownTile(tile_n)) throw std::invalid_argument("tile_n must be one of 8, 16, 32, 64, 128");
  using Key = std::tuple<int, int64_t, int64_t, int>;
  static thread_local std::map<Key, tmoe::MoE::Runner> cache;
  Key key{scheme, tile_n, activation, device};
  auto it = cache.find(key);
  if (it == cache.end()) {
    it = cache
             .try_emplace(key, btg::Dtype::E4m3, btg::Dtype::E4m3, /*useDeepSeekFp8=*/false,
                          static_cast<int32_t>(tile_n),
                          static_cast<tmoe::MoE::ActivationType>(activation),
                          /*useShuffledMatrix=*/true, batchedGemm::gemm::MatrixLayout::MajorK,
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
  args.mDtypeElt = btg::Dtype::E4m3;
  args.mDtypeExpW = btg::Dtype::Fp32;
  args.mDtypeOut = btg::Dtype::Bfloat16;
  args.mUseDeepSeekFp8 = false;
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

// Byte offsets of every buffer in the workspace (same order as the MoEWorkspace fields).
struct Plan {
  int64_t tokens_per_expert, total_padded, expanded_to_permuted, permuted_to_token, histogram,
      cta_to_batch, cta_to_mn_limit, non_exiting_ctas, gemm1_out, gemm1_out_scale, gemm2_out,
      bmm1, bmm2, total;
  int32_t max_padded;
  int64_t config;
};

Plan MakePlan(Problem const& p, int64_t config, int device) {
  auto& runner = GetRunner(kSchemeFp8PerTensor, p.tile_n, p.activation, device);
  config = ResolveConfig(runner, p, config);
  auto const e = static_cast<int32_t>(p.experts);
  auto const t = static_cast<int32_t>(p.tokens);
  auto const k = static_cast<int32_t>(p.top_k);
  auto const tile = static_cast<int32_t>(p.tile_n);
  int32_t const max_padded = tmoe::Routing::getMaxPermutedPaddedCount(t, k, e, tile);
  int32_t const max_ctas = tmoe::Routing::getMaxNumCtasInBatchDim(t, k, e, tile);
  auto const args = BaseArgs(p);
  auto const [bmm1, bmm2] = runner.getWorkspaceSizeInBytes(args, config);
  int64_t const padded1 = max_padded + e;  // GEMM1 rows, as FlashInfer's launcher sizes them

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
  plan.gemm1_out = take(padded1 * 2 * p.inter);                 // fp8
  plan.gemm1_out_scale = take(4 * (2 * p.inter / 128) * padded1);  // float32
  plan.gemm2_out = take(2 * int64_t{max_padded} * p.hidden);     // bf16
  plan.bmm1 = take(bmm1);
  plan.bmm2 = take(bmm2);
  plan.total = off;
  plan.max_padded = max_padded;
  plan.config = config;
  return plan;
}

// ------------------------------------------------------------------------- host queries

int64_t WorkspaceSize(int64_t tokens, int64_t hidden, int64_t inter, int64_t experts, int64_t top_k,
                      int64_t activation, int64_t tile_n, int64_t config, int device) {
  return MakePlan({tokens, hidden, inter, experts, top_k, activation, tile_n}, config, device).total;
}

int64_t DefaultTileN(int64_t tokens, int64_t top_k, int64_t experts) {
  // The smallest tile covering the average tokens per expert (FlashInfer's selectDefaultTileN).
  double const avg = static_cast<double>(tokens) * top_k / std::max<int64_t>(experts, 1);
  for (int tile : kTileNs)
    if (tile >= avg) return tile;
  return kTileNs[std::size(kTileNs) - 1];
}

int64_t DefaultConfig(int64_t tokens, int64_t hidden, int64_t inter, int64_t experts,
                      int64_t top_k, int64_t activation, int64_t tile_n, int device) {
  Problem const p{tokens, hidden, inter, experts, top_k, activation, tile_n};
  return ResolveConfig(GetRunner(kSchemeFp8PerTensor, tile_n, activation, device), p, -1);
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
  std::vector<int64_t> tiles;
  if (tile_n > 0) tiles.push_back(tile_n);
  else tiles.assign(std::begin(kTileNs), std::end(kTileNs));
  for (int64_t tile : tiles) {
    auto& runner = GetRunner(scheme, tile, activation, device);
    if (tokens > 0) {  // the two kernels this call would load
      Problem const p{tokens, hidden, inter, experts, top_k, activation, tile};
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

// ------------------------------------------------------------------------- the handler

namespace {

ffi::Error Fp8PerTensorImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::S32> topk_ids, ffi::Buffer<ffi::F32> topk_weights,
                            ffi::AnyBuffer w13, ffi::AnyBuffer w2,
                            ffi::Buffer<ffi::F32> out1_scale, ffi::Buffer<ffi::F32> out1_gate_scale,
                            ffi::Buffer<ffi::F32> out2_scale, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::U8>> workspace, int64_t activation,
                            int64_t tile_n, int64_t config, bool enable_pdl) {
  using jax_moe::InvalidArgument;
  auto const xd = x.dimensions(), w13d = w13.dimensions(), w2d = w2.dimensions();
  auto const idd = topk_ids.dimensions();
  if (xd.size() != 2 || w13d.size() != 3 || w2d.size() != 3 || idd.size() != 2)
    return InvalidArgument("trtllm fp8: x [T,H], w13 [E,2I,H], w2 [E,H,I], topk_ids [T,k] ranks");
  if (x.element_type() != ffi::F8E4M3FN || w13.element_type() != ffi::F8E4M3FN ||
      w2.element_type() != ffi::F8E4M3FN || out->element_type() != ffi::BF16)
    return InvalidArgument("trtllm fp8: x, w13, w2 must be float8_e4m3fn and out bfloat16");
  Problem const p{xd[0], xd[1], w2d[2], w13d[0], idd[1], activation, tile_n};
  bool const gated = tmoe::MoE::isGatedActivation(static_cast<tmoe::MoE::ActivationType>(activation));
  if (w13d[1] != (gated ? 2 : 1) * p.inter || w13d[2] != p.hidden || w2d[0] != p.experts ||
      w2d[1] != p.hidden || idd[0] != p.tokens || topk_weights.dimensions().size() != 2 ||
      topk_weights.dimensions()[0] != p.tokens || topk_weights.dimensions()[1] != p.top_k)
    return InvalidArgument("trtllm fp8: inconsistent shapes of x, w13, w2, topk_ids/weights");
  for (auto const* s : {&out1_scale, &out1_gate_scale, &out2_scale})
    if (s->dimensions().size() != 1 || s->dimensions()[0] != p.experts)
      return InvalidArgument("trtllm fp8: the three output scales must be float32 [E]");
  if (p.tokens == 0) return ffi::Error::Success();

  try {
    Plan const plan = MakePlan(p, config, device);
    if (static_cast<int64_t>(workspace->size_bytes()) < plan.total)
      return InvalidArgument("trtllm fp8: workspace is " + std::to_string(workspace->size_bytes()) +
                             " bytes, the plan needs " + std::to_string(plan.total));
    auto* base = static_cast<uint8_t*>(workspace->untyped_data());
    auto at = [base](int64_t off) { return static_cast<void*>(base + off); };
    auto i32 = [&at](int64_t off) { return static_cast<int32_t*>(at(off)); };

    auto args = BaseArgs(p);
    args.hidden_states = x.untyped_data();
    args.gemm1_weights = w13.untyped_data();
    args.gemm2_weights = w2.untyped_data();
    args.output1_scales_scalar = out1_scale.typed_data();
    args.output1_scales_gate_scalar = out1_gate_scale.typed_data();
    args.output2_scales_scalar = out2_scale.typed_data();
    args.output = out->untyped_data();

    tmoe::MoE::MoEWorkspace ws;
    // Read only: with precomputed ids and no logits, FlashInfer 0.7.2's routing kernels never write
    // mPtrTopKPacked (only the DeepSeek and Llama4 kernels do, when they take the top-k from logits),
    // and FlashInfer's own precomputed-ids launcher passes topk_ids the same way.
    ws.routing_expert_indexes = topk_ids.typed_data();
    ws.permuted_idx_size = i32(plan.total_padded);
    ws.total_num_padded_tokens = i32(plan.total_padded);
    ws.total_max_padded_tokens = plan.max_padded;
    ws.ProjUpTileN = static_cast<int32_t>(p.tile_n);
    ws.expanded_idx_to_permuted_idx = i32(plan.expanded_to_permuted);
    ws.permuted_idx_to_token_idx = i32(plan.permuted_to_token);
    ws.expert_weights = topk_weights.typed_data();
    ws.cta_idx_xy_to_batch_idx = i32(plan.cta_to_batch);
    ws.cta_idx_xy_to_mn_limit = i32(plan.cta_to_mn_limit);
    ws.num_non_exiting_ctas = i32(plan.non_exiting_ctas);
    ws.gemm1_output = at(plan.gemm1_out);
    ws.gemm1_output_scale = static_cast<float*>(at(plan.gemm1_out_scale));
    ws.gemm2_output = at(plan.gemm2_out);
    ws.bmm1_workspace = at(plan.bmm1);
    ws.bmm2_workspace = at(plan.bmm2);

    // Routing from precomputed ids: no logits; the kernels build the permutation and CTA tables.
    tmoe::Routing::Runner routing(static_cast<int32_t>(p.tile_n));
    routing.run(/*routingLogits=*/nullptr, /*routingBias=*/nullptr, args.num_tokens,
                args.num_experts, args.top_k, /*numFusedSharedExpert=*/0, /*nGroups=*/0,
                /*topkGroups=*/0, args.local_expert_offset, args.local_num_experts,
                args.routed_scaling_factor, ws.routing_expert_indexes, i32(plan.histogram),
                ws.permuted_idx_size, ws.expanded_idx_to_permuted_idx,
                /*permutedIdxToExpandedIdx=*/nullptr, ws.permuted_idx_to_token_idx,
                /*expertIds=*/topk_ids.typed_data(), ws.expert_weights,
                i32(plan.tokens_per_expert), ws.cta_idx_xy_to_batch_idx,
                ws.cta_idx_xy_to_mn_limit, ws.num_non_exiting_ctas, args.mDtypeElt,
                btg::Dtype::Bfloat16, /*useRoutingScalesOnInput=*/false, /*useDeepSeekFp8=*/false,
                tmoe::Routing::RoutingMethodType::TopK, stream, btg::Dtype::Fp32,
                /*normTopkProb=*/false, /*routing_replay_out=*/nullptr, enable_pdl);

    auto& runner = GetRunner(kSchemeFp8PerTensor, p.tile_n, p.activation, device);
    runner.run(args, ws, device, stream, plan.config, enable_pdl);
  } catch (std::invalid_argument const& ex) {
    return InvalidArgument(std::string("trtllm fp8: ") + ex.what());
  } catch (std::exception const& ex) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_moe: trtllm fp8: ") + ex.what());
  }
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_moe_trtllm

// Not kCmdBufferCompatible: the first call per (tile, activation) builds the runner and loads
// cubins (cuModuleLoadData), which must not happen during graph capture.
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
