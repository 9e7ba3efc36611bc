// What the decode paths' kernels and handlers share (moe_decode.cu on bf16 weights, moe_decode_fp8.cu on
// FP8 ones): the call's sizes, a slot's expert, the grouped path's bf16 rounding of GEMM outputs, and the
// checks of the operands both handlers take alike.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "decode_launch.h"
#include "moe_device.cuh"

namespace jax_moe {
namespace decode {

struct DecodeShape {
  int64_t t, k, h, i, experts;
};

// The expert of a slot, or -1 where its id is outside [0, experts) (an expert of another rank).
__device__ __forceinline__ int ExpertOf(const int32_t* ids, int64_t slot, int experts) {
  const int32_t e = ids[slot];
  return (e >= 0 && e < experts) ? e : -1;
}

// A launch's grid (decode_launch.h) as CUDA takes it.
inline dim3 GridOf(const Launch& l) {
  return dim3(static_cast<unsigned>(l.grid.x), static_cast<unsigned>(l.grid.y));
}

__device__ __forceinline__ float RoundBf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// One lane's batch of a warp's row stream: kUnroll 16-byte vectors of each of kRows rows.
template <int kRows, int kUnroll>
struct RowBatch {
  uint4 v[kUnroll][kRows];
};

// A lane's batch at vectors c0, c0 + 32, ... (kUnroll of each row; past the end, the last vector again).
template <int kRows, int kUnroll>
__device__ __forceinline__ void LoadRowBatch(const uint4* const (&rows)[kRows], int64_t vecs, int64_t c0,
                                             RowBatch<kRows, kUnroll>& b) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t c = c0 + 32 * u < vecs ? c0 + 32 * u : vecs - 1;
#pragma unroll
    for (int r = 0; r < kRows; ++r) b.v[u][r] = __ldg(rows[r] + c);
  }
}

// The stream's loop (StreamRows below) from the lane's first batch in cur; next is the batch loaded
// while cur is used.
template <int kRows, int kUnroll, typename Use>
__device__ __forceinline__ void StreamBatches(const uint4* const (&rows)[kRows], int64_t vecs,
                                              RowBatch<kRows, kUnroll>& cur, RowBatch<kRows, kUnroll>& next,
                                              Use&& use) {
  for (int64_t c0 = threadIdx.x & 31; c0 < vecs; c0 += 32 * kUnroll) {
    LoadRowBatch(rows, vecs, c0 + 32 * kUnroll, next);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (c0 + 32 * u < vecs) use(c0 + 32 * u, cur.v[u]);
    cur = next;
  }
}

// Streams kRows rows of 16-byte vectors through a warp: lane l takes vectors c = l, l + 32, ... below
// vecs of every row, and use(c, vals) gets vals[r], vector c of row r. The vectors come in batches of
// kUnroll per row and lane, the next batch loaded before this one is used, so that the compiler cannot
// put each load next to its use: a whole batch is in flight at once (predicated loads were each issued
// just before their use, one at a time). The loads are unconditional: a vector past the end re-reads
// the last one, and is not passed to use.
template <int kRows, int kUnroll, typename Use>
__device__ __forceinline__ void StreamRows(const uint4* const (&rows)[kRows], int64_t vecs, Use&& use) {
  const int lane = threadIdx.x & 31;
  RowBatch<kRows, kUnroll> cur, next;
  LoadRowBatch(rows, vecs, lane, cur);
  StreamBatches(rows, vecs, cur, next, use);
}

// The checks both decode handlers make alike, of a call of shape s: at most 65535 slots and tokens (a
// grid's y), the output, the optional biases and the activation attributes; n names the handler in the
// error.
inline std::optional<ffi::Error> CheckSharedOperands(const std::string& n, const DecodeShape& s,
                                                     ffi::Result<ffi::AnyBuffer>& out, ffi::Buffer<ffi::F32>& w13_bias,
                                                     ffi::Buffer<ffi::F32>& w2_bias, int64_t activation,
                                                     int64_t layout) {
  if (s.t * s.k > 65535 || s.t > 65535) return InvalidArgument(n + "at most 65535 slots");
  const auto out_type = out->element_type();
  if (out->element_count() != static_cast<size_t>(s.t * s.h) ||
      (out_type != ffi::DataType::BF16 && out_type != ffi::DataType::F16 && out_type != ffi::DataType::F32))
    return InvalidArgument(n + "out must be [T, H] bfloat16, float16 or float32");
  const size_t nb13 = w13_bias.element_count(), nb2 = w2_bias.element_count();
  if ((nb13 != 0 && nb13 != static_cast<size_t>(s.experts * 2 * s.i)) ||
      (nb2 != 0 && nb2 != static_cast<size_t>(s.experts * s.h)))
    return InvalidArgument(n + "w13_bias must be [E, 2I] and w2_bias [E, H] float32, or empty");
  if (activation != kActSilu && activation != kActGelu && activation != kActSwigluOai)
    return InvalidArgument(n + "activation must be 0 (silu), 1 (gelu) or 2 (swigluoai)");
  if (layout != kLayoutConcat && layout != kLayoutInterleaved)
    return InvalidArgument(n + "layout must be 0 (concat) or 1 (interleaved)");
  return std::nullopt;
}

}  // namespace decode
}  // namespace jax_moe
