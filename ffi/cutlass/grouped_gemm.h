// jax_moe's own SM90 grouped GEMMs (CUTLASS 3.x pointer-array kernels), six XLA FFI targets
// (jax_moe/backends/cutlass_gemm.py and cutlass_grad_gemm.py hold their shape rules and jnp references):
//
// jax_moe_cutlass_grouped_gemm (bf16):
//   a [M, K] bf16        expert-sorted activation rows; expert e owns rows [offsets[e], offsets[e+1])
//   b [E, N, K] bf16     expert weights, K contiguous (vLLM's w13 [E, 2I, H] and w2 [E, H, I] as they are)
//   offsets [E+1] int32  nondecreasing row offsets on device (sort_by_expert's offsets)
// -> d [M, N] bf16       d[r] = a[r] @ b[e]^T for the rows r of expert e (float32 accumulation); rows
//                        outside [offsets[0], offsets[E]) are written as zeros
//    workspace [W] uint8 scratch (its contents are meaningless): the per-group problem shapes, pointers
//                        and strides, built on device from offsets (no host sync), then CUTLASS's own
//                        workspace (TMA descriptors per SM). W = WorkspaceBytes(E, tile, sm_count, kind).
//
// jax_moe_cutlass_grouped_gemm_fp8 (FP8 E4M3 x E4M3 -> bf16, scales in the epilogue):
//   a [M, K] float8_e4m3fn, b [E, N, K] float8_e4m3fn, offsets as above, and
//   row_scale [M] float32    a's dequantization scale per row (per token; a per-tensor scale broadcast)
//   col_scale [E, N] float32 b's dequantization scale per output channel of each expert (per-tensor or
//                            per-expert scales broadcast)
// -> d [M, N] bf16       d[r, n] = (a[r] @ b[e]^T)[n] * row_scale[r] * col_scale[e, n], accumulated by the
//                        tensor cores over the whole K ("fast accumulation": no periodic promotion into a
//                        second float32 register accumulator, which does not fit at 128x256; see
//                        grouped_gemm_traits.cuh); rows outside as above
//    workspace [W] uint8 as above (two more pointer arrays: the groups' scale vectors)
//
// Batched format (both targets; a's rank says which): activations already grouped per expert, as after an
// all-to-all dispatch, capacity C rows per expert:
//   a [E, C, K]          expert e's rows are a[e, :counts[e]]; the rows past them are never read
//   counts [E] int32     in place of offsets: rows used per expert, clamped to [0, C] on device
//   row_scale [E, C]     (fp8) in place of [M]
// -> d [E, C, N]         d[e, r] as above for r < counts[e], zeros for the rest
// The same kernels and instantiations serve both formats: only the per-group rows differ
// (GroupRows in grouped_gemm_impl.cuh), so the format costs no compile time.
//
// The backward pass's targets (bf16 only, standard format only; handlers in grouped_gemm_grad.cu):
//
// jax_moe_cutlass_grouped_gemm_dgrad (input gradient: the stored weights read the other way round):
//   a [M, K] bf16, b [E, K, N] bf16 (N contiguous: a forward's weights [E, N_fwd, K_fwd] as stored),
//   offsets as above -> d [M, N] bf16, d[r] = a[r] @ b[e] for the rows r of expert e; rows outside zero.
//
// jax_moe_cutlass_grouped_gemm_wgrad (weight gradient: a reduction over each expert's own rows):
//   a [M, P] bf16 (u), b [M, Q] bf16 (v), offsets [E+1] as above
// -> d [E, P, Q] bf16    d[e] = u[rows of e]^T @ v[rows of e] (float32 accumulation; the GEMM's K is the
//                        expert's row count, "ragged K"); an expert with no rows gets zeros
//
// jax_moe_cutlass_grouped_gemm_act (GEMM1 with the gated activation in its epilogue; ffi/cutlass/gated_epilogue.cuh):
//   a [M, K], b [E, N, K] with N = 2I whose rows alternate gate and up (row 2i gate i, 2i+1 up i),
//   offsets [E+1] as above, and
//   row_scale, col_scale  FP8 a and b: the compact scales below; [0] for bf16
//   bias [E, N] float32   each expert's GEMM1 bias in b's row order, or [0]: none
//   out_scale [1] float32 FP8 a and b: d's static quantization scale; [0] for bf16
// -> d [M, I]            h = a[r] @ b[e]^T (times the scales, plus the bias, in float32), then
//                        d[r, i] = act(h[2i], h[2i+1]) (silu(g) * u, gelu(g) * u, or swigluoai), bf16
//                        for bf16 a and b, float8_e4m3fn = clip(v / out_scale) for FP8; rows outside
//                        [offsets[0], offsets[E]) zero. N a multiple of 16 (32 for FP8: 16-byte rows of d).
//    workspace [W] uint8 as above
//   attrs tile, activation (kAct* of ffi/kernels/moe_prepare_finalize.h), alpha, limit (swigluoai's),
//   transposed (0: b [E, N, K] as above; 1: bf16 only, b [E, K, N], N contiguous, the same columns:
//   the transposed load-time layout, whose weight stream is faster on the H100).
//   The batched format as above (a [E, C, K], counts [E], row_scale [E, C], d [E, C, I]).
//
// jax_moe_cutlass_grouped_gemm_scatter (GEMM2 with the weighted un-permute in its epilogue;
// ffi/cutlass/scatter_epilogue.cuh): the forward's last GEMM adds each row, times its routing weight,
// straight into its token's output row, so the [M, N] rows are never written nor read back:
//   a [M, K], b [E, K, N] bf16 (N contiguous, transposed=1; kGemmBf16KNScatter), [E, N, K] bf16
//   (K contiguous; kGemmBf16Scatter) or [E, N, K] float8_e4m3fn (kGemmFp8Scatter), offsets [E+1] as
//   above, and
//   slots [M] int32       each row's top-k slot s = t * k + j (sort_by_expert's sorted_slots): the row
//                         goes to output row t = s / k with weight weights[t, j]; s outside [0, T * k):
//                         the row is dropped
//   weights [T, k] float32  the routing weights (T = d's rows)
//   row_scale, col_scale  FP8 a and b: the compact scales below; [0] for bf16
//   bias [E, N] float32   each expert's GEMM2 bias, or [0]: none
// -> d [T, N] bf16       d[t] = sum over the rows r with slots[r] / k = t of
//                        weights[slots[r]] * (a[r] @ b[e]^T (times the scales) + bias[e]), computed in float32
//                        per row, rounded to bf16, and added into d with 16-byte bf16 atomics (each add
//                        rounds to bf16; the order of the adds, and so the last bits, may differ run to
//                        run). d is zeroed first (by the setup launch); a token no row reaches stays 0.
//    workspace [W] uint8 as above (one more array: each group's first row)
//   attrs tile, transposed (1: bf16 b [E, K, N]; 0: b [E, N, K]). Standard format only. N a multiple of
//   8 (16-byte rows of d).
//
// The compact scales (the act and scatter targets' FP8 kinds): each scale in the form it has, so that no
// broadcast runs before the GEMM:
//   row_scale [M] float32 (per row; [E, C] batched) or [1] (one for every row: per tensor)
//   col_scale [E, N] float32 (per output channel), [E, 1] (per expert) or [1, 1] (per tensor)
// and the scale of d[r, n] is row_scale[r or 0] * col_scale[e or 0, n or 0]. An expert's one column
// scale is folded into its rows' factors, so those epilogues load no column scales. The fp8 target's
// epilogue visitor tree reads whole vectors: it takes [M] (or [E, C]) and [E, N] only.
//
// attr tile: a CutlassTile below. E >= 1. K must be a multiple of CutlassAlignK(kind) (16-byte TMA rows of
// a and b), N a multiple of kCutlassAlignN (16-byte bf16 rows of d). Offsets are clamped to [0, M] on
// device, so no value of them makes the kernel touch memory outside the buffers; a decreasing pair
// gives that expert zero rows.
#pragma once

