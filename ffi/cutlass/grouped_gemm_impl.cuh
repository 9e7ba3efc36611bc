// The CUTLASS side of the grouped GEMM FFI targets (contract in grouped_gemm.h): one SM90
// pointer-array grouped GEMM type per (kind, tile), the device kernel that fills its per-group argument
// arrays from the expert offsets (or, batched, the counts: GroupRows), and the host launch. Included by
// ffi/cutlass/grouped_gemm_kind.cu, which CMake compiles once per range of kinds (all their tiles in one
// object file; a kind each on many cores, cmake/cutlass_gemm.cmake) so that the ranges compile in
// parallel; the FFI handlers (grouped_gemm.cu) see
// only GroupedGemmCall, GroupRows and Run/WorkspaceBytes.
//
// Layouts, in CUTLASS's terms (grouped_gemm_traits.cuh per kind): forward A row-major [M_e, K], B
// "column-major" (K, N), i.e. our [N, K] rows with K contiguous; D row-major; no C operand.
// Epilogues: bf16, D = acc. fp8, an epilogue visitor tree D = bf16((acc * col_scale[n]) * row_scale[m])
// whose two broadcast vectors are per group too (arrays of pointers, like A, B and D): row_scale + lo
// (the group's rows) and col_scale + g * N (the group's expert).
// The act kinds: the gated activation of gated_epilogue.cuh (no shared memory, direct stores), d of
// N / 2 columns; its FP8 kind takes the same two pointer arrays of scales, of the compact scales
// (grouped_gemm.h): a one-scale form's pointer stays put, and the epilogue reads it with a step of 0.
// The scatter kinds: the weighted scatter-add of scatter_epilogue.cuh into d [T, N] (zeroed by the
// setup launch first), one more per-group array (each group's first row: its rows' slots and scales).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include <cuda_runtime.h>

#include "../common/errors.h"
#include "grouped_gemm.h"

#ifdef JAX_MOE_CUTLASS_IMPL
#include "dynamic_tile_scheduler.cuh"  // before any kernel type: its scheduler selector
#include "group_order.cuh"
#include "group_tensormaps.cuh"
#include "grouped_gemm_traits.cuh"
#include "row_block_tiles.cuh"
#endif

