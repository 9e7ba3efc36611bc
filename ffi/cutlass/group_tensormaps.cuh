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
// collective, acquires them all once per CTA, then only points its loads at group g's pair when a
// tile of group g comes, and prefetches it: no edit, no copy and no fence at the switch.
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

  struct Arguments : Base::Arguments {
    // [groups][kTensormapsPerGroup], device memory, written by the setup launch of the same call
    cute::TmaDescriptor const* group_tensormaps = nullptr;
    int32_t groups = 0;
  };
  struct Params : Base::Params {
    cute::TmaDescriptor const* group_tensormaps;
    int32_t groups;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args, void* workspace) {
    return {Base::to_underlying_arguments(problem_shapes, args, workspace), args.group_tensormaps, args.groups};
  }

  // The current group's pair, in the producer warp's registers.
  cute::TmaDescriptor const* tensormap_a_ = nullptr;
  cute::TmaDescriptor const* tensormap_b_ = nullptr;

  // Called by the producer warp once, before its first load. Every group's pair was written through
  // the generic proxy by the setup launch and is read here through the tensormap proxy, which takes
  // an acquire fence per descriptor before its first use in the CTA (an earlier call's pairs, at the
  // same workspace addresses, may still be cached). All of them are fenced here, spread over the
  // warp's lanes, and the warp barrier orders the fences before the elected lane's loads. (Measured
  // on an H200, one lane's fence at each switch between groups took back about half of what the
  // prebuilt pairs save; every lane's, all of it.)
  template <class TensorMapStorage>
  CUTLASS_DEVICE auto tensormaps_init(Params const& params, TensorMapStorage&, int32_t, int32_t) {
    const int descriptors = params.groups * kTensormapsPerGroup;
    for (int i = threadIdx.x % 32; i < descriptors; i += 32)
      cute::tma_descriptor_fence_acquire(params.group_tensormaps + i);
    __syncwarp();
    return cute::make_tuple(params.group_tensormaps, params.group_tensormaps + 1);
  }

  // Group `next_batch` comes next: point at its pair, and start fetching it. A CTA without work is
  // asked for the group of its first (invalid) tile, which may be past the last: it loads nothing.
  template <class TensorMapStorage, class TensorMaps, class ProblemShapeMNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage&, Params const& params, TensorMaps const&,
                                                ProblemShapeMNKL, int32_t next_batch) {
    if (next_batch < 0 || next_batch >= params.groups) return;
    tensormap_a_ = params.group_tensormaps + int64_t(next_batch) * kTensormapsPerGroup;
    tensormap_b_ = tensormap_a_ + 1;
    if (cute::elect_one_sync()) {
      cute::prefetch_tma_descriptor(tensormap_a_);
      cute::prefetch_tma_descriptor(tensormap_b_);
    }
  }

  // Nothing is written here, so nothing to release; the acquires are in tensormaps_init.
  template <class TensorMapStorage, class TensorMaps>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(TensorMapStorage&, TensorMaps const&) {}
  template <class TensorMaps>
  CUTLASS_DEVICE void tensormaps_fence_acquire(TensorMaps const&) {}

  // CUTLASS's loads, through the current group's pair.
  template <class Pipeline, class PipeState, class LoadInputs, class TensorMaps, class... Rest>
  CUTLASS_DEVICE void load(Params const& params, Pipeline pipeline, PipeState state, LoadInputs const& load_inputs,
                           TensorMaps const&, Rest&&... rest) {
    Base::load(params, pipeline, state, load_inputs, cute::make_tuple(tensormap_a_, tensormap_b_),
               static_cast<Rest&&>(rest)...);
  }
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
