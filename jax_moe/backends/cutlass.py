"""jax_moe's own CUTLASS MoE for Hopper -- ``backend="cutlass"`` (issue 5).

One forward, every stage a custom call on the expert-sorted rows (:mod:`jax_moe.kernels`)::

    sort = sort_by_expert(topk_ids, E)                              # jax_moe.ffi
    a1 = permute_rows(x, sort.sorted_slots, k, valid_rows=valid)    # [T*k, H] bf16
    h = grouped_gemm(a1, w13, sort.offsets)                         # [T*k, 2I] (I for relu2)
    a2 = act_and_mul(h, activation, valid_rows=valid)               # [T*k, I]
    y = grouped_gemm(a2, w2, sort.offsets)                          # [T*k, H]
    out = unpermute_reduce(y, sort.inverse, topk_weights, valid_rows=valid)   # [T, H]

``valid = sort.offsets[E]``: slots whose expert id is outside ``[0, E)`` (expert-parallel ids of
-1) sort last and are skipped. The weights are used as vLLM stores them (``w13 [E, 2I, H]`` gate
rows then up rows, ``w2 [E, H, I]``, K contiguous): no repack, no per-call weight pass.

FP8 (``quant=QuantConfig("fp8", ...)``: float8_e4m3fn weights with per-tensor ``[]``, per-expert
``[E]`` or per-channel ``[E, N, 1]`` scales) runs the same pipeline on FP8 rows, each GEMM's
dequantization in its epilogue (``d = acc * a_scale[row] * b_scale[expert, col]``)::

    a1, s1 = permute_rows(x, ..., quant="fp8_per_token" | "fp8_static", scale=a13)   # fused quantization
    h = grouped_gemm(a1, w13, sort.offsets, a_scale=s1, b_scale=w13_scale)          # bf16
    a2, s2 = act_and_mul(h, activation, ..., quant="fp8_per_token" | "fp8_static", scale=a2)
    y = grouped_gemm(a2, w2, sort.offsets, a_scale=s2, b_scale=w2_scale)

Activation scales mean what they mean on the ``xla`` backend (:func:`jax_moe.quant.quantize_activation`):
``fp8_per_token`` is one dynamic scale per row; ``fp8_per_tensor`` takes the static ``a13_scale`` /
``a2_scale`` (the max over experts when given per expert), or, when None, the dynamic
``amax / 448`` of the tensor handed over: all of ``x`` for GEMM1 (as xla quantizes x before routing),
and all routed rows of the activation for GEMM2 (an extra float32 pass over the activation, then a
jnp quantization; the fused path serves static and per-token scales). ``relu2`` quantizes in jnp.
What differs from ``xla``: GEMM1's output is rounded to bf16 before the activation (xla keeps
float32), so a few FP8 values of the GEMM2 input land one step apart; the tests bound the effect.

:func:`grouped_gemm` is the SM90 CUTLASS pointer-array grouped GEMM of
``ffi/cutlass_grouped_gemm*`` (bf16 x bf16 -> bf16, or e4m3 x e4m3 -> bf16 with the scales in an
epilogue visitor tree; float32 accumulation), in the nanobind module ``jax_moe._jax_moe_cutlass``
(``cmake/cutlass_gemm.cmake``). Its per-group arguments are built on the device from the offsets,
so the call never waits for the GPU and is safe in a CUDA graph. Its workspace is a second,
discarded ``uint8`` result, sized at trace time (:func:`workspace_size`). The tile configuration
(:data:`TILES`) is picked at trace time from the rows per expert (:func:`pick_tile`); ``tile=`` or
``JAX_MOE_CUTLASS_TILE`` overrides it.

Batched activation format (``[E, C, H]``, C rows of capacity per expert, ``counts [E]`` rows used,
as after an all-to-all dispatch): :func:`grouped_gemm_batched` runs the same FFI targets and CUTLASS
instantiations (the handler reads the format from a's rank: ``a [E, C, K]`` and ``counts [E]``
instead of ``a [M, K]`` and ``offsets [E+1]``; FP8 row scales ``[E, C]``), the counts clamped to
``[0, C]`` on the device, rows past them zero in d and never read in a; still no host sync.
:func:`apply_batched` is the expert stage on that format (GEMM1 -> act_and_mul over all E*C rows ->
GEMM2; no routing weights, those belong to the combine), what :mod:`jax_moe.parallel` runs
between dispatch and combine with ``ParallelConfig(expert_format="batched")`` (the oracle feature
``"batched"``); under expert parallelism CPU-tested on the jnp references, its multi-GPU tests
written.

Scope of this build: bf16, and FP8 W8A8 (``act`` ``fp8_per_tensor`` static or dynamic, or
``fp8_per_token``; not ``bf16`` activations on FP8 weights); activations ``silu`` and ``gelu``
(gated, gate/up rows concatenated) and ``relu2``; no biases; SM90 (``sm_90a``).
"""

