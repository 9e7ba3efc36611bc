// The gated activation as a grouped GEMM's epilogue (the act kinds of grouped_gemm.h): GEMM1's
// accumulator tile goes straight to act(gate) * up, so the [M, 2I] pre-activation is never written.
//
// The weights' rows alternate gate and up (gate_up_layout "interleaved": row 2i is gate i, row 2i+1
// up i), so output columns 2i and 2i+1 of a tile are one pair. In the SM90 tensor cores' accumulator
// layout (wgmma, m64nNk16) a thread holds columns 2q and 2q+1 of every 8-column group of its rows
// (q = lane % 4), as the fragment's first two values: every pair lies in one thread's registers.
// Each thread computes act(gate) * up for its pairs in float32 (FP8: the row and column
// dequantization scales first; then the expert's bias, then the activation, then, for an FP8 output,
// the static quantization scale). The column scales and biases of eight groups are loaded together,
// once for both of the thread's rows. The four lanes of a quad (same rows, columns 8g .. 8g+7 of a
// group) then exchange results, eight groups at a time, so that each lane writes the eight
// consecutive outputs of two groups as one 16-byte (bf16) or 8-byte (FP8) store: a quad's store
// covers whole 32-byte sectors. No shared memory: the adapter runs it where the TMA epilogue would
// (cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter).
//
// d [M, N/2] per group: row m of the group, column i = act(acc[m, 2i] ..., acc[m, 2i+1] ...).
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"

#include "../kernels/moe_device.cuh"
#include "no_smem_epilogue.cuh"

namespace jax_moe::cutlass_gg {

// Out: the stored element as the row kernels write it (__nv_bfloat16, or Fp8 with a static scale);
// ElementD: the same bytes in CUTLASS's type (the pointer arrays' type). kScaled: FP8 operands, the
// row and column dequantization scales applied to the accumulator first.
template <class ElementD_, class Out, bool kScaled>
class GatedActEpilogue : public NoSmemEpilogueBase<ElementD_> {
 public:
  using Base = NoSmemEpilogueBase<ElementD_>;
  using typename Base::ElementD;
  using typename Base::StrideD;
  static_assert(sizeof(ElementD) == sizeof(Out), "CUTLASS's and the row kernels' output element differ in size");

  struct Arguments {
    ElementD** ptr_D = nullptr;               // per group: its rows of d [M, N/2]
    StrideD dD = nullptr;                     // per group: d's leading dimension (d_cols = N/2)
    const float** ptr_row_scale = nullptr;    // FP8 per group: its rows' scales
    const float** ptr_col_scale = nullptr;    // FP8 per group: its expert's [N] column scales
    int row_scale_step = 1;                   // FP8: 0 where a group's row pointer is one scale for all rows
    bool per_channel_cols = true;             // FP8: a scale per column; false: the expert's one scale, folded into the rows
    const float* bias = nullptr;              // [E, N] float32 (w13's rows), or nullptr
    const int32_t* group_expert = nullptr;  // per group: its expert, bias's row (with a bias)
    const float* out_scale = nullptr;         // [1] float32, FP8 output only: d = fp8(v / out_scale)
    int activation = kActSilu;                // kAct* (moe_prepare_finalize.h)
    float alpha = 1.702f, limit = 7.0f;       // swigluoai's
  };
  using Params = Arguments;

  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.ptr_D != nullptr && (args.bias == nullptr || args.group_expert != nullptr) &&
           (!kScaled || (args.ptr_row_scale != nullptr && args.ptr_col_scale != nullptr));
  }

  CUTLASS_HOST_DEVICE explicit GatedActEpilogue(Params const& params) : params_(params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    // One uniform branch, then one activation's unrolled code: all three inline per element made
    // the 128x256 tile's epilogue too large for the instruction cache (measured 2x slower).
    // An expert with one scale for all its columns has it folded into the rows' scales: no column loads.
    if (kScaled && params_.per_channel_cols) {
      return StoreAct<kScaled>(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl, acc, tiled_mma, thread_idx);
    }
    return StoreAct<false>(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl, acc, tiled_mma, thread_idx);
  }

 private:
  template <bool kCols, class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma>
  CUTLASS_DEVICE void StoreAct(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                               BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                               TiledMma tiled_mma, int thread_idx) {
    switch (params_.activation) {
      case kActGelu:
        return Store<kActGelu, kCols>(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl, acc, tiled_mma, thread_idx);
      case kActSwigluOai:
        return Store<kActSwigluOai, kCols>(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl, acc, tiled_mma,
                                           thread_idx);
      default:
        return Store<kActSilu, kCols>(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl, acc, tiled_mma, thread_idx);
    }
  }

