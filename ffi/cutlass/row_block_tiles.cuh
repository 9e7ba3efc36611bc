// A cooperative grouped-GEMM mainloop whose two consumer warpgroups split the tile's columns, not its
// rows, and multiply only the 64-row blocks of the tile that hold rows.
//
// CUTLASS's cooperative 128x256 tile gives warpgroup 0 rows 0-63 and warpgroup 1 rows 64-127. With
// random routing at about 128 rows per expert, half the experts need a second row tile that holds a
// few rows, and the tile multiplies 128 rows for them (GPT-OSS-120B's GEMM1 at T=4096 multiplies 1.51
// times its rows). Two ways of not multiplying that padding were slower: a warpgroup that skips its
// padding leaves the other alone on the tensor pipe, which one warpgroup keeps only half busy; and a
// half tile split by columns finishes early, so the CTA reading the expert's first row tile no longer
// reads the same weight tile at the same time, and the weights cross the DRAM twice.
//
// Here the tile is 192 rows by 256 columns, and warpgroup w owns columns [128 w, 128 w + 128) of all
// three 64-row blocks (a TiledMma of 64x128 WGMMAs laid out 1x2). An expert of up to 192 rows has one
// row tile per column tile, so no two CTAs read the same weight tile. A tile of r rows multiplies its
// first ceil(r / 64) blocks only, the same blocks in both warpgroups, so both stay on the pipe: an
// expert of 140 rows multiplies 192, one of 100 rows 128.
//
// CUTLASS's `mma` is not told the tile. Every tile of one call has the same K, so the consumer counts
// its tiles from its pipeline state (count() / k_tile_count). A CTA's tiles are its first, then one
// every grid's size after it, in the group scheduler's linear order, which the fence plan of
// PrebuiltTensormapMainloop follows too. A cursor over the groups' tile counts, kept across the CTA's
// tiles, gives each tile's group and row tile. The order has no swizzle: the host sets none.
//
// A block not multiplied keeps the accumulators of the CTA's last tile. No epilogue stores them: the
// gated epilogue stores rows below M only.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/gemm.h"
#include "group_tensormaps.cuh"

namespace jax_moe::cutlass_gg {

// The TiledMma of a tile whose two warpgroups split its columns: 64 x kHalfN x kK WGMMAs, laid out 1x2.
template <class Element, int kHalfN, int kK, cute::GMMA::Major kMajorA, cute::GMMA::Major kMajorB>
struct ColumnSplitMma {
  using type = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kHalfN>, cute::Int<kK>>,
                                 kMajorA, kMajorB>(),
      cute::Layout<cute::Shape<cute::_1, cute::_2, cute::_1>>{}));
};

// CUTLASS's collective `Op` with its TiledMma replaced (the builder lays a cooperative tile's
// warpgroups along M).
template <class Op, class NewTiledMma>
struct WithTiledMma;
template <class DP, class TS, class EA, class SA, class EB, class SB, class TM, class GA, class LA, class CA,
          class TA, class GB, class LB, class CB, class TB, class NewTiledMma>
struct WithTiledMma<cutlass::gemm::collective::CollectiveMma<DP, TS, EA, SA, EB, SB, TM, GA, LA, CA, TA, GB, LB, CB, TB>,
                    NewTiledMma> {
  using type =
      cutlass::gemm::collective::CollectiveMma<DP, TS, EA, SA, EB, SB, NewTiledMma, GA, LA, CA, TA, GB, LB, CB, TB>;
};

template <class Base>
struct RowBlockMainloop : PrebuiltTensormapMainloop<Base> {
  using Prebuilt = PrebuiltTensormapMainloop<Base>;
  using TileShape = typename Base::TileShape;
  using TiledMma = typename Base::TiledMma;

  static constexpr int kBlockRows = 64;  // one WGMMA's rows
  static constexpr int kBlocks = cute::size<0>(TileShape{}) / kBlockRows;
  static_assert(kBlocks == 3 && cute::size<0>(TileShape{}) == kBlocks * kBlockRows,
                "three 64-row blocks: the 192-row tile");
  static_assert(cute::size(TiledMma{}) == 2 * cutlass::NumThreadsPerWarpGroup, "two consumer warpgroups");

