// The small kernels around a grouped-GEMM MoE (jax_moe/kernels.py holds the shape rules and the jnp
// references they are tested against). Rows are in expert-sorted order (jax_moe/permute.py): row r
// holds slot sorted_slots[r] = t * k + j. `valid_rows` is a [1] int32 device value, normally
// offsets[E] of sort_by_expert: rows at or past it belong to slots whose expert id is outside
// [0, E) (expert-parallel ids of -1, sorted last).
//
// jax_moe_permute_rows     x [T, H] bf16/f16/f32, sorted_slots [T*k] i32, inverse [T*k] i32 or [0],
//                          valid_rows [1] i32, scale [1] f32 (static) or [0]
//                       -> rows [T*k, H] (x's dtype, or f8e4m3fn), scales [T*k] f32 (per-token) or [0].
//                          attrs: top_k, quant (kQuant*). Row r = x[sorted_slots[r] / k]; rows >= valid_rows
//                          are zero (their per-token scale is kFp8MinScale). With an inverse (sort_by_expert's:
//                          a permutation of [0, T*k) with sorted_slots[inverse[s]] == s) the rows are written
//                          in slot order instead, row inverse[s] = x[s / k] (from 1024 tokens by token: x[t] to
//                          rows inverse[t*k .. t*k + k)), sorted_slots unread; same result.
// jax_moe_act_and_mul      h [M, 2I] bf16/f16/f32, valid_rows [1] i32, scale [1] f32 or [0],
//                          bias [E, 2I] f32 or [0], offsets [E+1] i32 or [0] (both or neither)
//                       -> out [M, I] (bf16/f16/f32, or f8e4m3fn), scales [M] f32 or [0].
//                          attrs: activation (kAct*), quant (kQuant*), layout (kLayout*: gate columns [0, I)
//                          and up [I, 2I), or gate 2i and up 2i+1), alpha, limit (f32, swigluoai's).
//                          With a bias, row r's expert is the e with offsets[e] <= r < offsets[e+1] and
//                          bias[e] is added to h[r] (same column order) before the activation:
//                          silu(g) * u, gelu_erf(g) * u, or swigluoai: g <- min(g, limit),
//                          u <- clip(u, -limit, limit), (u + 1) * g * sigmoid(alpha * g).
//                          Rows >= valid_rows are zero. Quantization applies to the activated row.
// jax_moe_unpermute_reduce y [M, H] bf16/f16/f32, inverse [T*k] i32, topk_weights [T, k] f32, valid_rows [1] i32,
//                          bias [E, H] f32 or [0], offsets [E+1] i32 or [0] (both or neither)
//                       -> out [T, H] bf16/f16/f32. attr: weighted (0: apply_router_weight_on_input, plain sum).
//                          out[t] = sum_j w[t, j] * (y[row] + bias[e(row)]) over slots with row = inverse[t*k + j]
//                          < valid_rows (e(row): as above; no bias: y[row] alone), accumulated in float32.
// jax_moe_decode_moe      x [T, H] bf16, topk_ids [T, k] i32, topk_weights [T, k] f32, w13 [E, 2I, H] bf16,
//                          w2 [E, H, I] bf16, w13_bias [E, 2I] f32 or [0], w2_bias [E, H] f32 or [0]
//                       -> out [T, H] bf16/f16/f32, act [T*k, I] bf16 (scratch). attrs: activation, layout,
//                          alpha, limit, transposed (i64 0/1: with 1, w13 is [E, H, 2I] and w2 [E, I, H],
//                          the same weights with their last two axes swapped, N contiguous; layout then
//                          orders w13's columns). The gated MoE of a few slots with no sort (moe_decode.cu):
//                          per slot, GEMM1 + activation from the slot's expert id, then GEMM2 + the weighted
//                          reduce per token; slots with ids outside [0, E) contribute zero. H and I are
//                          multiples of 8; both layouts give the same function (same roundings).
// jax_moe_decode_moe_fp8  x [T, H] bf16/f16/f32, topk_ids [T, k] i32, topk_weights [T, k] f32,
//                          w13 [E, 2I, H] f8e4m3fn, w2 [E, H, I] f8e4m3fn, a13_scale [1] f32, a2_scale [1] f32
//                          (per-tensor activation scales), w13_scale [E, 2I], [E, 1] or [1, 1] f32, w2_scale
//                          [E, H], [E, 1] or [1, 1] f32 (per channel, expert or tensor), w13_bias [E, 2I] f32 or
//                          [0], w2_bias [E, H] f32 or [0] -> out [T, H] bf16/f16/f32, act [T*k, I] f8e4m3fn
//                          (scratch). attrs: activation, layout, alpha, limit. decode_moe on W8A8 weights
//                          (moe_decode_fp8.cu): x quantized with a13_scale, GEMM1 dequantized with it and
//                          w13_scale, the activation quantized with a2_scale, GEMM2 dequantized with it and
//                          w2_scale; H and I multiples of 16, H and k * I at most 49152.
#pragma once

#include <cfloat>

#include "xla/ffi/api/api.h"

namespace jax_moe {
// FP8 E4M3 per-token/static quantization (jax_moe/quant/fp8.py): scale = max(amax * (1/448), FLT_MIN),
// q = e4m3(clip(x * (1 / scale), -448, 448)), rounded to nearest even.
constexpr float kFp8Max = 448.0f;
constexpr float kFp8MinScale = FLT_MIN;

enum QuantMode : int { kQuantNone = 0, kQuantPerToken = 1, kQuantStatic = 2 };
enum Activation : int { kActSilu = 0, kActGelu = 1, kActSwigluOai = 2 };
enum GateUpLayout : int { kLayoutConcat = 0, kLayoutInterleaved = 1 };
}  // namespace jax_moe

extern "C" XLA_FFI_Error* JaxMoePermuteRowsCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeActAndMulCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeUnpermuteReduceCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeDecodeMoeCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeDecodeMoeFp8Cuda(XLA_FFI_CallFrame* call_frame);
