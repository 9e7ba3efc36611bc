// The TRT-LLM gen fused-MoE runner (FlashInfer's MoE::Runner, SM100) as jax_moe uses it: what a
// scheme id (host_queries.h) means to the runner, a problem's shape, the runner cache (one runner
// per scheme, tile, activation and device, built once per host thread, as FlashInfer's launcher
// caches it: constructing one filters the whole cubin table), the arguments every call shares and
// the config index of a call.
#pragma once

#include <cstdint>

#include "flashinfer/trtllm/batched_gemm/trtllmGen_bmm_export/BatchedGemmInterface.h"
#include "flashinfer/trtllm/fused_moe/runner.h"
#include "host_queries.h"

namespace jax_moe_trtllm {

// (not "moe": FlashInfer declares namespace moe::dev for its kernels)
namespace tmoe = tensorrt_llm::kernels::trtllmgen_moe;
namespace btg = batchedGemm::trtllm::gen;

inline constexpr int kTileNs[] = {8, 16, 32, 64, 128};
inline constexpr int64_t kMaxTileNBf16Act = 64;  // FlashInfer has no tile-128 FP4 kernels for BF16 activations

// What a scheme id means to the runner: activation and weight dtypes, and the weights' (and GEMM1
// output's) scale block.
struct SchemeTypes {
  btg::Dtype act, weights;
  int64_t sf_vec;
  bool deepseek = false;  // DeepSeek FP8: 128x128 block scales, BlockMajorK weights, unfused activation
};
SchemeTypes TypesOf(int scheme);  // throws std::invalid_argument for an unknown id

// A problem as the runner sees it (local experts = all experts: no expert parallelism here).
// hidden and inter are the logical sizes (elements, not bytes).
struct Problem {
  int scheme;
  int64_t tokens, hidden, inter, experts, top_k, activation, tile_n;
};

// The runner for (scheme, tile, activation, device), built on first use on this host thread.
// Weights are shuffled (useShuffledMatrix) for every scheme here, MajorK except DeepSeek FP8's
// BlockMajorK; GEMM1 biases, when given, are per expert (BiasType::None is FlashInfer's choice
// too: BiasType::Mn is its LoRA-delta path).
tmoe::MoE::Runner& GetRunner(int scheme, int64_t tile_n, int64_t activation, int device);

// The runner arguments every call shares (sizes, dtypes, finalize); the caller adds its pointers.
tmoe::MoE::MoERunnerArgs BaseArgs(Problem const& p);

// `config`, or the runner's default for the shape when -1; throws std::invalid_argument when it is
// not valid for the shape and tile.
int64_t ResolveConfig(tmoe::MoE::Runner& runner, Problem const& p, int64_t config);

}  // namespace jax_moe_trtllm
