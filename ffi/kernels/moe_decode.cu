// CUDA handler of decode_moe (contract in moe_prepare_finalize.h, reference in jax_moe/kernels.py): the
// whole gated MoE for a few token slots in two launches, with no sort, no permute and no group arrays.
// Each slot's expert is read from topk_ids, and the weights stream once per slot through warps that
// each own an output element (a GEMV per slot):
//   1. ExpertGemvAct: one warp per (slot s = t*k + j, column i of I):
//        gate = bf16(w13[e][g(i)] . x[t]), up = bf16(w13[e][u(i)] . x[t])    (g, u: the gate/up layout)
//        a[s, i] = bf16(act(gate + b13[e][g(i)], up + b13[e][u(i)]))         (0 for e outside [0, E))
//   2. ExpertGemvReduce: one warp per (token t, column h of H):
//        out[t, h] = sum_j w[t, j] * (bf16(w2[e_j][h] . a[t*k + j]) + b2[e_j][h])   over e_j in [0, E)
// The roundings are those of the grouped path (bf16 GEMM outputs, float32 activation and reduce), so
// both paths give the same function. Rows are read as 16-byte vectors (H and I multiples of 8).
#include <cstdint>

#include "moe_device.cuh"

namespace jax_moe {
namespace {

constexpr int kWarps = 8;   // warps per block: one output element each
constexpr int kUnroll = 4;  // 16-byte loads in flight per lane and row

// Dot product of a bf16 row of length n (n % 8 == 0) with a bf16 vector, summed over the warp (every
// lane gets it), float32 accumulation.
__device__ __forceinline__ float WarpDot(const __nv_bfloat16* row, const __nv_bfloat16* v, int64_t n) {
  const uint4* r4 = reinterpret_cast<const uint4*>(row);
  const uint4* v4 = reinterpret_cast<const uint4*>(v);
  const int64_t vecs = n / 8;
  const int lane = threadIdx.x & 31;
  float acc = 0.0f;
  for (int64_t c0 = lane; c0 < vecs; c0 += 32 * kUnroll) {
    uint4 rv[kUnroll], vv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + 32 * u;
      if (c < vecs) {
        rv[u] = __ldg(r4 + c);
        vv[u] = __ldg(v4 + c);
      } else {
        rv[u] = make_uint4(0, 0, 0, 0);
        vv[u] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&rv[u]);
      const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&vv[u]);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 fa = __bfloat1622float2(a[q]), fb = __bfloat1622float2(b[q]);
        acc = fmaf(fa.x, fb.x, acc);
        acc = fmaf(fa.y, fb.y, acc);
      }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  return acc;
}

__device__ __forceinline__ float RoundBf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

__device__ __forceinline__ int ExpertOf(const int32_t* ids, int64_t slot, int experts) {
  const int32_t e = ids[slot];
  return (e >= 0 && e < experts) ? e : -1;
}

struct DecodeShape {
  int64_t t, k, h, i, experts;
};

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

ffi::Error DecodeMoeCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_ids,
                         ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer w13, ffi::AnyBuffer w2,
                         ffi::Buffer<ffi::F32> w13_bias, ffi::Buffer<ffi::F32> w2_bias,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> act, int64_t activation,
                         int64_t layout, float alpha, float limit) {
  const std::string n = "decode_moe: ";
  const auto xd = x.dimensions(), id = topk_ids.dimensions(), d13 = w13.dimensions(), d2 = w2.dimensions();
  if (xd.size() != 2 || id.size() != 2 || d13.size() != 3 || d2.size() != 3)
    return InvalidArgument(n + "x [T, H], topk_ids [T, k], w13 [E, 2I, H] and w2 [E, H, I] have the wrong ranks");
  const int64_t t = xd[0], h = xd[1], k = id[1], e = d13[0], i = d2[2];
  if (id[0] != t || topk_weights.element_count() != static_cast<size_t>(t * k))
    return InvalidArgument(n + "topk_ids and topk_weights must be [T, k]");
  if (d13[1] != 2 * i || d13[2] != h || d2[0] != e || d2[1] != h)
    return InvalidArgument(n + "w13 must be [E, 2I, H] and w2 [E, H, I] with x's H");
  if (h % 8 || i % 8) return InvalidArgument(n + "H and I must be multiples of 8 (16-byte rows)");
  for (auto dt : {x.element_type(), w13.element_type(), w2.element_type()})
    if (dt != ffi::DataType::BF16) return InvalidArgument(n + "x, w13 and w2 must be bfloat16");
  if (act->element_type() != ffi::DataType::BF16 || act->element_count() != static_cast<size_t>(t * k * i))
    return InvalidArgument(n + "act must be [T*k, I] bfloat16");
  const auto out_type = out->element_type();
  if (out->element_count() != static_cast<size_t>(t * h) ||
      (out_type != ffi::DataType::BF16 && out_type != ffi::DataType::F16 && out_type != ffi::DataType::F32))
    return InvalidArgument(n + "out must be [T, H] bfloat16, float16 or float32");
  const size_t nb13 = w13_bias.element_count(), nb2 = w2_bias.element_count();
  if ((nb13 != 0 && nb13 != static_cast<size_t>(e * 2 * i)) || (nb2 != 0 && nb2 != static_cast<size_t>(e * h)))
    return InvalidArgument(n + "w13_bias must be [E, 2I] and w2_bias [E, H] float32, or empty");
  if (activation != kActSilu && activation != kActGelu && activation != kActSwigluOai)
    return InvalidArgument(n + "activation must be 0 (silu), 1 (gelu) or 2 (swigluoai)");
  if (layout != kLayoutConcat && layout != kLayoutInterleaved)
    return InvalidArgument(n + "layout must be 0 (concat) or 1 (interleaved)");
  if (t == 0 || k == 0 || t * k > 65535 || t > 65535)
    return t * k == 0 ? ffi::Error::Success() : InvalidArgument(n + "at most 65535 slots");
  const DecodeShape s{t, k, h, i, e};
  const auto* xs = static_cast<const __nv_bfloat16*>(x.untyped_data());
  auto* a = static_cast<__nv_bfloat16*>(act->untyped_data());
  const dim3 block(32 * kWarps);
  ExpertGemvAct<<<dim3((i + kWarps - 1) / kWarps, t * k), block, 0, stream>>>(
      xs, topk_ids.typed_data(), static_cast<const __nv_bfloat16*>(w13.untyped_data()),
      nb13 ? w13_bias.typed_data() : nullptr, s, static_cast<int>(activation), static_cast<int>(layout), alpha, limit,
      a);
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return WithFloatType(out->element_type(), "decode_moe: out", [&](auto tag) -> ffi::Error {
    using Out = typename decltype(tag)::type;
    ExpertGemvReduce<Out><<<dim3((h + kWarps - 1) / kWarps, t), block, 0, stream>>>(
        a, topk_ids.typed_data(), topk_weights.typed_data(), static_cast<const __nv_bfloat16*>(w2.untyped_data()),
        nb2 ? w2_bias.typed_data() : nullptr, s, static_cast<Out*>(out->untyped_data()));
    JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jax_moe

// x, topk_ids, topk_weights, w13, w2, w13_bias, w2_bias -> out, act; attributes activation, layout, alpha,
// limit (common/binding.h).
JAX_MOE_DEFINE_CUDA_HANDLER(JaxMoeDecodeMoeCuda, jax_moe::DecodeMoeCuda, "activation", "layout", "alpha", "limit");
