// The weighted un-permute as GEMM2's epilogue (the scatter kinds of grouped_gemm.h): each accumulator
// row, times its routing weight, is added straight into its token's row of the output, so GEMM2's
// [M, N] rows are never written and the separate un-permute kernel never reads them back.
//
// Per row m of a group (global row lo + m), whose top-k slot is s = slots[lo + m] (token t = s / k,
// its j-th expert): w = weights[s]; per column n,
//   v = (acc[m, n] (FP8: * col_scale[e, n] * row_scale[lo + m]) + bias[e, n]) * w
// in float32, rounded to bf16, then d[t, n] += v with the L2's bf16 atomics. In the SM90 tensor
// cores' accumulator layout (wgmma, m64nNk16) a thread holds columns 2q and 2q+1 (q = lane % 4) of
// every 8-column group of its rows; the four lanes of a quad transpose four groups' packed pairs so
// that each lane holds one group's 8 consecutive columns, and adds them with one 16-byte
// `red.global.add.noftz.v4.bf16x2`.
//
// A tile's rows (token, weight and, FP8, weight times row scale) are read ahead by the kernel's
// epilogue producer warp while the consumers run the tile's mainloop: a chain of three dependent
// loads per row (the group's first row, the row's slot, the slot's weight) that the consumers would
// otherwise wait on after it. They pass through shared memory, kRowStages tiles deep, on a
// PipelineAsync (ScatterRowsAdapter below, in place of CUTLASS's
// cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter).
//
// The adds of a token's k rows come from different CTAs in no fixed order, and each rounds to bf16:
// the sum is not bit-reproducible run to run, and carries up to k roundings where the un-permute
// kernel's float32 sum carries one. A row whose slot is outside [0, T * k) adds nothing.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "no_smem_epilogue.cuh"

namespace jax_moe::cutlass_gg {

// One row of a tile as the epilogue needs it, read ahead (16 bytes: one shared-memory load).
struct ScatterRow {
  int32_t token;  // t = slot / k, or -1: the row adds nothing
  float weight;   // its routing weight (0 where dropped)
  float factor;   // the weight, FP8: times the row's dequantization scale
  int32_t unused;
};

// kScaled: FP8 operands, the row and column dequantization scales applied to the accumulator first.
// kTileM: the tile's rows.
template <bool kScaled, int kTileM>
class ScatterAddEpilogue : public NoSmemEpilogueBase<cutlass::bfloat16_t> {
 public:
  static constexpr int kRowStages = 2;  // tiles of rows read ahead
  struct RowStorage {
    alignas(16) ScatterRow rows[kRowStages][kTileM];
  };
  struct Arguments {
    ElementD** ptr_D = nullptr;             // per group: d [T, N] itself (every group adds into all of it)
    StrideD dD = nullptr;                   // per group: d's leading dimension (N)
    const int64_t* row_lo = nullptr;        // per group: its first row (the slots' index)
    const int32_t* slots = nullptr;         // [M] each row's top-k slot t * k + j, or outside [0, T * k): dropped
    const float* weights = nullptr;         // [T * k] the routing weight of each slot
    int64_t k = 1;                          // slots per token
    const float** ptr_row_scale = nullptr;  // FP8 per group: its rows' scales
    const float** ptr_col_scale = nullptr;  // FP8 per group: its expert's [N] column scales
    int row_scale_step = 1;                 // FP8: 0 where a group's row pointer is one scale for all rows
    bool per_channel_cols = true;           // FP8: a scale per column; false: the expert's one scale, folded into the rows
    const float* bias = nullptr;            // [E, N] float32 GEMM2 bias, or nullptr
    const int32_t* group_expert = nullptr;  // per group: its expert, bias's row (with a bias)
    int64_t num_tokens = 0;                 // T: d's rows
  };
  using Params = Arguments;

  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.ptr_D != nullptr && args.row_lo != nullptr && args.slots != nullptr && args.weights != nullptr &&
           args.k >= 1 && (args.bias == nullptr || args.group_expert != nullptr) &&
           (!kScaled || (args.ptr_row_scale != nullptr && args.ptr_col_scale != nullptr));
  }

