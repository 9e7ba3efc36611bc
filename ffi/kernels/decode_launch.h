// How the decode path's kernels are launched (moe_decode.cu on bf16 weights, moe_decode_fp8.cu on FP8
// ones): their block sizes, and the rules that pick each GEMM's kernel form and grid from the call's
// shape and the GPU's SM count. Plain C++ with no CUDA: the handlers launch what PlanDecode returns,
// and the CPU module exposes it (jax_moe.decode.kernel_launches), so that the rules are specified by
// tests that need no GPU.
#pragma once

#include <cstdint>

namespace jax_moe {
namespace decode {

// ---------------------------------------------------------------- the GEMV kernels (one output per warp)

constexpr int kWarps = 8;  // warps per block of a GEMV kernel: one output element each (at a time)

// ---------------------------------------------------------------- the column kernels (transposed weights)

constexpr int kColWarps = 16;  // warps per block of the column kernels
// Rows per thread in flight (16-byte loads), a column kernel's depth: 4 (32 KB per block, two blocks per
// SM). GEMM2 takes 8 (64 KB per block, 72 registers a thread: one block per SM) where its grid has no more
// blocks than the GPU has SMs and each thread streams at least kDeepMinRows rows (ReduceDepth).
constexpr int kColDepth = 4, kDeepColDepth = 8;
// On an H200 (132 SMs), depth 8 took GEMM2 from 26.0 to 22.7 us at GPT-OSS-120B's T = 1 (90 rows a
// thread), from 65.2 to 57.9 at DeepSeek-V3's (256), and from 17.1 to 18.3 at Qwen3-30B-A3B's T = 2 (48).
constexpr int64_t kDeepMinRows = 64;
// A column kernel takes the widest chunk (8, 4, 2 or 1 vectors of a row: wider reads stream faster) that
// still launches this many blocks (GEMM1 may take 16: ActColumns). On an H100 (132 SMs), for Qwen3-30B,
// GPT-OSS-120B and DeepSeek-V3 at T = 1, 2: 90 blocks reading 128 bytes a row beat 180 reading 64; 64
// blocks lost to 128. Narrower still lost on an H200: Qwen3-30B-A3B's GEMM2 at T = 1 in 256 blocks of
// 16-byte row reads (half a DRAM sector) took 15.7 us against 12.3 in 128 blocks of 32 bytes.
constexpr int kFillBlocks = 66;

// Blocks across the columns for a chunk of `vecs` 16-byte vectors of a row: GEMM1's chunk yields 4 * vecs
// outputs of I (their gate and up columns, 8 * vecs weight columns); GEMM2's 8 * vecs outputs of H.
constexpr int64_t ActColumnBlocks(int64_t i, int vecs) { return (i + 4 * vecs - 1) / (4 * vecs); }
constexpr int64_t ReduceColumnBlocks(int64_t h, int vecs) { return (h + 8 * vecs - 1) / (8 * vecs); }

// A grid: x across the outputs, y over the slots (GEMM1) or the tokens (GEMM2).
struct Grid {
  int64_t x = 0, y = 0;
  int64_t blocks() const { return x * y; }
};

// One kernel launch as the handlers make it.
struct Launch {
  const char* kernel = "";  // the kernel's name, without its template arguments
  int vecs = 0;              // column kernels: 16-byte vectors of a row per block's chunk (a template argument)
  int depth = 0;             // column kernels: rows in flight per thread (ExpertColumnsReduce's template argument)
  int outputs_per_warp = 0;  // GEMV kernels: the outputs each warp computes
  Grid grid;
  int threads = 0;  // per block
};

// The widest chunk of 8, 4, 2, ... down to `narrowest` vectors whose grid, column_blocks(vecs) x rows,
// still has kFillBlocks blocks.
template <typename ColumnBlocks>
int ChunkVecs(ColumnBlocks column_blocks, int64_t rows, int narrowest) {
  int v = 8;
  while (v > narrowest && column_blocks(v) * rows < kFillBlocks) v /= 2;
  return v;
}

// GEMM2's depth for a grid of `blocks` blocks of `vecs`-vector chunks over `rows` rows (I) and k slots, on
// `sms` SMs (0: unknown): a thread streams the rows of one of its team's row groups (BlockColumnDots).
inline int ReduceDepth(int64_t blocks, int vecs, int64_t rows, int64_t k, int sms) {
  const int64_t sets = k < kColWarps ? k : kColWarps, groups = (kColWarps / sets) * (32 / vecs);
  return sms > 0 && blocks <= sms && (rows + groups - 1) / groups >= kDeepMinRows ? kDeepColDepth : kColDepth;
}

// GEMM1 + activation on w13t [E, H, 2I] for `slots` slots: ChunkVecs' chunk (2 vectors at least: the
// concatenated layout splits a chunk into gate and up), or 16 vectors (256 bytes a row) where 8 would
// launch more than one wave of blocks (two per SM) and 16 launches one that still has a block on every
// SM. On an H200 this took GEMM1 from 40.6 to 35.8 us at GPT-OSS-120B's T = 1 (360 blocks to 180) and
// from 31.4 to 26.8 at Qwen3-30B-A3B's T = 2 (384 to 192); DeepSeek-V3's at T = 1 (512 to 256) stayed
// level. Six-vector chunks, for Qwen3-30B-A3B's T = 1 (256 blocks where 8 gives 192), lost: 15.4 -> 17.4 us.
inline Launch ActColumns(int64_t i, int64_t slots, int sms) {
  const auto columns = [&](int v) { return ActColumnBlocks(i, v); };
  int v = ChunkVecs(columns, slots, 2);
  const int64_t blocks8 = columns(8) * slots, blocks16 = columns(16) * slots;
  if (v == 8 && sms > 0 && blocks8 > 2 * sms && blocks16 >= sms && blocks16 <= 2 * sms) v = 16;
  return {"ExpertColumnsAct", v, kColDepth, 0, {columns(v), slots}, 32 * kColWarps};
}

// GEMM2 + weighted reduce on w2t [E, I, H] for `tokens` tokens of k slots.
inline Launch ReduceColumns(int64_t h, int64_t i, int64_t tokens, int64_t k, int sms) {
  const int v = ChunkVecs([&](int w) { return ReduceColumnBlocks(h, w); }, tokens, 1);
  const Grid grid{ReduceColumnBlocks(h, v), tokens};
  return {"ExpertColumnsReduce", v, ReduceDepth(grid.blocks(), v, i, k, sms), 0, grid, 32 * kColWarps};
}

// ---------------------------------------------------------------- the FP8 GEMVs

// The outputs per warp of an FP8 GEMV kernel whose rows (blockIdx.y) each have `groups` groups of kWarps
// outputs: the fewest with which rows * blocks per row fit in one wave of blocks, two per SM
// (__launch_bounds__(32 * kWarps, 2)), where that wave fills at least 90% of the SMs' places; else one.
// A wave that leaves SMs half used was slower than more waves of single outputs (GEMM2 at T = 1:
// GPT-OSS-120B's 180 blocks of 264 places 18%, DeepSeek-V3's 224 4%); 240 and 256 blocks gained
// 8-28%.
inline int OutputsPerWarp(int64_t groups, int64_t rows, int sms) {
  const int64_t places = 2 * int64_t(sms);
  int64_t cols = 1;
  while (cols < groups && rows * ((groups + cols - 1) / cols) > places) ++cols;
  return 10 * rows * ((groups + cols - 1) / cols) >= 9 * places ? static_cast<int>(cols) : 1;
}

// An FP8 GEMV over `outputs` outputs for each of `rows` rows (slots or tokens).
inline Launch Fp8Gemv(const char* kernel, int64_t outputs, int64_t rows, int sms) {
  const int64_t groups = (outputs + kWarps - 1) / kWarps;
  const int cols = OutputsPerWarp(groups, rows, sms);
  return {kernel, 0, 0, cols, {(groups + cols - 1) / cols, rows}, 32 * kWarps};
}

// ---------------------------------------------------------------- a call's two launches

struct DecodePlan {
  Launch gemm1, gemm2;
};

// The two launches of a decode call: t tokens of k slots, hidden size h, intermediate size i; FP8 or bf16
// weights; bf16 ones as stored (K contiguous: one output per warp) or transposed (the column kernels); on
// a GPU of `sms` SMs (0 where unknown: the rules that need it keep their defaults).
inline DecodePlan PlanDecode(int64_t t, int64_t k, int64_t h, int64_t i, bool fp8, bool transposed, int sms) {
  if (fp8) return {Fp8Gemv("ExpertGemvActFp8", i, t * k, sms), Fp8Gemv("ExpertGemvReduceFp8", h, t, sms)};
  if (transposed) return {ActColumns(i, t * k, sms), ReduceColumns(h, i, t, k, sms)};
  const auto gemv = [](const char* kernel, int64_t outputs, int64_t rows) {
    return Launch{kernel, 0, 0, 1, {(outputs + kWarps - 1) / kWarps, rows}, 32 * kWarps};
  };
  return {gemv("ExpertGemvAct", i, t * k), gemv("ExpertGemvReduce", h, t)};
}

}  // namespace decode
}  // namespace jax_moe
