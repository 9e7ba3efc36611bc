// top_k: per row of x [..., N] float32, the indices of its k largest values, largest first, as
// jax.lax.top_k orders them (float32's total order: NaN above +inf, -0 below +0; equal values to the
// lower index first). The routers' top-k (jax_moe/top_k.py, jax_moe/routing.py).
//
// Inputs:  x [..., N] float32, 1 <= N <= kTopKMaxN.
// Outputs: indices [..., k] int32.
// Attribute: k (int64), 1 <= k <= N.
#pragma once

#include "xla/ffi/api/api.h"

namespace jax_moe {
// Values per row the kernel takes: 32 per lane of the row's warp.
constexpr int kTopKMaxN = 1024;
}  // namespace jax_moe

extern "C" XLA_FFI_Error* JaxMoeTopKCuda(XLA_FFI_CallFrame* call_frame);
