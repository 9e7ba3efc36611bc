"""GEMM2 with the weighted un-permute in its epilogue: each expert row, times its routing weight,
is added straight into its token's output row, so the forward's ``[T*k, H]`` rows are never
written nor read back by a separate un-permute.

:func:`grouped_gemm_scatter` is :func:`jax_moe.backends.cutlass_gemm.grouped_gemm` whose epilogue
(``ffi/cutlass/scatter_epilogue.cuh``) computes, per row r of expert e, whose top-k slot is
``s = slots[r] = t * k + j`` (the sort's ``sorted_slots``), in float32::

    v = a[r] @ b[e].T                        # [N]   (FP8: * a_scale[r] * b_scale[e, n])
    v = (v + bias[e]) * weights[t, j]        # optional GEMM2 bias, then the routing weight
    d[t] += bf16(v)                          # 16-byte bf16 atomics in the L2

into ``d [T, N]`` bfloat16, zeroed first. A row whose slot is outside ``[0, T*k)`` adds nothing;
so do the rows outside ``[offsets[0], offsets[E])``. A token's k adds come from different CTAs
in no fixed order and each rounds to bf16, so the result carries up to k roundings (the
un-permute kernel's float32 sum carries one) and its last bits may differ from run to run. The
weights are the layouts the forward's GEMM2 reads: bf16 ``b [E, N, K]`` (K contiguous, as
stored) or ``b [E, K, N]`` (N contiguous, ``transposed=True``: the prepared layout of
:mod:`jax_moe.backends.cutlass_prepared`), or FP8 ``b [E, N, K]``.

Where it pays: the adds replace GEMM2's ``[T*k, N]`` store and the un-permute kernel's read of it.
:func:`jax_moe.backends.cutlass.apply`'s ``finalize`` picks it (:func:`scatters`): by default
wherever it applies, unless ``JAX_MOE_CUTLASS_FINALIZE=gather`` or XLA's determinism flags
(:func:`auto_finalize`) ask for the bit-reproducible sum.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.backends.cutlass_gemm import (
    ALIGN_N,
    SCATTER_KINDS,
    TILES,
    _check_operands,
    _check_scale,
    _reference,
    _register,
    _resolve_tile,
    _row_col_scales,
    full_scales,
    kernel_scales,
    check_offsets,
    dtype_name,
    owned_rows,
    row_experts,
    workspace_size,
)
from jax_moe.config import check_rank
from jax_moe.layouts.transposed import transpose_experts, transposed_shape

# how cutlass.apply sums a token's k expert rows (its ``finalize`` argument)
FINALIZES = ("auto", "gather", "scatter")
# JAX_MOE_CUTLASS_FINALIZE (read at trace time): what "auto" means, "gather" or "scatter"
FINALIZE_ENV = "JAX_MOE_CUTLASS_FINALIZE"
# XLA's own switches for deterministic GPU programs (in XLA_FLAGS): under either, "auto" gathers
DETERMINISTIC_XLA_FLAGS = ("--xla_gpu_deterministic_ops", "--xla_gpu_exclude_nondeterministic_ops")


def deterministic_requested(xla_flags: str | None = None) -> bool:
    """Whether ``XLA_FLAGS`` (``xla_flags``: that string, None: the environment's) turns on one of
    XLA's switches for deterministic GPU programs (:data:`DETERMINISTIC_XLA_FLAGS`), written
    ``--flag``, ``--flag=true`` or ``--flag=1``: the same request XLA's own scatter-adds honour."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    for word in flags.split():
        name, _, value = word.partition("=")
        if name in DETERMINISTIC_XLA_FLAGS and value.lower() in ("", "true", "1"):
            return True
    return False


def auto_finalize() -> tuple[str, str]:
    """What ``finalize="auto"`` means now -> (``"gather"`` or ``"scatter"``, why): the
    ``JAX_MOE_CUTLASS_FINALIZE`` variable where set; else ``"gather"`` under XLA's determinism
    flags (:func:`deterministic_requested`); else ``"scatter"``, as XLA's own scatter-adds on a GPU
    take atomics unless those flags ask otherwise. ValueError for another value of the variable."""
    mode = os.environ.get(FINALIZE_ENV, "")
    if mode:
        if mode not in ("gather", "scatter"):
            raise ValueError(f"{FINALIZE_ENV} must be 'gather' or 'scatter', got {mode!r}")
        return mode, f"{FINALIZE_ENV}={mode}"
    if deterministic_requested():
        return "gather", "XLA_FLAGS asks for deterministic GPU ops"
    return "scatter", "the default where no flag asks for determinism"


def scatters(finalize: str, *, bf16_out: bool) -> bool:
    """Whether a cutlass forward sums its k rows per token in GEMM2's epilogue
    (:func:`grouped_gemm_scatter`) rather than with the un-permute kernel.

    ``finalize``: ``"gather"`` (the un-permute kernel: a float32 sum, bit-reproducible),
    ``"scatter"`` (GEMM2's epilogue), or ``"auto"``: :func:`auto_finalize` (scatter unless
    ``JAX_MOE_CUTLASS_FINALIZE`` or XLA's determinism flags say gather), and scatter only where the
    output is bf16 (``bf16_out``: a float32 output keeps its float32 sum). A kernel takes every
    layout of GEMM2's weights: FP8 [E, H, I], bf16 [E, H, I] as stored, or bf16 [E, I, H] (the
    prepared layout)."""
    if finalize not in FINALIZES:
        raise ValueError(f"finalize must be one of {FINALIZES}, got {finalize!r}")
    if finalize != "auto":
        return finalize == "scatter"
    return auto_finalize()[0] == "scatter" and bf16_out


def scattered_gemm2(a2, w2, sort, topk_weights, *, w2_bias=None, apply_router_weight_on_input: bool = False,
                    tile: str | None = "auto", transposed: bool = False, **scales) -> jax.Array:
    """A forward's GEMM2 and un-permute as one call: :func:`grouped_gemm_scatter` on the sort's
    rows (``sort.offsets``, ``sort.sorted_slots``) with the routing weights [T, k] (ones where
    ``apply_router_weight_on_input`` put them into x) and ``w2_bias`` [E, H] (any float dtype, or
    None) in float32; ``scales``: FP8's ``a_scale`` and ``b_scale``. Returns [T, H] bfloat16."""
    tw = topk_weights.astype(jnp.float32)
    bias = None if w2_bias is None else w2_bias.astype(jnp.float32)
    return grouped_gemm_scatter(a2, w2, sort.offsets, sort.sorted_slots,
                                jnp.ones_like(tw) if apply_router_weight_on_input else tw, bias=bias, tile=tile,
                                transposed=transposed, **scales)


def _check_scatter(a, b, offsets, slots, weights, a_scale, b_scale, bias, tile, transposed):
    """Checks :func:`grouped_gemm_scatter`'s arguments (ValueError) -> (kind, tile, b as [E, N, K])."""
    check_rank("a", a, 2, "[M, K]")
    check_rank("b", b, 3, "[E, K, N] (bf16, transposed)" if transposed else "[E, N, K]")
    if dtype_name(a) == "float8_e4m3fn" and transposed:
        raise ValueError("FP8 b must be [E, N, K] (transposed=False): the FP8 tensor cores read K-major weights")
    stored = transposed_shape(b) if transposed else b
    m, k = a.shape
    kind = _check_operands(a, stored, k, a_scale, b_scale, {(m,): "per row [M]"})
    e, n, _ = stored.shape
    check_offsets(offsets, e, m)
    check_rank("slots", slots, 1, "[M]")
    if dtype_name(slots) != "int32" or slots.shape[0] != m:
        raise ValueError(f"slots must be [M] = [{m}] int32 (each row's top-k slot t * k + j), "
                         f"got {list(slots.shape)} {dtype_name(slots)}")
    check_rank("weights", weights, 2, "[T, k]")
    if dtype_name(weights) != "float32" or weights.shape[1] < 1:
        raise ValueError(f"weights must be [T, k] float32 with k >= 1 (the routing weights), "
                         f"got {list(weights.shape)} {dtype_name(weights)}")
    if n % ALIGN_N:
        raise ValueError(f"N must be a multiple of {ALIGN_N} (16-byte rows of d), got N={n}")
    if bias is not None:
        _check_scale("bias", bias, {(e, n): "[E, N] float32: each expert's GEMM2 bias"})
    # its own tuned tiles ("fp8_scatter/E/N/K"), else GEMM2's tuned tiles, else the tile table (pick_tile)
    scatter_kind = "fp8_scatter" if kind == "fp8" else "bf16_kn_scatter" if transposed else "bf16_scatter"
    return scatter_kind, _resolve_tile(tile, m, e, n=n, k=k, kind=scatter_kind), stored


def grouped_gemm_scatter_shape(a, b, offsets, slots, weights, *, a_scale=None, b_scale=None, bias=None,
                               transposed: bool = False) -> jax.ShapeDtypeStruct:
    """The shape rule: a [M, K], b [E, K, N] bf16 (``transposed``) or [E, N, K], slots [M],
    weights [T, k] -> d [T, N] bfloat16 (no data read)."""
    _, _, stored = _check_scatter(a, b, offsets, slots, weights, a_scale, b_scale, bias, "auto", transposed)
    return jax.ShapeDtypeStruct((weights.shape[0], stored.shape[1]), jnp.bfloat16)


def _scatter_reference(a, b, offsets, slots, weights, row, col, bias):
    """The definition in float32: the rows' GEMM (scales included), the bias, the slot's weight, a
    sum per token over the owned rows (slots outside [0, T*k) dropped), then bf16."""
    m = a.shape[0]
    t, k = weights.shape
    if t == 0:
        return jnp.zeros((0, b.shape[1]), jnp.bfloat16)
    v = _reference(a, b, offsets, row, col, dtype=jnp.float32)
    off, owned = owned_rows(offsets, m)
    if bias is not None:
        v = v + bias[row_experts(off, m)]
    ok = owned & (slots >= 0) & (slots < t * k)
    w = weights.reshape(-1)[jnp.clip(slots, 0, t * k - 1)]
    v = jnp.where(ok[:, None], v * w[:, None], 0.0)
    return jax.ops.segment_sum(v, jnp.where(ok, slots // k, t), num_segments=t).astype(jnp.bfloat16)


def grouped_gemm_scatter_reference(a, b, offsets, slots, weights, *, a_scale=None, b_scale=None, bias=None,
                                   tile=None, transposed: bool = False) -> jax.Array:
    """jnp reference of :func:`grouped_gemm_scatter` (same arguments and result; ``tile`` is checked
    and ignored): the rows' products in float32, the bias and weight, summed per token in float32."""
    kind, _, _ = _check_scatter(a, b, offsets, slots, weights, a_scale, b_scale, bias, tile, transposed)
    bs = transpose_experts(b) if transposed else b
    scales = (None, None) if kind != "fp8_scatter" else _row_col_scales(a_scale, b_scale, (a.shape[0],),
                                                                       bs.shape[0], bs.shape[1])
    return _scatter_reference(a, bs, offsets, slots, weights, *scales, bias)


def grouped_gemm_scatter(a: jax.Array, b: jax.Array, offsets: jax.Array, slots: jax.Array, weights: jax.Array, *,
                         a_scale=None, b_scale=None, bias=None, tile: str | None = "auto",
                         transposed: bool = False) -> jax.Array:
    """``d[t] = sum_j weights[t, j] * (a[r] @ b[e(r)].T + bias[e(r)])`` over the rows r of token t's
    slots (``slots[r] = t * k + j``).

    a [M, K] expert-sorted rows (expert e owns ``offsets[e] <= r < offsets[e+1]``); offsets [E+1]
    int32; slots [M] int32 (each row's top-k slot: ``sort_by_expert``'s ``sorted_slots``; outside
    ``[0, T*k)``: dropped); weights [T, k] float32 (the routing weights; ones where the weight went
    into the input); ``bias`` [E, N] float32 or None.

    - bfloat16 a and b [E, N, K] (K contiguous: the weights as stored), or with ``transposed=True``
      b [E, K, N] (N contiguous: the prepared layout).
    - float8_e4m3fn a and b [E, N, K] with ``a_scale``/``b_scale`` as
      :func:`~jax_moe.backends.cutlass_gemm.grouped_gemm` takes them (handed to the kernel in their
      own forms, :func:`~jax_moe.backends.cutlass_gemm.kernel_scales`).

    Returns d [T, N] bfloat16, N a multiple of 8. The adds are bf16 atomics in no fixed
    order (see the module note). ``tile``: ``"auto"`` (the pick for kind ``"bf16_scatter"``,
    ``"bf16_kn_scatter"`` or ``"fp8_scatter"``: tuned tiles of its own where a tile cache has them,
    else the gathering GEMM2's (``"bf16"``, ``"bf16_kn"`` or ``"fp8"``) tuned tiles, then rows of
    the tile table) or a name in
    :data:`TILES`. CPU or no module: :func:`grouped_gemm_scatter_reference`.
    """
    kind, tile, stored = _check_scatter(a, b, offsets, slots, weights, a_scale, b_scale, bias, tile, transposed)
    m, (e, n, _) = a.shape[0], stored.shape
    t = weights.shape[0]
    if t == 0:
        return jnp.zeros((0, n), jnp.bfloat16)
    scaled = kind == "fp8_scatter"
    if scaled:
        row, col = kernel_scales(a_scale, b_scale, (m,), e, n)
    else:
        row = col = jnp.zeros((0,), jnp.float32)
    bias_in = jnp.zeros((0,), jnp.float32) if bias is None else bias

    def default(a, b, offsets, slots, weights, row, col, bias_in):
        bs = transpose_experts(b) if transposed else b
        if scaled:
            row, col = full_scales(row, col, (m,), e, n)
        return _scatter_reference(a, bs, offsets, slots, weights, row if scaled else None, col if scaled else None,
                                  None if bias is None else bias_in)

    if m == 0 or not _register():
        return default(a, b, offsets, slots, weights, row, col, bias_in)

    def cuda(*args):
        outs = (jax.ShapeDtypeStruct((t, n), jnp.bfloat16),
                jax.ShapeDtypeStruct((workspace_size(e, tile, kind),), jnp.uint8))
        d, _ = jax.ffi.ffi_call(SCATTER_KINDS[kind][1], outs, vmap_method="sequential")(
            *args, tile=np.int64(TILES[tile]), transposed=np.int64(transposed))
        return d

    return jax.lax.platform_dependent(a, b, offsets, slots, weights, row, col, bias_in, cuda=cuda, default=default)
