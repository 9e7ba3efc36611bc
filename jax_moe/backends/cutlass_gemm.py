"""jax_moe's own SM90 CUTLASS grouped GEMMs, the custom calls under ``backend="cutlass"``
(:mod:`jax_moe.backends.cutlass`).

:func:`grouped_gemm` is the SM90 CUTLASS pointer-array grouped GEMM of
``ffi/cutlass/grouped_gemm*`` (bf16 x bf16 -> bf16, or e4m3 x e4m3 -> bf16 with the scales in an
epilogue visitor tree; float32 accumulation, for FP8 the tensor cores' own over the whole K
without promotion), in the nanobind module ``jax_moe._jax_moe_cutlass``
(``cmake/cutlass_gemm.cmake``). Its per-group arguments are built on the device from the offsets,
so the call never waits for the GPU and is safe in a CUDA graph. Its workspace is a second,
discarded ``uint8`` result, sized at trace time (:func:`workspace_size`). The tile configuration
(:data:`TILES`) is picked at trace time per GEMM, from its shape and rows per expert
(:mod:`jax_moe.backends.cutlass_tiles`); ``tile=`` or ``JAX_MOE_CUTLASS_TILE`` overrides it.

Batched activation format (``[E, C, H]``, C rows of capacity per expert, ``counts [E]`` rows used,
as after an all-to-all dispatch): :func:`grouped_gemm_batched` runs the same FFI targets and CUTLASS
instantiations (the handler reads the format from a's rank: ``a [E, C, K]`` and ``counts [E]``
instead of ``a [M, K]`` and ``offsets [E+1]``; FP8 row scales ``[E, C]``), the counts clamped to
``[0, C]`` on the device, rows past them zero in d and never read in a; still no host sync.

Each form has its shape rule (:func:`grouped_gemm_shape`, :func:`grouped_gemm_batched_shape`) and
its jnp reference (:func:`grouped_gemm_reference`, :func:`grouped_gemm_batched_reference`), which
runs wherever the kernel cannot (CPU, or no module).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.backends.cutlass_tiles import (  # noqa: F401  (the tile facts, re-exported)
    DECODE_ROWS_PER_EXPERT,
    TILE_ENV,
    TILES,
    WIDE_ROWS_PER_EXPERT,
    pick_tile,
)
from jax_moe.config import check_rank
from jax_moe.ffi import gpu_backend, load_once
from jax_moe.permute import batched_rows_used

log = logging.getLogger("jax_moe")

# kind -> (CutlassGemmKind in ffi/cutlass/grouped_gemm.h, FFI target, dtype of a and b)
KINDS: dict[str, tuple[int, str, str]] = {
    "bf16": (0, "jax_moe_cutlass_grouped_gemm", "bfloat16"),
    "fp8": (1, "jax_moe_cutlass_grouped_gemm_fp8", "float8_e4m3fn"),
}
# the backward pass's bf16 kinds (jax_moe.backends.cutlass_grad_gemm): kind -> (CutlassGemmKind, FFI target)
GRAD_KINDS: dict[str, tuple[int, str]] = {
    "dgrad": (2, "jax_moe_cutlass_grouped_gemm_dgrad"),  # d[r] = a[r] @ b[e]       (b [E, K, N])
    "wgrad": (3, "jax_moe_cutlass_grouped_gemm_wgrad"),  # d[e] = u[rows of e]^T @ v[rows of e]
}
# GEMM1 with the gated activation in its epilogue (jax_moe.backends.cutlass_act_gemm), one FFI target
# for all three: kind -> (CutlassGemmKind, FFI target, dtype of a and b); "bf16_act_kn" reads b [E, K, N]
# (the transposed layout of jax_moe.backends.cutlass_prepared)
ACT_KINDS: dict[str, tuple[int, str, str]] = {
    "bf16_act": (4, "jax_moe_cutlass_grouped_gemm_act", "bfloat16"),
    "fp8_act": (5, "jax_moe_cutlass_grouped_gemm_act", "float8_e4m3fn"),
    "bf16_act_kn": (6, "jax_moe_cutlass_grouped_gemm_act", "bfloat16"),
}
# GEMM2 with the weighted un-permute in its epilogue (jax_moe.backends.cutlass_scatter_gemm), one FFI
# target for all three: kind -> (CutlassGemmKind, FFI target, dtype of a and b); "bf16_kn_scatter"
# reads b [E, K, N] (the transposed layout), the others b [E, N, K]
SCATTER_KINDS: dict[str, tuple[int, str, str]] = {
    "bf16_kn_scatter": (7, "jax_moe_cutlass_grouped_gemm_scatter", "bfloat16"),
    "fp8_scatter": (8, "jax_moe_cutlass_grouped_gemm_scatter", "float8_e4m3fn"),
    "bf16_scatter": (9, "jax_moe_cutlass_grouped_gemm_scatter", "bfloat16"),
}
ALIGN_N = 8  # N: 16-byte bf16 rows of d; ffi: kCutlassAlignN
ALIGN_K = {"bf16": 8, "fp8": 16}  # K: 16-byte rows of a and b; ffi: kCutlassAlignKBf16, kCutlassAlignKFp8

_state: dict = {"module": None, "error": None, "registered": False}


# ----------------------------------------------------------------------------- the native module


def _import():
    from jax_moe import _jax_moe_cutlass  # noqa: PLC0415

    return _jax_moe_cutlass


def _not_loaded(err) -> str:
    why = (f"jax_moe._jax_moe_cutlass is not built or cannot load ({err}); it needs CUTLASS headers at "
           "build time (CUTLASS_DIR, FLASHINFER_SRC_DIR or flashinfer-python) and JAX_MOE_CUDA_ARCHS with 90a")
    log.info("jax_moe: %s", why)
    return why


def _module():
    """``jax_moe._jax_moe_cutlass`` or None (the reason recorded in ``_state`` and logged once)."""
    return load_once(_state, _import, _not_loaded)


def available(device=None) -> tuple[bool, str]:
    """Whether the custom calls can run on ``device`` (default: JAX's default device), and why not."""
    from jax_moe.device import sm90_module_ready

    ok, why = sm90_module_ready(_module(), _state["error"], device)
    if not ok:
        return False, why
    return True, "jax_moe CUTLASS grouped GEMMs (SM90, bf16 and fp8)"


def _constants_match(mod) -> bool:
    """The compiled module's tile and kind counts and alignments are this file's."""
    want = {"num_tiles": len(TILES), "num_kinds": len(KINDS) + len(GRAD_KINDS) + len(ACT_KINDS) + len(SCATTER_KINDS),
            "align_n": ALIGN_N,
            "align_k_bf16": ALIGN_K["bf16"], "align_k_fp8": ALIGN_K["fp8"]}
    return all(getattr(mod, name, None) == value for name, value in want.items())


def _register() -> bool:
    """Register the FFI targets once; False where the module or a GPU backend is missing."""
    if _state["registered"]:
        return True
    mod = _module()
    if mod is None or not gpu_backend():
        return False
    if not _constants_match(mod):
        _state["error"] = ("the compiled module's tiles, kinds or alignments do not match "
                           "jax_moe/backends/cutlass_gemm.py (rebuild it)")
        _state["module"] = None
        return False
    for name, capsule in mod.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    _state["registered"] = True
    return True


@functools.lru_cache(maxsize=None)
def workspace_size(num_groups: int, tile: str, kind: str = "bf16") -> int:
    """Bytes of the grouped GEMM's workspace result for ``num_groups`` experts, ``tile`` and
    ``kind`` (a key of :data:`KINDS`, :data:`GRAD_KINDS`, :data:`ACT_KINDS` or :data:`SCATTER_KINDS`)
    on the current CUDA device: per-group arrays (each group's two TMA descriptors among them), and
    CUTLASS's share, which the SM count sets."""
    mod = _module()
    if mod is None:
        raise RuntimeError(_state["error"])
    kind_id = {**KINDS, **GRAD_KINDS, **ACT_KINDS, **SCATTER_KINDS}[kind][0]
    return int(mod.workspace_size(int(num_groups), TILES[tile], kind=kind_id))


# ----------------------------------------------------------------------------- grouped GEMM


def dtype_name(x) -> str:
    return jnp.dtype(x.dtype).name


def _check_scale(name: str, s, shapes: dict[tuple, str]) -> None:
    """``s`` is a float32 array of one of ``shapes`` (shape -> what it means), else ValueError."""
    if not hasattr(s, "shape") or not hasattr(s, "dtype"):
        raise ValueError(f"{name} must be a float32 array, got {type(s).__name__}")
    if dtype_name(s) != "float32":
        raise ValueError(f"{name} must be float32, got {dtype_name(s)}")
    if tuple(s.shape) not in shapes:
        want = ", ".join(f"{list(k)} ({v})" for k, v in shapes.items())
        raise ValueError(f"{name} must have shape {want}; got {list(s.shape)}")


def _check_gemm(a, b, offsets, a_scale, b_scale, tile, table: str | None = None) -> tuple[str, str]:
    """Checks :func:`grouped_gemm`'s arguments (ValueError) and resolves (kind, tile); ``table``:
    the tile table's kind to pick from (None: the operands' kind)."""
    for name, x, rank, what in (("a", a, 2, "[M, K]"), ("b", b, 3, "[E, N, K]"), ("offsets", offsets, 1, "[E+1]")):
        check_rank(name, x, rank, what)
    m, k = a.shape
    e = b.shape[0]
    kind = _check_operands(a, b, k, a_scale, b_scale, {(m,): "per row [M]"})
    check_offsets(offsets, e, m)
    return kind, _resolve_tile(tile, m, e, n=b.shape[1], k=k, kind=table or kind)


def check_offsets(offsets, e: int, m: int) -> None:
    """``offsets`` is an int32 [E+1] vector for ``e`` experts over ``m`` rows, and M fits int32."""
    check_rank("offsets", offsets, 1, "[E+1]")
    if jnp.dtype(offsets.dtype) != jnp.int32:
        raise ValueError(f"offsets must be int32, got {dtype_name(offsets)}")
    if offsets.shape[0] != e + 1:
        raise ValueError(f"offsets must have E + 1 = {e + 1} elements, got {offsets.shape[0]}")
    if m >= 2**31:
        raise ValueError(f"dimensions must fit in int32, got M={m}")


def _check_gemm_batched(a, b, counts, a_scale, b_scale, tile) -> tuple[str, str]:
    """Checks :func:`grouped_gemm_batched`'s arguments (ValueError) and resolves (kind, tile)."""
    for name, x, rank, what in (("a", a, 3, "[E, C, K]"), ("b", b, 3, "[E, N, K]"), ("counts", counts, 1, "[E]")):
        check_rank(name, x, rank, what)
    e, c, k = a.shape
    kind = _check_operands(a, b, k, a_scale, b_scale, {(e, c): "per row [E, C]"})
    if b.shape[0] != e:
        raise ValueError(f"b must be [E, N, K] with a's E = {e} experts, got shape {list(b.shape)}")
    if jnp.dtype(counts.dtype) != jnp.int32:
        raise ValueError(f"counts must be int32, got {dtype_name(counts)}")
    if counts.shape[0] != e:
        raise ValueError(f"counts must have E = {e} elements (one per expert), got {counts.shape[0]}")
    if e * c >= 2**31:
        raise ValueError(f"dimensions must fit in int32, got E*C={e * c}")
    return kind, _resolve_tile(tile, e * c, e, n=b.shape[1], k=k, kind=kind)


def _check_operands(a, b, k: int, a_scale, b_scale, row_forms: dict[tuple, str]) -> str:
    """What both formats share: dtypes (-> the kind), b's K, E >= 1, 16-byte rows, int32 sizes and
    the fp8 scales (``row_forms``: a_scale's per-row shapes besides per tensor)."""
    kinds = {dt: kind for kind, (_, _, dt) in KINDS.items()}
    if dtype_name(a) not in kinds:
        raise ValueError(f"a must be bfloat16, or float8_e4m3fn (with a_scale and b_scale), got {dtype_name(a)}")
    kind = kinds[dtype_name(a)]
    if dtype_name(b) != dtype_name(a):
        raise ValueError(f"b must have a's dtype {dtype_name(a)}, got {dtype_name(b)}")
    e, n, k2 = b.shape
    if k2 != k:
        raise ValueError(f"b must be [E, N, K] with a's K = {k}, got shape {list(b.shape)}")
    if e < 1:
        raise ValueError("b must hold at least one expert")
    ak = ALIGN_K[kind]
    if k < ak or k % ak or n < ALIGN_N or n % ALIGN_N:
        raise ValueError(f"{kind}: K must be a positive multiple of {ak} and N of {ALIGN_N} (16-byte rows), "
                         f"got K={k}, N={n}")
    if max(n, k) >= 2**31:
        raise ValueError(f"dimensions must fit in int32, got N={n}, K={k}")
    if kind == "bf16":
        for name, s in (("a_scale", a_scale), ("b_scale", b_scale)):
            if s is not None:
                raise ValueError(f"{name} is only taken with float8_e4m3fn a and b (bf16 has no scales)")
    else:
        for name, s in (("a_scale", a_scale), ("b_scale", b_scale)):
            if s is None:
                raise ValueError(f"{name} is required with float8_e4m3fn a and b")
        _check_scale("a_scale", a_scale, {(): "per tensor", (1,): "per tensor", **row_forms})
        _check_scale("b_scale", b_scale, {(): "per tensor", (e,): "per expert [E]", (e, n): "per channel [E, N]",
                                          (e, n, 1): "per channel [E, N, 1]"})
    return kind


def _resolve_tile(tile, rows: int, e: int, *, n: int | None = None, k: int | None = None,
                  kind: str = "bf16") -> str:
    """``tile`` checked, or for ``"auto"``/None the pick for this GEMM (:func:`pick_tile`: the
    measured table when ``n``/``k`` are given, else the heuristic)."""
    if tile is None or tile == "auto":
        return pick_tile(rows, e, n=n, k=k, kind=kind)
    if tile not in TILES:
        raise ValueError(f"tile must be 'auto' or one of {sorted(TILES)}, got {tile!r}")
    return tile


def kernel_scales(a_scale, b_scale, rows: tuple[int, ...], e: int, n: int) -> tuple[jax.Array, jax.Array]:
    """The fused GEMMs' (act, scatter) FP8 scale operands, in the compact forms their kernels read, so
    that no broadcast runs before the GEMM: row ``rows`` float32 ([M] per row) or [1] (per tensor);
    col [E, N] (per channel), [E, 1] (per expert) or [1, 1] (per tensor). From any form
    :func:`grouped_gemm` accepts."""
    row = jnp.reshape(a_scale, (-1,))
    if row.shape[0] != 1:
        row = row.reshape(rows)
    col = jnp.reshape(b_scale, (1, 1) if b_scale.ndim == 0 else (e, 1) if b_scale.ndim == 1 else (e, n))
    return row, col


def full_scales(row, col, rows: tuple[int, ...], e: int, n: int) -> tuple[jax.Array, jax.Array]:
    """:func:`kernel_scales`' operands broadcast whole: row ``rows`` ([M], or [E, C] batched) and col
    [E, N] float32 (the plain FP8 GEMM's epilogue and the jnp references read whole vectors)."""
    return jnp.broadcast_to(jnp.reshape(row, (-1,)), (int(np.prod(rows)),)).reshape(rows), jnp.broadcast_to(col, (e, n))


def _row_col_scales(a_scale, b_scale, rows: tuple[int, ...], e: int, n: int):
    """The plain kernel's scale operands: row ``rows`` ([M], or [E, C] batched) and col [E, N]
    float32, broadcast from any accepted form."""
    return full_scales(*kernel_scales(a_scale, b_scale, rows, e, n), rows, e, n)


def grouped_gemm_shape(a, b, offsets, *, a_scale=None, b_scale=None) -> jax.ShapeDtypeStruct:
    """The shape rule: a [M, K], b [E, N, K], offsets [E+1] (and the scales, for fp8) ->
    d [M, N] bfloat16 (no data read)."""
    _check_gemm(a, b, offsets, a_scale, b_scale, "auto")
    return jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), jnp.bfloat16)


