// A grouped-GEMM mainloop that loads and multiplies only the 64-row blocks of a 192-row tile that hold
// rows, in two forms: a cooperative tile whose two consumer warpgroups split its columns, not its rows
// (GEMM1, the act kinds), and a pingpong tile whose warpgroups each multiply a tile of their own
// (GEMM2, the scatter kinds).
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
// The pingpong form, 192 rows by 128 columns, gives each warpgroup all three blocks of its own tile
// (CUTLASS's TiledMma of one warpgroup's 64x128 WGMMAs, over the blocks): the same 192 accumulators per
// thread as the cooperative form, and one warpgroup's epilogue runs while the other multiplies. GEMM2's
// scatter epilogue, which adds every row into the output through the L2, is long enough for that to
// pay: the cooperative form, whose epilogue runs while neither warpgroup multiplies, was slower there
// than the 64-row pingpong tile, and this form is faster on GPT-OSS-120B's GEMM2 at 96 to 160 rows per
// expert. The producer and the consumers count the tiles as the cooperative form does: the pingpong
// kernel advances each warpgroup's pipeline state past the other's tiles, so count() / k_tile_count
// is still the CTA's tile number.
//
// The producer loads A one 64-row block at a time (each group's A descriptor has a 64-row box, set by
// the setup launch), and only the blocks that hold rows; the stage's barrier is told at once of the
// bytes of the blocks it skips. A tile of at most 128 rows so reads none of the next expert's rows.
// B's loads of an expert of up to 192 rows are marked evict-first in the L2, as in
// PrebuiltTensormapMainloop (HintB).
//
// CUTLASS's `mma` is not told the tile; the producer is: its group by the descriptor update (the kernel's
// tile coordinate carries none), its row tile by that coordinate. It writes each tile's block count into
// a ring in shared memory before the tile's first load, and the consumers read it once that stage is
// full. Every tile of one call has the same K, so both count their tiles from their pipeline state
// (count() / k_tile_count). This holds in any order of tiles, the fixed deal of the group scheduler or
// tiles taken from a counter (dynamic_tile_scheduler.cuh).
//
// A block not multiplied keeps the accumulators of the warpgroup's last tile. No epilogue stores them:
// the gated epilogue stores rows below M only, and the scatter epilogue adds only rows with a token.
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
  // Cooperative: two consumer warpgroups on one tile's column halves; pingpong: one warpgroup per tile.
  static_assert(cute::size(TiledMma{}) == 2 * cutlass::NumThreadsPerWarpGroup ||
                    cute::size(TiledMma{}) == cutlass::NumThreadsPerWarpGroup,
                "two consumer warpgroups on one tile, or one");

  // A is loaded one 64-row block per TMA box (BuildGroupTensormaps gives each group's A descriptor that
  // box), and only the blocks that hold rows: a tile of at most 128 rows reads no out-of-bounds third
  // block. Dimension 1 of A's descriptor is its rows (dimension 0 its K); load() checks it.
  static constexpr int kABoxRows = kBlockRows;
  static constexpr int kABoxDimM = 1;

  // The ring of the block counts of the CTA's tiles, in shared memory: entry t % kTileRing holds
  // BlocksWithRows of the CTA's tile number t, written by the producer before its first load of the
  // tile, read by the consumers once that load's stage is full (the stage barrier's arrive and wait
  // order the two). The producer is at most a pipeline's stages of K tiles ahead of the consumers.
  static constexpr int kTileRing = 16;
  static_assert(Base::DispatchPolicy::Stages < kTileRing, "the producer never laps the ring");
  struct TensorStorage : Base::TensorStorage {
    alignas(16) int32_t tile_blocks[kTileRing];
  };

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

  // The 64-row blocks that a tile of `rows` rows loads and multiplies: its first ceil(rows / 64), and
  // at least one, so that a tile of no rows (past the last group) still reads and releases its stages.
  // The producer and the consumers both count with it, so they agree on every stage's bytes.
  CUTLASS_DEVICE static int BlocksWithRows(int rows) {
    return rows <= kBlockRows ? 1 : rows <= 2 * kBlockRows ? 2 : kBlocks;
  }

  // The producer's loads (CUTLASS's, but A by blocks): for each K tile, B's box and A's first
  // ceil(r / 64) 64-row blocks of the tile's r rows (every block without the skip). The stage's barrier
  // expects the whole stage's bytes; the blocks not loaded are counted off it at once.
  template <class Pipeline, class PipeState, class LoadInputs, class TensorMaps, class BlockCoord, class KTileIterator,
            class TensorStorage>
  CUTLASS_DEVICE void load(Params const& params, Pipeline pipeline, PipeState state, LoadInputs const& load_inputs,
                           TensorMaps const&, BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int, uint32_t, TensorStorage& shared_tensors) {
    using namespace cute;
    if (!elect_one_sync()) return;
    const auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    int blocks = kBlocks;
    if (params.skip) {
      blocks = BlocksWithRows(this->rows_ - int(m_coord) * int(size<0>(TileShape{})));
    }
    if (k_tile_count > 0) shared_tensors.tile_blocks[state.count() / uint32_t(k_tile_count) % kTileRing] = blocks;
    constexpr uint32_t kBlockBytes = kBlockRows * size<2>(TileShape{}) * sizeof(typename Base::ElementA);
    static_assert(Base::TmaTransactionBytes == kBlocks * kBlockBytes + size<1>(TileShape{}) * size<2>(TileShape{}) *
                                                                          sizeof(typename Base::ElementB),
                  "a stage: A's blocks and B's box");
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), typename Base::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
    Tensor gA_mkl = get<0>(load_inputs);  // TMA coordinates of A: (BLK_M, BLK_K, m, k, l)
    Tensor gB = get<1>(load_inputs)(_, _, n_coord, _, l_coord);
    auto block_tma_b = params.tma_load_b.get_slice(0);
    Tensor tBgB = block_tma_b.partition_S(gB);
    Tensor tBsB = block_tma_b.partition_D(sB);
    // A's rows are its descriptor's dimension kABoxDimM (the box edited there): one block down moves
    // that coordinate alone, by 64.
    const auto down = gA_mkl(kBlockRows, 0, 0, 0, 0), origin = gA_mkl(0, 0, 0, 0, 0);
    if (int(get<kABoxDimM>(down)) - int(get<kABoxDimM>(origin)) != kBlockRows) __trap();
    const uint64_t hint_a = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
    const auto hint_b = this->HintB();
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(state);
      auto* barrier = pipeline.producer_get_barrier(state);
      if (blocks < kBlocks) {
        cutlass::arch::ClusterTransactionBarrier::complete_transaction(barrier, block_rank_in_cluster(),
                                                                       (kBlocks - blocks) * kBlockBytes);
      }
      const int stage = state.index();
      const int k = *k_tile_iter;
      copy(params.tma_load_b.with(this->tensormap_b_, *barrier, uint16_t(0), hint_b), tBgB(_, _, _, k),
           tBsB(_, _, _, stage));
      for (int b = 0; b < blocks; ++b) {
        auto* dst = raw_pointer_cast(&sA(b * kBlockRows, 0, stage));
        apply(gA_mkl(b * kBlockRows, 0, m_coord, k, l_coord), [&](auto const&... crd) {
          SM90_TMA_LOAD::copy(this->tensormap_a_, barrier, hint_a, dst, static_cast<int32_t>(crd)...);
        });
      }
      ++k_tile_iter;
      ++state;
    }
  }

  template <class FrgTensorC, class MainloopPipeline, class PipelineState, class TensorStorage>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum, int k_tile_count,
                          int thread_idx, TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    if (k_tile_count <= 0) return;  // no K: no stage to read (the grouped GEMMs' K is at least one tile)
    // The producer's count of the tile's blocks, from the ring, once the tile's first stage is full.
    const uint32_t tile = smem_pipe_read.count() / static_cast<uint32_t>(k_tile_count);
    pipeline.consumer_wait(smem_pipe_read);
    const int blocks = shared_tensors.tile_blocks[tile % kTileRing];
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
    // across a branch makes ptxas serialize them all, warning C7515).
    if (blocks == kBlocks) {
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
