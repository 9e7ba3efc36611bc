// What jax_moe's own grouped-GEMM epilogues share (gated_epilogue.cuh, scatter_epilogue.cuh): the
// types and no-op host hooks CUTLASS's pointer-array kernels ask of a collective epilogue that stores
// straight from the accumulators, without a shared-memory staging of its tile, under
// cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter (or, for the scatter epilogue,
// ScatterRowsAdapter, which adds the tile's rows read ahead). An epilogue derives from it and adds its
// Arguments (= Params), can_implement and operator().
#pragma once

#include <cstddef>
#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"

namespace jax_moe::cutlass_gg {

template <class ElementD_>
struct NoSmemEpilogueBase {
  using EpilogueSchedule = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using ElementC = void;
  using ElementD = ElementD_;
  using ElementOutput = ElementD;
  using InternalStrideC = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;
  using InternalStrideD = InternalStrideC;
  using StrideC = InternalStrideC*;
  using StrideD = InternalStrideD*;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  using ThreadEpilogueOp = void;  // named by CUTLASS's device adapter, never used

  struct SharedStorage {};
  using TensorMapStorage = SharedStorage;

  // The arguments are the parameters: no workspace, nothing to set up.
  template <class ProblemShape, class Arguments>
  static constexpr Arguments to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape, class Arguments>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int) {
    return 0;
  }
  template <class ProblemShape, class Arguments>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_DEVICE bool is_source_needed() { return false; }
};

// The 8-column groups of the SM90 tensor cores' accumulator fragment (wgmma, m64nNk16: ((2 columns,
// 2 row halves, groups of 8 columns), MMA_M, MMA_N); a thread holds columns 2q and 2q + 1 of each
// group of its rows, q = lane % 4), checked to be that layout.
template <class FrgLayout>
constexpr int WgmmaColumnGroups() {
  using namespace cute;
  static_assert(rank<0>(FrgLayout{}) == 3 && size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2,
                "the epilogue needs the SM90 wgmma accumulator layout");
  return size<0, 2>(FrgLayout{});
}

// The (m, n) coordinates, within the group's m_size x n_size problem, of each of this thread's
// accumulators of the tile at blk_coord.
template <class BlockShapeMNK, class BlockCoordMNKL, class TiledMma>
CUTLASS_DEVICE auto AccumulatorCoords(int m_size, int n_size, BlockShapeMNK const& blk_shape,
                                      BlockCoordMNKL const& blk_coord, TiledMma const& tiled_mma, int thread_idx) {
  using namespace cute;
  Tensor cd = local_tile(make_identity_tensor(make_shape(m_size, n_size)), take<0, 2>(blk_shape),
                         make_coord(get<0>(blk_coord), get<1>(blk_coord)));
  return tiled_mma.get_thread_slice(thread_idx).partition_C(cd);
}

// What an epilogue reads first for one tile of group l: the group's problem size m_size x n_size, the
// thread's accumulator coordinates tc (AccumulatorCoords), d's first row for the group and its row
// length ld (as the setup kernel wrote them), the group's FP8 scale vectors (kScaled; else nullptr) and
// its bias row (nullptr: none).
template <class Out, class Coords>
struct TileOperands {
  int m_size, n_size, l;
  Coords tc;
  Out* d;
  int64_t ld;
  const float* row_scale;
  const float* col_scale;
  const float* bias;
};

// TileOperands from an epilogue's params (ptr_D, dD, ptr_row_scale, ptr_col_scale: per group; bias
// [E, n_size] or nullptr, group l's row group_expert[l]) and the arguments CUTLASS passes it for a tile.
template <class Out, bool kScaled, class Params, class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL,
          class TiledMma>
CUTLASS_DEVICE auto ReadTileOperands(Params const& p, ProblemShapeMNKL const& problem_shape_mnkl,
                                     BlockShapeMNK const& blk_shape_mnk, BlockCoordMNKL const& blk_coord_mnkl,
                                     TiledMma const& tiled_mma, int thread_idx) {
  using namespace cute;
  const int m_size = static_cast<int>(get<0>(problem_shape_mnkl));
  const int n_size = static_cast<int>(get<1>(problem_shape_mnkl));
  const int l = static_cast<int>(get<3>(blk_coord_mnkl));
  const auto tc = AccumulatorCoords(m_size, n_size, blk_shape_mnk, blk_coord_mnkl, tiled_mma, thread_idx);
  // Braced: the loads in this order (d, its row length, the scales, the bias).
  return TileOperands<Out, decltype(tc)>{m_size,
                                         n_size,
                                         l,
                                         tc,
                                         reinterpret_cast<Out*>(p.ptr_D[l]),
                                         get<0>(p.dD[l]),
                                         kScaled ? p.ptr_row_scale[l] : nullptr,
                                         kScaled ? p.ptr_col_scale[l] : nullptr,
                                         p.bias != nullptr ? p.bias + int64_t(p.group_expert[l]) * n_size : nullptr};
}

// The column dequantization scales (kCols: FP8 with a scale per column) and the bias of this lane's
// column pair in the kN accumulator groups g0 .. g0 + kN - 1 of (mi, ni), loaded together with 8-byte
// loads (a pair's first column is even) ahead of the rows that use them; ones and zeros where there
// are none or the pair is past n_size. tc: the thread's partition of the tile's (m, n) coordinates;
// col_scale and bias: the expert's [N] vectors, or nullptr. Where the expert has one scale for all
// its columns (per_channel_cols false), the epilogues fold it into their row factors instead (kCols false).
template <int kN, bool kCols, class Coords>
CUTLASS_DEVICE void LoadColumnPairs(Coords const& tc, int mi, int ni, int g0, int n_size, const float* col_scale,
                                    const float* bias, float2 (&cs)[kN], float2 (&bs)[kN]) {
  using namespace cute;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kN; ++j) {
    const int n = get<1>(tc(make_coord(make_coord(0, 0, g0 + j), mi, ni)));
    const bool ok = n < n_size;
    cs[j] = make_float2(1.0f, 1.0f);
    if constexpr (kCols) {
      if (ok) cs[j] = __ldg(reinterpret_cast<const float2*>(col_scale + n));
    }
    bs[j] = bias != nullptr && ok ? __ldg(reinterpret_cast<const float2*>(bias + n)) : make_float2(0.0f, 0.0f);
  }
}

}  // namespace jax_moe::cutlass_gg