#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/api.h"

namespace jax_moe {

// Tile configurations (one CUTLASS instantiation per kind and tile; keep this list short: compile time).
// bf16 uses a K tile of 64, fp8 a K tile of 128 (the same 128 bytes per smem row), except where noted.
enum CutlassTile : int {
  kTileCoop128x128 = 0,     // 128x128 (x64 bf16, x128 fp8), cooperative (2 consumer warpgroups): prefill
  kTilePingpong64x128 = 1,  // 64x128 (x64 bf16, x128 fp8), pingpong: decode (few rows per expert)
  kTileCoop128x256 = 2,     // 128x256, cooperative, 2x1 cluster: large prefill and training batches
  kTilePingpong64x256 = 3,  // 64x256, pingpong: weight streaming with half the tiles of 64x128
  kTilePingpong64x128K2 = 4,  // 64x128, pingpong, a K tile of 256 bytes (128 bf16, 256 fp8): longer row reads
  kTileCoop128x256C1 = 5,  // 128x256, cooperative, no cluster: M tiles not rounded up to pairs per expert
  kTileCoop192x256 = 6,  // 192x256, cooperative, the warpgroups on column halves, multiplying only the
                         // 64-row blocks with rows; act kinds only, the others run kTileCoop128x256C1
  kTilePingpong192x128 = 7,  // 192x128, pingpong, multiplying only the 64-row blocks with rows; scatter
                             // kinds only, the others run kTileCoop128x256C1
  kNumCutlassTiles = 8,
};

// Operand types: one FFI target each.
enum CutlassGemmKind : int {
  kGemmBf16 = 0,       // bf16 x bf16 -> bf16
  kGemmFp8 = 1,        // e4m3 x e4m3 -> bf16, row and column scales in the epilogue
  kGemmBf16Dgrad = 2,  // bf16: d = a @ b[e], b's N contiguous
  kGemmBf16Wgrad = 3,  // bf16: d[e] = a[rows]^T @ b[rows], ragged K
  kGemmBf16Act = 4,    // bf16 x bf16 -> bf16 act(gate) * up of interleaved gate/up columns (gated_epilogue.cuh)
  kGemmFp8Act = 5,     // e4m3 x e4m3 -> e4m3 act(gate) * up, scales and a static output scale in the epilogue
  kGemmBf16ActKN = 6,  // kGemmBf16Act on b [E, K, N] (N contiguous: the transposed load-time layout)
  kGemmBf16KNScatter = 7,  // bf16, b [E, K, N]: weighted rows added into d[slot / k] (scatter_epilogue.cuh)
  kGemmFp8Scatter = 8,     // e4m3 x e4m3, the scales, then the weighted rows added into d[slot / k]
  kGemmBf16Scatter = 9,    // kGemmBf16KNScatter on b [E, N, K] (K contiguous: the weights as stored)
  kNumCutlassGemmKinds = 10,
};

constexpr bool IsFp8Kind(int kind) { return kind == kGemmFp8 || kind == kGemmFp8Act || kind == kGemmFp8Scatter; }
constexpr bool IsActKind(int kind) { return kind == kGemmBf16Act || kind == kGemmFp8Act || kind == kGemmBf16ActKN; }
constexpr bool IsScatterKind(int kind) {
  return kind == kGemmBf16KNScatter || kind == kGemmFp8Scatter || kind == kGemmBf16Scatter;
}
// b [E, K, N] (N contiguous) rather than [E, N, K]: the dgrad kind, and the act and scatter kinds on
// transposed weights.
constexpr bool IsNContiguousB(int kind) {
  return kind == kGemmBf16Dgrad || kind == kGemmBf16ActKN || kind == kGemmBf16KNScatter;
}

constexpr int kCutlassAlignN = 8;      // bf16 elements per 16 bytes: N (d's rows) must be a multiple of it
constexpr int kCutlassAlignKBf16 = 8;  // K of bf16 a and b: 16-byte rows
constexpr int kCutlassAlignKFp8 = 16;  // K of fp8 a and b: 16-byte rows
constexpr int CutlassAlignK(int kind) { return IsFp8Kind(kind) ? kCutlassAlignKFp8 : kCutlassAlignKBf16; }

// Bytes of the workspace result for E groups with this kind and tile on a device with sm_count SMs
// (0 when the kind or tile is unknown). Host only; no CUDA call.
size_t CutlassGroupedGemmWorkspaceBytes(int64_t num_groups, int tile, int sm_count, int kind);

// SMs of the current CUDA device (cached per device), 0 if it cannot be read.
int CutlassCurrentSmCount();

}  // namespace jax_moe

extern "C" XLA_FFI_Error* JaxMoeCutlassGroupedGemm(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeCutlassGroupedGemmFp8(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeCutlassGroupedGemmDgrad(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeCutlassGroupedGemmWgrad(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeCutlassGroupedGemmAct(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeCutlassGroupedGemmScatter(XLA_FFI_CallFrame* call_frame);
