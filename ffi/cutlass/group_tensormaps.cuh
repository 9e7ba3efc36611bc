// The grouped GEMMs' TMA descriptors, built once per call for every group, before the GEMM runs.
//
// CUTLASS's pointer-array mainloop keeps one descriptor pair (A and B) per CTA and rewrites it each
// time the CTA's next tile belongs to another group: it reads the group's pointers and strides, edits
// the pair in shared memory, copies it out to global memory behind a release fence, and acquires it
// again before the next load. With many small groups (128 experts of 256 rows each, say) a CTA's every
// tile is in a new group, and that chain is on its load path at each one.
//
// Here the setup launch (grouped_gemm_impl.cuh's FillGroupArrays) builds every group's pair, with the
// same CUTLASS edits, into an array of the workspace: tensormaps [groups][2] (A, then B), one group
// per block so that the edits run on many SMs at once. The mainloop below, a thin layer over CUTLASS's
// collective, acquires at its start the pairs of the groups the CTA will visit, then only points its
// loads at group g's pair when a tile of group g comes, and prefetches it: no edit, no copy and no
// fence at the switch.
//
// Its loads also mark B's lines evict-first in the L2 for a group whose rows fit one row tile (HintB):
// each of that expert's weight tiles is then read by one CTA, once, and the weights streaming through
// the L2 no longer push out the lines still in use: A's rows, which every column tile of the expert
// reads, and the scatter epilogue's output rows. With several row tiles per expert the weights stay
// normal lines, since the other row tiles read them again (evict-first there made GEMM2 11-36% slower
// at T=4096 on an H200).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"

namespace jax_moe::cutlass_gg {

// Descriptors per group in the workspace's array: A's, then B's.
inline constexpr int kTensormapsPerGroup = 2;

// CUTLASS's SM90 pointer-array mainloop `Base` (MainloopSm90ArrayTmaGmmaWarpSpecialized), its loads
// pointed at group descriptors that the setup launch built (BuildGroupTensormaps).
template <class Base>
struct PrebuiltTensormapMainloop : Base {
  static_assert(Base::IsGroupedGemmKernel, "a mainloop over groups with their own shapes");

  // Where the mainloop's acquires go. A CTA fences the descriptors of the groups it will visit, all at
  // its start (spread over the producer warp's lanes), and any other group's at its first switch to
  // it. Which groups a CTA visits follows from the tile scheduler's order
  // (PersistentTileSchedulerSm90Group): the groups' tiles in turn, a group's tile count being
  // round_up(ceil(M / tile_m), round_m) * round_up(ceil(N / tile_n), round_n), handed to the CTAs in
  // turn from the CTA's first tile (its block index along the raster order) by the grid's size.
  // The host copies these from its own build of the scheduler's params (grouped_gemm_impl.cuh).
  struct TileOrder {
    int32_t tile_m = 0, tile_n = 0;    // the CTA tile's rows and columns
    int32_t round_m = 1, round_n = 1;  // swizzle size times cluster size, along M and N
    // the scheduler's raster order, which gives the CTA's first tile: blockIdx.x + blockIdx.y *
    // gridDim.x along N, blockIdx.x * gridDim.y + blockIdx.y along M
    bool raster_along_n = true;
    // the CTAs take their tiles after the first from a counter (dynamic_tile_scheduler.cuh): which
    // tiles a CTA runs is not known ahead
    bool dynamic = false;
  };

  // Group `shape`'s row and column tile counts in the scheduler's terms (each rounded up to its
  // rounding); its tile count is their product.
  CUTLASS_DEVICE static void GroupTiles(TileOrder const& order, cute::Shape<int, int, int> const& shape,
                                        uint64_t& tiles_m, uint64_t& tiles_n) {
    const uint64_t m = (cute::get<0>(shape) + order.tile_m - 1) / order.tile_m;
    const uint64_t n = (cute::get<1>(shape) + order.tile_n - 1) / order.tile_n;
    tiles_m = (m + order.round_m - 1) / order.round_m * order.round_m;
    tiles_n = (n + order.round_n - 1) / order.round_n * order.round_n;
  }

  // The linear index of this CTA's first tile; its tiles are that plus i times the grid's size.
  CUTLASS_DEVICE static uint64_t FirstTile(TileOrder const& order) {
    return order.raster_along_n ? blockIdx.x + uint64_t(blockIdx.y) * gridDim.x
                                : uint64_t(blockIdx.x) * gridDim.y + blockIdx.y;
  }
  CUTLASS_DEVICE static uint64_t GridTiles() { return uint64_t(gridDim.x) * gridDim.y * gridDim.z; }

