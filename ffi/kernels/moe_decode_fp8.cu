// CUDA handler of decode_moe_fp8 (contract in moe_prepare_finalize.h, reference in jax_moe/decode_fp8.py):
// the decode path on FP8 E4M3 weights with per-tensor activation scales (W8A8), in two launches with no
// sort, no permute and no group arrays. Each slot's expert is read from topk_ids and its weights stream
// once per slot, each warp reading the K-contiguous rows of one or more output elements (16 weights per
// 16-byte load), as many per warp as fit each launch in one wave of blocks (OutputsPerWarp, decode_launch.h):
//   1. GEMM1 + activation, per slot s = t*k + j (expert e) and output i of I:
//        xq = fp8(x[t] / s1)                          (each block quantizes its token's row into shared memory)
//        gate = (w13[e][g(i)] . xq) * s1 * c13(e, g(i)) + b13[e][g(i)], up likewise at u(i)
//        a[s, i] = fp8(act(gate, up) / s2)            (0 where e is outside [0, E))
//   2. GEMM2 + weighted reduce, per token t and column h of H:
//        out[t, h] = sum_j w[t, j] * (bf16((w2[e_j][h] . a[t*k + j]) * s2 * c2(e_j, h)) + b2[e_j][h])
// c13 and c2 are the weight scales in their compact forms: [E, N] (per channel), [E, 1] (per expert) or
// [1, 1] (per tensor). The products of two FP8 values are exact in float32, and the sums are float32: the
// grouped FP8 path's arithmetic (GEMM1's epilogue: the activation on float32, quantized with s2; GEMM2's
// rows rounded to bf16, the bias and the weighted sum in float32), up to the order of the sums.
#include <cstdint>
#include <optional>
#include <string>

#include "../common/col_scale.h"
#include "../common/sm_count.h"
#include "moe_decode_common.cuh"

namespace jax_moe {
namespace {

using namespace decode;  // NOLINT: the decode paths' shared helpers (moe_decode_common.cuh)

constexpr int kSlotRows = 4;  // GEMM2: the slots whose rows a warp sums at once
constexpr int kActUnroll = 4;  // GEMM1: a lane's loads per row and batch (gate and up: 8 in flight)
constexpr int64_t kEarlyBatchBytes = 32 * kActUnroll * 16;  // GEMM1: a warp's first batch of a row

// The 16 FP8 values of a 16-byte vector as float32 (exact: E4M3 -> half -> float).
__device__ __forceinline__ void Fp8x16ToF32(const uint4& v, float (&out)[16]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(words[q] >> (16 * p));
      const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3));
      const float2 f = __half22float2(h);
      out[4 * q + 2 * p] = f.x;
      out[4 * q + 2 * p + 1] = f.y;
    }
  }
}

// A weight scale in its compact form: c[e * group_step + n * col_step] (steps n and 1, 1 and 0, or 0 and 0).
struct ColScale {
  const float* c;
  int64_t group_step, col_step;
  __device__ float At(int e, int64_t n) const { return __ldg(c + e * group_step + n * col_step); }
};

// How many of a warp's outputs col0 + kWarps * j (j < cols_per_warp) lie below n.
__device__ __forceinline__ int WarpOutputs(int64_t col0, int64_t n, int cols_per_warp) {
  return col0 < n ? static_cast<int>(min(int64_t(cols_per_warp), (n - col0 + kWarps - 1) / kWarps)) : 0;
}

// The scales and biases of one output's gate and up rows, loaded with the output's first batch of weights.
struct GateUpEpilogue {
  float gate_scale, up_scale, gate_bias, up_bias;
};