from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import kernels
from jax_moe.config import check_rank
from jax_moe.permute import batched_rows_used
from jax_moe.quant import fp8

log = logging.getLogger("jax_moe")

NAME = "cutlass"
# oracle.call_features: "dtype:" names the unquantized weights' dtype (bf16 here); with quant= the
# call carries no dtype feature and supports() decides from the QuantConfig (scheme "fp8").
# "batched": apply_batched, the expert stage on the batched format.
FEATURES = frozenset({"router_weight_on_input", "batched", "dtype:bfloat16"})
# kind -> (CutlassGemmKind in ffi/cutlass_grouped_gemm.h, FFI target, dtype of a and b)
KINDS: dict[str, tuple[int, str, str]] = {
    "bf16": (0, "jax_moe_cutlass_grouped_gemm", "bfloat16"),
    "fp8": (1, "jax_moe_cutlass_grouped_gemm_fp8", "float8_e4m3fn"),
}
# tile name -> CutlassTile in ffi/cutlass_grouped_gemm.h (one CUTLASS instantiation per kind; the K
# tile is 128 bytes: 64 for bf16, 128 for fp8)
TILES: dict[str, int] = {"coop_128x128": 0, "pingpong_64x128": 1}
TILE_ENV = "JAX_MOE_CUTLASS_TILE"
ALIGN_N = 8  # N: 16-byte bf16 rows of d; ffi: kCutlassAlignN
ALIGN_K = {"bf16": 8, "fp8": 16}  # K: 16-byte rows of a and b; ffi: kCutlassAlignKBf16, kCutlassAlignKFp8
ACTIVATIONS = ("silu", "gelu", "relu2")
FP8_ACTS = ("fp8_per_tensor", "fp8_per_token")  # QuantConfig.act values the FP8 path serves
DECODE_ROWS_PER_EXPERT = 64  # at most this many rows per expert on average: the 64-row pingpong tile

_state: dict = {"module": None, "error": None, "registered": False}


# ----------------------------------------------------------------------------- the native module


def _module():
    """``jax_moe._jax_moe_cutlass`` or None (the reason recorded in ``_state`` and logged once)."""
    if _state["module"] is None and _state["error"] is None:
        try:
            from jax_moe import _jax_moe_cutlass as mod  # noqa: PLC0415

            _state["module"] = mod
        except ImportError as e:
            _state["error"] = (f"jax_moe._jax_moe_cutlass is not built or cannot load ({e}); it needs CUTLASS "
                               "headers at build time (CUTLASS_DIR, FLASHINFER_SRC_DIR or flashinfer-python) "
                               "and JAX_MOE_CUDA_ARCHS with 90a")
            log.info("jax_moe: %s", _state["error"])
    return _state["module"]


def available(device=None) -> tuple[bool, str]:
    """Whether the custom calls can run on ``device`` (default: JAX's default device), and why not."""
    from jax_moe.device import sm90_module_ready

    ok, why = sm90_module_ready(_module(), _state["error"], device)
    if not ok:
        return False, why
    return True, "jax_moe CUTLASS grouped GEMMs (SM90, bf16 and fp8)"


def _constants_match(mod) -> bool:
    """The compiled module's tile and kind counts and alignments are this file's."""
    want = {"num_tiles": len(TILES), "num_kinds": len(KINDS), "align_n": ALIGN_N,
            "align_k_bf16": ALIGN_K["bf16"], "align_k_fp8": ALIGN_K["fp8"]}
    return all(getattr(mod, name, None) == value for name, value in want.items())