namespace jax_moe {

// One call's operands, decoded and checked by the handler. The rows of a, d and row_scale are m
// rows either way; the format says which of them group g owns (GroupRows).
// Per kind: forward a [m, k], b [groups, n, k], d [m, n]; dgrad and kGemmBf16ActKN b [groups, k, n]; wgrad (u, v) a [m, k],
// b [m, n], d [groups, k, n].
struct GroupedGemmCall {
  cudaStream_t stream;
  const void* a;            // [m, k] bf16 or e4m3 (batched: [groups, capacity, k], m = groups * capacity)
  const void* b;            // [groups, n, k], a's type (dgrad: [groups, k, n]; wgrad: [m, n])
  const int32_t* offsets;   // standard: offsets [groups + 1]; batched: counts [groups]; int32, device
  const float* row_scale;   // [m], or [1] (row_scale_step 0) (fp8; nullptr for bf16)
  const float* col_scale;   // [groups, n], [groups, 1] or [1, 1] (fp8; nullptr for bf16)
  int64_t row_scale_step;   // 1: a scale per row of a; 0: one for every row
  int64_t col_scale_group_step;  // col_scale's elements from one expert to the next: n, 1 or 0
  bool per_channel_cols;    // true: col_scale has a scale per column; false: one per expert (or tensor)
  void* d;                  // [m, d_cols] bf16, or e4m3 for kGemmFp8Act (wgrad: [groups, k, n])
  int64_t d_cols;           // d's row length: n, or n / 2 for the act kinds (16-byte multiple of rows)
  const float* bias;        // act kinds: [groups, n] float32 GEMM1 bias, or nullptr
  const float* out_scale;   // kGemmFp8Act: [1] float32 static output scale
  const int32_t* slots;     // scatter kinds: [m] int32 top-k slot t * k + j of each row (d [num_tokens, n])
  const float* weights;     // scatter kinds: [num_tokens * k] float32 routing weight of each slot
  int64_t topk;             // scatter kinds: slots per token
  int64_t num_tokens;       // scatter kinds: d's rows
  int activation;           // act kinds: kAct*
  float alpha, limit;       // act kinds: swigluoai's constants
  void* workspace;
  size_t workspace_bytes;
  int64_t groups, m, n, k;
  bool batched;             // the batched format (a rank 3): offsets holds counts
  int64_t capacity;         // batched: rows per expert (C); 0 for the standard format
  bool zero_unowned;        // the setup launch also zeroes d's rows no group writes (ZeroUnownedRows);
                            // the scatter kinds' setup launch always zeroes all of d [num_tokens, n]
  int device, sm_count;
};

// The fields every handler decodes alike: the offsets, d, the workspace and the sizes.
inline void SetCommon(GroupedGemmCall& call, const int32_t* offsets, void* d, void* workspace, size_t workspace_bytes,
                      int64_t groups, int64_t m, int64_t n, int64_t k) {
  call.offsets = offsets;
  call.d = d;
  call.workspace = workspace;
  call.workspace_bytes = workspace_bytes;
  call.groups = groups;
  call.m = m;
  call.n = n;
  call.k = k;
  call.d_cols = n;
}

// Rows [lo, hi) of a (and d, row_scale) that group g owns, in 0 <= lo <= hi <= m, whatever the
// device values are. Standard: [offsets[g], offsets[g+1]) clamped to [0, m] (a decreasing pair is
// empty). Batched: [g * capacity, g * capacity + clamp(counts[g], 0, capacity)).
__device__ __forceinline__ void GroupRows(const int32_t* offsets, int64_t g, int64_t m, bool batched,
                                          int64_t capacity, int64_t& lo, int64_t& hi) {
  if (batched) {
    int64_t c = offsets[g];
    c = c < 0 ? 0 : (c > capacity ? capacity : c);
    lo = g * capacity;
    hi = lo + c;
    return;
  }
  lo = offsets[g];
  hi = offsets[g + 1];
  lo = lo < 0 ? 0 : (lo > m ? m : lo);
  hi = hi < lo ? lo : (hi > m ? m : hi);
}

// Zeroes the rows of d [m, vec_per_row 16-byte vectors] that the GEMM does not write, block `block`
// of `blocks` (block-stride over rows, threads over a row's vectors).
// Standard: the rows outside [offsets[0], offsets[groups]) (clamped to [0, m]); batched: the rows
// of group g past clamp(counts[g], 0, capacity) (GroupRows).
__device__ __forceinline__ void ZeroUnownedRows(const int32_t* offsets, int64_t groups, int64_t m, bool batched,
                                                int64_t capacity, int64_t vec_per_row, uint4* d, int64_t block,
                                                int64_t blocks) {
  auto zero_row = [&](int64_t row) {
    uint4* dst = d + row * vec_per_row;
    for (int64_t c = threadIdx.x; c < vec_per_row; c += blockDim.x) dst[c] = make_uint4(0, 0, 0, 0);
  };
  if (batched) {
    for (int64_t row = block; row < m; row += blocks) {
      int64_t lo, hi;
      GroupRows(offsets, row / capacity, m, true, capacity, lo, hi);
      if (row >= hi) zero_row(row);
    }
    return;
  }
  int64_t lo = offsets[0], hi = offsets[groups];
  lo = lo < 0 ? 0 : (lo > m ? m : lo);
  hi = hi < lo ? lo : (hi > m ? m : hi);
  const int64_t unowned = lo + (m - hi);
  for (int64_t i = block; i < unowned; i += blocks) zero_row(i < lo ? i : hi + (i - lo));
}

// Zeroes all of d [rows, vec_per_row 16-byte vectors], block `block` of `blocks`: the threads of all
// the blocks stride over d's vectors, so that a row's length need not match a block's.
__device__ __forceinline__ void ZeroAll(int64_t rows, int64_t vec_per_row, uint4* d, int64_t block, int64_t blocks) {
  const int64_t total = rows * vec_per_row;
  for (int64_t i = block * blockDim.x + threadIdx.x; i < total; i += blocks * blockDim.x) d[i] = make_uint4(0, 0, 0, 0);
}

// Shared by the handler files (grouped_gemm.cu): the (kind, tile) instantiation's run on a checked call
// with m >= 1 (one setup launch, which also zeroes the unowned rows when call.zero_unowned, or a scatter
// kind's whole d, then the CUTLASS kernel).
ffi::Error RunKind(int kind, int64_t tile, const GroupedGemmCall& call);

namespace cutlass_gg {

constexpr size_t kArrayAlign = 256;  // every array of the workspace starts on this boundary

inline size_t RoundUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Defined, all tiles of a range of kinds per TU, by JAX_MOE_INSTANTIATE_CUTLASS_GEMM below.
template <int Kind, int Tile>
size_t WorkspaceBytes(int64_t groups, int sm_count);
template <int Kind, int Tile>
ffi::Error Run(const GroupedGemmCall& call);

// M(KIND, TILE) for each CutlassTile of grouped_gemm.h: the declarations below and the definitions
// (grouped_gemm_kind.cu) go through this one list.
#define JAX_MOE_FOR_EACH_CUTLASS_TILE(M, KIND) \
  M(KIND, kTileCoop128x128)                    \
  M(KIND, kTilePingpong64x128)                 \
  M(KIND, kTileCoop128x256)                    \
  M(KIND, kTilePingpong64x256)                 \
  M(KIND, kTilePingpong64x128K2)               \
  M(KIND, kTileCoop128x256C1)                  \
  M(KIND, kTileCoop192x256)                    \
  M(KIND, kTilePingpong192x128)
static_assert(kNumCutlassTiles == 8, "one entry per tile in JAX_MOE_FOR_EACH_CUTLASS_TILE");

#define JAX_MOE_DECLARE_CUTLASS_GEMM(KIND, TILE)                   \
  template <>                                                      \
  size_t WorkspaceBytes<KIND, TILE>(int64_t groups, int sm_count); \
  template <>                                                      \
  ffi::Error Run<KIND, TILE>(const GroupedGemmCall& call);
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_DECLARE_CUTLASS_GEMM, kGemmBf16)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_DECLARE_CUTLASS_GEMM, kGemmFp8)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_DECLARE_CUTLASS_GEMM, kGemmBf16Dgrad)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_DECLARE_CUTLASS_GEMM, kGemmBf16Wgrad)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_DECLARE_CUTLASS_GEMM, kGemmBf16Act)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_DECLARE_CUTLASS_GEMM, kGemmFp8Act)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_DECLARE_CUTLASS_GEMM, kGemmBf16ActKN)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_DECLARE_CUTLASS_GEMM, kGemmBf16KNScatter)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_DECLARE_CUTLASS_GEMM, kGemmFp8Scatter)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_DECLARE_CUTLASS_GEMM, kGemmBf16Scatter)
#undef JAX_MOE_DECLARE_CUTLASS_GEMM

