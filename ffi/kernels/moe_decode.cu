// CUDA handler of decode_moe (contract in moe_prepare_finalize.h, reference in jax_moe/decode.py): the
// whole gated MoE for a few token slots in two launches, with no sort, no permute and no group arrays.
// Each slot's expert is read from topk_ids and its weights stream once per slot (a GEMV per slot):
//   1. GEMM1 + activation, per slot s = t*k + j and column i of I:
//        gate = bf16(w13[e][g(i)] . x[t]), up = bf16(w13[e][u(i)] . x[t])    (g, u: the gate/up layout)
//        a[s, i] = bf16(act(gate + b13[e][g(i)], up + b13[e][u(i)]))         (0 for e outside [0, E))
//   2. GEMM2 + weighted reduce, per token t and column h of H:
//        out[t, h] = sum_j w[t, j] * (bf16(w2[e_j][h] . a[t*k + j]) + b2[e_j][h])   over e_j in [0, E)
// The roundings are those of the grouped path (bf16 GEMM outputs, float32 activation and reduce), so
// both paths give the same function. Two weight layouts, two kernel pairs:
//   * as stored, K contiguous (w13 [E, 2I, H], w2 [E, H, I]): ExpertGemvAct / ExpertGemvReduce, one warp
//     per output element reading its row;
//   * transposed, N contiguous (w13t [E, H, 2I], w2t [E, I, H]): ExpertColumnsAct / ExpertColumnsReduce,
//     a block per chunk of output columns whose warps split the rows of the reduction, each lane
//     reading 8 columns of a row at a time, the partial sums reduced in shared memory (BlockColumnDots).
// Rows are read as 16-byte vectors (H and I multiples of 8).
#include <cstdint>
#include <type_traits>

#include "../common/sm_count.h"
#include "moe_decode_common.cuh"

namespace jax_moe {
namespace {

using namespace decode;  // NOLINT: the decode paths' shared helpers (moe_decode_common.cuh)

constexpr int kUnroll = 4;  // 16-byte loads in flight per lane and row

// Dot product of a bf16 row of length n (n % 8 == 0) with a bf16 vector, summed over the warp (every
// lane gets it), float32 accumulation; row and vector streamed together (StreamRows).
__device__ __forceinline__ float WarpDot(const __nv_bfloat16* row, const __nv_bfloat16* v, int64_t n) {
  const uint4* const rows[2] = {reinterpret_cast<const uint4*>(row), reinterpret_cast<const uint4*>(v)};
  float acc = 0.0f;
  StreamRows<2, kUnroll>(rows, n / 8, [&](int64_t, const uint4(&vals)[2]) {
    const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&vals[0]);
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&vals[1]);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 fa = __bfloat1622float2(a[q]), fb = __bfloat1622float2(b[q]);
      acc = fmaf(fa.x, fb.x, acc);
      acc = fmaf(fa.y, fb.y, acc);
    }
  });
  return WarpSum(acc);
}

__global__ void ExpertGemvAct(const __nv_bfloat16* x, const int32_t* ids, const __nv_bfloat16* w13, const float* b13,
                              DecodeShape s, int activation, int layout, float alpha, float limit,
                              __nv_bfloat16* a) {
  const int64_t slot = blockIdx.y;
  const int64_t col = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (col >= s.i) return;
  const int e = ExpertOf(ids, slot, static_cast<int>(s.experts));
  const bool lane0 = (threadIdx.x & 31) == 0;
  if (e < 0) {
    if (lane0) a[slot * s.i + col] = __float2bfloat16_rn(0.0f);
    return;
  }
  const int64_t g_row = layout == kLayoutInterleaved ? 2 * col : col;
  const int64_t u_row = layout == kLayoutInterleaved ? 2 * col + 1 : s.i + col;
  const __nv_bfloat16* w = w13 + int64_t(e) * 2 * s.i * s.h;
  const __nv_bfloat16* xt = x + (slot / s.k) * s.h;
  float gate = RoundBf16(WarpDot(w + g_row * s.h, xt, s.h));
  float up = RoundBf16(WarpDot(w + u_row * s.h, xt, s.h));
  if (lane0) {
    if (b13 != nullptr) {
      gate += b13[int64_t(e) * 2 * s.i + g_row];
      up += b13[int64_t(e) * 2 * s.i + u_row];
    }
    a[slot * s.i + col] = __float2bfloat16_rn(GatedAct(activation, gate, up, alpha, limit));
  }
}

