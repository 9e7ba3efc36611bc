"""The grouped GEMMs of ``backend="cutlass"``'s backward pass (bf16, SM90 CUTLASS, float32
accumulation), beside the forward's :func:`jax_moe.backends.cutlass_gemm.grouped_gemm`.

A grouped-GEMM MoE computes, per expert e and its expert-sorted rows ``r`` in
``[offsets[e], offsets[e+1])``, ``d[r] = a[r] @ w[e].T`` (w [E, N, K] as stored). Its backward
needs two more grouped GEMMs on the same rows:

- :func:`grouped_gemm_dgrad` (the input gradient): ``da[r] = dd[r] @ w[e]``, the stored weights
  read the other way round (b [E, K, N], N contiguous: w13 [E, 2I, H] and w2 [E, H, I] as they
  are). One row per row, like the forward.
- :func:`grouped_gemm_wgrad` (the weight gradient): ``dw[e] = dd[rows of e].T @ a[rows of e]``,
  a reduction over each expert's own rows (ragged K: group e's K is its row count). Experts with
  no rows get zeros.

Both take the forward's offsets ([E+1] int32, clamped to [0, M] on the device, a decreasing pair
empty), build their per-group arguments on the device (no host sync, safe in a CUDA graph) and
return bfloat16. Each has its shape rule and its jnp reference, which runs wherever the kernel
cannot (CPU, or no module); the FFI targets are in the same module as the forward's
(:data:`jax_moe.backends.cutlass_gemm.GRAD_KINDS`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe.backends.cutlass_gemm import ALIGN_N, _lower, _resolve_tile, check_offsets, dtype_name
from jax_moe.config import check_rank


def _check_bf16(name: str, x, what: str, *dims: int) -> None:
    """x is bfloat16 and each of ``dims`` a positive multiple of 8 (16-byte rows)."""
    if dtype_name(x) != "bfloat16":
        raise ValueError(f"{name} must be bfloat16 {what}, got {dtype_name(x)}")
    for d in dims:
        if d < ALIGN_N or d % ALIGN_N or d >= 2**31:
            raise ValueError(f"{name} {what}: its dimensions must be positive multiples of {ALIGN_N} "
                             f"(16-byte rows), got shape {list(x.shape)}")


def _owned_rows(offsets, m: int, e: int):
    """(clamped offsets [E+1], rows owned by some expert [M] bool, ragged_dot group sizes [E] that
    let the unowned rows ride along in the first and last groups). The callers zero what an
    unowned row or an expert without rows holds: ragged_dot may multiply every row by every
    group's operand (0 * NaN = NaN), the kernels never read them."""
    off = jax.lax.cummax(jnp.clip(offsets, 0, m))  # the kernel's clamp: a decreasing pair is empty
    lo, hi = off[0], off[e]
    rows = jnp.arange(m, dtype=jnp.int32)
    owned = (rows >= lo) & (rows < hi)
    sizes = jnp.diff(off).at[0].add(lo).at[e - 1].add(m - hi)
    return off, owned, sizes.astype(jnp.int32)


# ----------------------------------------------------------------------------- dgrad


def _check_dgrad(a, b, offsets, tile) -> str:
    check_rank("a", a, 2, "[M, K]")
    check_rank("b", b, 3, "[E, K, N]")
    m, k = a.shape
    e, k2, n = b.shape
    if k2 != k:
        raise ValueError(f"b must be [E, K, N] with a's K = {k}, got shape {list(b.shape)}")
    if e < 1:
        raise ValueError("b must hold at least one expert")
    _check_bf16("a", a, "[M, K]", k)
    _check_bf16("b", b, "[E, K, N]", k, n)
    check_offsets(offsets, e, m)
    return _resolve_tile(tile, m, e, n=n, k=k, kind="bf16_kn")


def grouped_gemm_dgrad_shape(a, b, offsets) -> jax.ShapeDtypeStruct:
    """The shape rule: a [M, K] bf16, b [E, K, N] bf16, offsets [E+1] int32 -> d [M, N] bf16."""
    _check_dgrad(a, b, offsets, "auto")
    return jax.ShapeDtypeStruct((a.shape[0], b.shape[2]), jnp.bfloat16)


def grouped_gemm_dgrad_reference(a, b, offsets, *, tile=None) -> jax.Array:
    """jnp reference of :func:`grouped_gemm_dgrad`: ``jax.lax.ragged_dot`` in float32, rows
    outside ``[offsets[0], offsets[E])`` zero."""
    _check_dgrad(a, b, offsets, tile)
    return _dgrad_reference(a, b, offsets)


