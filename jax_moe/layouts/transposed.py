"""The transposed (N-contiguous) expert layout: each expert's matrix with its two axes swapped.

The layout as stored is ``[E, N, K]``, K contiguous (vLLM's w13 ``[E, 2I, H]`` and w2 ``[E, H, I]``).
The transposed layout is ``[E, K, N]``, N contiguous (w13 ``[E, H, 2I]``, w2 ``[E, I, H]``), with
the same order along N, so an interleaved gate/up w13 keeps gate ``i`` in column ``2i`` and up ``i``
in column ``2i + 1``. The cutlass backend transposes bf16 weights to it at load time
(:mod:`jax_moe.backends.cutlass_prepared`); its kernels read it, and its checks and references
read it back through :func:`transposed_shape` and :func:`transpose_experts`. The permutation is
exact and its own inverse.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Why only bf16 weights take this layout, as every check that refuses FP8 on it says.
BF16_ONLY = "bf16 only (the FP8 tensor cores read K-major weights)"


def transpose_experts(w: jax.Array) -> jax.Array:
    """[E, N, K] -> [E, K, N], and back: each expert's matrix transposed. Any dtype."""
    return jnp.swapaxes(w, 1, 2)


def transposed_shape(w) -> jax.ShapeDtypeStruct:
    """The shape and dtype :func:`transpose_experts` gives ``w`` (an array or a ShapeDtypeStruct,
    rank 3), without reading data."""
    return jax.eval_shape(transpose_experts, w)
