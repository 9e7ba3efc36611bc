// The CUTLASS grouped GEMM instantiations of consecutive kinds: every tile of grouped_gemm.h's CutlassTile
// for each CutlassGemmKind from JAX_MOE_CUTLASS_KIND_FIRST to JAX_MOE_CUTLASS_KIND_LAST, in one object
// file. cmake/cutlass_gemm.cmake compiles this file once per range (a kind each on many cores, up to three
// on few); the ranges compile in parallel. Tiles and kinds share a TU because most of a TU's time is
// fixed (the CUTLASS/CuTe headers through cudafe++, cicc and the host compiler): a kind's six tiles cost
// about three times one tile's time, and a second kind in the TU costs less than a TU of its own (the
// numbers are in docs/BUILD.md).
#define JAX_MOE_CUTLASS_IMPL
#include "grouped_gemm_impl.cuh"

#if !defined(JAX_MOE_CUTLASS_KIND_FIRST) || !defined(JAX_MOE_CUTLASS_KIND_LAST)
#error "define JAX_MOE_CUTLASS_KIND_FIRST and JAX_MOE_CUTLASS_KIND_LAST (cmake/cutlass_gemm.cmake does)"
#endif
static_assert(0 <= JAX_MOE_CUTLASS_KIND_FIRST && JAX_MOE_CUTLASS_KIND_FIRST <= JAX_MOE_CUTLASS_KIND_LAST &&
              JAX_MOE_CUTLASS_KIND_LAST < jax_moe::kNumCutlassGemmKinds);
static_assert(jax_moe::kNumCutlassGemmKinds == 10, "one block per kind below");
#define JAX_MOE_KIND_IN_TU(K) (JAX_MOE_CUTLASS_KIND_FIRST <= (K) && (K) <= JAX_MOE_CUTLASS_KIND_LAST)

namespace jax_moe::cutlass_gg {
#if JAX_MOE_KIND_IN_TU(0)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_INSTANTIATE_CUTLASS_GEMM, 0)
#endif
#if JAX_MOE_KIND_IN_TU(1)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_INSTANTIATE_CUTLASS_GEMM, 1)
#endif
#if JAX_MOE_KIND_IN_TU(2)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_INSTANTIATE_CUTLASS_GEMM, 2)
#endif
#if JAX_MOE_KIND_IN_TU(3)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_INSTANTIATE_CUTLASS_GEMM, 3)
#endif
#if JAX_MOE_KIND_IN_TU(4)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_INSTANTIATE_CUTLASS_GEMM, 4)
#endif
#if JAX_MOE_KIND_IN_TU(5)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_INSTANTIATE_CUTLASS_GEMM, 5)
#endif
#if JAX_MOE_KIND_IN_TU(6)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_INSTANTIATE_CUTLASS_GEMM, 6)
#endif
#if JAX_MOE_KIND_IN_TU(7)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_INSTANTIATE_CUTLASS_GEMM, 7)
#endif
#if JAX_MOE_KIND_IN_TU(8)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_INSTANTIATE_CUTLASS_GEMM, 8)
#endif
#if JAX_MOE_KIND_IN_TU(9)
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_INSTANTIATE_CUTLASS_GEMM, 9)
#endif
}  // namespace jax_moe::cutlass_gg