#ifdef JAX_MOE_CUTLASS_IMPL
using namespace cute;

// An integer environment variable: its value, or `fallback` where it is unset. Each caller reads it
// once, into a function-local static.
inline int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v == nullptr ? fallback : static_cast<int>(std::strtol(v, nullptr, 10));
}

// Whether RowBlockMainloop multiplies only the 64-row blocks with rows: JAX_MOE_CUTLASS_SKIP_BLOCKS
// (default 1; 0 multiplies every block, to time the tile without the skip), read once.
inline bool SkipEmptyBlocks() {
  static const bool skip = EnvInt("JAX_MOE_CUTLASS_SKIP_BLOCKS", 1) != 0;
  return skip;
}

// Which unclustered tiles take their tiles from a counter (dynamic_tile_scheduler.cuh):
// JAX_MOE_CUTLASS_DYNAMIC_TILES, a mask: bit 1 << EpilogueKindOf(kind) for every cooperative tile of a
// kind (1: the plain kinds, 2: the act kinds, 4: the scatter kinds), kDynamicRowBlocks for the two
// 192-row tiles (cooperative and pingpong); read once.
inline constexpr int kDynamicRowBlocks = 8;
inline constexpr int kDynamicTilesDefault = kDynamicRowBlocks;
inline int DynamicTilesMask() {
  static const int mask = EnvInt("JAX_MOE_CUTLASS_DYNAMIC_TILES", kDynamicTilesDefault);
  return mask;
}

