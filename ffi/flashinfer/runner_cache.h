// The FlashInfer CUTLASS MoE runners of this process, shared by the handlers and the host queries
// (the state lives in runner_cache.cu):
//   tactic schemes  one runner per device and scheme (the runner is stateful: callers hold
//                   DeviceState::mu around any use), its GEMM1/GEMM2 tactic lists, and the tactic
//                   pair chosen per problem shape, once, among the tactics this build compiled
//                   (the generated jax_moe_fi_kernels.h)
//   fp8_block       one runner per device and problem shape: the block-scale GEMM runner keeps the
//                   largest row count it was sized for and lays its workspace out by it, so a
//                   shared runner would need more workspace for a small shape after a large one
//                   than XLA allocated at trace time
// and the workspace every handler takes: [runner workspace | unpermuted_row_to_permuted_row
// (T*k int32)], each 128-byte aligned. Runners exist only for SM90 devices (else: throws).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "schemes.h"

namespace jax_moe_fi {

using Config = ce::CutlassGemmConfig;

constexpr size_t kAlign = 128;  // tensorrt_llm::common::kCudaMemAlign
inline size_t AlignUp(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

template <typename S>
struct DeviceState {
  using Scheme = S;
  std::mutex mu;
  std::unique_ptr<typename S::Runner> runner;
  std::vector<Config> gemm1, gemm2;                // the runner's full tactic lists
  std::map<ShapeKey, std::pair<int, int>> chosen;  // shape -> (gemm1 idx, gemm2 idx)
};

// The device's state for tactic scheme S (created on first use, with the device current).
template <typename S>
DeviceState<S>& GetState(int device);

// The (gemm1, gemm2) tactic indices for a shape: g1/g2 when >= 0 (checked: in range and compiled;
// std::invalid_argument otherwise), else the cached or built-in choice. Call with st.mu held.
template <typename S>
std::pair<int, int> ChooseTactics(DeviceState<S>& st, ShapeKey const& key, int64_t g1, int64_t g2);

// Whether `c` names a kernel of `scheme` that this build compiled (not a throwing stub).
bool IsCompiled(int scheme, Config const& c);
// One line describing tactic `c` ("sm90 tma_ws tile=128x64x128B cluster=1x1x1 ...").
std::string DescribeTactic(int scheme, Config const& c);

// Runs `f(DeviceState<S>&, S::kId)` for the tactic scheme with id `scheme` (device -1: the current
// one). R is spelled out: a build with no tactic scheme (fp8_block alone) has none to deduce it from.
template <typename S, typename R, typename F>
bool TryScheme(int scheme, int device, F& f, std::optional<R>& out) {
  if constexpr (S::kCompiled) {
    if (scheme == S::kId) {
      out.emplace(f(GetState<S>(device), S::kId));
      return true;
    }
  }
  return false;
}
template <typename R, typename F>
R WithState(int scheme, int device, F&& f) {
  if (device < 0) cudaGetDevice(&device);
  std::optional<R> out;
  std::apply([&](auto... s) { (TryScheme<decltype(s), R>(scheme, device, f, out) || ...); }, TacticSchemes{});
  if (!out) throw std::invalid_argument("scheme " + std::to_string(scheme) + " is not compiled into this build");
  return *std::move(out);
}

// fp8_block's runners of one device.
struct Fp8BlockState {
  std::mutex mu;
  std::map<ShapeKey, std::unique_ptr<Fp8BlockScheme::Runner>> runners;
};
Fp8BlockState& GetFp8BlockState(int device);
// The runner of one problem shape (call with st.mu held and the device current).
Fp8BlockScheme::Runner& Fp8BlockRunnerFor(Fp8BlockState& st, ShapeKey const& key);

// The runner's own workspace for a problem (deepseek: fp8_block's block-scale GEMMs; awq: sized
// for the AWQ pre-quant scale paths), and the handler's whole workspace.
template <typename R>
size_t RunnerWorkspaceBytes(R& r, ShapeKey const& key, bool deepseek, bool awq) {
  return r.getWorkspaceSize(key.t, key.h, key.i, key.e, key.k, static_cast<tk::ActivationType>(key.act),
                            tk::MOEParallelismConfig{}, /*use_lora=*/false, deepseek,
                            /*use_mxfp8_act_scaling=*/false, /*min_latency_mode=*/false, awq);
}
template <typename R>
size_t TotalWorkspaceBytes(R& r, ShapeKey const& key, bool deepseek, bool awq) {
  return AlignUp(RunnerWorkspaceBytes(r, key, deepseek, awq)) +
         AlignUp(static_cast<size_t>(key.t) * key.k * sizeof(int));
}

}  // namespace jax_moe_fi