  // Up to this many groups a lane records the groups it fenced in one 64-bit mask (a bit per 32 groups).
  static constexpr int32_t kMaxPlannedGroups = 64 * 32;

  struct Arguments : Base::Arguments {
    // [groups][kTensormapsPerGroup], device memory, written by the setup launch of the same call
    cute::TmaDescriptor const* group_tensormaps = nullptr;
    TileOrder tile_order{};
  };
  struct Params : Base::Params {
    cute::TmaDescriptor const* group_tensormaps;
    cute::Shape<int, int, int> const* problem_shapes;  // [groups] (M, N, K), device memory
    int32_t groups;
    TileOrder tile_order;
  };

  // More groups than a lane's mask can record, or tiles taken from a counter: every pair is fenced at
  // the CTA's start.
  CUTLASS_DEVICE static bool FenceEveryGroup(Params const& params) {
    return params.groups > kMaxPlannedGroups || params.tile_order.dynamic;
  }

  // One step of a warp's walk over the groups in the scheduler's order: lane l takes group base + l,
  // reads its shape once and counts its tiles, and an inclusive scan over the lanes gives where each
  // lane's group's tiles end. Every lane of the warp must call it. The fence plan (tensormaps_init) walks
  // with it.
  struct GroupChunk {
    int32_t group;             // base + lane
    uint64_t tiles_m, tiles_n;  // its row and column tile counts (GroupTiles; 0 past the last group)
    uint64_t end;              // one past its last tile's linear index: chunk_start + the lanes' tiles up to l
    CUTLASS_DEVICE uint64_t tiles() const { return tiles_m * tiles_n; }
    CUTLASS_DEVICE uint64_t start() const { return end - tiles(); }
  };
  CUTLASS_DEVICE static GroupChunk ChunkTiles(Params const& params, int32_t base, uint64_t chunk_start) {
    const int lane = static_cast<int>(threadIdx.x % cutlass::NumThreadsPerWarp);
    GroupChunk c{base + lane, 0, 0, 0};
    if (c.group < params.groups) {
      const cute::Shape<int, int, int> shape = params.problem_shapes[c.group];
      GroupTiles(params.tile_order, shape, c.tiles_m, c.tiles_n);
    }
    uint64_t inclusive = c.tiles();
    CUTLASS_PRAGMA_UNROLL
    for (int d = 1; d < cutlass::NumThreadsPerWarp; d *= 2) {
      const uint64_t below = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += below;
    }
    c.end = chunk_start + inclusive;
    return c;
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args, void* workspace) {
    return {Base::to_underlying_arguments(problem_shapes, args, workspace),
            args.group_tensormaps,
            problem_shapes.problem_shapes,
            problem_shapes.groups(),
            args.tile_order};
  }

  // The current group's M and its pair, in the producer warp's registers (the kernel's tile
  // coordinates carry no group: their L is a placeholder). The rows come at the switch from the
  // problem shape the kernel has just read for the group, so that the loads of each tile (HintB, the
  // 192-row tile's blocks) read no global memory for them.
  int32_t rows_ = 0;
  cute::TmaDescriptor const* tensormap_a_ = nullptr;
  cute::TmaDescriptor const* tensormap_b_ = nullptr;
  // Lane l's bit c: group 32 c + l's pair is fenced (all set when every group's is).
  uint64_t fenced_ = 0;

  CUTLASS_DEVICE static void FencePair(Params const& params, int32_t g) {
    cute::tma_descriptor_fence_acquire(params.group_tensormaps + int64_t(g) * kTensormapsPerGroup);
    cute::tma_descriptor_fence_acquire(params.group_tensormaps + int64_t(g) * kTensormapsPerGroup + 1);
  }

