"""Peer MoE implementations the bench compares jax_moe against (optional bench dependencies).

``tokamax``: the same forward written on tokamax's Mosaic-GPU grouped GEMM,
``tokamax.ragged_dot(lhs, rhs, group_sizes, implementation="mosaic")``::

    order = argsort(topk_ids.ravel(), stable)       # sorted position -> slot
    sizes = bincount(topk_ids.ravel(), E)           # rows per expert
    xs = x[order // k]                              # permute
    h = ragged_dot(xs, w13^T, sizes)                # GEMM1, [T*k, 2I] bf16 (float32 accumulation)
    a = silu(h[:, :I]) * h[:, I:]                   # in float32, rounded to bf16
    y = ragged_dot(a, w2^T, sizes)                  # GEMM2, [T*k, H]
    out[t] = sum_j w[t, j] * y[inverse[t*k + j]]    # weighted un-permute in float32

tokamax takes ``rhs [G, K, N]``; jax_moe stores vLLM's ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``
(K contiguous), so :func:`tokamax_prepare` transposes both once at load time (untimed, as a
tokamax user would store them). Absent tokamax (CPU machines, or not installed), :func:`available`
says why and the bench leaves the column out.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def available() -> tuple[bool, str]:
    """Whether tokamax's Mosaic-GPU ragged_dot can run here (an NVIDIA GPU and tokamax importable)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError as err:  # no backend at all
        return False, str(err)
    if dev.platform != "gpu" or "NVIDIA" not in dev.device_kind:
        return False, f"tokamax's Mosaic-GPU kernels need an NVIDIA GPU (have {dev.device_kind})"
    try:
        import tokamax  # noqa: F401, PLC0415
    except Exception as err:  # ImportError, or an import-time failure of its dependencies
        return False, f"tokamax is not importable ({type(err).__name__}: {err})"
    return True, "ok"


def tokamax_prepare(w13: jax.Array, w2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """vLLM's ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` -> tokamax's ``rhs [E, K, N]``: ``[E, H, 2I]`` and
    ``[E, I, H]`` (one transpose each, at load time)."""
    return jnp.swapaxes(w13, 1, 2), jnp.swapaxes(w2, 1, 2)


def tokamax_moe(x: jax.Array, weights: tuple[jax.Array, jax.Array], topk_weights: jax.Array,
                topk_ids: jax.Array, *, implementation: str = "mosaic") -> jax.Array:
    """The gated-SiLU MoE forward on ``tokamax.ragged_dot`` (see the module note).

    x [T, H] bf16; weights from :func:`tokamax_prepare`; topk_weights [T, k] float; topk_ids
    [T, k] int32 in [0, E). Returns [T, H] in x's dtype."""
    import tokamax  # noqa: PLC0415

    w13t, w2t = weights
    e, i = w13t.shape[0], w2t.shape[1]
    t, k = topk_ids.shape
    n = t * k
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1)
    inverse = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    xs = jnp.take(x.astype(jnp.bfloat16), order // k, axis=0)
    h = tokamax.ragged_dot(xs, w13t, sizes, implementation=implementation)
    hf = h.astype(jnp.float32)
    a = (jax.nn.silu(hf[:, :i]) * hf[:, i:]).astype(jnp.bfloat16)
    y = tokamax.ragged_dot(a, w2t, sizes, implementation=implementation)
    gathered = jnp.take(y, inverse, axis=0).reshape(t, k, -1).astype(jnp.float32)
    return jnp.einsum("tkh,tk->th", gathered, topk_weights.astype(jnp.float32)).astype(x.dtype)


def implementations() -> dict[str, tuple[bool, Callable, Callable]]:
    """The peers that can run here, in :func:`bench.moe_bench.implementations`' form: name ->
    (uses the scheme's weights? (never: peers run bf16), prepare(w13, w2), fn(x, weights, w, ids))."""
    ok, why = available()
    if not ok:
        print(f"# tokamax: not run ({why})")
        return {}
    return {"tokamax": (False, tokamax_prepare, tokamax_moe)}
