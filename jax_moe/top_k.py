"""``jax.lax.top_k`` for routers: the same values and indices, from a CUDA kernel where it applies.

A router picks a token's k experts out of E scores (:mod:`jax_moe.routing`): rows of at most a few
hundred values, and many of them. XLA runs ``lax.top_k`` there as a sort of every row (16 us for
[4096, 128] on an H100, 57 us for [16384, 128]); ``ffi/kernels/top_k.cu`` runs a warp per row and k
rounds of a warp-wide argmax.

:func:`top_k` takes the kernel where the computation is lowered for a GPU with jax_moe's CUDA module
registered, x is float32 and its rows have at most :data:`jax_moe.ffi.TOP_K_MAX_N` values; else it
is ``lax.top_k`` itself. Either way the result is ``lax.top_k``'s: the k largest values of the last
axis, largest first, in float32's total order (NaN above +inf, -0 below +0), equal values to the
lower index first. The values are gathered from x by the indices, so they differentiate as
``lax.top_k``'s do (the indices are integers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe import ffi


def uses_kernel(x: jax.Array, k: int) -> bool:
    """Whether :func:`top_k` of ``x`` takes the CUDA kernel (on a GPU, with the CUDA module registered)."""
    return (x.dtype == jnp.float32 and x.ndim >= 1 and 1 <= x.shape[-1] <= ffi.TOP_K_MAX_N
            and 1 <= k <= x.shape[-1] and x.size > 0)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)``: x [..., N] -> (values [..., k] x's dtype, indices [..., k] int32)."""
    x = jnp.asarray(x)
    k = int(k)
    if not uses_kernel(x, k) or not ffi.has_native("cuda"):
        return lax_top_k(x, k)

    def cuda(x):
        out = jax.ShapeDtypeStruct(x.shape[:-1] + (k,), jnp.int32)
        idx = jax.ffi.ffi_call("jax_moe_top_k", out, vmap_method="broadcast_all")(jax.lax.stop_gradient(x), k=k)
        return jnp.take_along_axis(x, idx, axis=-1), idx

    return jax.lax.platform_dependent(x, cuda=cuda, default=lambda x: lax_top_k(x, k))


def lax_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` as a tuple: :func:`top_k` off the kernel."""
    values, indices = jax.lax.top_k(x, k)
    return values, indices