template <typename Out>
__global__ void ExpertGemvReduce(const __nv_bfloat16* a, const int32_t* ids, const float* weights,
                                 const __nv_bfloat16* w2, const float* b2, DecodeShape s, Out* out) {
  const int64_t t = blockIdx.y;
  const int64_t col = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (col >= s.h) return;
  float acc = 0.0f;
  for (int64_t j = 0; j < s.k; ++j) {
    const int64_t slot = t * s.k + j;
    const int e = ExpertOf(ids, slot, static_cast<int>(s.experts));
    if (e < 0) continue;
    float y = RoundBf16(WarpDot(w2 + (int64_t(e) * s.h + col) * s.i, a + slot * s.i, s.i));
    if (b2 != nullptr) y += b2[int64_t(e) * s.h + col];
    acc += weights[slot] * y;
  }
  if ((threadIdx.x & 31) == 0) out[t * s.h + col] = FromF32<Out>(acc);
}

// ---------------------------------------------------------------- transposed (N-contiguous) weights

// The warps of a column block form `sets` teams of kColWarps / sets warps each (warp w in team
// w / (kColWarps / sets); with sets not dividing kColWarps the last warps are in none, team >= sets).
__device__ __forceinline__ int TeamOf(int sets) { return static_cast<int>(threadIdx.x >> 5) / (kColWarps / sets); }

// acc[c] += sum_r v[r] * w[r * ld + c] for c < 8, over the rows first, first + step, ... below rows; w points
// at the thread's 8 columns of row 0 (16-byte aligned). Rows go in batches of kDepth, the next batch
// loaded before this one is used, so that the compiler cannot put each load next to its use: all of a
// batch's loads are in flight at once. The loads are unconditional (a row past the end re-reads the last
// one), the products of rows past the end are masked to zero with no branch.
template <int kDepth>
__device__ __forceinline__ void RowsDot(const __nv_bfloat16* w, int64_t ld, const __nv_bfloat16* v, int64_t first,
                                        int64_t step, int64_t rows, float (&acc)[8]) {
  struct Batch {
    uint4 w[kDepth];
    __nv_bfloat16 v[kDepth];
  };
  const auto load = [&](int64_t r0, Batch& b) {
#pragma unroll
    for (int u = 0; u < kDepth; ++u) {
      const int64_t r = r0 + u * step < rows ? r0 + u * step : rows - 1;
      b.w[u] = __ldg(reinterpret_cast<const uint4*>(w + r * ld));
      b.v[u] = v[r];
    }
  };
  if (first >= rows) return;
  Batch cur, next;
  load(first, cur);
  for (int64_t r0 = first; r0 < rows; r0 += step * kDepth) {
    load(r0 + step * kDepth, next);
#pragma unroll
    for (int u = 0; u < kDepth; ++u) {
      const uint32_t keep = 0u - static_cast<uint32_t>(r0 + u * step < rows);  // all ones, or zero past the end
      const uint32_t bits[4] = {cur.w[u].x & keep, cur.w[u].y & keep, cur.w[u].z & keep, cur.w[u].w & keep};
      const float x = __uint_as_float(__float_as_uint(__bfloat162float(cur.v[u])) & keep);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits[q]));
        acc[2 * q] = fmaf(f.x, x, acc[2 * q]);
        acc[2 * q + 1] = fmaf(f.y, x, acc[2 * q + 1]);
      }
    }
    cur = next;
  }
}

