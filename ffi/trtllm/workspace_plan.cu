// The workspace layout of workspace_plan.h.
#include "workspace_plan.h"

#include <algorithm>

namespace jax_moe_trtllm {
namespace {

constexpr int64_t kAlign = 256;  // every sub-buffer starts 256-byte aligned

int64_t RoundUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

}  // namespace

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

}  // namespace jax_moe_trtllm