// The mainloop of a tile: CUTLASS's collective on the prebuilt descriptors, or with kRowBlocks the
// same collective multiplying only the 64-row blocks with rows: a cooperative tile's warpgroups on
// column halves, a pingpong tile's one warpgroup on all its columns.
template <bool kRowBlocks, class Built, class Element, class TileShape, bool kPingpong = false>
struct MainloopOf {
  using type = PrebuiltTensormapMainloop<Built>;
};
// Pingpong: CUTLASS's own TiledMma (one warpgroup of 64xN WGMMAs, repeated over the tile's blocks).
template <class Built, class Element, class TileShape>
struct MainloopOf<true, Built, Element, TileShape, true> {
  using type = RowBlockMainloop<Built>;
};
template <class Built, class Element, class TileShape>
struct MainloopOf<true, Built, Element, TileShape, false> {
  static constexpr auto kMajorA = cutlass::gemm::detail::is_mn_major<typename Built::InternalStrideA>()
                                      ? cute::GMMA::Major::MN : cute::GMMA::Major::K;
  static constexpr auto kMajorB = cutlass::gemm::detail::is_mn_major<typename Built::InternalStrideB>()
                                      ? cute::GMMA::Major::MN : cute::GMMA::Major::K;
  using Mma = typename ColumnSplitMma<Element, cute::size<1>(TileShape{}) / 2, cute::size<2>(TileShape{}), kMajorA,
                                     kMajorB>::type;
  using type = RowBlockMainloop<typename WithTiledMma<Built, Mma>::type>;
};

// One kind's grouped GEMM with one tile's shapes and schedules (grouped_gemm_traits.cuh).
// kRowBlocks: a tile that multiplies only its 64-row blocks with rows (row_block_tiles.cuh).
template <int Kind, class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule,
          bool kRowBlocks = false>
struct GroupedGemm {
  static constexpr bool kScaled = IsFp8Kind(Kind);
  static constexpr bool kAct = IsActKind(Kind);
  static constexpr bool kScatter = IsScatterKind(Kind);
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using Element = ElementAB<Kind>;
  using ElementD = ElementDOf<Kind>;
  using Acc = float;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;
  static_assert(kAlign == CutlassAlignK(Kind), "grouped_gemm.h's K alignment must match the TMA's");
  static_assert(kEpilogueAlignD == kCutlassAlignN,
                "grouped_gemm.h's N alignment must match the TMA's");

  using CollectiveEpilogue = typename EpilogueOf<Kind, TileShape, ClusterShape, EpilogueSchedule>::type;

  // FP8 runs the same mainloop as bf16: its schedules accumulate without promotion (MainloopKernel,
  // grouped_gemm_traits.cuh). Its loads read each group's TMA descriptors as the setup launch built them
  // (group_tensormaps.cuh). kRowBlocks: see MainloopOf.
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, typename OperandLayouts<Kind>::A*, kAlign,
      Element, typename OperandLayouts<Kind>::B*, kAlign,
      Acc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  static constexpr bool kPingpong =
      std::is_same_v<KernelSchedule, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong> ||
      std::is_same_v<KernelSchedule, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum>;
  using CollectiveMainloop = typename MainloopOf<kRowBlocks, BuiltMainloop, Element, TileShape, kPingpong>::type;
  using MainloopParams = typename CollectiveMainloop::Params;
  using TensorMapStorage = typename CollectiveMainloop::TensorMapStorage;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  // Tiles from a counter need a kernel without a cluster: the cooperative one, or the pingpong one on
  // the row-block tile (dynamic_tile_scheduler.cuh).
  static constexpr bool kDynamicCapable = cute::size(ClusterShape{}) == 1 && (!kPingpong || kRowBlocks);
  static_assert(std::is_same_v<typename Kernel::TileScheduler,
                               DynamicGroupScheduler<ProblemShape, Kernel::TileSchedulerStages>>,
                "the kernel runs dynamic_tile_scheduler.cuh's scheduler");
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  // Every operand is "rows of contiguous elements": one int64 leading dimension, a static unit stride.
  static_assert(std::is_same_v<StrideD, Stride<int64_t, Int<1>, Int<0>>>);

  // The per-group arrays, carved out of the front of the XLA workspace (prow/pcol: fp8 only).
  struct Arrays {
    Shape3* shapes;
    const Element** pa;
    const Element** pb;
    ElementD** pd;
    const float** prow;
    const float** pcol;
    StrideA* sa;
    StrideB* sb;
    StrideD* sd;
    int64_t* row_lo;  // scatter kinds: each group's first row
    int32_t* expert;  // act and scatter kinds: each group's expert (its bias row; group_order.cuh)
    cute::TmaDescriptor* tensormaps;  // [groups][kTensormapsPerGroup]: each group's A and B descriptors
    void* cutlass_workspace;
  };

