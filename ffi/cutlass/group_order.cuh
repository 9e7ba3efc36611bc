// The order in which a grouped GEMM visits its experts: each expert's place in the GEMM's group arrays.
//
// The persistent tile scheduler deals the groups' tiles to the CTAs in turn, group after group, so the
// groups' order decides which experts' tiles run at the same time. On random routing the experts' rows
// differ. A heavy expert (more row tiles, or more 64-row blocks on the 192-row tile) multiplies more for
// the same weight bytes than a light one, so in expert order the stretches where heavy experts cluster
// lean on the tensor cores and those where light ones cluster lean on the DRAM, at random.
//
// The spread order mixes them evenly: the experts ranked by rows, most first, and rank r at the place
// of r in the van der Corput order of 0 .. E - 1 (its bit reversal where E is a power of two), so that
// each stretch of the order holds heavy and light experts alike. The setup launch fills group arrays
// in that order (FillGroupArrays); every array entry is per group, and the epilogues read the bias row
// of a group's expert (group_expert). The outputs do not change: each group's rows, weights, scales and
// bias are its expert's.
//
// JAX_MOE_CUTLASS_GROUP_ORDER=expert keeps expert order (to time the two apart).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace jax_moe::cutlass_gg {

// The least experts the spread order is used for. With Mixtral-8x7B's 8 experts, spread was 0.5-1.7%
// slower per layer on an H200; with 128 and 256 it was level or faster (bench/expert_order.py).
inline constexpr int64_t kSpreadFromGroups = 64;
// The experts' mean rows for which it is used: near the ridge of a bf16 grouped GEMM (an expert's
// FLOPs per weight byte are its rows), where heavy experts are bound by the tensor cores and light ones
// by the DRAM. At 256 rows (Qwen3-30B-A3B at 4096 tokens) every expert is compute-bound, and the spread
// order cost its layer 0.4% on an H200.
inline constexpr int64_t kSpreadFromRows = 96, kSpreadToRows = 192;

// Whether the setup launch lays the groups out in the spread order (JAX_MOE_CUTLASS_GROUP_ORDER:
// "spread", the default, or "expert"), read once.
inline bool SpreadGroupOrder() {
  static const bool spread = [] {
    const char* v = std::getenv("JAX_MOE_CUTLASS_GROUP_ORDER");
    return v == nullptr || std::strcmp(v, "expert") != 0;
  }();
  return spread;
}

// The place of group g among `groups` in the spread order, where rows_of(e) gives group e's rows.
// Every thread of the block calls it and gets the same place. Rank: the groups with more rows, or as
// many and a smaller index. Place: the ranks whose 32-bit reversal is smaller than the rank's (the
// van der Corput order compares bit-reversed ranks).
template <class RowsOf>
__device__ __forceinline__ int64_t SpreadPlace(RowsOf rows_of, int64_t g, int64_t groups) {
  __shared__ int32_t sums[2];
  if (threadIdx.x < 2) sums[threadIdx.x] = 0;
  __syncthreads();
  const int64_t mine = rows_of(g);
  int32_t ahead = 0;
  for (int64_t e = threadIdx.x; e < groups; e += blockDim.x) {
    const int64_t rows = rows_of(e);
    ahead += rows > mine || (rows == mine && e < g);
  }
  ahead = __reduce_add_sync(0xffffffffu, ahead);
  if (threadIdx.x % 32 == 0) atomicAdd(&sums[0], ahead);
  __syncthreads();
  const uint32_t rank_bits = __brev(static_cast<uint32_t>(sums[0]));
  int32_t before = 0;
  for (int64_t r = threadIdx.x; r < groups; r += blockDim.x) before += __brev(static_cast<uint32_t>(r)) < rank_bits;
  before = __reduce_add_sync(0xffffffffu, before);
  if (threadIdx.x % 32 == 0) atomicAdd(&sums[1], before);
  __syncthreads();
  return sums[1];
}

}  // namespace jax_moe::cutlass_gg