def grouped_gemm_reference(a, b, offsets, *, a_scale=None, b_scale=None, tile=None) -> jax.Array:
    """jnp reference of :func:`grouped_gemm` (same arguments and result; ``tile`` is checked and
    ignored): ``jax.lax.ragged_dot`` in float32 over the clamped offsets, then the scales, zero
    rows outside the offsets."""
    kind, _ = _check_gemm(a, b, offsets, a_scale, b_scale, tile)
    if kind == "bf16":
        return _reference(a, b, offsets, None, None)
    return _reference(a, b, offsets, *_row_col_scales(a_scale, b_scale, (a.shape[0],), b.shape[0], b.shape[1]))


def owned_rows(offsets, m: int):
    """The kernel's clamp of ``offsets`` [E+1] to [0, m] (a decreasing pair is an empty expert) ->
    (clamped offsets [E+1], owned [m] bool: rows in [offsets[0], offsets[E]))."""
    off = jax.lax.cummax(jnp.clip(offsets, 0, m))
    rows = jnp.arange(m, dtype=jnp.int32)
    return off, (rows >= off[0]) & (rows < off[-1])


def row_experts(off, m: int):
    """The expert of each of ``m`` rows under clamped offsets ``off`` [E+1] (:func:`owned_rows`) ->
    [m] int32 in [0, E); an unowned row gets its nearest expert (its values are zeroed anyway)."""
    rows = jnp.arange(m, dtype=jnp.int32)
    return jnp.clip(jnp.searchsorted(off, rows, side="right") - 1, 0, off.shape[0] - 2)


