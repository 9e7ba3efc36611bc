// The runner cache and the shared runner arguments of runner.h.
#include "runner.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

namespace jax_moe_trtllm {
namespace {

bool KnownTile(int64_t tile_n) {
  return std::find(std::begin(kTileNs), std::end(kTileNs), tile_n) != std::end(kTileNs);
}

}  // namespace

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

}  // namespace jax_moe_trtllm