def _register() -> bool:
    """Register the FFI targets once; False where the module or a GPU backend is missing."""
    if _state["registered"]:
        return True
    mod = _module()
    from jax_moe.ffi import gpu_backend  # noqa: PLC0415

    if mod is None or not gpu_backend():
        return False
    if not _constants_match(mod):
        _state["error"] = ("the compiled module's tiles, kinds or alignments do not match "
                           "jax_moe/backends/cutlass.py (rebuild it)")
        _state["module"] = None
        return False
    for name, capsule in mod.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    _state["registered"] = True
    return True


@functools.lru_cache(maxsize=None)
def workspace_size(num_groups: int, tile: str, kind: str = "bf16") -> int:
    """Bytes of the grouped GEMM's workspace result for ``num_groups`` experts, ``tile`` and
    ``kind`` (``"bf16"`` or ``"fp8"``) on the current CUDA device (its SM count sets CUTLASS's
    share: TMA descriptors per SM)."""
    mod = _module()
    if mod is None:
        raise RuntimeError(_state["error"])
    return int(mod.workspace_size(int(num_groups), TILES[tile], kind=KINDS[kind][0]))


# ----------------------------------------------------------------------------- grouped GEMM


def pick_tile(rows: int, num_groups: int) -> str:
    """The tile for ``rows`` expert-sorted rows over ``num_groups`` experts: the 64-row pingpong
    tile while experts average at most :data:`DECODE_ROWS_PER_EXPERT` rows (decode, small
    batches), else the 128x128 cooperative one. ``JAX_MOE_CUTLASS_TILE`` overrides."""
    forced = os.environ.get(TILE_ENV)
    if forced:
        if forced not in TILES:
            raise ValueError(f"{TILE_ENV} must be one of {sorted(TILES)}, got {forced!r}")
        return forced
    return "pingpong_64x128" if rows <= DECODE_ROWS_PER_EXPERT * num_groups else "coop_128x128"


def _dtype_name(x) -> str:
    return jnp.dtype(x.dtype).name


def _check_scale(name: str, s, shapes: dict[tuple, str]) -> None:
    """``s`` is a float32 array of one of ``shapes`` (shape -> what it means), else ValueError."""
    if not hasattr(s, "shape") or not hasattr(s, "dtype"):
        raise ValueError(f"{name} must be a float32 array, got {type(s).__name__}")
    if _dtype_name(s) != "float32":
        raise ValueError(f"{name} must be float32, got {_dtype_name(s)}")
    if tuple(s.shape) not in shapes:
        want = ", ".join(f"{list(k)} ({v})" for k, v in shapes.items())
        raise ValueError(f"{name} must have shape {want}; got {list(s.shape)}")


def _check_gemm(a, b, offsets, a_scale, b_scale, tile) -> tuple[str, str]:
    """Checks :func:`grouped_gemm`'s arguments (ValueError) and resolves (kind, tile)."""
    for name, x, rank, what in (("a", a, 2, "[M, K]"), ("b", b, 3, "[E, N, K]"), ("offsets", offsets, 1, "[E+1]")):
        check_rank(name, x, rank, what)
    m, k = a.shape
    e = b.shape[0]
    kind = _check_operands(a, b, k, a_scale, b_scale, {(m,): "per row [M]"})
    if jnp.dtype(offsets.dtype) != jnp.int32:
        raise ValueError(f"offsets must be int32, got {_dtype_name(offsets)}")
    if offsets.shape[0] != e + 1:
        raise ValueError(f"offsets must have E + 1 = {e + 1} elements, got {offsets.shape[0]}")
    if m >= 2**31:
        raise ValueError(f"dimensions must fit in int32, got M={m}")
    return kind, _resolve_tile(tile, m, e)


