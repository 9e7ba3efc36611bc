// jax_moe's own SM90 grouped GEMM (CUTLASS 3.x pointer-array kernel), the XLA FFI target
// jax_moe_cutlass_grouped_gemm (jax_moe/backends/cutlass.py holds its shape rule and jnp reference):
//
//   a [M, K] bf16        expert-sorted activation rows; expert e owns rows [offsets[e], offsets[e+1])
//   b [E, N, K] bf16     expert weights, K contiguous (vLLM's w13 [E, 2I, H] and w2 [E, H, I] as they are)
//   offsets [E+1] int32  nondecreasing row offsets on device (sort_by_expert's offsets)
// -> d [M, N] bf16       d[r] = a[r] @ b[e]^T for the rows r of expert e (float32 accumulation); rows
//                        outside [offsets[0], offsets[E]) are written as zeros
//    workspace [W] uint8 scratch (its contents are meaningless): the per-group problem shapes, pointers
//                        and strides, built on device from offsets (no host sync), then CUTLASS's own
//                        workspace (TMA descriptors per SM). W = WorkspaceBytes(E, tile, sm_count).
// attr tile: a CutlassTile below. K and N must be multiples of 8 (16-byte TMA rows); E >= 1.
// Offsets are clamped to [0, M] on device, so no value of them makes the kernel touch memory outside
// the buffers; a decreasing pair gives that expert zero rows.
#pragma once

#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/api.h"

namespace jax_moe {

// Tile configurations (one CUTLASS instantiation each; keep this list short: compile time).
enum CutlassTile : int {
  kTileCoop128x128 = 0,     // 128x128x64, cooperative (2 consumer warpgroups), cluster 1x1x1: prefill
  kTilePingpong64x128 = 1,  // 64x128x64, pingpong, cluster 1x1x1: decode (few rows per expert)
  kNumCutlassTiles = 2,
};

constexpr int kCutlassAlign = 8;  // elements of bf16 per 16 bytes: K and N must be multiples of it

// Bytes of the workspace result for E groups with this tile on a device with sm_count SMs
// (0 when the tile is unknown). Host only; no CUDA call.
size_t CutlassGroupedGemmWorkspaceBytes(int64_t num_groups, int tile, int sm_count);

// SMs of the current CUDA device (cached per device), 0 if it cannot be read.
int CutlassCurrentSmCount();

}  // namespace jax_moe

extern "C" XLA_FFI_Error* JaxMoeCutlassGroupedGemm(XLA_FFI_CallFrame* call_frame);
