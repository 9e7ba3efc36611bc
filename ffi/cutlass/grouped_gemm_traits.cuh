// What each kind and tile of the grouped GEMMs (grouped_gemm.h) is made of, in CUTLASS's terms: the
// element types, the operand layouts (which operand is K-major), the epilogue's fusion, and the tile
// shapes, clusters and schedules. Included by grouped_gemm_impl.cuh in the TUs that instantiate the
// kernels (JAX_MOE_CUTLASS_IMPL).
#pragma once

#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

#include "gated_epilogue.cuh"
#include "grouped_gemm.h"
#include "scatter_epilogue.cuh"

namespace jax_moe::cutlass_gg {
using namespace cute;

// The epilogue's fusion: what D is made of (every bf16 kind: D = acc).
template <int Kind, class TileShape>
struct Fusion {
  using type = cutlass::epilogue::fusion::LinearCombination<cutlass::bfloat16_t, float, void, float>;
};
template <class TileShape>
struct Fusion<kGemmFp8, TileShape> {  // D = (acc * col_scale[n]) * row_scale[m], both vectors per group
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
  // Alignment 1: a group's row_scale + lo starts at any float, so no vector loads of the broadcast vectors.
  using RowScale = cutlass::epilogue::fusion::Sm90ColBroadcast<  // one value per row m, broadcast along N
      0, TileShape, float*, float, Stride<_1, _0, _0>, 1>;
  using ColScale = cutlass::epilogue::fusion::Sm90RowBroadcast<  // one value per column n, broadcast along M
      0, TileShape, float*, float, Stride<_0, _1, _0>, 1>;
  using AccTimesCol = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>, ColScale,
      cutlass::epilogue::fusion::Sm90AccFetch>;
  using type = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, cutlass::bfloat16_t, float, kRound>, RowScale,
      AccTimesCol>;
};

template <int Kind>
using ElementAB = std::conditional_t<IsFp8Kind(Kind), cutlass::float_e4m3_t, cutlass::bfloat16_t>;
// d's element: bf16, except the FP8 act kind's quantized output.
template <int Kind>
using ElementDOf = std::conditional_t<Kind == kGemmFp8Act, cutlass::float_e4m3_t, cutlass::bfloat16_t>;

// The collective epilogue of a kind: CUTLASS's TMA epilogue with the kind's Fusion, or under the
// no-shared-memory adapter the gated activation (the act kinds, gated_epilogue.cuh) or the weighted
// scatter-add (the scatter kinds, scatter_epilogue.cuh).
enum EpilogueKind : int { kEpiTma = 0, kEpiGatedAct = 1, kEpiScatterAdd = 2 };
constexpr int EpilogueKindOf(int kind) {
  return IsActKind(kind) ? kEpiGatedAct : IsScatterKind(kind) ? kEpiScatterAdd : kEpiTma;
}
// D's alignment in elements for CUTLASS's TMA epilogue: 16 bytes.
inline constexpr int kEpilogueAlignD = 128 / cutlass::sizeof_bits<cutlass::bfloat16_t>::value;
template <int Kind, class TileShape, class ClusterShape, class EpilogueSchedule, int kEpi = EpilogueKindOf(Kind)>
struct EpilogueOf {
  static constexpr int kAlignD = kEpilogueAlignD;
  using type = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor*, kAlignD,                 // no C operand
      cutlass::bfloat16_t, cutlass::layout::RowMajor*, kAlignD,  // D [M_e, N]
      EpilogueSchedule, typename Fusion<Kind, TileShape>::type>::CollectiveOp;
};
template <int Kind, class TileShape, class ClusterShape, class EpilogueSchedule>
struct EpilogueOf<Kind, TileShape, ClusterShape, EpilogueSchedule, kEpiGatedAct> {
  using Out = std::conditional_t<Kind == kGemmFp8Act, Fp8, __nv_bfloat16>;
  using type = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
      GatedActEpilogue<ElementDOf<Kind>, Out, IsFp8Kind(Kind)>>;
};
template <int Kind, class TileShape, class ClusterShape, class EpilogueSchedule>
struct EpilogueOf<Kind, TileShape, ClusterShape, EpilogueSchedule, kEpiScatterAdd> {
  using type = ScatterRowsAdapter<ScatterAddEpilogue<IsFp8Kind(Kind), int(cute::size<0>(TileShape{}))>>;
};

// A and B in CUTLASS's terms (A is M x K, B is K x N; RowMajor A and ColumnMajor B are K-major).
template <int Kind>
struct OperandLayouts {  // forward (bf16, fp8): A = rows [M_e, K], B = weights [N, K]
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
};
template <>
struct OperandLayouts<kGemmBf16Dgrad> {  // A = rows [M_e, K], B = weights [K, N] (N contiguous)
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
};
template <>
struct OperandLayouts<kGemmBf16ActKN> : OperandLayouts<kGemmBf16Dgrad> {};  // the act kind on [E, K, N] weights
template <>
struct OperandLayouts<kGemmBf16KNScatter> : OperandLayouts<kGemmBf16Dgrad> {};  // the scatter kind on [E, K, N]
template <>
struct OperandLayouts<kGemmBf16Wgrad> {  // A = u[rows]^T (P x rows, P contiguous), B = v[rows] (rows x Q)
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
};

// A CUTLASS stride (one int64 leading dimension and a static unit stride, in either order) with its
// leading dimension set to ld.
template <class Stride>
__device__ __forceinline__ Stride LeadingStride(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static<std::remove_reference_t<decltype(get<0>(s))>>::value) {
    get<1>(s) = ld;
  } else {
    get<0>(s) = ld;
  }
  return s;
}

