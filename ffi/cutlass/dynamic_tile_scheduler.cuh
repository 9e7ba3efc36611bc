// The grouped GEMMs' tile scheduler: CUTLASS's persistent group scheduler, which can also hand out
// the tiles from a counter (dynamic scheduling) instead of in a fixed deal.
//
// CUTLASS's SM90 group scheduler deals the tiles of the groups' linear order to the CTAs in turn: CTA
// b runs tiles b, b + grid, b + 2 grid, ... Where tiles differ in cost (the 192-row tile multiplies
// one, two or three 64-row blocks) or CTAs differ in speed, the CTAs then end apart, and the kernel
// ends with its most loaded one. Here, when the call asks for it, each CTA still runs tile b first,
// and then takes the next tile of the order from a counter in global memory as it starts its current
// one: every CTA works on a window of consecutive tiles of the order, and the last ones end within a
// tile of each other.
//
// The kernel (sm90_gemm_array_tma_warpspecialized_cooperative.hpp) runs the scheduler in one warp of
// its producer warpgroup, which hands each next tile to the other warps through a pipeline of 8
// responses in shared memory. CUTLASS's scheduler fills that pipeline as far ahead as it can; this one,
// when dynamic, takes a tile from the counter only once every warp has taken the previous response
// (the consumers' release of it), so that a CTA holds at most one tile beyond its current one.
//
// The counter lives in the scheduler's workspace and is zeroed by the setup launch of the same call
// (grouped_gemm_impl.cuh). Dynamic scheduling needs an unclustered kernel: the group scheduler places a
// cluster's CTAs by their block index. The pingpong kernel (sm90_gemm_array_tma_warpspecialized_
// pingpong.hpp) also works: its two consumer warpgroups run alternate responses, but each reads every
// response (the other's tiles to skip them), so every response is still released by every warp. A
// warpgroup's next tile is then taken once it has finished its current one, epilogue included, and the
// producer loads it while the other warpgroup multiplies. The grouped GEMMs take it on the pingpong
// row-block tile only (grouped_gemm_impl.cuh).
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/pipeline/pipeline.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace jax_moe::cutlass_gg {

template <class GroupProblemShape, int kStages>
class DynamicGroupScheduler
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<GroupProblemShape, kStages> {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<GroupProblemShape, kStages>;

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;
  using SchedulerResponse = typename Base::SchedulerResponse;

  // How many tiles past its current one a CTA may hold when dynamic: 1, the next (the producer warp
  // loads it while the consumers finish the current one).
  static constexpr int kLookahead = 1;
  static_assert(kLookahead >= 1 && kLookahead < kStages, "a lookahead within the response pipeline");

  struct Arguments : Base::Arguments {
    bool dynamic = false;  // take tiles from the counter (an unclustered cooperative kernel only)
  };
  struct Params : Base::Params {
    uint32_t* counter = nullptr;  // the tiles taken so far beyond each CTA's first; nullptr: static
  };

  template <class TileShape, class ClusterShape>
  static Params to_underlying_arguments(GroupProblemShape problem_shapes, TileShape tile_shape,
                                        ClusterShape cluster_shape, cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1, uint32_t ktile_start_alignment_count = 1u) {
    Params p;
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(problem_shapes, tile_shape, cluster_shape, hw_info, args, workspace,
                                      epilogue_subtile, ktile_start_alignment_count);
    p.counter = args.dynamic ? static_cast<uint32_t*>(workspace) : nullptr;
    return p;
  }

  // One counter (the workspace's alignment rounds it up), zeroed by the call's setup launch.
  template <class ProblemShape, class ElementAccumulator>
  static size_t get_workspace_size(Arguments const&, ProblemShape, cutlass::KernelHardwareInfo const&, uint32_t,
                                   const uint32_t = 1, uint32_t = 1) {
    return sizeof(uint32_t);
  }
  template <class ProblemShape, class ElementAccumulator>
  static cutlass::Status initialize_workspace(Arguments const&, void*, cudaStream_t, ProblemShape,
                                              cutlass::KernelHardwareInfo const&, uint32_t, const uint32_t = 1,
                                              uint32_t = 1, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  DynamicGroupScheduler() = default;
  CUTLASS_DEVICE DynamicGroupScheduler(Params const& params, SchedulerResponse* response)
      : Base(params, response), counter_(params.counter) {}

  // The scheduler warp's step (every lane): the next tile, handed to the other warps as response
  // number responses_. Static: CUTLASS's (its first tile plus the grid's size each time). Dynamic: the
  // grid's size plus the counter's value before this CTA's increment, taken once the warps have all
  // released the response kLookahead before this one.
  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(Pipeline& pipeline, PipelineState state, uint32_t advance_count = 1) {
    if (counter_ == nullptr) return Base::advance_to_next_work(pipeline, state, advance_count);
    if (responses_ >= kLookahead) {
      // The state kStages - kLookahead responses on waits at the slot of response responses_ -
      // kLookahead for that response's release, as the producer would before refilling it.
      PipelineState ahead = state;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kStages - kLookahead; ++i) ++ahead;
      pipeline.producer_acquire(ahead);
    }
    pipeline.producer_acquire(state);
    const bool leader = cute::elect_one_sync();
    uint32_t taken = 0;
    if (leader) taken = atomicAdd(counter_, 1u);
    taken = __shfl_sync(0xffffffffu, taken, __ffs(__ballot_sync(0xffffffffu, leader)) - 1);
    const uint64_t grid = uint64_t(gridDim.x) * gridDim.y * gridDim.z;
    const WorkTileInfo work = this->get_current_work_for_linear_idx(grid + taken);
    if (leader) {
      this->response_ptr_[state.index()] = work;
      cutlass::arch::fence_view_async_shared();
      pipeline.producer_commit(state);
    }
    ++responses_;
    return cute::make_tuple(work, true);
  }

 private:
  uint32_t* counter_ = nullptr;
  uint32_t responses_ = 0;  // responses handed out so far
};

}  // namespace jax_moe::cutlass_gg

namespace cutlass::gemm::kernel::detail {

// The SM90 grouped kernels' scheduler (8 response stages, the problem shapes of grouped_gemm_impl.cuh):
// DynamicGroupScheduler, static unless the call asks otherwise. More specialized than CUTLASS's own
// selector for the group scheduler, which it replaces for these kernels.
template <class TileShape, class ClusterShape>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape, 8u,
                             cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>> {
  using Scheduler =
      jax_moe::cutlass_gg::DynamicGroupScheduler<cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>, 8>;
};

}  // namespace cutlass::gemm::kernel::detail
