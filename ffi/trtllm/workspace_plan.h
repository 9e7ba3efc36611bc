// The one uint8 workspace of a TRT-LLM gen MoE call (XLA allocates it as the call's second
// result; nothing is allocated here): the routing tables, the GEMM outputs and the batched GEMMs'
// own workspaces, each 256-byte aligned, laid out per scheme as FlashInfer's launchers size them.
#pragma once

#include <cstdint>

#include "runner.h"

namespace jax_moe_trtllm {

// Byte offsets of every buffer in the workspace (same order as the MoEWorkspace fields); -1: the
// scheme does not use that buffer (its pointer stays null).
struct Plan {
  int64_t tokens_per_expert, total_padded, expanded_to_permuted, permuted_to_token, histogram,
      cta_to_batch, cta_to_mn_limit, non_exiting_ctas, gemm1_out, gemm1_out_scale,
      activation_out = -1, activation_out_scale = -1, gemm2_out, bmm1, bmm2, total;
  int32_t max_padded;
  int64_t config;
};

// The layout for a problem (config -1: the runner's default for the shape, resolved into
// Plan::config). Builds the runner if needed.
Plan MakePlan(Problem const& p, int64_t config, int device);

// The runner's view of the workspace at `base` (routing inputs: the caller's top-k ids and weights).
tmoe::MoE::MoEWorkspace BindWorkspace(Plan const& plan, Problem const& p, uint8_t* base,
                                      int32_t* topk_ids, float* topk_weights);

}  // namespace jax_moe_trtllm