def _check_gemm_batched(a, b, counts, a_scale, b_scale, tile) -> tuple[str, str]:
    """Checks :func:`grouped_gemm_batched`'s arguments (ValueError) and resolves (kind, tile)."""
    for name, x, rank, what in (("a", a, 3, "[E, C, K]"), ("b", b, 3, "[E, N, K]"), ("counts", counts, 1, "[E]")):
        check_rank(name, x, rank, what)
    e, c, k = a.shape
    kind = _check_operands(a, b, k, a_scale, b_scale, {(e, c): "per row [E, C]"})
    if b.shape[0] != e:
        raise ValueError(f"b must be [E, N, K] with a's E = {e} experts, got shape {list(b.shape)}")
    if jnp.dtype(counts.dtype) != jnp.int32:
        raise ValueError(f"counts must be int32, got {_dtype_name(counts)}")
    if counts.shape[0] != e:
        raise ValueError(f"counts must have E = {e} elements (one per expert), got {counts.shape[0]}")
    if e * c >= 2**31:
        raise ValueError(f"dimensions must fit in int32, got E*C={e * c}")
    return kind, _resolve_tile(tile, e * c, e)


def _check_operands(a, b, k: int, a_scale, b_scale, row_forms: dict[tuple, str]) -> str:
    """What both formats share: dtypes (-> the kind), b's K, E >= 1, 16-byte rows, int32 sizes and
    the fp8 scales (``row_forms``: a_scale's per-row shapes besides per tensor)."""
    kinds = {dt: kind for kind, (_, _, dt) in KINDS.items()}
    if _dtype_name(a) not in kinds:
        raise ValueError(f"a must be bfloat16, or float8_e4m3fn (with a_scale and b_scale), got {_dtype_name(a)}")
    kind = kinds[_dtype_name(a)]
    if _dtype_name(b) != _dtype_name(a):
        raise ValueError(f"b must have a's dtype {_dtype_name(a)}, got {_dtype_name(b)}")
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


def _resolve_tile(tile, rows: int, e: int) -> str:
    if tile is None or tile == "auto":
        return pick_tile(rows, e)
    if tile not in TILES:
        raise ValueError(f"tile must be 'auto' or one of {sorted(TILES)}, got {tile!r}")
    return tile


def _row_col_scales(a_scale, b_scale, rows: tuple[int, ...], e: int, n: int):
    """The kernel's scale operands: row ``rows`` ([M], or [E, C] batched) and col [E, N] float32,
    broadcast from any accepted form."""
    row = jnp.broadcast_to(jnp.reshape(a_scale, (-1,)), (int(np.prod(rows)),)).reshape(rows)
    b = jnp.reshape(b_scale, (-1, n) if b_scale.ndim >= 2 else (-1, 1))
    return row, jnp.broadcast_to(b, (e, n))


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