  CUTLASS_HOST_DEVICE explicit ScatterAddEpilogue(Params const& params) : params_(params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char* smem) {
    using namespace cute;
    constexpr int kGroups = WgmmaColumnGroups<FrgLayout>();
    static_assert(kGroups % 4 == 0, "a quad adds four 8-column groups at a time");
    static_assert(int(size<0>(BlockShapeMNK{})) == kTileM, "the rows read ahead are the tile's");

    // The tile's columns (d, scales, bias) are read here; its rows come read ahead, in rows (FillRows).
    const auto op = ReadTileOperands<__nv_bfloat16, kScaled>(params_, problem_shape_mnkl, blk_shape_mnk,
                                                             blk_coord_mnkl, tiled_mma, thread_idx);
    // A body per case, so that a layer without a bias (most) carries neither its loads nor its
    // registers, and an expert with one scale (folded into the rows' factors by FillRows) no column loads.
    const ScatterRow* rows = reinterpret_cast<const ScatterRow*>(smem);
    const int m0 = TileFirstRow(blk_coord_mnkl);
    const bool cols = kScaled && params_.per_channel_cols;
    if (op.bias == nullptr) {
      if (cols) AddRows<false, kScaled>(acc, op.tc, rows, m0, op.n_size, op.d, op.ld, op.col_scale, nullptr);
      else AddRows<false, false>(acc, op.tc, rows, m0, op.n_size, op.d, op.ld, op.col_scale, nullptr);
    } else {
      if (cols) AddRows<true, kScaled>(acc, op.tc, rows, m0, op.n_size, op.d, op.ld, op.col_scale, op.bias);
      else AddRows<true, false>(acc, op.tc, rows, m0, op.n_size, op.d, op.ld, op.col_scale, op.bias);
    }
  }

  // The first row, within its group, of the tile at coord (m, n, k, group).
  template <class TileCoordMNKL>
  static CUTLASS_DEVICE int TileFirstRow(TileCoordMNKL const& coord) {
    return static_cast<int>(cute::get<0>(coord)) * kTileM;
  }

  // Run by the epilogue producer warp (lane 0 .. 31) for the tile of group l whose first row is m0:
  // rows[i] for its kTileM rows m0 + i (token -1 past the group's m_size rows).
  CUTLASS_DEVICE void FillRows(ScatterRow* rows, int l, int m0, int m_size, int lane) const {
    const int64_t lo = params_.row_lo[l];
    const int32_t* slots = params_.slots + lo;
    const float* row_scale = nullptr;
    float expert_scale = 1.0f;  // the expert's one column scale, where it has one (per_channel_cols false)
    if constexpr (kScaled) {
      row_scale = params_.ptr_row_scale[l];
      if (!params_.per_channel_cols) expert_scale = __ldg(params_.ptr_col_scale[l]);
    }
    const int64_t num_slots = params_.num_tokens * params_.k, k = params_.k;
    for (int i = lane; i < kTileM; i += cutlass::NumThreadsPerWarp) {
      const int m = m0 + i;
      const int64_t s = m < m_size ? int64_t(__ldg(slots + m)) : -1;
      const bool in = s >= 0 && s < num_slots;
      const float w = in ? __ldg(params_.weights + s) : 0.0f;
      float f = w;
      if constexpr (kScaled) f *= in ? __ldg(row_scale + m * params_.row_scale_step) * expert_scale : 0.0f;
      rows[i] = ScatterRow{in ? static_cast<int32_t>(s / k) : -1, w, f, 0};
    }
  }

