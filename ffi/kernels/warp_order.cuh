// Warp-level pieces of a top-k in lax.top_k's order, shared by the top_k and route kernels.
//
// A float32 maps to an order-preserving uint32 key: a negative NaN < -inf < ... < -0 < +0 < ... <
// +inf < NaN, float32's total order as jax.lax.top_k sorts it. A warp's value is picked in that
// order, the lowest index first among equal keys, with two warp reductions (redux.sync, sm_80+):
// the largest key, then the lowest index holding it.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace jax_moe {

__device__ __forceinline__ uint32_t OrderKey(float v) {
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The float32 that OrderKey maps to key.
__device__ __forceinline__ float KeyValue(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The index of the warp's largest key, the lowest index among equal keys. Lane l holds the keys of
// indices l, l + 32, ..., l + 32 (P - 1); bit i of open says whether key[i] takes part. At least
// one lane must have an open key. Every lane gets the index.
template <int P>
__device__ __forceinline__ int WarpTopIndex(const uint32_t (&key)[P], uint32_t open, int lane) {
  uint32_t mine = 0;
#pragma unroll
  for (int i = 0; i < P; ++i) mine = ((open >> i) & 1u) ? max(mine, key[i]) : mine;
  const uint32_t top = __reduce_max_sync(0xffffffffu, mine);
  uint32_t index = 0xffffffffu;
#pragma unroll
  for (int i = P - 1; i >= 0; --i)  // descending i: the lane's lowest index is written last
    index = (((open >> i) & 1u) && key[i] == top) ? uint32_t(lane + 32 * i) : index;
  return static_cast<int>(__reduce_min_sync(0xffffffffu, index));
}

// A row of n <= 32 * P floats spread over the warp: lane l gets v[i] = row[l + 32 i], -inf past n.
// Returns bit i set where l + 32 i < n.
template <int P>
__device__ __forceinline__ uint32_t LoadLanes(const float* row, int n, int lane, float (&v)[P]) {
  uint32_t valid = 0;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int c = lane + 32 * i;
    v[i] = c < n ? row[c] : -INFINITY;
    valid |= c < n ? (1u << i) : 0u;
  }
  return valid;
}

// Calls launch(std::integral_constant<int, P>{}) with the fewest values per lane P in {1, 2, 4, ..., 32}
// that hold a row of n <= 1024 values (32 * P >= n).
template <class F>
void WithValuesPerLane(int64_t n, F&& launch) {
  if (n <= 32) launch(std::integral_constant<int, 1>{});
  else if (n <= 64) launch(std::integral_constant<int, 2>{});
  else if (n <= 128) launch(std::integral_constant<int, 4>{});
  else if (n <= 256) launch(std::integral_constant<int, 8>{});
  else if (n <= 512) launch(std::integral_constant<int, 16>{});
  else launch(std::integral_constant<int, 32>{});
}

}  // namespace jax_moe
