// The host-side queries of host_queries.h (through the nanobind glue, at trace time).
#include "host_queries.h"

#include <algorithm>
#include <cctype>
#include <exception>
#include <iterator>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "runner.h"
#include "workspace_plan.h"

namespace jax_moe_trtllm {

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

}  // namespace jax_moe_trtllm