 private:
  // The tile's weighted rows added into d (the file's comment): kBias, whether bias is there; rows, the
  // tile's rows read ahead (FillRows), its first row m0.
  template <bool kBias, bool kCols, class FrgEngine, class FrgLayout, class Coords>
  CUTLASS_DEVICE void AddRows(cute::Tensor<FrgEngine, FrgLayout> const& acc, Coords const& tc,
                              const ScatterRow* rows, int m0, int n_size, __nv_bfloat16* d, int64_t ld,
                              const float* col_scale, const float* bias) const {
    using namespace cute;
    constexpr int kGroups = WgmmaColumnGroups<FrgLayout>();
    const int q = static_cast<int>(threadIdx.x & 3);

    CUTLASS_PRAGMA_UNROLL
    for (int mi = 0; mi < size<1>(acc); ++mi) {
      CUTLASS_PRAGMA_UNROLL
      for (int ni = 0; ni < size<2>(acc); ++ni) {
        // The thread's two rows (one per half): their output row (-1: none), weight and factor.
        int64_t t[2];
        float rw[2], rf[2];
        CUTLASS_PRAGMA_UNROLL
        for (int half = 0; half < 2; ++half) {
          const ScatterRow row = rows[get<0>(tc(make_coord(make_coord(0, half, 0), mi, ni))) - m0];
          t[half] = row.token;
          rw[half] = row.weight;
          rf[half] = row.factor;
        }
        CUTLASS_PRAGMA_UNROLL
        for (int g0 = 0; g0 < kGroups; g0 += 4) {
          float2 cs[4], bs[4];  // this lane's column pair in groups g0 .. g0 + 3: scales, bias
          LoadColumnPairs<4, kCols>(tc, mi, ni, g0, n_size, col_scale, kBias ? bias : nullptr, cs, bs);
          CUTLASS_PRAGMA_UNROLL
          for (int half = 0; half < 2; ++half) {
            uint32_t w[4];  // w[j]: this lane's pair of group g0 + j, weighted, packed to bf16x2
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < 4; ++j) {
              // (acc (* col scale * row scale) + bias) * w, as acc * (col scale) * factor + bias * w
              float v0 = acc(make_coord(make_coord(0, half, g0 + j), mi, ni));
              float v1 = acc(make_coord(make_coord(1, half, g0 + j), mi, ni));
              if constexpr (kCols) v0 *= cs[j].x, v1 *= cs[j].y;
              v0 *= rf[half], v1 *= rf[half];
              if constexpr (kBias) v0 += bs[j].x * rw[half], v1 += bs[j].y * rw[half];
              w[j] = Pack(v0, v1);
            }
            uint32_t r[4];  // after the transpose: the four lanes' pairs of group g0 + q, columns in order
            QuadTranspose(w, q, r);
            // Every lane runs the shuffles above; only the ones with a row and columns in bounds add.
            const int n = get<1>(tc(make_coord(make_coord(0, half, g0 + q), mi, ni))) - 2 * q;
            if (t[half] >= 0 && n < n_size) RedAddBf16x8(d + t[half] * ld + n, r);
          }
        }
      }
    }
  }

  // The quad's 4x4 transpose of 32-bit words: lane q holds M[q][0..3] (its pair of groups g0 .. g0 + 3)
  // and ends with M[0..3][q] (group g0 + q's pairs, columns 0-1, 2-3, 4-5, 6-7). With lane q ^ 2 it
  // swaps the half of its row it does not end in, with lane q ^ 1 the column it does not end in.
  static CUTLASS_DEVICE void QuadTranspose(const uint32_t (&w)[4], int q, uint32_t (&r)[4]) {
    const bool right = (q & 2) != 0;  // lane q ends in columns 2..3 of the 4
    const uint32_t keep0 = right ? w[2] : w[0], keep1 = right ? w[3] : w[1];
    const uint32_t recv0 = __shfl_xor_sync(0xffffffffu, right ? w[0] : w[2], 2);
    const uint32_t recv1 = __shfl_xor_sync(0xffffffffu, right ? w[1] : w[3], 2);
    // keep_c = M[q][c0 + c], recv_c = M[q ^ 2][c0 + c] for c0 = q & 2
    const bool odd = (q & 1) != 0;
    const uint32_t own_a = odd ? keep1 : keep0;  // M[q][q]
    const uint32_t own_b = odd ? recv1 : recv0;  // M[q ^ 2][q]
    const uint32_t got_a = __shfl_xor_sync(0xffffffffu, odd ? keep0 : keep1, 1);  // M[q ^ 1][q]
    const uint32_t got_b = __shfl_xor_sync(0xffffffffu, odd ? recv0 : recv1, 1);  // M[q ^ 3][q]
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 4; ++i) {
      const int x = i ^ q;  // row i is M[q ^ x]: x 0 own_a, 1 got_a, 2 own_b, 3 got_b
      const uint32_t lo = (x & 1) ? got_a : own_a, hi = (x & 1) ? got_b : own_b;
      r[i] = (x & 2) ? hi : lo;
    }
  }

  static CUTLASS_DEVICE uint32_t Pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }

  // dst[0..7] += the eight bf16 of r, in one 16-byte reduction (dst 16-byte aligned: N % 8 == 0).
  static CUTLASS_DEVICE void RedAddBf16x8(__nv_bfloat16* dst, const uint32_t (&r)[4]) {
    asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(r[0]), "r"(r[1]),
                 "r"(r[2]), "r"(r[3])
                 : "memory");
  }

  Params params_;
};