  // The arrays at base (an address, or 0 to measure: cutlass_workspace is then the front's size).
  static Arrays Carve(uintptr_t base, int64_t groups) {
    const size_t g = static_cast<size_t>(groups);
    auto take = [&](size_t bytes) {
      const uintptr_t out = base;
      base += RoundUp(bytes, kArrayAlign);
      return reinterpret_cast<void*>(out);
    };
    Arrays r{};
    r.shapes = static_cast<Shape3*>(take(g * sizeof(Shape3)));
    r.pa = static_cast<const Element**>(take(g * sizeof(void*)));
    r.pb = static_cast<const Element**>(take(g * sizeof(void*)));
    r.pd = static_cast<ElementD**>(take(g * sizeof(void*)));
    if constexpr (kScaled) {
      r.prow = static_cast<const float**>(take(g * sizeof(void*)));
      r.pcol = static_cast<const float**>(take(g * sizeof(void*)));
    }
    r.sa = static_cast<StrideA*>(take(g * sizeof(StrideA)));
    r.sb = static_cast<StrideB*>(take(g * sizeof(StrideB)));
    r.sd = static_cast<StrideD*>(take(g * sizeof(StrideD)));
    if constexpr (kScatter) r.row_lo = static_cast<int64_t*>(take(g * sizeof(int64_t)));
    if constexpr (kAct || kScatter) r.expert = static_cast<int32_t*>(take(g * sizeof(int32_t)));
    r.tensormaps = static_cast<cute::TmaDescriptor*>(take(g * kTensormapsPerGroup * sizeof(cute::TmaDescriptor)));
    r.cutlass_workspace = take(0);
    return r;
  }

  // call: the act and scatter kinds' epilogue operands (nullptr to size the workspace, which they do
  // not change).
  static typename Gemm::Arguments MakeArguments(const Arrays& arr, int64_t groups, int device, int sm_count,
                                                const GroupedGemmCall* call = nullptr) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device;
    hw.sm_count = sm_count;
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    // host problem shapes: none (they live on device only), so nothing here waits for the GPU
    args.problem_shape = ProblemShape{static_cast<int>(groups), arr.shapes, nullptr};
    args.mainloop.ptr_A = arr.pa;
    args.mainloop.dA = arr.sa;
    args.mainloop.ptr_B = arr.pb;
    args.mainloop.dB = arr.sb;
    args.mainloop.group_tensormaps = arr.tensormaps;
    if constexpr (kAct || kScatter) {  // our own epilogues: the FP8 scale arrays and the bias, then each one's
      auto& ep = args.epilogue;
      if constexpr (kScaled) {
        ep.ptr_row_scale = arr.prow;
        ep.ptr_col_scale = arr.pcol;
      }
      if constexpr (kScatter) ep.row_lo = arr.row_lo;
      ep.group_expert = arr.expert;
      if (call != nullptr) {
        if constexpr (kScaled) {
          ep.row_scale_step = static_cast<int>(call->row_scale_step);
          ep.per_channel_cols = call->per_channel_cols;
        }
        ep.bias = call->bias;
        if constexpr (kAct) {
          ep.out_scale = call->out_scale;
          ep.activation = call->activation;
          ep.alpha = call->alpha;
          ep.limit = call->limit;
        } else {
          ep.slots = call->slots;
          ep.weights = call->weights;
          ep.k = call->topk;
          ep.num_tokens = call->num_tokens;
        }
      }
    } else {
      if constexpr (kScaled) {
        auto& t = args.epilogue.thread;  // Sm90EVT arguments: children first, then the node's own
        t.op_0.ptr_col = arr.prow;       // RowScale
        t.op_1.op_0.ptr_row = arr.pcol;  // AccTimesCol's ColScale
      } else {
        args.epilogue.thread.alpha = 1.0f;
        args.epilogue.thread.beta = 0.0f;
      }
      args.epilogue.ptr_C = nullptr;
      args.epilogue.dC = nullptr;
    }
    args.epilogue.ptr_D = arr.pd;
    args.epilogue.dD = arr.sd;
    args.hw_info = hw;
    if constexpr (kRowBlocks) args.mainloop.skip = SkipEmptyBlocks();
    if constexpr (kDynamicCapable) {
      const int mask = DynamicTilesMask();
      args.scheduler.dynamic =
          (!kPingpong && ((mask >> EpilogueKindOf(Kind)) & 1)) || (kRowBlocks && (mask & kDynamicRowBlocks));
    }
    SetTileOrder(args);
    return args;
  }

  // The tile scheduler's order, from the scheduler's params as the kernel will build them from the
  // same arguments, for the mainloop's plan of which groups' descriptors each CTA fences.
  static void SetTileOrder(typename Gemm::Arguments& args) {
    using Scheduler = typename Kernel::TileScheduler;
    const auto sp = Scheduler::to_underlying_arguments(args.problem_shape, TileShape{}, ClusterShape{},
                                                       args.hw_info, args.scheduler, nullptr);
    const int swizzle = 1 << sp.log_swizzle_size_;
    auto& order = args.mainloop.tile_order;
    order.tile_m = sp.cta_shape_.m();
    order.tile_n = sp.cta_shape_.n();
    order.round_m = swizzle * sp.cluster_shape_.m();
    order.round_n = swizzle * sp.cluster_shape_.n();
    order.raster_along_n = sp.raster_order_ == decltype(sp.raster_order_)::AlongN;
    order.dynamic = args.scheduler.dynamic;
  }

  static size_t WorkspaceBytes(int64_t groups, int sm_count) {
    const Arrays sized = Carve(0, groups);
    const size_t front = reinterpret_cast<uintptr_t>(sized.cutlass_workspace);
    return front + Gemm::get_workspace_size(MakeArguments(Arrays{}, groups, 0, sm_count));
  }
};