  template <int kAct, bool kCols, class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma>
  CUTLASS_DEVICE void Store(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                            BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                            TiledMma tiled_mma, int thread_idx) {
    using namespace cute;
    constexpr int kGroups = WgmmaColumnGroups<FrgLayout>();
    static_assert(kGroups % 8 == 0, "a quad stores eight 8-column groups at a time");

    // ld: d's row length, N / 2
    const auto [m_size, n_size, l, tc, d, ld, row_scale, col_scale, bias] =
        ReadTileOperands<Out, kScaled>(params_, problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl, tiled_mma,
                                       thread_idx);
    const float alpha = params_.alpha, limit = params_.limit;
    float inv_out = 1.0f;
    if constexpr (sizeof(Out) == 1) inv_out = 1.0f / *params_.out_scale;
    float expert_scale = 1.0f;  // the expert's one column scale, folded into the rows' (kCols false)
    if constexpr (kScaled && !kCols) expert_scale = __ldg(col_scale);
    const int lane = static_cast<int>(threadIdx.x & 31), q = lane & 3;
    // The transposes' last byte permutes, fixed per lane: QuadTransposeBf16's two, QuadTransposeFp8's one.
    const uint32_t sel_lo = q == 0 ? 0x5410u : q == 1 ? 0x1054u : q == 2 ? 0x7632u : 0x3276u;
    const uint32_t sel_hi = q == 0 ? 0x7632u : q == 1 ? 0x3276u : q == 2 ? 0x5410u : 0x1054u;
    const uint32_t sel_fp8 = q == 0 ? 0x6240u : q == 1 ? 0x3715u : q == 2 ? 0x4062u : 0x1537u;

    constexpr int kBlocksM = size<1>(FrgLayout{}), kBlocksN = size<2>(FrgLayout{});
    // The thread's two rows (one per half) in row block mi, their scales, and whether any lane of the
    // warp has a row there. A warp whose rows in a block are all padding stores nothing there, and
    // skips the block (the whole warp, so that the transposes' shuffles stay among lanes that all run
    // them). With one row block they are found once. With several they are found where each block is
    // used, not kept for all blocks beside the accumulators: kept, they spilled on the 192-row tile.
    struct BlockRows {
      int m[2];
      float rs[2];
      bool any;
    };
    const auto rows_of = [&](int mi) {
      BlockRows r;
      CUTLASS_PRAGMA_UNROLL
      for (int half = 0; half < 2; ++half) {
        r.m[half] = get<0>(tc(make_coord(make_coord(0, half, 0), mi, 0)));
        r.rs[half] = 1.0f;
        if constexpr (kScaled)
          r.rs[half] = r.m[half] < m_size ? __ldg(row_scale + r.m[half] * params_.row_scale_step) * expert_scale
                                          : 0.0f;
      }
      r.any = __any_sync(0xffffffffu, r.m[0] < m_size || r.m[1] < m_size);
      return r;
    };
    BlockRows first_block;
    if constexpr (kBlocksM == 1) first_block = rows_of(0);
    // Column groups outside the row blocks: a lane's column scales and bias are loaded once for all.
    CUTLASS_PRAGMA_UNROLL
    for (int ni = 0; ni < kBlocksN; ++ni) {
      CUTLASS_PRAGMA_UNROLL
      for (int g0 = 0; g0 < kGroups; g0 += 8) {
        float2 cs[8], bs[8];  // this lane's column pair in groups g0 .. g0 + 7: scales, bias
        LoadColumnPairs<8, kCols>(tc, 0, ni, g0, n_size, col_scale, bias, cs, bs);
        CUTLASS_PRAGMA_UNROLL
        for (int mi = 0; mi < kBlocksM; ++mi) {
          BlockRows rows;
          if constexpr (kBlocksM == 1) rows = first_block;
          else rows = rows_of(mi);
          if (!rows.any) continue;
          const int* m = rows.m;
          const float* rs = rows.rs;
          CUTLASS_PRAGMA_UNROLL
          for (int half = 0; half < 2; ++half) {
            // v[j]: this lane's output of group g0 + j (columns 2q, 2q+1 of the group's 8), in the
            // order the two transposes take them: even groups, then odd ones.
            float v[2][4];
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < 8; ++j) {
              float gate = acc(make_coord(make_coord(0, half, g0 + j), mi, ni));
              float up = acc(make_coord(make_coord(1, half, g0 + j), mi, ni));
              if constexpr (kScaled) gate *= cs[j].x * rs[half], up *= cs[j].y * rs[half];
              const float a = FastGatedAct<kAct>(gate + bs[j].x, up + bs[j].y, alpha, limit);
              v[j & 1][j >> 1] = sizeof(Out) == 1 ? ScaleForFp8(a, inv_out) : a;  // FP8: as quantize_fp8_static
            }
            // Lane q ends with the four outputs of group g0 + 2q and of g0 + 2q + 1: eight
            // consecutive outputs (n_size is a multiple of 16, so both groups are in or both out).
            // The transposes shuffle across the warp: every lane runs them, then stores if in bounds.
            const int n = get<1>(tc(make_coord(make_coord(0, half, g0 + 2 * q), mi, ni))) - 2 * q;
            const bool in = m[half] < m_size && n < n_size;
            Out* dst = d + int64_t(m[half]) * ld + n / 2;
            if constexpr (sizeof(Out) == 2) {
              // bf16: 16 bytes per lane, 64 consecutive bytes per quad.
              const uint2 lo = QuadTransposeBf16(v[0], q, sel_lo, sel_hi);
              const uint2 hi = QuadTransposeBf16(v[1], q, sel_lo, sel_hi);
              if (in) *reinterpret_cast<uint4*>(dst) = make_uint4(lo.x, lo.y, hi.x, hi.y);
            } else {
              // FP8: 8 bytes per lane, a whole 32-byte sector per quad.
              const uint2 out = make_uint2(QuadTransposeFp8(v[0], q, sel_fp8), QuadTransposeFp8(v[1], q, sel_fp8));
              if (in) *reinterpret_cast<uint2*>(dst) = out;
            }
          }
        }
      }
    }
  }

  // The quad's 4x4 transpose (M[r][j]: lane r's output of group g0 + j; lane q ends with M[0..3][q], the
  // four consecutive outputs of group g0 + q) on bf16 pairs, as one 8-byte store: lane q packs
  // (M[q][0], M[q][1]) and (M[q][2], M[q][3]); with lane q ^ 2 it swaps the 2x2 block of columns it does
  // not end in; with lane q ^ 1 the column it does not end in; a byte permute orders rows 0..3.
  // The values are rounded to bf16 once, to nearest, as StoreF32 rounds them.
  static CUTLASS_DEVICE uint2 QuadTransposeBf16(const float (&v)[4], int q, uint32_t sel_lo, uint32_t sel_hi) {
    const uint32_t p0 = Pack(v[0], v[1]), p1 = Pack(v[2], v[3]);
    const bool right = (q & 2) != 0;  // lane q ends in columns 2..3
    const uint32_t keep = right ? p1 : p0;  // (M[q][c], M[q][c + 1]), c = q & 2
    const uint32_t got = __shfl_xor_sync(0xffffffffu, right ? p0 : p1, 2);  // (M[q ^ 2][c], M[q ^ 2][c + 1])
    const bool odd = (q & 1) != 0;  // lane q ends in column c + 1
    const uint32_t own = __byte_perm(keep, got, odd ? 0x7632u : 0x5410u);    // (M[q][q], M[q ^ 2][q])
    const uint32_t send = __byte_perm(keep, got, odd ? 0x5410u : 0x7632u);
    const uint32_t recv = __shfl_xor_sync(0xffffffffu, send, 1);             // (M[q ^ 1][q], M[q ^ 3][q])
    return make_uint2(__byte_perm(own, recv, sel_lo), __byte_perm(own, recv, sel_hi));
  }

  static CUTLASS_DEVICE uint32_t Pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }

  // The same transpose on FP8 bytes: lane q packs M[q][0..3] into one word (rounded as StoreF32
  // rounds: saturating, to nearest even); the word of lane q ^ 2 gives the 2x2 block of the columns
  // c, c + 1 (c = q & 2) that lane q ends in; the word so formed of lane q ^ 1 gives the other two rows.
  static CUTLASS_DEVICE uint32_t QuadTransposeFp8(const float (&v)[4], int q, uint32_t sel) {
    const uint32_t p = PackFp8x2(v[0], v[1]) | (PackFp8x2(v[2], v[3]) << 16);
    const uint32_t p2 = __shfl_xor_sync(0xffffffffu, p, 2);                             // M[q ^ 2][0..3]
    const uint32_t w = __byte_perm(p, p2, (q & 2) ? 0x7632u : 0x5410u);  // M[q][c, c+1], M[q ^ 2][c, c+1]
    const uint32_t w1 = __shfl_xor_sync(0xffffffffu, w, 1);        // M[q ^ 1][c, c+1], M[q ^ 3][c, c+1]
    return __byte_perm(w, w1, sel);                                                     // M[0..3][q]
  }

  Params params_;
};

}  // namespace jax_moe::cutlass_gg