// CUTLASS's no-shared-memory adapter around ScatterAddEpilogue, with the tile's rows read ahead:
// - the kernel's epilogue producer warp (is_producer_load_needed) runs load per tile: it waits for a
//   free stage of the rows pipeline, fills it (FillRows) and commits it;
// - the consumers' store waits for that stage, runs the epilogue on it and releases it;
// - one stage per tile (get_load_pipe_increment, as the base), so the pingpong kernel's skipping of
//   the other warpgroup's tiles keeps the two sides in step.
// Its shared memory, the stages of rows, is carved out of the mainloop's (grouped_gemm_impl.cuh sizes
// the carve-out by SharedStorage).
template <class Op>
class ScatterRowsAdapter : public cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Op> {
  using Base = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Op>;

 public:
  using LoadPipeline = cutlass::PipelineAsync<Op::kRowStages>;
  using LoadPipelineState = cutlass::PipelineState<Op::kRowStages>;
  using TensorStorage = typename Op::RowStorage;
  using PipelineStorage = typename LoadPipeline::SharedStorage;
  struct SharedStorage {  // what the epilogue takes of the kernel's shared memory (the carve-out)
    TensorStorage rows;
    PipelineStorage pipeline;
  };
  using StorePipeline = typename Base::StorePipeline;
  using StorePipelineState = typename Base::StorePipelineState;

  using Base::Base;
  CUTLASS_HOST_DEVICE ScatterRowsAdapter(typename Op::Params const& params, TensorStorage&) : Base(params) {}

  CUTLASS_DEVICE bool is_producer_load_needed() const { return true; }

  // The epilogue producer warp, per tile: the tile's rows into the next stage.
  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class TiledMma, class TensorMapC>
  CUTLASS_DEVICE auto load(LoadPipeline load_pipeline, LoadPipelineState state, ProblemShapeMNKL problem_shape_mnkl,
                           TileShapeMNK, TileCoordMNKL tile_coord_mnkl, TiledMma, int thread_idx,
                           TensorStorage& storage, TensorMapC const&, int = -1, bool = false) {
    using namespace cute;
    load_pipeline.producer_acquire(state);
    this->FillRows(storage.rows[state.index()], static_cast<int>(get<3>(tile_coord_mnkl)),
                   Op::TileFirstRow(tile_coord_mnkl), static_cast<int>(get<0>(problem_shape_mnkl)), thread_idx);
    load_pipeline.producer_commit(state);  // each lane arrives after its own stores (release)
    ++state;
    return state;
  }

  // The producer warp, after its last tile: every stage consumed before it leaves.
  CUTLASS_DEVICE auto load_tail(LoadPipeline load_pipeline, LoadPipelineState state) {
    load_pipeline.producer_tail(state);
    return state;
  }

  // The consumers, per tile: the epilogue on the stage the producer filled for this tile.
  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma, class TensorMapD>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadPipelineState load_state, StorePipeline,
                            StorePipelineState store_state, ProblemShapeMNKL problem_shape_mnkl,
                            TileShapeMNK tile_shape_mnk, TileCoordMNKL tile_coord_mnkl,
                            cute::Tensor<AccEngine, AccLayout> accumulators, TiledMma tiled_mma, int thread_idx,
                            TensorStorage& storage, TensorMapD const&, int = -1) {
    load_pipeline.consumer_wait(load_state);
    (*this)(problem_shape_mnkl, tile_shape_mnk, tile_coord_mnkl, accumulators, tiled_mma, cute::Int<0>{},
            thread_idx, reinterpret_cast<char*>(storage.rows[load_state.index()]));
    load_pipeline.consumer_release(load_state);
    ++load_state;
    return cute::make_tuple(load_state, store_state);
  }

  CUTLASS_DEVICE auto store_tail(LoadPipeline, LoadPipelineState load_state, StorePipeline,
                                 StorePipelineState store_state) {
    return cute::make_tuple(load_state, store_state);
  }
};

}  // namespace jax_moe::cutlass_gg
