// CUTLASS tile kTilePingpong64x128 of jax_moe_cutlass_grouped_gemm (one instantiation per TU: compile time).
#define JAX_MOE_CUTLASS_IMPL
#include "cutlass_grouped_gemm_impl.cuh"

namespace jax_moe::cutlass_gg {
JAX_MOE_INSTANTIATE_CUTLASS_TILE(kTilePingpong64x128)
}  // namespace jax_moe::cutlass_gg