  // Called by the producer warp once, before its first load. Every group's pair was written through
  // the generic proxy by the setup launch and is read here through the tensormap proxy, which takes
  // an acquire fence per descriptor before its first use in the CTA (an earlier call's pairs, at the
  // same workspace addresses, may still be cached). The pairs of the groups this CTA will visit are
  // fenced here, group g by lane g % 32, and the warp barrier orders the fences before the elected
  // lane's loads. (Measured on an H200 with Qwen3-30B-A3B's 128 experts: one lane's fence at each
  // switch between groups took back about half of what the prebuilt pairs save; every group's pair
  // fenced at each CTA's start cost its layer 2-3% at T = 16 to 1024, where a CTA visits few groups.)
  template <class TensorMapStorage>
  CUTLASS_DEVICE auto tensormaps_init(Params const& params, TensorMapStorage&, int32_t, int32_t) {
    const int lane = threadIdx.x % 32;
    if (FenceEveryGroup(params)) {
      for (int32_t g = lane; g < params.groups; g += 32) FencePair(params, g);
      fenced_ = ~uint64_t(0);
    } else {
      const TileOrder& order = params.tile_order;
      const uint64_t first = FirstTile(order);
      const uint64_t stride = GridTiles();
      uint64_t chunk_start = 0;  // the linear index of this chunk's first group's first tile
      for (int32_t base = 0; base < params.groups; base += 32) {
        const GroupChunk c = ChunkTiles(params, base, chunk_start);
        const uint64_t start = c.start();
        // The CTA's first tile at or after `start` (its tiles are first + i * stride, i >= 0).
        const uint64_t next = start <= first ? first : first + (start - first + stride - 1) / stride * stride;
        if (c.tiles() > 0 && next < c.end) {
          FencePair(params, c.group);
          fenced_ |= uint64_t(1) << (base / 32);
        }
        chunk_start = __shfl_sync(0xffffffffu, c.end, 31);
      }
    }
    __syncwarp();
    return cute::make_tuple(params.group_tensormaps, params.group_tensormaps + 1);
  }

  // Group `next_batch` comes next: point at its pair, fence it if this CTA's start did not (only where
  // the scheduler's order was not foreseen), and start fetching it. A CTA without work is asked for
  // the group of its first (invalid) tile, which may be past the last: it loads nothing.
  template <class TensorMapStorage, class TensorMaps, class ProblemShapeMNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage&, Params const& params, TensorMaps const&,
                                                ProblemShapeMNKL problem, int32_t next_batch) {
    if (next_batch < 0 || next_batch >= params.groups) return;
    rows_ = cute::get<0>(problem);
    tensormap_a_ = params.group_tensormaps + int64_t(next_batch) * kTensormapsPerGroup;
    tensormap_b_ = tensormap_a_ + 1;
    const int owner = next_batch % 32;
    const uint64_t bit = uint64_t(1) << (next_batch / 32 % 64);
    if (!(__shfl_sync(0xffffffffu, fenced_, owner) & bit)) {
      if (threadIdx.x % 32 == owner) {
        FencePair(params, next_batch);
        fenced_ |= bit;
      }
      __syncwarp();
    }
    if (cute::elect_one_sync()) {
      cute::prefetch_tma_descriptor(tensormap_a_);
      cute::prefetch_tma_descriptor(tensormap_b_);
    }
  }

  // Nothing is written here, so nothing to release; the acquires are in tensormaps_init and
  // tensormaps_perform_update.
  template <class TensorMapStorage, class TensorMaps>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(TensorMapStorage&, TensorMaps const&) {}
  template <class TensorMaps>
  CUTLASS_DEVICE void tensormaps_fence_acquire(TensorMaps const&) {}

  // The L2 priority of B's loads for the current group: evict first where the group's rows fit one
  // row tile, so that each of its B tiles is read by one CTA, once (the weights of an expert of up to
  // a tile's rows); as any other line where several row tiles read each B tile.
  CUTLASS_DEVICE cute::TMA::CacheHintSm90 HintB() const {
    constexpr int kTileRows = cute::size<0>(typename Base::TileShape{});
    return rows_ <= kTileRows ? cute::TMA::CacheHintSm90::EVICT_FIRST : cute::TMA::CacheHintSm90::EVICT_NORMAL;
  }