// GEMM1 + activation: block (x: kWarps * cols_per_warp outputs i, y: slot). The block quantizes its
// token's row of x into shared memory (h bytes); then warp w takes the outputs col0 + kWarps * j for
// j < cols_per_warp (col0 = blockIdx.x * kWarps * cols_per_warp + w): their gate and up rows of w13[e],
// streamed as one pipeline of batches across the outputs, the next batch (of this output or the next)
// issued before this one is used. The handler sizes cols_per_warp so that the grid is one wave of
// blocks (two per SM), so each block quantizes x once for all its outputs and no block waits for a
// second wave. Where a row is longer than one batch of loads (kEarlyBatchBytes), the warp issues its
// first batch before x is quantized; where one batch holds the whole row, issued first it was slower
// (Qwen3-30B-A3B, h = 2048, 4-8%).
template <typename In>
__global__ void __launch_bounds__(32 * kWarps, 2)
    ExpertGemvActFp8(const In* x, const int32_t* ids, const Fp8* w13, const float* s1, const float* s2,
                     ColScale c13, const float* b13, DecodeShape s, int cols_per_warp, int activation, int layout,
                     float alpha, float limit, Fp8* a) {
  extern __shared__ __align__(16) unsigned char smem[];
  Fp8* xq = reinterpret_cast<Fp8*>(smem);
  const int64_t slot = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int64_t col0 = int64_t(blockIdx.x) * kWarps * cols_per_warp + (threadIdx.x >> 5);
  const int cols = WarpOutputs(col0, s.i, cols_per_warp);
  const int e = ExpertOf(ids, slot, static_cast<int>(s.experts));  // uniform over the block
  if (e < 0) {
    if (lane == 0)
      for (int j = 0; j < cols; ++j) a[slot * s.i + col0 + kWarps * j] = Fp8{0};
    return;
  }
  const Fp8* w = w13 + int64_t(e) * 2 * s.i * s.h;
  const int64_t vecs = s.h / 16;
  constexpr int kUnroll = kActUnroll;
  const int batches = static_cast<int>((vecs + 32 * kUnroll - 1) / (32 * kUnroll));  // per row
  // Output j's gate and up rows (g, u), its row pointers, and its epilogue's scales and biases.
  auto rows_of = [&](int j, int64_t(&gu)[2], const uint4* (&rows)[2]) {
    const int64_t col = col0 + kWarps * j;
    gu[0] = layout == kLayoutInterleaved ? 2 * col : col;
    gu[1] = layout == kLayoutInterleaved ? 2 * col + 1 : s.i + col;
    rows[0] = reinterpret_cast<const uint4*>(w + gu[0] * s.h);
    rows[1] = reinterpret_cast<const uint4*>(w + gu[1] * s.h);
  };
  auto epilogue_of = [&](const int64_t(&gu)[2]) {
    GateUpEpilogue p{c13.At(e, gu[0]), c13.At(e, gu[1]), 0.0f, 0.0f};
    if (b13 != nullptr) {
      p.gate_bias = __ldg(b13 + int64_t(e) * 2 * s.i + gu[0]);
      p.up_bias = __ldg(b13 + int64_t(e) * 2 * s.i + gu[1]);
    }
    return p;
  };
  RowBatch<2, kUnroll> cur, next;
  GateUpEpilogue ep_cur{}, ep_next{};
  auto load_first = [&] {
    int64_t gu[2];
    const uint4* rows[2];
    rows_of(0, gu, rows);
    LoadRowBatch(rows, vecs, lane, cur);
    ep_cur = epilogue_of(gu);
  };
  const bool early = s.h > kEarlyBatchBytes;  // uniform over the grid
  if (early && cols > 0) load_first();
  const float scale1 = *s1, inv1 = 1.0f / scale1, inv2 = 1.0f / *s2;
  const In* xt = x + (slot / s.k) * s.h;
  for (int64_t c = threadIdx.x; c < s.h / 8; c += blockDim.x) {  // 8 values of x per thread and step
    float v[8];
    LoadF32<In, 8>(xt + 8 * c, v);
    ScaleForFp8(v, inv1);
    StoreF32<Fp8, 8>(xq + 8 * c, v);
  }
  __syncthreads();
  if (cols == 0) return;
  if (!early) load_first();
  float sums[2] = {0.0f, 0.0f};
  int j = 0, b = 0;  // the output and the batch of its rows in cur
  for (int unit = 0, units = cols * batches; unit < units; ++unit) {
    const int nj = b + 1 < batches ? j : j + 1, nb = b + 1 < batches ? b + 1 : 0;
    if (nj < cols) {  // uniform over the warp: the next batch goes out before this one is used
      int64_t gu[2];
      const uint4* rows[2];
      rows_of(nj, gu, rows);
      LoadRowBatch(rows, vecs, lane + 32 * kUnroll * nb, next);
      if (nb == 0) ep_next = epilogue_of(gu);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = lane + 32 * (kUnroll * b + u);
      if (c < vecs) {
        float xv[16], wv[16];
        Fp8x16ToF32(reinterpret_cast<const uint4*>(xq)[c], xv);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          Fp8x16ToF32(cur.v[u][r], wv);
#pragma unroll
          for (int q = 0; q < 16; ++q) sums[r] = fmaf(wv[q], xv[q], sums[r]);
        }
      }
    }
    if (b + 1 == batches) {  // output j is summed
      const float gate = WarpSum(sums[0]) * (scale1 * ep_cur.gate_scale) + ep_cur.gate_bias;
      const float up = WarpSum(sums[1]) * (scale1 * ep_cur.up_scale) + ep_cur.up_bias;
      if (lane == 0)
        a[slot * s.i + col0 + kWarps * j] =
            FromF32<Fp8>(ScaleForFp8(GatedAct(activation, gate, up, alpha, limit), inv2));
      sums[0] = sums[1] = 0.0f;
      ep_cur = ep_next;
    }
    cur = next;
    j = nj;
    b = nb;
  }
}