// The setup launch. Block g < groups: its first thread fills group g's entries from its rows [lo, hi)
// (GroupRows, FillGroup) and builds the group's TMA descriptors from them (BuildGroupTensormaps,
// group_tensormaps.cuh), a group per block so that the descriptor edits run on many SMs at once (on an
// H200, with 128 groups: 13.6-16.2 us for this launch with every group on one SM, 5.3 us spread out,
// 3.4 us before it built descriptors). The blocks after them (zero_blocks > 0) zero d: its unowned rows
// for the forward and dgrad kinds (ZeroUnownedRows), all of d [num_tokens, n] for the scatter kinds,
// whose epilogue adds into it (ZeroAll; a memset launch of its own before). So each GEMM is two
// launches (this, then CUTLASS's).
// Group g's entries per kind:
//   forward, dgrad: rows [lo, hi) of a and d (and row_scale's, or its one scale), expert g's weights
//                   (and col_scale's row of expert g, or its one row);
//                   problem (hi - lo, n, k); b is [E, N, K] (forward) or [E, K, N] (IsNContiguousB)
//   scatter:        as forward, but d whole (the epilogue adds each row into d[slot / k]) and lo kept
//   wgrad:          rows [lo, hi) of u (a, [M, k]) and v (b, [M, n]), expert g's d [k, n]; problem
//                   (k, n, hi - lo), or no tiles at all (M = 0) for an expert without rows (the handler
//                   zeroes its d: a K of 0 is not a GEMM CUTLASS's mainloop runs)
// Expert g's entries go to place `at` of the arrays: g itself, or its place in the spread order
// (group_order.cuh; the standard forward, dgrad and scatter kinds); the act and scatter kinds also
// record the place's expert, whose bias row their epilogues read.
template <int Kind, class G>
__device__ __forceinline__ typename G::Shape3 FillGroup(const typename G::Arrays& arr, int64_t at, int64_t g,
                                                       const int32_t* offsets, int64_t m, bool batched,
                                                       int64_t capacity, int n, int k, int64_t d_cols,
                                                       const typename G::Element* a, const typename G::Element* b,
                                                       typename G::ElementD* d, const float* row_scale,
                                                       int64_t row_scale_step, const float* col_scale,
                                                       int64_t col_scale_group_step) {
  int64_t lo, hi;
  GroupRows(offsets, g, m, batched, capacity, lo, hi);
  const int64_t n64 = n, k64 = k;
  typename G::Shape3 shape;
  if constexpr (Kind == kGemmBf16Wgrad) {
    const int rows = static_cast<int>(hi - lo);
    shape = make_shape(rows > 0 ? k : 0, n, rows);
    arr.pa[at] = a + lo * k64;
    arr.pb[at] = b + lo * n64;
    arr.pd[at] = d + g * k64 * n64;
    arr.sa[at] = LeadingStride<typename G::StrideA>(k64);
    arr.sb[at] = LeadingStride<typename G::StrideB>(n64);
  } else {
    shape = make_shape(static_cast<int>(hi - lo), n, k);
    arr.pa[at] = a + lo * k64;
    arr.pb[at] = b + g * n64 * k64;
    arr.pd[at] = G::kScatter ? d : d + lo * d_cols;  // scatter: every group adds into all of d [T, N]
    arr.sa[at] = LeadingStride<typename G::StrideA>(k64);
    arr.sb[at] = LeadingStride<typename G::StrideB>(IsNContiguousB(Kind) ? n64 : k64);
  }
  arr.shapes[at] = shape;
  if constexpr (G::kScaled) {
    arr.prow[at] = row_scale + lo * row_scale_step;
    arr.pcol[at] = col_scale + g * col_scale_group_step;
  }
  if constexpr (G::kScatter) arr.row_lo[at] = lo;
  if constexpr (G::kAct || G::kScatter) arr.expert[at] = static_cast<int32_t>(g);
  arr.sd[at] = LeadingStride<typename G::StrideD>(Kind == kGemmBf16Wgrad ? n64 : d_cols);
  return shape;
}

