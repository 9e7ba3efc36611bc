// The runner cache of runner_cache.h: per-device runners, tactic lists and per-shape tactic
// choices of the tactic schemes, fp8_block's per-shape runners, and the built-in tactic choice.
// Instantiated for the schemes compiled in (JAX_MOE_FI_WITH_<SCHEME>).
#include "runner_cache.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "jax_moe_fi_kernels.h"

namespace jax_moe_fi {
namespace {

// Runners are built for sm_90a only (`what`: the scheme's note in the message).
void RequireSm90(int device, char const* what) {
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (major != 9 || minor != 0) {
    std::ostringstream msg;
    msg << "jax_moe FlashInfer CUTLASS MoE" << what << " is built for SM90 (sm_90a) only; device "
        << device << " is sm_" << major << minor;
    throw std::runtime_error(msg.str());
  }
}

bool AnyFinalizeCompiled(int scheme) {
  for (auto const& t : kCompiledSm90Tactics)
    if (t.scheme == scheme && t.finalize) return true;
  return false;
}

std::pair<int, int> TileMN(Config const& c) {
  auto const [m, n, k] = ce::enum_to_shape_tuple(c.tile_config_sm90);
  return {m, n};
}

bool IsPlain(Config const& c) {  // 1x1x1 cluster, no epilogue fusion
  return c.cluster_shape == ce::ClusterShape::ClusterShape_1x1x1 &&
         c.epilogue_fusion_type == Config::EpilogueFusionType::NONE;
}

// Deterministic built-in choice for one GEMM: with few rows per expert, swap A/B so that the
// narrow N tile runs over tokens; otherwise a 128x128 (or the widest compiled) tile.
// gemm_k: the GEMM's K; for w4a8 only tiles whose K divides it are taken (as FlashInfer's
// profiler filters its tactics; a K residue inside a scale group is not something to rely on).
int DefaultTactic(int scheme, std::vector<Config> const& list, int64_t rows_per_expert,
                  int64_t gemm_k) {
  int best = -1;
  int64_t best_score = INT64_MAX;
  for (int idx = 0; idx < static_cast<int>(list.size()); ++idx) {
    Config const& c = list[idx];
    if (!c.is_tma_warp_specialized || !IsCompiled(scheme, c) || !IsPlain(c)) continue;
    if (scheme == W4a8Scheme::kId && gemm_k % std::get<2>(ce::enum_to_shape_tuple(c.tile_config_sm90)) != 0)
      continue;
    auto const [tm, tn] = TileMN(c);
    int64_t score;
    if (rows_per_expert <= 64) {
      // prefer swap_ab with the smallest N tile covering the rows
      score = c.swap_ab ? (tn >= rows_per_expert ? tn : 1000 + (rows_per_expert - tn)) : 100000;
      score = score * 1000 + tm;
    } else {
      // prefer no swap, 128x128, then closest
      score = c.swap_ab ? 100000 : 0;
      score += std::abs(tm - 128) + std::abs(tn - 128);
    }
    if (score < best_score) {
      best_score = score;
      best = idx;
    }
  }
  if (best < 0) {  // fall back to the first compiled tactic of any kind
    for (int idx = 0; idx < static_cast<int>(list.size()); ++idx)
      if (IsCompiled(scheme, list[idx])) return idx;
  }
  return best;
}

}  // namespace

template <typename S>
std::pair<int, int> ChooseTactics(DeviceState<S>& st, ShapeKey const& key, int64_t g1, int64_t g2) {
  auto check = [](std::vector<Config> const& list, int64_t idx, char const* which) {
    if (idx < 0 || idx >= static_cast<int64_t>(list.size()))
      throw std::invalid_argument(std::string("jax_moe: ") + which + " tactic index " +
                                  std::to_string(idx) + " out of range [0, " +
                                  std::to_string(list.size()) + ")");
    if (!IsCompiled(S::kId, list[idx]))
      throw std::invalid_argument(std::string("jax_moe: ") + which + " tactic " +
                                  std::to_string(idx) + " was not compiled into this build");
    return static_cast<int>(idx);
  };
  if (g1 >= 0 && g2 >= 0) return {check(st.gemm1, g1, "gemm1"), check(st.gemm2, g2, "gemm2")};
  auto it = st.chosen.find(key);
  std::pair<int, int> pick;
  if (it != st.chosen.end()) {
    pick = it->second;
  } else {
    int64_t const rows_per_expert = (key.t * key.k + key.e - 1) / key.e;
    pick = {DefaultTactic(S::kId, st.gemm1, rows_per_expert, key.h),
            DefaultTactic(S::kId, st.gemm2, rows_per_expert, key.i)};
    if (pick.first < 0 || pick.second < 0)
      throw std::runtime_error("jax_moe: no compiled SM90 MoE GEMM tactic available");
    st.chosen.emplace(key, pick);
  }
  if (g1 >= 0) pick.first = check(st.gemm1, g1, "gemm1");
  if (g2 >= 0) pick.second = check(st.gemm2, g2, "gemm2");
  return pick;
}

template <typename S>
DeviceState<S>& GetState(int device) {
  if constexpr (!S::kCompiled) {
    throw std::invalid_argument(std::string("scheme ") + S::kName + " is not compiled into this build");
  } else {
    static std::mutex states_mu;
    static std::map<int, std::unique_ptr<DeviceState<S>>> states;
    std::lock_guard<std::mutex> lock(states_mu);
    auto& slot = states[device];
    if (!slot) {
      DeviceGuard guard(device);
      RequireSm90(device, "");
      auto state = std::make_unique<DeviceState<S>>();
      state->runner = std::make_unique<typename S::Runner>();
      // Finalize fusion (GEMM2 epilogue does the top-k reduce) only when its kernels exist.
      state->runner->use_fused_finalize_ = AnyFinalizeCompiled(S::kId);
      state->gemm1 = state->runner->getTactics(tk::MoeGemmId::GEMM_1);
      state->gemm2 = state->runner->getTactics(tk::MoeGemmId::GEMM_2);
      slot = std::move(state);
    }
    return *slot;
  }
}

// Whether `c` names a kernel of `scheme` that this build compiled (not a throwing stub).
bool IsCompiled(int scheme, Config const& c) {
  if (!c.is_tma_warp_specialized)  // the SM80 fused gated GEMMs exist for bf16 and f16 only
    return (scheme == Bf16Scheme::kId || scheme == F16Scheme::kId) && kSm80FusedCompiled &&
           c.sm_version < 90;
  if (c.sm_version != 90) return false;
  auto const [tm, tn, tile_k] = ce::enum_to_shape_tuple(c.tile_config_sm90);
  auto const [cm, cn, ck] = ce::enum_to_shape_tuple(c.cluster_shape);
  int const fin = c.epilogue_fusion_type == Config::EpilogueFusionType::FINALIZE ? 1 : 0;
  if (ck != 1) return false;
  for (auto const& t : kCompiledSm90Tactics) {
    if (t.scheme == scheme && t.tile_m == tm && t.tile_n == tn && t.tile_k == tile_k &&
        t.cluster_m == cm && t.cluster_n == cn && t.finalize == fin &&
        t.swap_ab == (c.swap_ab ? 1 : 0) &&
        (t.mainloop < 0 || t.mainloop == static_cast<int>(c.mainloop_schedule)))
      return true;
  }
  return false;
}

std::string DescribeTactic(int scheme, Config const& c) {
  char buf[192];
  if (c.is_tma_warp_specialized) {
    auto const [tm, tn, tkb] = ce::enum_to_shape_tuple(c.tile_config_sm90);
    auto const [cm, cn, ck] = ce::enum_to_shape_tuple(c.cluster_shape);
    bool const fin = c.epilogue_fusion_type == Config::EpilogueFusionType::FINALIZE;
    bool const auto_sched = c.mainloop_schedule == ce::MainloopScheduleType::AUTO;
    std::snprintf(buf, sizeof(buf), "sm%d tma_ws tile=%dx%dx%dB cluster=%dx%dx%d fusion=%s swap_ab=%d%s%s%s",
                  c.sm_version, tm, tn, tkb, cm, cn, ck, fin ? "finalize" : "none",
                  c.swap_ab ? 1 : 0, auto_sched ? "" : " mainloop=",
                  auto_sched ? "" : ce::get_mainloop_schedule_name(c.mainloop_schedule),
                  IsCompiled(scheme, c) ? "" : " (not compiled)");
  } else {
    std::snprintf(buf, sizeof(buf), "sm80 tile_id=%d stages=%d%s",
                  static_cast<int>(c.tile_config_sm80), c.stages,
                  IsCompiled(scheme, c) ? "" : " (not compiled)");
  }
  return std::string(buf);
}

#if JAX_MOE_FI_WITH_FP8_BLOCK
Fp8BlockState& GetFp8BlockState(int device) {
  static std::mutex states_mu;
  static std::map<int, std::unique_ptr<Fp8BlockState>> states;
  std::lock_guard<std::mutex> lock(states_mu);
  auto& slot = states[device];
  if (!slot) {
    RequireSm90(device, " (fp8_block)");
    slot = std::make_unique<Fp8BlockState>();
  }
  return *slot;
}

Fp8BlockScheme::Runner& Fp8BlockRunnerFor(Fp8BlockState& st, ShapeKey const& key) {
  auto& r = st.runners[key];
  if (!r) {
    r = std::make_unique<Fp8BlockScheme::Runner>();
    r->use_fused_finalize_ = false;
    // The block-scale GEMMs ignore the tactic, but the runner asks for one to be set; FlashInfer's
    // binding sets this one.
    ce::CutlassGemmConfig const placeholder(ce::CutlassTileConfigSM90::CtaShape128x16x128B,
                                            ce::MainloopScheduleType::AUTO,
                                            ce::EpilogueScheduleType::AUTO,
                                            ce::ClusterShape::ClusterShape_1x1x1);
    r->setTactic(placeholder, placeholder);
  }
  return *r;
}
#endif  // JAX_MOE_FI_WITH_FP8_BLOCK

// For every tactic scheme: an uncompiled one's GetState throws (and names no runner function).
#define JAX_MOE_FI_INSTANTIATE(S)                 \
  template DeviceState<S>& GetState<S>(int); \
  template std::pair<int, int> ChooseTactics<S>(DeviceState<S>&, ShapeKey const&, int64_t, int64_t);
JAX_MOE_FI_INSTANTIATE(Bf16Scheme)
JAX_MOE_FI_INSTANTIATE(Fp8Scheme)
JAX_MOE_FI_INSTANTIATE(Mxfp4Scheme)
JAX_MOE_FI_INSTANTIATE(F16Scheme)
JAX_MOE_FI_INSTANTIATE(W4a8Scheme)
#undef JAX_MOE_FI_INSTANTIATE

}  // namespace jax_moe_fi