// Column dot products of a block, float32: team s (TeamOf) sums v_s[r] * W_s[r][c] over all rows r < rows
// for the block's 8 * kVecs columns c, lane l owning the 8 columns of vector l % kVecs in rows spread over
// the team's warps. Each thread passes w = W_s offset to its own 8 columns (nullptr: nothing to sum, e.g. a
// slot of no expert or columns past the end) and v = v_s. The per-thread sums are reduced over the warp
// (shuffles), then over the team's warps in shared memory; on return sums[s * 8 * kVecs + c] holds team
// s's results. Every thread of the block calls it (it synchronizes the block). kDepth: RowsDot's rows in flight.
template <int kVecs, int kDepth>
__device__ void BlockColumnDots(const __nv_bfloat16* w, int64_t ld, const __nv_bfloat16* v, int64_t rows, int sets,
                                float* sums) {
  constexpr int kCols = 8 * kVecs, kGroups = 32 / kVecs;  // columns per block, row groups per warp
  __shared__ float warp_sums[kColWarps][kCols];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, team_warps = kColWarps / sets;
  float acc[8] = {};
  if (TeamOf(sets) < sets && w != nullptr)
    RowsDot<kDepth>(w, ld, v, (warp % team_warps) * kGroups + lane / kVecs, team_warps * kGroups, rows, acc);
#pragma unroll
  for (int off = kVecs; off < 32; off <<= 1)
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[c] += __shfl_xor_sync(0xffffffffu, acc[c], off);
  if (lane < kVecs)
#pragma unroll
    for (int c = 0; c < 8; ++c) warp_sums[warp][8 * lane + c] = acc[c];
  __syncthreads();
  for (int o = threadIdx.x; o < sets * kCols; o += blockDim.x) {
    const int first = (o / kCols) * team_warps, c = o % kCols;
    float sum = 0.0f;
    for (int m = 0; m < team_warps; ++m) sum += warp_sums[first + m][c];
    sums[o] = sum;
  }
  __syncthreads();
}

// GEMM1 + activation on w13t [E, H, 2I]: block (x: chunk of 4 * kVecs outputs i, y: slot). The chunk's
// 8 * kVecs weight columns are contiguous (interleaved: gate 2i, up 2i + 1) or the gate columns i and the
// up columns I + i (concat, kVecs even), read by one team of all the block's warps.
template <int kVecs>
__global__ void ExpertColumnsAct(const __nv_bfloat16* x, const int32_t* ids, const __nv_bfloat16* w13t,
                                 const float* b13, DecodeShape s, int activation, int layout, float alpha,
                                 float limit, __nv_bfloat16* a) {
  constexpr int kOut = 4 * kVecs;  // outputs i per block
  __shared__ float sums[2 * kOut];
  const int64_t slot = blockIdx.y, i0 = int64_t(blockIdx.x) * kOut;
  const int e = ExpertOf(ids, slot, static_cast<int>(s.experts));
  const int o = threadIdx.x;
  if (e < 0) {  // the whole block: no synchronization is skipped
    if (o < kOut && i0 + o < s.i) a[slot * s.i + i0 + o] = __float2bfloat16_rn(0.0f);
    return;
  }
  const bool il = layout == kLayoutInterleaved;
  const int vec = (threadIdx.x & 31) % kVecs;
  const int64_t first_i = il ? i0 + 4 * vec : i0 + 8 * (vec % (kVecs / 2));  // the vector's first output
  const int64_t col = il ? 2 * first_i : (vec < kVecs / 2 ? first_i : s.i + first_i);
  const __nv_bfloat16* w = first_i < s.i ? w13t + int64_t(e) * s.h * 2 * s.i + col : nullptr;
  BlockColumnDots<kVecs, kColDepth>(w, 2 * s.i, x + (slot / s.k) * s.h, s.h, 1, sums);
  if (o >= kOut || i0 + o >= s.i) return;
  const int64_t g_col = il ? 2 * (i0 + o) : i0 + o, u_col = il ? g_col + 1 : s.i + i0 + o;
  float gate = RoundBf16(sums[il ? 2 * o : o]), up = RoundBf16(sums[il ? 2 * o + 1 : kOut + o]);
  if (b13 != nullptr) {
    gate += b13[int64_t(e) * 2 * s.i + g_col];
    up += b13[int64_t(e) * 2 * s.i + u_col];
  }
  a[slot * s.i + i0 + o] = __float2bfloat16_rn(GatedAct(activation, gate, up, alpha, limit));
}