constexpr int kFillThreads = 128;  // the setup launch's block (the zeroing blocks' threads share a row)
constexpr int kZeroBlocksPerSm = 4;  // a scatter kind's zeroing blocks per SM at most (ZeroAll)

template <int Kind, class G>
__global__ void __launch_bounds__(kFillThreads)
    FillGroupArrays(typename G::Arrays arr, typename G::MainloopParams mainloop, const int32_t* offsets,
                    int64_t groups, int64_t m, bool batched, int64_t capacity, int n, int k, int64_t d_cols,
                    int64_t d_rows, const typename G::Element* a, const typename G::Element* b,
                    typename G::ElementD* d, const float* row_scale, int64_t row_scale_step, const float* col_scale,
                    int64_t col_scale_group_step, bool spread, uint32_t* tile_counter) {
  const int64_t g = blockIdx.x;
  if (tile_counter != nullptr && g == 0 && threadIdx.x == 0) *tile_counter = 0;
  if (g >= groups) {
    const int64_t vec_per_row = d_cols * int64_t(sizeof(*d)) / 16;
    if constexpr (IsScatterKind(Kind))
      ZeroAll(d_rows, vec_per_row, reinterpret_cast<uint4*>(d), g - groups, gridDim.x - groups);
    else if constexpr (Kind != kGemmBf16Wgrad)
      ZeroUnownedRows(offsets, groups, m, batched, capacity, vec_per_row, reinterpret_cast<uint4*>(d), g - groups,
                      gridDim.x - groups);
    return;
  }
  __shared__ typename G::TensorMapStorage slot;  // the descriptors as they are edited
  const int64_t at = spread ? SpreadPlace(
                                  [&](int64_t e) {
                                    int64_t lo, hi;
                                    GroupRows(offsets, e, m, false, 0, lo, hi);
                                    return hi - lo;
                                  },
                                  g, groups)
                            : g;
  if (threadIdx.x != 0) return;
  const auto shape = FillGroup<Kind, G>(arr, at, g, offsets, m, batched, capacity, n, k, d_cols, a, b, d, row_scale,
                                        row_scale_step, col_scale, col_scale_group_step);
  BuildGroupTensormaps<typename G::CollectiveMainloop>(mainloop, at, append<4>(shape, 1), slot,
                                                       arr.tensormaps);
}

inline ffi::Error CutlassError(const char* what, cutlass::Status s) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jax_moe: cutlass grouped gemm: ") + what + ": " + cutlassGetStatusString(s));
}