def _dgrad_reference(a, b, offsets, *_):
    m, e = a.shape[0], b.shape[0]
    off, owned, sizes = _owned_rows(offsets, m, e)
    a0 = jnp.where(owned[:, None], a, jnp.zeros((), a.dtype))
    b0 = jnp.where((jnp.diff(off) > 0)[:, None, None], b, jnp.zeros((), b.dtype))
    d = jax.lax.ragged_dot(a0, b0, sizes, preferred_element_type=jnp.float32)
    return jnp.where(owned[:, None], d, 0.0).astype(jnp.bfloat16)


def grouped_gemm_dgrad(a: jax.Array, b: jax.Array, offsets: jax.Array, *, tile: str | None = "auto") -> jax.Array:
    """Per expert e, ``d[r] = a[r] @ b[e]`` for the rows ``offsets[e] <= r < offsets[e+1]``.

    a [M, K] bfloat16 (expert-sorted rows: the output gradient of a forward grouped GEMM);
    b [E, K, N] bfloat16 (the forward's weights [E, N_fwd, K_fwd] as stored: K here is the
    forward's N); offsets [E+1] int32. K and N multiples of 8. Returns d [M, N] bfloat16 (float32
    accumulation), zero outside ``[offsets[0], offsets[E])``. ``tile`` as for the forward
    (``"auto"``: the ``"bf16_kn"`` rows of the tile table, else the rows per expert). Also the
    forward's GEMMs on transposed weights (w13 [E, H, 2I], w2 [E, I, H]:
    :mod:`jax_moe.backends.cutlass_prepared`). CPU or no module: the jnp reference.
    """
    tile = _check_dgrad(a, b, offsets, tile)
    m, n = a.shape[0], b.shape[2]
    if m == 0:
        return jnp.zeros((0, n), jnp.bfloat16)
    return _lower("dgrad", tile, (m, n), _dgrad_reference, a, b, offsets, ())


# ----------------------------------------------------------------------------- wgrad


def _check_wgrad(u, v, offsets) -> None:
    check_rank("u", u, 2, "[M, P]")
    check_rank("v", v, 2, "[M, Q]")
    m, p = u.shape
    if v.shape[0] != m:
        raise ValueError(f"v must be [M, Q] with u's M = {m} rows, got shape {list(v.shape)}")
    _check_bf16("u", u, "[M, P]", p)
    _check_bf16("v", v, "[M, Q]", v.shape[1])
    if offsets.ndim != 1 or offsets.shape[0] < 2:
        raise ValueError(f"offsets must be [E+1] with E >= 1, got shape {list(offsets.shape)}")
    check_offsets(offsets, offsets.shape[0] - 1, m)


def grouped_gemm_wgrad_shape(u, v, offsets) -> jax.ShapeDtypeStruct:
    """The shape rule: u [M, P] bf16, v [M, Q] bf16, offsets [E+1] int32 -> d [E, P, Q] bf16."""
    _check_wgrad(u, v, offsets)
    return jax.ShapeDtypeStruct((offsets.shape[0] - 1, u.shape[1], v.shape[1]), jnp.bfloat16)


def grouped_gemm_wgrad_reference(u, v, offsets) -> jax.Array:
    """jnp reference of :func:`grouped_gemm_wgrad`: ``jax.lax.ragged_dot_general`` with the rows
    as the ragged contracting dimension, in float32."""
    _check_wgrad(u, v, offsets)
    return _wgrad_reference(u, v, offsets)


def _wgrad_reference(u, v, offsets, *_):
    m, e = u.shape[0], offsets.shape[0] - 1
    _, owned, sizes = _owned_rows(offsets, m, e)
    u0 = jnp.where(owned[:, None], u, jnp.zeros((), u.dtype))  # unowned rows add nothing
    v = jnp.where(owned[:, None], v, jnp.zeros((), v.dtype))
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    d = jax.lax.ragged_dot_general(u0, v, sizes, dims, preferred_element_type=jnp.float32)
    return d.astype(jnp.bfloat16)


def grouped_gemm_wgrad(u: jax.Array, v: jax.Array, offsets: jax.Array) -> jax.Array:
    """Per expert e, ``d[e] = u[rows].T @ v[rows]`` over its rows ``offsets[e] <= r < offsets[e+1]``.

    u [M, P] bfloat16 and v [M, Q] bfloat16 (expert-sorted rows: a forward GEMM's output gradient
    and its input); offsets [E+1] int32. P and Q multiples of 8. Returns d [E, P, Q] bfloat16
    (float32 accumulation over the expert's rows; zeros for an expert with none): the gradient of
    the forward's weights [E, P, Q] as they are stored. CPU or no module: the jnp reference.
    """
    _check_wgrad(u, v, offsets)
    e, p, q = offsets.shape[0] - 1, u.shape[1], v.shape[1]
    if u.shape[0] == 0:
        return jnp.zeros((e, p, q), jnp.bfloat16)
    return _lower("wgrad", "coop_128x256", (e, p, q), _wgrad_reference, u, v, offsets, (), groups=e)