// GEMM2 + weighted reduce on w2t [E, I, H]: block (x: chunk of 8 * kVecs columns h, y: token). Up to
// kColWarps slots at a time, a team of warps each; then the weighted sum over the slots in slot order.
template <int kVecs, int kDepth, typename Out>
__global__ void ExpertColumnsReduce(const __nv_bfloat16* a, const int32_t* ids, const float* weights,
                                    const __nv_bfloat16* w2t, const float* b2, DecodeShape s, Out* out) {
  constexpr int kCols = 8 * kVecs;
  __shared__ float sums[kColWarps * kCols];
  const int64_t t = blockIdx.y, h0 = int64_t(blockIdx.x) * kCols;
  const int sets = static_cast<int>(s.k < kColWarps ? s.k : kColWarps), team = TeamOf(sets);
  const int64_t col = h0 + 8 * ((threadIdx.x & 31) % kVecs), c = h0 + threadIdx.x;
  float acc = 0.0f;
  for (int64_t j0 = 0; j0 < s.k; j0 += sets) {
    const int64_t slot = t * s.k + j0 + team;
    const int e = team < sets && j0 + team < s.k ? ExpertOf(ids, slot, static_cast<int>(s.experts)) : -1;
    const __nv_bfloat16* w = e >= 0 && col < s.h ? w2t + int64_t(e) * s.i * s.h + col : nullptr;
    BlockColumnDots<kVecs, kDepth>(w, s.h, e >= 0 ? a + slot * s.i : a, s.i, sets, sums);
    if (threadIdx.x >= kCols || c >= s.h) continue;
    for (int q = 0; q < sets && j0 + q < s.k; ++q) {
      const int64_t sq = t * s.k + j0 + q;
      const int eq = ExpertOf(ids, sq, static_cast<int>(s.experts));
      if (eq < 0) continue;
      float y = RoundBf16(sums[q * kCols + threadIdx.x]);
      if (b2 != nullptr) y += b2[int64_t(eq) * s.h + c];
      acc += weights[sq] * y;
    }
  }
  if (threadIdx.x < kCols && c < s.h) out[t * s.h + c] = FromF32<Out>(acc);
}

// f(std::integral_constant<int, d>{}) for depth d = kDeepColDepth or kColDepth, known at compile time.
template <typename F>
void WithDepth(int depth, F&& f) {
  if (depth == kDeepColDepth) return f(std::integral_constant<int, kDeepColDepth>{});
  f(std::integral_constant<int, kColDepth>{});
}

// f(std::integral_constant<int, v>{}) for v = 16, 8, 4, 2 or 1: a chunk width known at compile time.
template <typename F>
void WithVecs(int v, F&& f) {
  if (v == 16) return f(std::integral_constant<int, 16>{});
  if (v == 8) return f(std::integral_constant<int, 8>{});
  if (v == 4) return f(std::integral_constant<int, 4>{});
  if (v == 2) return f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, 1>{});
}