// What one pass of GEMM2's epilogue needs for kSlotRows slots of a column: the slots' experts (-1: none),
// the weight scales and the biases, loaded with the pass's first batch of weights.
struct SlotsEpilogue {
  int e[kSlotRows];
  float scale[kSlotRows], bias[kSlotRows];
};

// GEMM2 + weighted reduce: block (x: kWarps * cols_per_warp columns h, y: token). The block copies the
// token's k activation rows into shared memory (k * I bytes); then warp w takes the columns
// col0 + kWarps * j for j < cols_per_warp (col0 = blockIdx.x * kWarps * cols_per_warp + w), and sums
// each over the k slots, in passes of kSlotRows slots whose weight rows stream together. The passes of
// all its columns are one pipeline of batches, the next batch issued before this one is used; the
// passes' sums are added in slot order. The handler sizes cols_per_warp as GEMM1's: one wave of blocks.
template <typename Out>
__global__ void __launch_bounds__(32 * kWarps, 2)
    ExpertGemvReduceFp8(const Fp8* a, const int32_t* ids, const float* weights, const Fp8* w2, const float* s2,
                        ColScale c2, const float* b2, DecodeShape s, int cols_per_warp, Out* out) {
  extern __shared__ __align__(16) unsigned char smem[];
  Fp8* at = reinterpret_cast<Fp8*>(smem);  // the token's k activation rows, [k, I]
  const int64_t t = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int64_t col0 = int64_t(blockIdx.x) * kWarps * cols_per_warp + (threadIdx.x >> 5);
  const int cols = WarpOutputs(col0, s.h, cols_per_warp);
  const uint4* src = reinterpret_cast<const uint4*>(a + t * s.k * s.i);
  for (int64_t c = threadIdx.x; c < s.k * s.i / 16; c += blockDim.x) reinterpret_cast<uint4*>(at)[c] = src[c];
  __syncthreads();
  if (cols == 0) return;
  const int64_t vecs = s.i / 16;
  constexpr int kUnroll = 2;  // kSlotRows rows: 8 loads in flight per lane and batch
  const int batches = static_cast<int>((vecs + 32 * kUnroll - 1) / (32 * kUnroll));  // per row
  const int passes = static_cast<int>((s.k + kSlotRows - 1) / kSlotRows);
  // Pass p of column j: its slots' rows and epilogue. A slot with no expert streams expert 0's row and
  // drops its sum (the loads stay unconditional).
  auto rows_of = [&](int j, int p, const uint4* (&rows)[kSlotRows], bool with_epilogue, SlotsEpilogue& ep) {
    const int64_t col = col0 + kWarps * j;
    int es[kSlotRows];
#pragma unroll
    for (int r = 0; r < kSlotRows; ++r) {  // the loads unconditional, in parallel: a slot past k reads slot k - 1
      const int64_t slot = int64_t(p) * kSlotRows + r;
      const int e = ExpertOf(ids, t * s.k + (slot < s.k ? slot : s.k - 1), static_cast<int>(s.experts));
      es[r] = slot < s.k ? e : -1;
    }
#pragma unroll
    for (int r = 0; r < kSlotRows; ++r)
      rows[r] = reinterpret_cast<const uint4*>(w2 + (int64_t(es[r] >= 0 ? es[r] : 0) * s.h + col) * s.i);
    if (with_epilogue) {
#pragma unroll
      for (int r = 0; r < kSlotRows; ++r) {
        const int e0 = es[r] >= 0 ? es[r] : 0;
        ep.e[r] = es[r];
        ep.scale[r] = c2.At(e0, col);
        ep.bias[r] = b2 != nullptr ? __ldg(b2 + int64_t(e0) * s.h + col) : 0.0f;
      }
    }
  };
  const float scale2 = *s2;
  RowBatch<kSlotRows, kUnroll> cur, next;
  SlotsEpilogue ep_cur, ep_next;
  {
    const uint4* rows[kSlotRows];
    rows_of(0, 0, rows, true, ep_cur);
    LoadRowBatch(rows, vecs, lane, cur);
  }
  float sums[kSlotRows] = {}, acc = 0.0f;
  int j = 0, p = 0, b = 0;  // the column, pass and batch in cur
  for (int unit = 0, units = cols * passes * batches; unit < units; ++unit) {
    int nj = j, np = p, nb = b + 1;  // the next unit
    if (nb == batches) {
      nb = 0;
      if (++np == passes) np = 0, ++nj;
    }
    if (nj < cols) {  // uniform over the warp: the next batch goes out before this one is used
      const uint4* rows[kSlotRows];
      rows_of(nj, np, rows, nb == 0, ep_next);
      LoadRowBatch(rows, vecs, lane + 32 * kUnroll * nb, next);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = lane + 32 * (kUnroll * b + u);
      if (c < vecs) {
#pragma unroll
        for (int r = 0; r < kSlotRows; ++r) {
          float wv[16], av[16];
          Fp8x16ToF32(cur.v[u][r], wv);
          Fp8x16ToF32(reinterpret_cast<const uint4*>(at + (p * kSlotRows + r < s.k ? p * kSlotRows + r : 0) * s.i)[c],
                      av);
#pragma unroll
          for (int q = 0; q < 16; ++q) sums[r] = fmaf(wv[q], av[q], sums[r]);
        }
      }
    }
    if (b + 1 == batches) {  // pass p of column j is summed: its slots' rows added in slot order
#pragma unroll
      for (int r = 0; r < kSlotRows; ++r) {
        const float dot = WarpSum(sums[r]);
        sums[r] = 0.0f;
        if (ep_cur.e[r] < 0) continue;
        const float y = RoundBf16(dot * (scale2 * ep_cur.scale[r])) + ep_cur.bias[r];
        acc += weights[t * s.k + p * kSlotRows + r] * y;
      }
      if (p + 1 == passes) {  // column j is summed
        if (lane == 0) out[t * s.h + col0 + kWarps * j] = FromF32<Out>(acc);
        acc = 0.0f;
      }
      ep_cur = ep_next;
    }
    cur = next;
    j = nj;
    p = np;
    b = nb;
  }
}