template <int Kind, class G>
ffi::Error RunGemm(const GroupedGemmCall& c) {
  const size_t need = G::WorkspaceBytes(c.groups, c.sm_count);
  if (c.workspace_bytes < need)
    return InvalidArgument("cutlass_grouped_gemm: workspace has " + std::to_string(c.workspace_bytes) +
                           " bytes, this device needs " + std::to_string(need) +
                           " (sized for another GPU? see jax_moe.backends.cutlass.workspace_size)");
  const auto arr = G::Carve(reinterpret_cast<uintptr_t>(c.workspace), c.groups);
  using E = typename G::Element;
  using D = typename G::ElementD;

  // The kernel's params first (host only): the setup launch builds each group's descriptors from them.
  typename G::Gemm gemm;
  const auto args = G::MakeArguments(arr, c.groups, c.device, c.sm_count, &c);
  if (auto s = gemm.can_implement(args); s != cutlass::Status::kSuccess) return CutlassError("can_implement", s);
  if (auto s = gemm.initialize(args, arr.cutlass_workspace, c.stream); s != cutlass::Status::kSuccess)
    return CutlassError("initialize", s);

  // zeroing: the unowned rows, a block per row at most and at most one per SM (block-stride beyond);
  // a scatter kind's whole d [num_tokens, n], kZeroBlocksPerSm blocks per SM at most
  const int64_t d_rows = G::kScatter ? c.num_tokens : c.m;
  int64_t zero_blocks = 0;
  if constexpr (G::kScatter) {
    const int64_t vectors = c.num_tokens * c.d_cols * int64_t(sizeof(D)) / 16;
    zero_blocks =
        std::min<int64_t>((vectors + kFillThreads - 1) / kFillThreads, int64_t(kZeroBlocksPerSm) * c.sm_count);
  } else if (Kind != kGemmBf16Wgrad && c.zero_unowned) {
    zero_blocks = std::min<int64_t>(c.m, c.sm_count);
  }
  // The spread order (group_order.cuh) for many experts of mean rows near the ridge, in the standard
  // format; wgrad's groups are its outputs' experts, and the batched format keeps expert order.
  const int64_t mean_rows = c.groups > 0 ? c.m / c.groups : 0;
  const bool spread = Kind != kGemmBf16Wgrad && !c.batched && c.groups >= kSpreadFromGroups &&
                      kSpreadFromRows <= mean_rows && mean_rows <= kSpreadToRows && SpreadGroupOrder();
  FillGroupArrays<Kind, G><<<static_cast<unsigned>(c.groups + zero_blocks), kFillThreads, 0, c.stream>>>(
      arr, gemm.params().mainloop, c.offsets, c.groups, c.m, c.batched, c.capacity, static_cast<int>(c.n),
      static_cast<int>(c.k), c.d_cols, d_rows, static_cast<const E*>(c.a), static_cast<const E*>(c.b),
      static_cast<D*>(c.d), c.row_scale, c.row_scale_step, c.col_scale, c.col_scale_group_step, spread,
      gemm.params().scheduler.counter);
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());

  if (auto s = gemm.run(c.stream); s != cutlass::Status::kSuccess) return CutlassError("run", s);
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

// The K tile of a (kind, tile) in elements.
template <int Kind, int Tile>
inline constexpr int kKTile = TileSchedule<Tile>::kKBytes / static_cast<int>(sizeof(ElementAB<Kind>));

// The (kind, tile) pair's grouped GEMM type.
// A row-block tile serves the kinds it is built for (TileSchedule's kRowBlocksFor); the other kinds run
// the unclustered 128x256 tile for it.
template <int Kind, int Tile>
struct TileConfig {
  static constexpr int kFor = TileSchedule<Tile>::kRowBlocksFor;
  static constexpr bool kRowBlocks =
      (kFor == kRowBlocksAct && IsActKind(Kind)) || (kFor == kRowBlocksScatter && IsScatterKind(Kind));
  static constexpr int kTile = kFor != kRowBlocksNone && !kRowBlocks ? int(kTileCoop128x256C1) : Tile;
  using S = TileSchedule<kTile>;
  using type = GroupedGemm<Kind, Shape<typename S::Rows, typename S::Cols, Int<kKTile<Kind, kTile>>>,
                           typename S::Cluster, MainloopKernel<Kind, S>, typename S::Epilogue, kRowBlocks>;
};

#define JAX_MOE_INSTANTIATE_CUTLASS_GEMM(KIND, TILE)                                  \
  template <>                                                                         \
  size_t WorkspaceBytes<KIND, TILE>(int64_t groups, int sm_count) {                   \
    return TileConfig<KIND, TILE>::type::WorkspaceBytes(groups, sm_count);            \
  }                                                                                   \
  template <>                                                                         \
  ffi::Error Run<KIND, TILE>(const GroupedGemmCall& call) {                           \
    return RunGemm<KIND, TileConfig<KIND, TILE>::type>(call);                         \
  }
#endif  // JAX_MOE_CUTLASS_IMPL

}  // namespace cutlass_gg
}  // namespace jax_moe