def _reference(a, b, offsets, row, col, dtype=jnp.bfloat16):
    """The standard format's reference; ``dtype``: d's (float32 keeps the epilogue's values unrounded)."""
    m = a.shape[0]
    e = b.shape[0]
    off, owned = owned_rows(offsets, m)
    lo, hi = off[0], off[e]
    counts = jnp.diff(off)
    sizes = counts.at[0].add(lo).at[e - 1].add(m - hi)  # unowned rows ride along, zeroed
    a0 = jnp.where(owned[:, None], a, jnp.zeros((), a.dtype))
    # ragged_dot may multiply every row by every expert's weights (0 * NaN = NaN): an expert without
    # rows, whatever its weights hold, must not reach the others' rows, as in the kernel
    b = jnp.where((counts > 0)[:, None, None], b, jnp.zeros((), b.dtype))
    if row is None:
        d = jax.lax.ragged_dot(a0, jnp.swapaxes(b, 1, 2), sizes.astype(jnp.int32),
                               preferred_element_type=jnp.float32)
        return d.astype(dtype)
    # fp8: exact products in float32, then the epilogue's (acc * col) * row
    d = jax.lax.ragged_dot(a0.astype(jnp.float32), jnp.swapaxes(b, 1, 2).astype(jnp.float32),
                           sizes.astype(jnp.int32), precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
    d = d * col[row_experts(off, m)] * row[:, None]
    return jnp.where(owned[:, None], d, 0.0).astype(dtype)


def grouped_gemm(a: jax.Array, b: jax.Array, offsets: jax.Array, *, a_scale=None, b_scale=None,
                 tile: str | None = "auto") -> jax.Array:
    """Per expert e, ``d[r] = a[r] @ b[e].T`` for the rows ``offsets[e] <= r < offsets[e+1]``.

    a [M, K] (expert-sorted rows); b [E, N, K] (K contiguous: vLLM's w13 and w2 as they are);
    offsets [E+1] int32, nondecreasing (``sort_by_expert``'s offsets; clamped to [0, M]).

    - bfloat16 a and b: ``d = a @ b[e].T``; K and N multiples of 8.
    - float8_e4m3fn a and b, with dequantization scales (float32): ``d[r, n] = (a[r] @ b[e].T)[n]
      * a_scale[r] * b_scale[e, n]``; ``a_scale`` [] or [1] (per tensor) or [M] (per row/token),
      ``b_scale`` [] (per tensor), [E] (per expert), [E, N] or [E, N, 1] (per channel), broadcast
      here to the kernel's [M] and [E, N]. K a multiple of 16, N of 8.

    Returns d [M, N] bfloat16 (float32 accumulation), zero outside ``[offsets[0], offsets[E])``.
    ``tile``: ``"auto"`` (:func:`pick_tile`, at trace time) or a name in :data:`TILES`. Runs the
    CUTLASS kernel where lowered for a GPU with ``jax_moe._jax_moe_cutlass`` loaded, else
    :func:`grouped_gemm_reference`.
    """
    kind, tile = _check_gemm(a, b, offsets, a_scale, b_scale, tile)
    m, n, e = a.shape[0], b.shape[1], b.shape[0]
    if m == 0:
        return jnp.zeros((0, n), jnp.bfloat16)
    scales = () if kind == "bf16" else _row_col_scales(a_scale, b_scale, (m,), e, n)
    return _lower(kind, tile, (m, n), _reference, a, b, offsets, scales)


def _lower(kind: str, tile: str, d_shape: tuple, reference, a, b, sizes, scales, groups: int | None = None):
    """The kind's FFI target (one per kind serves both formats: the handler reads a's rank) where
    lowered for a GPU with the module loaded, else ``reference(a, b, sizes, row, col)``.
    ``groups``: the experts (default b's leading dimension, the weights' E)."""
    def default(a, b, sizes, *scales):
        return reference(a, b, sizes, *(scales or (None, None)))

    if not _register():
        return default(a, b, sizes, *scales)

    def cuda(*args):
        outs = (jax.ShapeDtypeStruct(d_shape, jnp.bfloat16),
                jax.ShapeDtypeStruct((workspace_size(groups or b.shape[0], tile, kind),), jnp.uint8))
        target = KINDS[kind][1] if kind in KINDS else GRAD_KINDS[kind][1]
        d, _ = jax.ffi.ffi_call(target, outs, vmap_method="sequential")(*args, tile=np.int64(TILES[tile]))
        return d

    return jax.lax.platform_dependent(a, b, sizes, *scales, cuda=cuda, default=default)


# ----------------------------------------------------------------------------- batched format


def grouped_gemm_batched_shape(a, b, counts, *, a_scale=None, b_scale=None) -> jax.ShapeDtypeStruct:
    """The shape rule of the batched format: a [E, C, K], b [E, N, K], counts [E] (and the scales,
    for fp8) -> d [E, C, N] bfloat16 (no data read)."""
    _check_gemm_batched(a, b, counts, a_scale, b_scale, "auto")
    return jax.ShapeDtypeStruct((a.shape[0], a.shape[1], b.shape[1]), jnp.bfloat16)


def grouped_gemm_batched_reference(a, b, counts, *, a_scale=None, b_scale=None, tile=None) -> jax.Array:
    """jnp reference of :func:`grouped_gemm_batched` (same arguments and result; ``tile`` is
    checked and ignored): a float32 batched matmul over the rows below the clamped counts, then
    the scales; the other rows zero (never read: garbage or NaN there does not leak)."""
    kind, _ = _check_gemm_batched(a, b, counts, a_scale, b_scale, tile)
    e, c, _ = a.shape
    scales = (None, None) if kind == "bf16" else _row_col_scales(a_scale, b_scale, (e, c), e, b.shape[1])
    return _reference_batched(a, b, counts, *scales)


def _reference_batched(a, b, counts, row, col):
    used = batched_rows_used(counts, a.shape[1])[..., None]
    a0 = jnp.where(used, a.astype(jnp.float32), 0.0)
    d = jnp.einsum("eck,enk->ecn", a0, b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
    if row is not None:  # fp8: the epilogue's (acc * col) * row
        d = d * col[:, None, :] * row[..., None]
    return jnp.where(used, d, 0.0).astype(jnp.bfloat16)


def grouped_gemm_batched(a: jax.Array, b: jax.Array, counts: jax.Array, *, a_scale=None, b_scale=None,
                         tile: str | None = "auto") -> jax.Array:
    """:func:`grouped_gemm` on the batched format (rows already grouped per expert, as after an
    all-to-all dispatch): ``d[e, r] = a[e, r] @ b[e].T`` for ``r < counts[e]``.

    a [E, C, K] (C: capacity rows per expert); b [E, N, K]; counts [E] int32, the rows each
    expert uses, clamped to [0, C] on the device (no host sync). fp8: ``a_scale`` [] or [1] (per
    tensor) or [E, C] (per row), ``b_scale`` as for :func:`grouped_gemm`; d[e, r, n] =
    ``(a[e, r] @ b[e].T)[n] * a_scale[e, r] * b_scale[e, n]``.

    Returns d [E, C, N] bfloat16 (float32 accumulation); rows at or past ``counts[e]`` are zeros
    and those rows of a (and a_scale) are never read. The same FFI targets, kernels and
    instantiations as the standard format (the handler reads the format from a's rank). ``tile``
    ``"auto"`` picks from the capacity (:func:`pick_tile` of E*C rows over E experts: C <= 64 is
    the decode tile). CPU or no module: :func:`grouped_gemm_batched_reference`.
    """
    kind, tile = _check_gemm_batched(a, b, counts, a_scale, b_scale, tile)
    e, c, _ = a.shape
    n = b.shape[1]
    if c == 0:
        return jnp.zeros((e, 0, n), jnp.bfloat16)
    scales = () if kind == "bf16" else _row_col_scales(a_scale, b_scale, (e, c), e, n)
    return _lower(kind, tile, (e, c, n), _reference_batched, a, b, counts, scales)