// A weight scale's compact form for n columns of e experts, or an error naming it.
std::optional<ffi::Error> ReadColScale(const std::string& name, ffi::Buffer<ffi::F32>& scale, int64_t e, int64_t n,
                                       ColScale& out) {
  const ColScaleForm form = ColScaleFormOf(scale.dimensions(), e, n);
  if (form == ColScaleForm::kNone)
    return InvalidArgument("decode_moe_fp8: " + name + " must be [E, " + std::to_string(n) +
                           "] float32 (per channel), [E, 1] (per expert) or [1, 1] (per tensor)");
  out = ColScale{scale.typed_data(), ColScaleExpertStep(form, n), form == ColScaleForm::kPerChannel ? 1 : 0};
  return std::nullopt;
}

ffi::Error DecodeMoeFp8Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_ids,
                            ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer w13, ffi::AnyBuffer w2,
                            ffi::Buffer<ffi::F32> a13_scale, ffi::Buffer<ffi::F32> a2_scale,
                            ffi::Buffer<ffi::F32> w13_scale, ffi::Buffer<ffi::F32> w2_scale,
                            ffi::Buffer<ffi::F32> w13_bias, ffi::Buffer<ffi::F32> w2_bias,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> act, int64_t activation,
                            int64_t layout, float alpha, float limit) {
  const std::string n = "decode_moe_fp8: ";
  const auto xd = x.dimensions(), id = topk_ids.dimensions(), d13 = w13.dimensions(), d2 = w2.dimensions();
  if (xd.size() != 2 || id.size() != 2 || d13.size() != 3 || d2.size() != 3)
    return InvalidArgument(n + "x [T, H], topk_ids [T, k], w13 [E, 2I, H] and w2 [E, H, I] have the wrong ranks");
  const int64_t t = xd[0], h = xd[1], k = id[1], e = d13[0], i = d2[2];
  if (id[0] != t || topk_weights.element_count() != static_cast<size_t>(t * k))
    return InvalidArgument(n + "topk_ids and topk_weights must be [T, k]");
  if (d13[1] != 2 * i || d13[2] != h || d2[0] != e || d2[1] != h)
    return InvalidArgument(n + "w13 [E, 2I, H] and w2 [E, H, I] must agree, with x's H");
  if (h % 16 || i % 16) return InvalidArgument(n + "H and I must be multiples of 16 (16-byte FP8 rows)");
  if (w13.element_type() != ffi::DataType::F8E4M3FN || w2.element_type() != ffi::DataType::F8E4M3FN)
    return InvalidArgument(n + "w13 and w2 must be float8_e4m3fn");
  if (a13_scale.element_count() != 1 || a2_scale.element_count() != 1)
    return InvalidArgument(n + "a13_scale and a2_scale must be [1] float32 (per-tensor activation scales)");
  ColScale c13{}, c2{};
  if (auto err = ReadColScale("w13_scale", w13_scale, e, 2 * i, c13)) return std::move(*err);
  if (auto err = ReadColScale("w2_scale", w2_scale, e, h, c2)) return std::move(*err);
  if (act->element_type() != ffi::DataType::F8E4M3FN || act->element_count() != static_cast<size_t>(t * k * i))
    return InvalidArgument(n + "act must be [T*k, I] float8_e4m3fn");
  const DecodeShape s{t, k, h, i, e};
  if (auto err = decode::CheckSharedOperands(n, s, out, w13_bias, w2_bias, activation, layout))
    return std::move(*err);
  const auto out_type = out->element_type();
  const size_t nb13 = w13_bias.element_count(), nb2 = w2_bias.element_count();
  if (h > 48 * 1024 || k * i > 48 * 1024)
    return InvalidArgument(n + "H and k * I must be at most 49152 (x's quantized row and a token's activations "
                               "in shared memory)");
  if (t * k == 0) return ffi::Error::Success();
  const int32_t* ids = topk_ids.typed_data();
  const auto* w13s = static_cast<const Fp8*>(w13.untyped_data());
  const auto* w2s = static_cast<const Fp8*>(w2.untyped_data());
  const float* b13 = nb13 ? w13_bias.typed_data() : nullptr;
  const float* b2 = nb2 ? w2_bias.typed_data() : nullptr;
  const float *s1 = a13_scale.typed_data(), *s2 = a2_scale.typed_data();
  auto* a = static_cast<Fp8*>(act->untyped_data());
  const int fn = static_cast<int>(activation), lay = static_cast<int>(layout);
  // Each GEMM's outputs per warp: the fewest that fit its grid in one wave of blocks, two per SM.
  const int sms = CurrentSmCount();
  if (sms <= 0) return ffi::Error(ffi::ErrorCode::kInternal, "jax_moe: cannot read the SM count");
  const DecodePlan plan = PlanDecode(t, k, h, i, /*fp8=*/true, /*transposed=*/false, sms);
  auto status = WithFloatType(x.element_type(), "decode_moe_fp8: x", [&](auto tag) -> ffi::Error {
    using In = typename decltype(tag)::type;
    if (!Aligned(x.untyped_data(), 8 * sizeof(In))) return InvalidArgument(n + "x must be 16-byte aligned");
    ExpertGemvActFp8<In><<<GridOf(plan.gemm1), plan.gemm1.threads, h, stream>>>(
        static_cast<const In*>(x.untyped_data()), ids, w13s, s1, s2, c13, b13, s, plan.gemm1.outputs_per_warp, fn,
        lay, alpha, limit, a);
    JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return ffi::Error::Success();
  });
  if (status.failure()) return status;
  return WithFloatType(out_type, "decode_moe_fp8: out", [&](auto tag) -> ffi::Error {
    using Out = typename decltype(tag)::type;
    ExpertGemvReduceFp8<Out><<<GridOf(plan.gemm2), plan.gemm2.threads, k * i, stream>>>(
        a, ids, topk_weights.typed_data(), w2s, s2, c2, b2, s, plan.gemm2.outputs_per_warp,
        static_cast<Out*>(out->untyped_data()));
    JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jax_moe

// x, topk_ids, topk_weights, w13, w2, a13_scale, a2_scale, w13_scale, w2_scale, w13_bias, w2_bias -> out, act;
// attributes activation, layout, alpha, limit (common/binding.h).
JAX_MOE_DEFINE_CUDA_HANDLER(JaxMoeDecodeMoeFp8Cuda, jax_moe::DecodeMoeFp8Cuda, "activation", "layout", "alpha",
                            "limit");