def _reference(a, b, offsets, row, col):
    m = a.shape[0]
    e = b.shape[0]
    off = jnp.clip(offsets, 0, m)
    off = jax.lax.cummax(off)  # the kernel's clamp: a decreasing pair is an empty expert
    lo, hi = off[0], off[e]
    rows = jnp.arange(m, dtype=jnp.int32)
    owned = (rows >= lo) & (rows < hi)
    sizes = jnp.diff(off).at[0].add(lo).at[e - 1].add(m - hi)  # unowned rows ride along, zeroed
    a0 = jnp.where(owned[:, None], a, jnp.zeros((), a.dtype))
    if row is None:
        d = jax.lax.ragged_dot(a0, jnp.swapaxes(b, 1, 2), sizes.astype(jnp.int32),
                               preferred_element_type=jnp.float32)
        return d.astype(jnp.bfloat16)
    # fp8: exact products in float32, then the epilogue's (acc * col) * row
    d = jax.lax.ragged_dot(a0.astype(jnp.float32), jnp.swapaxes(b, 1, 2).astype(jnp.float32),
                           sizes.astype(jnp.int32), precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
    expert = jnp.clip(jnp.searchsorted(off, rows, side="right") - 1, 0, e - 1)
    d = d * col[expert] * row[:, None]
    return jnp.where(owned[:, None], d, 0.0).astype(jnp.bfloat16)


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


def _lower(kind: str, tile: str, d_shape: tuple, reference, a, b, sizes, scales):
    """The kind's FFI target (one per kind serves both formats: the handler reads a's rank) where
    lowered for a GPU with the module loaded, else ``reference(a, b, sizes, row, col)``."""
    def default(a, b, sizes, *scales):
        return reference(a, b, sizes, *(scales or (None, None)))

    if not _register():
        return default(a, b, sizes, *scales)

    def cuda(*args):
        outs = (jax.ShapeDtypeStruct(d_shape, jnp.bfloat16),
                jax.ShapeDtypeStruct((workspace_size(b.shape[0], tile, kind),), jnp.uint8))
        d, _ = jax.ffi.ffi_call(KINDS[kind][1], outs, vmap_method="sequential")(*args, tile=np.int64(TILES[tile]))
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


# ----------------------------------------------------------------------------- the backend


def _quant_refusal(quant, h: int, i: int) -> str | None:
    """Why this build cannot serve ``quant`` (None when it can): scheme, activation format, K alignment."""
    if quant is None:
        return None
    if quant.scheme != "fp8":
        return f"scheme {quant.scheme!r} is not built yet (have bf16, fp8)"
    if quant.act not in FP8_ACTS:
        return (f"act {quant.act!r} on FP8 weights is not built (have {', '.join(FP8_ACTS)}: "
                "the grouped GEMM is FP8 x FP8)")
    if h % ALIGN_K["fp8"] or i % ALIGN_K["fp8"]:
        return f"FP8 needs hidden and intermediate sizes that are multiples of {ALIGN_K['fp8']} (16-byte rows)"
    return None


def supports(cfg, quant=None, device=None) -> tuple[bool, str]:
    """Whether this backend serves ``cfg`` (a :class:`jax_moe.config.MoEConfig`) with ``quant``
    on ``device``, and why not: hardware first, then the scheme, then this build, then shapes."""
    from jax_moe.device import device_info

    dev = device_info(device)
    if dev.sm != 90:
        return False, f"needs SM90 (this build compiles sm_90a only); this device is {dev.describe()}"
    if quant is not None and quant.scheme != "fp8":
        return False, _quant_refusal(quant, cfg.hidden_size, cfg.intermediate_size)
    ok, why = available(dev)
    if not ok:
        return False, why
    refusal = _config_refusal(cfg.activation, cfg.gate_up_layout, cfg.hidden_size, cfg.intermediate_size, quant)
    if refusal:
        return False, refusal
    return True, "ok"


def _config_refusal(activation: str, gate_up_layout: str, h: int, i: int, quant) -> str | None:
    """Why this build cannot run a layer (None when it can): the activation, the gate/up layout,
    16-byte rows, the quant scheme. :func:`supports` returns it; the apply functions raise it."""
    if activation not in ACTIVATIONS:
        return f"activation {activation!r} is not wired up (have {', '.join(ACTIVATIONS)})"
    if gate_up_layout != "concat":
        return f"gate_up_layout {gate_up_layout!r} is not wired up (have 'concat': gate rows, then up)"
    if h % ALIGN_N or i % ALIGN_N:
        return f"hidden and intermediate sizes (H={h}, I={i}) must be multiples of {ALIGN_N} (16-byte rows)"
    return _quant_refusal(quant, h, i)


def _relu2_rows(h, valid, dtype):
    """relu(h)^2 in float32, rows at or past ``valid[0]`` zero (act_and_mul's convention)."""
    rows = jnp.arange(h.shape[0], dtype=jnp.int32) < valid[0]
    r = jnp.maximum(h.astype(jnp.float32), 0.0)
    return jnp.where(rows[:, None], r * r, 0.0).astype(dtype)


def _per_tensor_scale(static, x):
    """``fp8_per_tensor``'s scale for x: the static one (max over experts when [E], as the xla
    backend without expert ids), or the dynamic ``amax(x) / 448``."""
    if static is not None:
        return jnp.max(jnp.asarray(static, jnp.float32))
    return fp8.amax_to_scale(jnp.max(jnp.abs(x.astype(jnp.float32))))


def _quantize_rows(v, act: str, static):
    """float32 rows [M, C] -> (q float8_e4m3fn, a_scale [M] or []) in jnp, as the kernels do."""
    if act == "fp8_per_token":
        q, s = fp8.quantize_fp8_per_token(v)
        return q, s[:, 0]
    s = _per_tensor_scale(static, v)
    return fp8.quantize_fp8_static(v, s), s


def _fp8_gemm1_input(xin, sort, k, valid, quant):
    """GEMM1's FP8 rows and scales: quantization fused into the gather (the scale of a dynamic
    per-tensor act is taken over all of xin first, as the xla backend does)."""
    if quant.act == "fp8_per_token":
        return kernels.permute_rows(xin, sort.sorted_slots, k, valid_rows=valid, quant="fp8_per_token")
    return kernels.permute_rows(xin, sort.sorted_slots, k, valid_rows=valid, quant="fp8_static",
                                scale=_per_tensor_scale(quant.a13_scale, xin))


def _fp8_gemm2_input(h1, cfg, valid, quant):
    """GEMM2's FP8 rows and scales: fused into act_and_mul for per-token and static scales; a
    dynamic per-tensor scale needs the whole activation first (float32 pass, jnp quantization)."""
    fused = quant.act == "fp8_per_token" or quant.a2_scale is not None
    if cfg.gated and fused:
        mode = "fp8_per_token" if quant.act == "fp8_per_token" else "fp8_static"
        scale = None if mode == "fp8_per_token" else _per_tensor_scale(quant.a2_scale, None)
        return kernels.act_and_mul(h1, cfg.activation, valid_rows=valid, quant=mode, scale=scale)
    if cfg.gated:
        a = kernels.act_and_mul(h1, cfg.activation, valid_rows=valid, out_dtype=jnp.float32)
    else:
        a = _relu2_rows(h1, valid, jnp.float32)
    return _quantize_rows(a, quant.act, quant.a2_scale)


def _check_biases(w13_bias, w2_bias) -> None:
    if w13_bias is not None or w2_bias is not None:
        raise ValueError(f"{NAME}: GEMM biases are not supported yet (use backend='flashinfer_cutlass' or 'xla')")


def _check_apply(x, w13, w2, topk_weights, topk_ids, cfg, quant, w13_bias, w2_bias,
                 apply_router_weight_on_input, tile) -> None:
    """ValueError for what this build does not take (quant schemes, biases, activations, dtypes, shapes)."""
    _check_biases(w13_bias, w2_bias)
    _check_experts(x, w13, w2, cfg, quant, tile)
    t = x.shape[0]
    k = topk_ids.shape[1]
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != t:
        raise ValueError(f"{NAME}: topk_weights {topk_weights.shape} / topk_ids {topk_ids.shape} must be [T, k]")
    if apply_router_weight_on_input and k != 1:
        raise ValueError(f"{NAME}: apply_router_weight_on_input needs top_k == 1, got top_k={k}")


def _check_experts(x, w13, w2, cfg, quant, tile) -> None:
    """What both formats check of the experts: activation, layout, weight dtypes, shapes against
    x's hidden size (x [..., H]), 16-byte rows, the quant scheme, the tile."""
    want = "bfloat16" if quant is None else "float8_e4m3fn"
    for name, w in (("w13", w13), ("w2", w2)):
        if _dtype_name(w) != want:
            raise ValueError(f"{NAME}: {name} must be {want} "
                             f"({'bf16 weights' if quant is None else 'FP8 weights with quant='}), "
                             f"got {_dtype_name(w)}")
    h = x.shape[-1]
    e, n1, h2 = w13.shape
    e2, h3, i = w2.shape
    want_n1 = 2 * i if cfg.gated else i
    if h2 != h or h3 != h or e2 != e or n1 != want_n1:
        raise ValueError(f"{NAME}: shape mismatch: x {x.shape}, w13 {w13.shape}, w2 {w2.shape}")
    refusal = _config_refusal(cfg.activation, cfg.gate_up_layout, h, i, quant)
    if refusal:
        raise ValueError(f"{NAME}: {refusal}")
    if tile not in (None, "auto") and tile not in TILES:
        raise ValueError(f"{NAME}: tile must be 'auto' or one of {sorted(TILES)}, got {tile!r}")


def apply(x, w13, w2, topk_weights, topk_ids, cfg, *, quant=None, w13_bias=None, w2_bias=None,
          apply_router_weight_on_input: bool = False, tile: str | None = "auto") -> jax.Array:
    """``y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` on jax_moe's CUTLASS
    grouped GEMMs (the oracle's entry point; ``fused_experts`` checks the shapes first).

    x [T, H] float; w13 [E, 2I, H] (gate rows, then up; [E, I, H] for relu2); w2 [E, H, I]:
    bfloat16 (x computed in bf16), or float8_e4m3fn with ``quant`` a ``QuantConfig("fp8", ...)``
    (x quantized from its own dtype; see the module note for the scales). topk_weights [T, k]
    float; topk_ids [T, k] int32 in [0, E), or outside it (-1: an expert on another rank) for a
    skipped slot. With ``apply_router_weight_on_input`` (top-1) the weight scales x and the
    experts' outputs are summed. ``tile``: both GEMMs' tile (:func:`grouped_gemm`). Returns
    [T, H] in x's dtype. Raises ValueError for what this build does not take: other schemes or
    activation formats, biases, other activations, other weight dtypes.
    """
    _check_apply(x, w13, w2, topk_weights, topk_ids, cfg, quant, w13_bias, w2_bias,
                 apply_router_weight_on_input, tile)
    t, h = x.shape
    e, k = w13.shape[0], topk_ids.shape[1]
    if t == 0:
        return jnp.zeros((0, h), x.dtype)
    if tile in (None, "auto"):
        tile = pick_tile(t * k, e)

    from jax_moe import ffi  # noqa: PLC0415

    tw = topk_weights.astype(jnp.float32)
    sort = ffi.sort_by_expert(topk_ids.astype(jnp.int32), e)
    valid = sort.offsets[e:]  # [1]: rows of experts in [0, E)
    if quant is None:
        xin = x.astype(jnp.float32) * tw if apply_router_weight_on_input else x
        a1 = kernels.permute_rows(xin.astype(jnp.bfloat16), sort.sorted_slots, k, valid_rows=valid)
        h1 = grouped_gemm(a1, w13, sort.offsets, tile=tile)
        if cfg.gated:
            a2 = kernels.act_and_mul(h1, cfg.activation, valid_rows=valid)
        else:
            a2 = _relu2_rows(h1, valid, jnp.bfloat16)
        y = grouped_gemm(a2, w2, sort.offsets, tile=tile)
    else:
        # as the xla backend: the router weight scales x in x's dtype, then x is quantized
        xin = (x.astype(jnp.float32) * tw).astype(x.dtype) if apply_router_weight_on_input else x
        a1, s1 = _fp8_gemm1_input(xin, sort, k, valid, quant)
        h1 = grouped_gemm(a1, w13, sort.offsets, a_scale=s1, b_scale=jnp.asarray(quant.w13_scale, jnp.float32),
                          tile=tile)
        a2, s2 = _fp8_gemm2_input(h1, cfg, valid, quant)
        y = grouped_gemm(a2, w2, sort.offsets, a_scale=s2, b_scale=jnp.asarray(quant.w2_scale, jnp.float32),
                         tile=tile)
    return kernels.unpermute_reduce(y, sort.inverse, tw, valid_rows=valid,
                                    apply_router_weight_on_input=apply_router_weight_on_input, out_dtype=x.dtype)


# ----------------------------------------------------------------------------- the batched expert stage


def _check_apply_batched(x, counts, w13, w2, cfg, quant, w13_bias, w2_bias, tile) -> None:
    _check_biases(w13_bias, w2_bias)
    check_rank("x", x, 3, "[E, C, H]")
    check_rank("counts", counts, 1, "[E]")
    if jnp.dtype(counts.dtype) != jnp.int32:
        raise ValueError(f"{NAME}: counts must be int32, got {_dtype_name(counts)}")
    _check_experts(x, w13, w2, cfg, quant, tile)
    e = w13.shape[0]
    if x.shape[0] != e or counts.shape[0] != e:
        raise ValueError(f"{NAME}: x [E, C, H] and counts [E] must have the weights' E = {e} experts, "
                         f"got x {list(x.shape)}, counts {list(counts.shape)}")


def apply_batched(x: jax.Array, counts: jax.Array, w13: jax.Array, w2: jax.Array, cfg, *, quant=None,
                  w13_bias=None, w2_bias=None, tile: str | None = "auto") -> jax.Array:
    """The expert stage on the batched format: ``y[e, r] = expert_e(x[e, r])`` for ``r < counts[e]``.

    What an all-to-all expert-parallel path runs between dispatch and combine, once each device
    holds its tokens grouped per local expert: x [E, C, H] (C a static capacity; rows at or past
    ``counts[e]`` are padding, never read), counts [E] int32 (clamped to [0, C] on the device), the
    weights as :func:`apply` takes them (E here is the experts this call owns: E_local under EP).
    No routing weights: the weighted top-k reduce belongs to the combine. Returns y [E, C, H] in
    x's dtype, rows at or past ``counts[e]`` zero.

    Pipeline, on E*C rows::

        h = grouped_gemm_batched(x, w13, counts)                      # [E, C, 2I]
        a = act_and_mul(h.reshape(E*C, 2I), activation)              # [E*C, I] (relu2: jnp)
        y = grouped_gemm_batched(a.reshape(E, C, I), w2, counts)     # [E, C, H]

    act_and_mul runs over every row: the unused rows of h are zeros (GEMM1 writes them so), act(0)
    * 0 = 0, and GEMM2 never reads them. FP8 (``quant`` as for :func:`apply`): x is quantized in
    jnp (per-token scales [E, C], or per tensor: the static ``a13_scale``, or the dynamic amax over
    the used rows only); GEMM2's input as in :func:`apply` (fused into act_and_mul for per-token
    and static scales). ``tile``: both GEMMs' (``"auto"``: from C, :func:`pick_tile`).

    Where it plugs in: :mod:`jax_moe.parallel` with ``expert_format="batched"`` lays each
    device's received token copies out per local expert (:func:`jax_moe.permute.batched_layout`,
    C = the rows received), calls this, and gathers each slot's row back for the weighted
    reduce before the combine.
    """
    _check_apply_batched(x, counts, w13, w2, cfg, quant, w13_bias, w2_bias, tile)
    e, c, h = x.shape
    i = w2.shape[2]
    if c == 0:
        return jnp.zeros((e, 0, h), x.dtype)
    if tile in (None, "auto"):
        tile = pick_tile(e * c, e)
    rows = e * c
    valid = jnp.full((1,), rows, jnp.int32)  # every row: the unused ones are zeros from GEMM1
    if quant is None:
        h1 = grouped_gemm_batched(x.astype(jnp.bfloat16), w13, counts, tile=tile).reshape(rows, -1)
        if cfg.gated:
            a2 = kernels.act_and_mul(h1, cfg.activation, valid_rows=valid)
        else:
            a2 = _relu2_rows(h1, valid, jnp.bfloat16)
        y = grouped_gemm_batched(a2.reshape(e, c, i), w2, counts, tile=tile)
    else:
        xf = x.astype(jnp.float32)
        if quant.act == "fp8_per_tensor" and quant.a13_scale is None:  # dynamic: amax over the used rows
            xf = jnp.where(batched_rows_used(counts, c)[..., None], xf, 0.0)
        a1, s1 = _quantize_rows(xf.reshape(rows, h), quant.act, quant.a13_scale)
        h1 = grouped_gemm_batched(a1.reshape(e, c, h), w13, counts, a_scale=_batched_scale(s1, e, c),
                                  b_scale=jnp.asarray(quant.w13_scale, jnp.float32), tile=tile)
        a2, s2 = _fp8_gemm2_input(h1.reshape(rows, -1), cfg, valid, quant)
        y = grouped_gemm_batched(a2.reshape(e, c, i), w2, counts, a_scale=_batched_scale(s2, e, c),
                                 b_scale=jnp.asarray(quant.w2_scale, jnp.float32), tile=tile)
    return y.astype(x.dtype)


def _batched_scale(s, e: int, c: int):
    """A row scale of the E*C flattened rows ([E*C]) as the batched GEMM takes it ([E, C]); a per
    tensor scale ([]) as it is."""
    return s if s.ndim == 0 else s.reshape(e, c)