  // skip: multiply only the blocks with rows (else every block; JAX_MOE_CUTLASS_SKIP_BLOCKS=0, to time
  // the tile without the skip).
  struct Arguments : Prebuilt::Arguments {
    bool skip = true;
  };
  struct Params : Prebuilt::Params {
    bool skip;
  };
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args, void* workspace) {
    return {Prebuilt::to_underlying_arguments(problem_shapes, args, workspace), args.skip};
  }

  // The consumer's cursor over the groups: the group of its last tile, and that group's first linear
  // tile index.
  int32_t cursor_group_ = 0;
  uint64_t cursor_start_ = 0;

  // The rows of its group that the CTA's tile number `tile` (0 for its first) holds: M minus the row
  // tile's first row, at most the tile's rows (0 past the last group).
  CUTLASS_DEVICE int32_t RowsOfTile(Params const& params, uint64_t tile) {
    const auto& order = params.tile_order;
    const uint64_t linear = Prebuilt::FirstTile(order) + tile * Prebuilt::GridTiles();
    uint64_t tiles_m = 0, tiles_n = 0;
    while (cursor_group_ < params.groups) {
      Prebuilt::GroupTiles(order, params.problem_shapes[cursor_group_], tiles_m, tiles_n);
      if (linear < cursor_start_ + tiles_m * tiles_n) break;
      cursor_start_ += tiles_m * tiles_n;
      ++cursor_group_;
    }
    if (cursor_group_ >= params.groups) return 0;
    const uint64_t t = linear - cursor_start_;
    const uint64_t m_tile = order.raster_along_n ? t / tiles_n : t % tiles_m;
    const int64_t rows = int64_t(cute::get<0>(params.problem_shapes[cursor_group_])) - int64_t(m_tile) * order.tile_m;
    return static_cast<int32_t>(rows < 0 ? 0 : (rows > order.tile_m ? order.tile_m : rows));
  }

  template <class FrgTensorC, class MainloopPipeline, class PipelineState, class TensorStorage>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum, int k_tile_count,
                          int thread_idx, TensorStorage& shared_tensors, Params const& params) {
    using namespace cute;
    if (k_tile_count <= 0) return;  // no K: no stage to read (the grouped GEMMs' K is at least one tile)
    int blocks = kBlocks;
    if (params.skip) {
      const int32_t rows = RowsOfTile(params, smem_pipe_read.count() / static_cast<uint32_t>(k_tile_count));
      blocks = (rows + kBlockRows - 1) / kBlockRows;
    }
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), typename Base::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(thread_idx);
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA, 3, MMA_K, PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA, 1, MMA_K, PIPE)
    static_assert(size<1>(decltype(tCrA){}) == kBlocks && size<1>(decltype(tCrB){}) == 1 &&
                      size<1>(FrgTensorC{}) == kBlocks && size<2>(FrgTensorC{}) == 1,
                  "each warpgroup: every 64-row block of its column half");
    // One loop per block count, each waiting for its WGMMAs before the paths join (a WGMMA in flight
    // across a branch makes ptxas serialize them all, warning C7515). A tile of no rows (past the last
    // group) still reads and releases its stages.
    if (blocks >= kBlocks) {
      Multiply<kBlocks>(tiled_mma, tCrA, tCrB, accum, pipeline, smem_pipe_read, k_tile_count);
    } else if (blocks == 2) {
      Multiply<2>(tiled_mma, tCrA, tCrB, accum, pipeline, smem_pipe_read, k_tile_count);
    } else {
      Multiply<1>(tiled_mma, tCrA, tCrB, accum, pipeline, smem_pipe_read, k_tile_count);
    }
  }

  // CUTLASS's consumer pipeline on the first kUsed blocks: the first Base::K_PIPE_MMAS stages read
  // without a release (the kernel's mma_tail gives it), then each stage read releases the one
  // K_PIPE_MMAS behind. Every WGMMA is waited for at the end; mma_tail's own wait then finds none.
  template <int kUsed, class Mma, class FragA, class FragB, class Acc, class MainloopPipeline, class PipelineState>
  CUTLASS_DEVICE static void Multiply(Mma& mma, FragA const& tCrA, FragB const& tCrB, Acc& acc,
                                      MainloopPipeline& pipeline, PipelineState smem_pipe_read, int k_tile_count) {
    using namespace cute;
    auto stage_gemms = [&](int stage) {
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        CUTLASS_PRAGMA_UNROLL
        for (int b = 0; b < kUsed; ++b) cute::gemm(mma, tCrA(_, b, kb, stage), tCrB(_, 0, kb, stage), acc(_, b, 0));
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
    };
    PipelineState smem_pipe_release = smem_pipe_read;
    const int prologue = k_tile_count < Base::K_PIPE_MMAS ? k_tile_count : Base::K_PIPE_MMAS;
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
    warpgroup_fence_operand(acc);
    for (int i = 0; i < prologue; ++i) {
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      warpgroup_arrive();
      stage_gemms(smem_pipe_read.index());
      warpgroup_commit_batch();
      ++smem_pipe_read;
      if (i + 1 < k_tile_count) barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
    }
    warpgroup_fence_operand(acc);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int remaining = k_tile_count - prologue; remaining > 0; --remaining) {
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      stage_gemms(smem_pipe_read.index());
      warpgroup_commit_batch();
      warpgroup_wait<Base::K_PIPE_MMAS>();
      warpgroup_fence_operand(acc);
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_read;
      ++smem_pipe_release;
      if (remaining > 1) barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
  }
};

}  // namespace jax_moe::cutlass_gg
