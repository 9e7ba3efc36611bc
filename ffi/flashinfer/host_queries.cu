// The host-side queries of exports.h (through the nanobind glue, at trace time): which schemes
// are compiled in, a handler's workspace size (which creates the runner, outside any capture),
// the tactic lists and the default tactic choice of the runner cache.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "exports.h"
#include "jax_moe_fi_kernels.h"
#include "runner_cache.h"

#if JAX_MOE_FI_WITH_FP8_BLOCK
extern "C" void JaxMoeDeepGemmRestoreEnv();  // deepgemm_stubs.cc
#endif

namespace jax_moe_fi {
namespace {

// fp8_block: its own runner per shape, no tactics.
size_t Fp8BlockWorkspaceSize(ShapeKey const& key, int device) {
#if JAX_MOE_FI_WITH_FP8_BLOCK
  if (!IsSupportedFp8BlockActivation(key.act))
    throw std::invalid_argument("fp8_block: unsupported activation type " + std::to_string(key.act));
  if (device < 0) cudaGetDevice(&device);
  Fp8BlockState& st = GetFp8BlockState(device);
  std::lock_guard<std::mutex> lock(st.mu);
  DeviceGuard guard(device);
  return TotalWorkspaceBytes(Fp8BlockRunnerFor(st, key), key, /*deepseek=*/true, /*awq=*/false);
#else
  (void)key, (void)device;
  throw std::invalid_argument("scheme fp8_block is not compiled into this build (JAX_MOE_FI_SCHEMES)");
#endif
}

}  // namespace

int CompiledSchemes() {
  auto bit = [](auto s) { return decltype(s)::kCompiled ? 1 << decltype(s)::kId : 0; };
  return std::apply([&](auto... s) { return (bit(s) | ... | bit(Fp8BlockScheme{})); }, TacticSchemes{});
}

void AfterLoad() {
#if JAX_MOE_FI_WITH_FP8_BLOCK
  JaxMoeDeepGemmRestoreEnv();
#endif
}

size_t WorkspaceSize(int64_t num_tokens, int64_t hidden, int64_t inter, int64_t num_experts,
                     int64_t top_k, int64_t activation, int scheme, int device) {
  ShapeKey const key{std::max<int64_t>(num_tokens, 1), hidden, inter, static_cast<int>(num_experts),
                     static_cast<int>(top_k), static_cast<int>(activation)};
  if (scheme == kFp8BlockSchemeId) return Fp8BlockWorkspaceSize(key, device);
  if (!IsSupportedActivation(activation))
    throw std::invalid_argument("unsupported activation type " + std::to_string(activation));
  if (device < 0) cudaGetDevice(&device);
  return WithState<size_t>(scheme, device, [&](auto& st, int) {
    std::lock_guard<std::mutex> lock(st.mu);
    DeviceGuard guard(device);
    using S = typename std::decay_t<decltype(st)>::Scheme;
    return TotalWorkspaceBytes(*st.runner, key, /*deepseek=*/false, S::kAwq);
  });
}

int NumTactics(int gemm_id, int scheme, int device) {
  return WithState<int>(scheme, device, [&](auto& st, int) {
    std::lock_guard<std::mutex> lock(st.mu);
    return static_cast<int>((gemm_id == 1 ? st.gemm1 : st.gemm2).size());
  });
}

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
