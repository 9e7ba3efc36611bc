// The CUTLASS grouped GEMM instantiations of one kind: every tile of grouped_gemm.h's CutlassTile for
// the CutlassGemmKind JAX_MOE_CUTLASS_KIND, in one object file. cmake/cutlass_gemm.cmake compiles this
// file once per kind with JAX_MOE_CUTLASS_KIND defined; the kinds compile in parallel. A kind's tiles
// share one TU because most of a TU's time is fixed (the CUTLASS/CuTe headers through cudafe++, cicc
// and the host compiler): five tiles of one kind cost about twice one tile's time, not five times
// (the numbers are in cmake/cutlass_gemm.cmake).
#define JAX_MOE_CUTLASS_IMPL
#include "grouped_gemm_impl.cuh"

#if !defined(JAX_MOE_CUTLASS_KIND)
#error "define JAX_MOE_CUTLASS_KIND (cmake/cutlass_gemm.cmake does)"
#endif
static_assert(JAX_MOE_CUTLASS_KIND >= 0 && JAX_MOE_CUTLASS_KIND < jax_moe::kNumCutlassGemmKinds);

namespace jax_moe::cutlass_gg {
JAX_MOE_FOR_EACH_CUTLASS_TILE(JAX_MOE_INSTANTIATE_CUTLASS_GEMM, JAX_MOE_CUTLASS_KIND)
}  // namespace jax_moe::cutlass_gg