ffi::Error DecodeMoeCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_ids,
                         ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer w13, ffi::AnyBuffer w2,
                         ffi::Buffer<ffi::F32> w13_bias, ffi::Buffer<ffi::F32> w2_bias,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> act, int64_t activation,
                         int64_t layout, float alpha, float limit, int64_t transposed) {
  const std::string n = "decode_moe: ";
  if (transposed != 0 && transposed != 1) return InvalidArgument(n + "transposed must be 0 or 1");
  const std::string shapes =
      transposed ? "w13 [E, H, 2I] and w2 [E, I, H] (transposed)" : "w13 [E, 2I, H] and w2 [E, H, I]";
  const auto xd = x.dimensions(), id = topk_ids.dimensions(), d13 = w13.dimensions(), d2 = w2.dimensions();
  if (xd.size() != 2 || id.size() != 2 || d13.size() != 3 || d2.size() != 3)
    return InvalidArgument(n + "x [T, H], topk_ids [T, k], " + shapes + " have the wrong ranks");
  const int64_t t = xd[0], h = xd[1], k = id[1], e = d13[0], i = transposed ? d2[1] : d2[2];
  if (id[0] != t || topk_weights.element_count() != static_cast<size_t>(t * k))
    return InvalidArgument(n + "topk_ids and topk_weights must be [T, k]");
  const bool fit = transposed ? (d13[1] == h && d13[2] == 2 * i && d2[0] == e && d2[2] == h)
                              : (d13[1] == 2 * i && d13[2] == h && d2[0] == e && d2[1] == h);
  if (!fit) return InvalidArgument(n + shapes + " must agree, with x's H");
  if (h % 8 || i % 8) return InvalidArgument(n + "H and I must be multiples of 8 (16-byte rows)");
  for (auto dt : {x.element_type(), w13.element_type(), w2.element_type()})
    if (dt != ffi::DataType::BF16) return InvalidArgument(n + "x, w13 and w2 must be bfloat16");
  if (act->element_type() != ffi::DataType::BF16 || act->element_count() != static_cast<size_t>(t * k * i))
    return InvalidArgument(n + "act must be [T*k, I] bfloat16");
  const DecodeShape s{t, k, h, i, e};
  if (auto err = decode::CheckSharedOperands(n, s, out, w13_bias, w2_bias, activation, layout))
    return std::move(*err);
  const size_t nb13 = w13_bias.element_count(), nb2 = w2_bias.element_count();
  if (t * k == 0) return ffi::Error::Success();
  const auto* xs = static_cast<const __nv_bfloat16*>(x.untyped_data());
  const auto* w13s = static_cast<const __nv_bfloat16*>(w13.untyped_data());
  const auto* w2s = static_cast<const __nv_bfloat16*>(w2.untyped_data());
  const int32_t* ids = topk_ids.typed_data();
  const float* b13 = nb13 ? w13_bias.typed_data() : nullptr;
  const float* b2 = nb2 ? w2_bias.typed_data() : nullptr;
  auto* a = static_cast<__nv_bfloat16*>(act->untyped_data());
  const int fn = static_cast<int>(activation), lay = static_cast<int>(layout);
  const DecodePlan plan = PlanDecode(t, k, h, i, /*fp8=*/false, transposed != 0, CurrentSmCount());
  if (!transposed) {
    ExpertGemvAct<<<GridOf(plan.gemm1), plan.gemm1.threads, 0, stream>>>(xs, ids, w13s, b13, s, fn, lay, alpha,
                                                                          limit, a);
  } else {
    WithVecs(plan.gemm1.vecs, [&](auto vecs) {
      constexpr int kVecs = decltype(vecs)::value;  // 2 at least: concat splits the chunk into gate and up
      if constexpr (kVecs >= 2)
        ExpertColumnsAct<kVecs><<<GridOf(plan.gemm1), plan.gemm1.threads, 0, stream>>>(xs, ids, w13s, b13, s, fn,
                                                                                       lay, alpha, limit, a);
    });
  }
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return WithFloatType(out->element_type(), "decode_moe: out", [&](auto tag) -> ffi::Error {
    using Out = typename decltype(tag)::type;
    const float* w = topk_weights.typed_data();
    auto* o = static_cast<Out*>(out->untyped_data());
    if (!transposed) {
      ExpertGemvReduce<Out><<<GridOf(plan.gemm2), plan.gemm2.threads, 0, stream>>>(a, ids, w, w2s, b2, s, o);
    } else {
      WithVecs(plan.gemm2.vecs, [&](auto vecs) {
        constexpr int kVecs = decltype(vecs)::value;  // 8 at most
        WithDepth(plan.gemm2.depth, [&](auto depth) {
          if constexpr (kVecs <= 8)
            ExpertColumnsReduce<kVecs, decltype(depth)::value, Out>
                <<<GridOf(plan.gemm2), plan.gemm2.threads, 0, stream>>>(a, ids, w, w2s, b2, s, o);
        });
      });
    }
    JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jax_moe

// x, topk_ids, topk_weights, w13, w2, w13_bias, w2_bias -> out, act; attributes activation, layout, alpha,
// limit, transposed (common/binding.h).
JAX_MOE_DEFINE_CUDA_HANDLER(JaxMoeDecodeMoeCuda, jax_moe::DecodeMoeCuda, "activation", "layout", "alpha", "limit",
                            "transposed");