  // The producer's loads, through the current group's pair: per K tile, A's box and B's box, B's at
  // HintB's priority. A tile of a cluster (its loads multicast) loads as CUTLASS's collective does.
  template <class Pipeline, class PipeState, class LoadInputs, class TensorMaps, class BlockCoord, class KTileIterator,
            class TensorStorage>
  CUTLASS_DEVICE void load(Params const& params, Pipeline pipeline, PipeState state, LoadInputs const& load_inputs,
                           TensorMaps const&, BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int thread_idx, uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    using namespace cute;
    if constexpr (!is_same_v<typename Base::GmemTiledCopyA, SM90_TMA_LOAD> ||
                  !is_same_v<typename Base::GmemTiledCopyB, SM90_TMA_LOAD>) {
      Base::load(params, pipeline, state, load_inputs, make_tuple(tensormap_a_, tensormap_b_), blk_coord, k_tile_iter,
                 k_tile_count, thread_idx, block_rank_in_cluster, shared_tensors);
    } else {
      if (!elect_one_sync()) return;
      Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), typename Base::SmemLayoutA{});
      Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
      const auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
      auto tma_a = params.tma_load_a.get_slice(0);
      auto tma_b = params.tma_load_b.get_slice(0);
      Tensor tAgA = tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord));  // (TMA, TMA_M, TMA_K, k)
      Tensor tAsA = tma_a.partition_D(sA);                                              // (TMA, TMA_M, TMA_K, PIPE)
      Tensor tBgB = tma_b.partition_S(get<1>(load_inputs)(_, _, n_coord, _, l_coord));  // (TMA, TMA_N, TMA_K, k)
      Tensor tBsB = tma_b.partition_D(sB);                                              // (TMA, TMA_N, TMA_K, PIPE)
      const auto hint_b = HintB();
      CUTLASS_PRAGMA_NO_UNROLL
      for (; k_tile_count > 0; --k_tile_count) {
        pipeline.producer_acquire(state);
        auto* barrier = pipeline.producer_get_barrier(state);
        const int stage = state.index();
        const int k = *k_tile_iter;
        copy(params.tma_load_a.with(tensormap_a_, *barrier), tAgA(_, _, _, k), tAsA(_, _, _, stage));
        copy(params.tma_load_b.with(tensormap_b_, *barrier, uint16_t(0), hint_b), tBgB(_, _, _, k),
             tBsB(_, _, _, stage));
        ++k_tile_iter;
        ++state;
      }
    }
  }
};

// A mainloop that loads A in boxes of fewer rows than its tile declares kABoxRows, and the descriptor
// dimension that A's rows take (kABoxDimM); BuildGroupTensormaps gives its A descriptors that box.
template <class Mainloop, class = void>
struct ABoxRows {
  static constexpr int value = 0;
};
template <class Mainloop>
struct ABoxRows<Mainloop, std::void_t<decltype(Mainloop::kABoxRows)>> {
  static constexpr int value = Mainloop::kABoxRows;
};

// Builds group g's pair into out[g] from the mainloop's params (whose ptr_A, ptr_B, dA and dB entries
// of group g this thread has just written) and the group's problem (M, N, K, 1): CUTLASS's own edits
// of the template descriptors in `slot` (shared memory), then a copy out to global memory and a
// release fence, which the mainloop's acquires (PrebuiltTensormapMainloop) pair with. A group
// without rows gets a pair too (of M or K 0), which no load reads: the scheduler gives it no tiles.
template <class Mainloop, class TensorMapStorage, class ProblemShapeMNKL>
__device__ __forceinline__ void BuildGroupTensormaps(typename Mainloop::Params const& params, int64_t g,
                                                     ProblemShapeMNKL problem, TensorMapStorage& slot,
                                                     cute::TmaDescriptor* out) {
  slot.smem_tensormap_A = *params.tma_load_a.get_tma_descriptor();
  slot.smem_tensormap_B = *params.tma_load_b.get_tma_descriptor();
  Mainloop mainloop;
  mainloop.tensormaps_replace_global_address(slot, params, static_cast<int32_t>(g));
  mainloop.tensormaps_replace_global_tensor_properties(slot, params, static_cast<int32_t>(g), problem);
  if constexpr (ABoxRows<Mainloop>::value > 0) {
    const uint32_t desc = cute::cast_smem_ptr_to_uint(&slot.smem_tensormap_A);
    asm volatile("tensormap.replace.tile.box_dim.shared::cta.b1024.b32 [%0], %1, %2;" ::"r"(desc),
                 "n"(Mainloop::kABoxDimM), "r"(uint32_t(ABoxRows<Mainloop>::value))
                 : "memory");
  }
  static_assert(sizeof(cute::TmaDescriptor) % sizeof(uint4) == 0);
  constexpr int kVecs = sizeof(cute::TmaDescriptor) / sizeof(uint4);
  const cute::TmaDescriptor* pair[kTensormapsPerGroup] = {&slot.smem_tensormap_A, &slot.smem_tensormap_B};
  for (int t = 0; t < kTensormapsPerGroup; ++t) {
    const uint4* src = reinterpret_cast<const uint4*>(pair[t]);
    uint4* dst = reinterpret_cast<uint4*>(out + g * kTensormapsPerGroup + t);
#pragma unroll
    for (int v = 0; v < kVecs; ++v) dst[v] = src[v];
  }
  cute::tma_descriptor_fence_release();
}

}  // namespace jax_moe::cutlass_gg
