// One CUTLASS grouped GEMM instantiation (one (kind, tile) of grouped_gemm.h per object file:
// compile time). cmake/cutlass_gemm.cmake compiles this file once per pair, with
// JAX_MOE_CUTLASS_KIND (a CutlassGemmKind) and JAX_MOE_CUTLASS_TILE (a CutlassTile) defined.
#define JAX_MOE_CUTLASS_IMPL
#include "grouped_gemm_impl.cuh"

#if !defined(JAX_MOE_CUTLASS_KIND) || !defined(JAX_MOE_CUTLASS_TILE)
#error "define JAX_MOE_CUTLASS_KIND and JAX_MOE_CUTLASS_TILE (cmake/cutlass_gemm.cmake does)"
#endif
static_assert(JAX_MOE_CUTLASS_KIND >= 0 && JAX_MOE_CUTLASS_KIND < jax_moe::kNumCutlassGemmKinds);
static_assert(JAX_MOE_CUTLASS_TILE >= 0 && JAX_MOE_CUTLASS_TILE < jax_moe::kNumCutlassTiles);

namespace jax_moe::cutlass_gg {
JAX_MOE_INSTANTIATE_CUTLASS_GEMM(JAX_MOE_CUTLASS_KIND, JAX_MOE_CUTLASS_TILE)
}  // namespace jax_moe::cutlass_gg
