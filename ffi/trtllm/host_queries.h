// The host side of the TRT-LLM gen MoE library (libjax_moe_trtllm.so, ffi/trtllm/)
// that the nanobind glue (module.cc) exposes to Python. No FlashInfer headers here, so the
// glue compiles without them. Scheme ids (jax_moe.backends.flashinfer_trtllm.SCHEME_IDS): the runner
// a scheme builds (activation and weight dtypes) and so its cubins and workspace.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace jax_moe_trtllm {

constexpr int kSchemeFp8PerTensor = 0;  // E4m3 x E4m3, per-tensor scales (JaxMoeTrtllmFp8PerTensorMoe)
// JaxMoeTrtllmFp4BlockScaleMoe:
constexpr int kSchemeNvfp4 = 1;        // E2m1 x E2m1 (e4m3 block-16 scales)
constexpr int kSchemeMxfp4Bf16 = 2;    // bf16 activations x MxE2m1 weights (E8M0 block-32 scales)
constexpr int kSchemeMxfp4Mxfp8 = 3;   // MxE4m3 activations x MxE2m1 weights
// JaxMoeTrtllmFp8BlockScaleMoe:
constexpr int kSchemeFp8Block = 4;     // DeepSeek FP8: E4m3 x E4m3, 128x128 block scales, BlockMajorK

// Bytes of the uint8 workspace result for this problem (needs an SM100 device: the runner filters
// its cubin table by the device's architecture). config -1: the runner's default for the shape.
// hidden and inter: the kernel's sizes in elements (MXFP4: padded).
int64_t WorkspaceSize(int64_t tokens, int64_t hidden, int64_t inter, int64_t experts, int64_t top_k,
                      int64_t activation, int64_t tile_n, int64_t config, int device, int scheme);

// Tokens per CTA tile for a shape: the smallest of 8..128 covering the average tokens per expert.
int64_t DefaultTileN(int64_t tokens, int64_t top_k, int64_t experts);

// The runner's default config index for the shape (throws when none is valid).
int64_t DefaultConfig(int64_t tokens, int64_t hidden, int64_t inter, int64_t experts,
                      int64_t top_k, int64_t activation, int64_t tile_n, int device, int scheme);

// [(cubin path relative to the cubin root, sha256)] the runner may load: with tokens > 0 the two
// kernels of that call (tile_n/config -1: defaults), else every kernel of the scheme and activation
// (tile_n -1: all tiles the scheme has: up to 64 for BF16 activations).
std::vector<std::pair<std::string, std::string>> Cubins(int scheme, int64_t activation,
                                                        int64_t tile_n, int64_t config,
                                                        int64_t tokens, int64_t hidden,
                                                        int64_t inter, int64_t experts,
                                                        int64_t top_k, int device);

std::string CubinRoot();  // cubin_dir.h

}  // namespace jax_moe_trtllm