// The kinds a row-block tile (row_block_tiles.cuh: only the 64-row blocks with rows are loaded and
// multiplied) is built for; every other kind runs the unclustered 128x256 tile in its place.
enum RowBlockKinds : int { kRowBlocksNone = 0, kRowBlocksAct = 1, kRowBlocksScatter = 2 };

// The tile configurations of grouped_gemm.h: the CTA's rows and columns, the cluster, and the
// schedule (cooperative: two consumer warpgroups on one tile; pingpong: on alternating tiles), and
// the K tile in bytes per row (128: 64 bf16, 128 fp8 elements). kRowBlockKinds: a row-block tile's
// kinds (RowBlockKinds); a cooperative one's warpgroups split the tile's columns.
template <class RowsT, class ColsT, class ClusterT, bool kPingpong, int kKTileBytes = 128,
          int kRowBlockKinds = kRowBlocksNone>
struct Schedule {
  using Rows = RowsT;
  using Cols = ColsT;
  using Cluster = ClusterT;
  static constexpr bool kIsPingpong = kPingpong;
  static constexpr int kKBytes = kKTileBytes;
  static constexpr int kRowBlocksFor = kRowBlockKinds;
  using Kernel = std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using Epilogue = std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};

// The mainloop schedule of a (kind, tile). FP8 accumulates in the tensor cores' own float32 path over
// the whole K ("fast accumulation"), as Hopper FP8 serving GEMMs do, instead of promoting a partial
// sum into a second register accumulator every few K blocks: that second accumulator does not fit in
// the registers at 128x256 (measured 2.0-2.8x slower than 128x128 on an H100), and costs at every tile.
template <int Kind, class S>
using MainloopKernel = std::conditional_t<
    IsFp8Kind(Kind),
    std::conditional_t<S::kIsPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum>,
    typename S::Kernel>;
template <int Tile>
struct TileSchedule;
template <>
struct TileSchedule<kTileCoop128x128> : Schedule<_128, _128, Shape<_1, _1, _1>, false> {};
template <>
struct TileSchedule<kTilePingpong64x128> : Schedule<_64, _128, Shape<_1, _1, _1>, true> {};
template <>  // 2x1 cluster: the two CTAs of a cluster share B's tile (TMA multicast)
struct TileSchedule<kTileCoop128x256> : Schedule<_128, _256, Shape<_2, _1, _1>, false> {};
template <>
struct TileSchedule<kTilePingpong64x256> : Schedule<_64, _256, Shape<_1, _1, _1>, true> {};
template <>  // 256 bytes of each row per stage: two 128-byte swizzle atoms side by side
struct TileSchedule<kTilePingpong64x128K2> : Schedule<_64, _128, Shape<_1, _1, _1>, true, 256> {};
template <>  // no cluster: the grouped scheduler rounds each expert's M tiles up to whole clusters
struct TileSchedule<kTileCoop128x256C1> : Schedule<_128, _256, Shape<_1, _1, _1>, false> {};
template <>  // 192 rows in three 64-row blocks, the warpgroups on column halves; the act kinds only
struct TileSchedule<kTileCoop192x256> : Schedule<_192, _256, Shape<_1, _1, _1>, false, 128, kRowBlocksAct> {};
template <>  // 192 rows in three 64-row blocks, each warpgroup on a tile of its own; the scatter kinds only
struct TileSchedule<kTilePingpong192x128> : Schedule<_192, _128, Shape<_1, _1, _1>, true, 128, kRowBlocksScatter> {};

}  // namespace jax_moe::cutlass_gg
