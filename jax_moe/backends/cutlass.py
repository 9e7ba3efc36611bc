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

:func:`grouped_gemm` is the SM90 CUTLASS pointer-array grouped GEMM of
``ffi/cutlass_grouped_gemm*.cu`` (bf16 x bf16 -> bf16, float32 accumulation), in the nanobind
module ``jax_moe._jax_moe_cutlass`` (``cmake/cutlass_gemm.cmake``). Its per-group arguments are
built on the device from the offsets, so the call never waits for the GPU and is safe in a CUDA
graph. Its workspace is a second, discarded ``uint8`` result, sized at trace time
(:func:`workspace_size`). The tile configuration (:data:`TILES`) is picked at trace time from
the rows per expert (:func:`pick_tile`); ``tile=`` or ``JAX_MOE_CUTLASS_TILE`` overrides it.

Scope of this build: bf16 only (FP8 scales in the epilogue to come); activations ``silu`` and
``gelu`` (gated, gate/up rows concatenated) and ``relu2``; no biases; SM90 (``sm_90a``).
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

log = logging.getLogger("jax_moe")

NAME = "cutlass"
FEATURES = frozenset({"router_weight_on_input", "dtype:bfloat16"})  # oracle.call_features
TARGET = "jax_moe_cutlass_grouped_gemm"
# tile name -> CutlassTile in ffi/cutlass_grouped_gemm.h (one CUTLASS instantiation each)
TILES: dict[str, int] = {"coop_128x128": 0, "pingpong_64x128": 1}
TILE_ENV = "JAX_MOE_CUTLASS_TILE"
ALIGN = 8  # K and N multiples of 8 bf16 elements (16-byte TMA rows); ffi: kCutlassAlign
ACTIVATIONS = ("silu", "gelu", "relu2")
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
    """Whether the custom call can run on ``device`` (default: JAX's default device), and why not."""
    from jax_moe.device import sm90_module_ready

    ok, why = sm90_module_ready(_module(), _state["error"], device)
    if not ok:
        return False, why
    return True, "jax_moe CUTLASS grouped GEMM (SM90, bf16)"


def _register() -> bool:
    """Register the FFI target once; False where the module or a GPU backend is missing."""
    if _state["registered"]:
        return True
    mod = _module()
    from jax_moe.ffi import gpu_backend  # noqa: PLC0415

    if mod is None or not gpu_backend():
        return False
    if getattr(mod, "align", ALIGN) != ALIGN or getattr(mod, "num_tiles", len(TILES)) != len(TILES):
        _state["error"] = "the compiled module's tile list or alignment does not match jax_moe/backends/cutlass.py"
        _state["module"] = None
        return False
    for name, capsule in mod.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    _state["registered"] = True
    return True


@functools.lru_cache(maxsize=None)
def workspace_size(num_groups: int, tile: str) -> int:
    """Bytes of the grouped GEMM's workspace result for ``num_groups`` experts and ``tile`` on the
    current CUDA device (its SM count sets CUTLASS's share: TMA descriptors per SM)."""
    mod = _module()
    if mod is None:
        raise RuntimeError(_state["error"])
    return int(mod.workspace_size(int(num_groups), TILES[tile]))


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


def _check_gemm(a, b, offsets, tile) -> str:
    """Checks :func:`grouped_gemm`'s arguments (ValueError) and resolves ``tile``."""
    for name, x, rank, what in (("a", a, 2, "[M, K]"), ("b", b, 3, "[E, N, K]"), ("offsets", offsets, 1, "[E+1]")):
        check_rank(name, x, rank, what)
    for name, x in (("a", a), ("b", b)):
        if jnp.dtype(x.dtype) != jnp.bfloat16:
            raise ValueError(f"{name} must be bfloat16 (this build's grouped GEMM is bf16 only), got "
                             f"{jnp.dtype(x.dtype).name}")
    if jnp.dtype(offsets.dtype) != jnp.int32:
        raise ValueError(f"offsets must be int32, got {jnp.dtype(offsets.dtype).name}")
    m, k = a.shape
    e, n, k2 = b.shape
    if k2 != k:
        raise ValueError(f"b must be [E, N, K] with a's K = {k}, got shape {list(b.shape)}")
    if e < 1:
        raise ValueError("b must hold at least one expert")
    if offsets.shape[0] != e + 1:
        raise ValueError(f"offsets must have E + 1 = {e + 1} elements, got {offsets.shape[0]}")
    if k < ALIGN or k % ALIGN or n < ALIGN or n % ALIGN:
        raise ValueError(f"K and N must be positive multiples of {ALIGN} (16-byte rows), got K={k}, N={n}")
    if max(m, n, k) >= 2**31:
        raise ValueError(f"dimensions must fit in int32, got M={m}, N={n}, K={k}")
    if tile is None or tile == "auto":
        return pick_tile(m, e)
    if tile not in TILES:
        raise ValueError(f"tile must be 'auto' or one of {sorted(TILES)}, got {tile!r}")
    return tile


def grouped_gemm_shape(a, b, offsets) -> jax.ShapeDtypeStruct:
    """The shape rule: a [M, K], b [E, N, K], offsets [E+1] -> d [M, N] bfloat16 (no data read)."""
    _check_gemm(a, b, offsets, "auto")
    return jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), jnp.bfloat16)


def grouped_gemm_reference(a, b, offsets, *, tile=None) -> jax.Array:
    """jnp reference of :func:`grouped_gemm` (same arguments and result; ``tile`` is checked and
    ignored): ``jax.lax.ragged_dot`` in float32 over the clamped offsets, zero rows outside them."""
    _check_gemm(a, b, offsets, tile)
    return _reference(a, b, offsets)


def _reference(a, b, offsets):
    m = a.shape[0]
    e = b.shape[0]
    off = jnp.clip(offsets, 0, m)
    off = jax.lax.cummax(off)  # the kernel's clamp: a decreasing pair is an empty expert
    lo, hi = off[0], off[e]
    rows = jnp.arange(m, dtype=jnp.int32)
    owned = (rows >= lo) & (rows < hi)
    sizes = jnp.diff(off).at[0].add(lo).at[e - 1].add(m - hi)  # unowned rows ride along, zeroed
    a0 = jnp.where(owned[:, None], a, jnp.zeros((), a.dtype))
    d = jax.lax.ragged_dot(a0, jnp.swapaxes(b, 1, 2), sizes.astype(jnp.int32),
                           preferred_element_type=jnp.float32)
    return d.astype(jnp.bfloat16)


def grouped_gemm(a: jax.Array, b: jax.Array, offsets: jax.Array, *, tile: str | None = "auto") -> jax.Array:
    """Per expert e, ``d[r] = a[r] @ b[e].T`` for the rows ``offsets[e] <= r < offsets[e+1]``.

    a [M, K] bfloat16 (expert-sorted rows); b [E, N, K] bfloat16 (K contiguous: vLLM's w13 and
    w2 as they are); offsets [E+1] int32, nondecreasing (``sort_by_expert``'s offsets; clamped to
    [0, M]). Returns d [M, N] bfloat16 (float32 accumulation), zero outside
    ``[offsets[0], offsets[E])``. K and N must be multiples of 8. ``tile``: ``"auto"``
    (:func:`pick_tile`, at trace time) or a name in :data:`TILES`. Runs the CUTLASS kernel where
    lowered for a GPU with ``jax_moe._jax_moe_cutlass`` loaded, else :func:`grouped_gemm_reference`.
    """
    tile = _check_gemm(a, b, offsets, tile)
    m, n, e = a.shape[0], b.shape[1], b.shape[0]
    if m == 0:
        return jnp.zeros((0, n), jnp.bfloat16)
    if not _register():
        return _reference(a, b, offsets)

    def cuda(a, b, offsets):
        outs = (jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
                jax.ShapeDtypeStruct((workspace_size(e, tile),), jnp.uint8))
        d, _ = jax.ffi.ffi_call(TARGET, outs, vmap_method="sequential")(a, b, offsets, tile=np.int64(TILES[tile]))
        return d

    return jax.lax.platform_dependent(a, b, offsets, cuda=cuda, default=_reference)


# ----------------------------------------------------------------------------- the backend


def supports(cfg, quant=None, device=None) -> tuple[bool, str]:
    """Whether this backend serves ``cfg`` (a :class:`jax_moe.config.MoEConfig`) with ``quant``
    on ``device``, and why not: hardware first, then the scheme, then this build, then shapes."""
    from jax_moe.device import device_info

    dev = device_info(device)
    if dev.sm != 90:
        return False, f"needs SM90 (this build compiles sm_90a only); this device is {dev.describe()}"
    scheme = "bf16" if quant is None else quant.scheme
    if scheme != "bf16":
        return False, f"scheme {scheme!r} is not built yet (have bf16)"
    ok, why = available(dev)
    if not ok:
        return False, why
    if cfg.activation not in ACTIVATIONS:
        return False, f"activation {cfg.activation!r} is not wired up (have {', '.join(ACTIVATIONS)})"
    if cfg.gate_up_layout != "concat":
        return False, f"gate_up_layout {cfg.gate_up_layout!r} is not wired up (have 'concat': gate rows, then up)"
    if cfg.hidden_size % ALIGN or cfg.intermediate_size % ALIGN:
        return False, f"hidden and intermediate sizes must be multiples of {ALIGN} (16-byte rows)"
    return True, "ok"


def _relu2_rows(h, valid):
    """relu(h)^2 in float32, rows at or past ``valid[0]`` zero (act_and_mul's convention)."""
    rows = jnp.arange(h.shape[0], dtype=jnp.int32) < valid[0]
    r = jnp.maximum(h.astype(jnp.float32), 0.0)
    return jnp.where(rows[:, None], r * r, 0.0).astype(jnp.bfloat16)


def apply(x, w13, w2, topk_weights, topk_ids, cfg, *, quant=None, w13_bias=None, w2_bias=None,
          apply_router_weight_on_input: bool = False, tile: str | None = "auto") -> jax.Array:
    """``y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` on jax_moe's CUTLASS
    grouped GEMMs (the oracle's entry point; ``fused_experts`` checks the shapes first).

    x [T, H] float (computed in bf16); w13 [E, 2I, H] bfloat16 (gate rows, then up; [E, I, H]
    for relu2); w2 [E, H, I] bfloat16; topk_weights [T, k] float; topk_ids [T, k] int32 in
    [0, E), or outside it (-1: an expert on another rank) for a skipped slot. With
    ``apply_router_weight_on_input`` (top-1) the weight scales x and the experts' outputs are
    summed. ``tile``: both GEMMs' tile (:func:`grouped_gemm`). Returns [T, H] in x's dtype.
    Raises ValueError for what this build does not take: quantized weights, biases, other
    activations, non-bf16 weights.
    """
    if quant is not None:
        raise ValueError(f"{NAME}: scheme {quant.scheme!r} is not built yet (bf16 only)")
    if w13_bias is not None or w2_bias is not None:
        raise ValueError(f"{NAME}: GEMM biases are not supported yet (use backend='flashinfer_cutlass' or 'xla')")
    if cfg.activation not in ACTIVATIONS:
        raise ValueError(f"{NAME}: activation {cfg.activation!r} is not wired up (have {', '.join(ACTIVATIONS)})")
    if cfg.gate_up_layout != "concat":
        raise ValueError(f"{NAME}: gate_up_layout {cfg.gate_up_layout!r} is not wired up (have 'concat')")
    for name, w in (("w13", w13), ("w2", w2)):
        if jnp.dtype(w.dtype) != jnp.bfloat16:
            raise ValueError(f"{NAME}: {name} must be bfloat16 (this build is bf16 only), got {jnp.dtype(w.dtype).name}")
    t, h = x.shape
    e, n1, h2 = w13.shape
    e2, h3, i = w2.shape
    k = topk_ids.shape[1]
    want_n1 = 2 * i if cfg.gated else i
    if h2 != h or h3 != h or e2 != e or n1 != want_n1:
        raise ValueError(f"{NAME}: shape mismatch: x {x.shape}, w13 {w13.shape}, w2 {w2.shape}")
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != t:
        raise ValueError(f"{NAME}: topk_weights {topk_weights.shape} / topk_ids {topk_ids.shape} must be [T, k]")
    if apply_router_weight_on_input and k != 1:
        raise ValueError(f"{NAME}: apply_router_weight_on_input needs top_k == 1, got top_k={k}")
    if h % ALIGN or i % ALIGN:
        raise ValueError(f"{NAME}: H={h} and I={i} must be multiples of {ALIGN}")
    if tile not in (None, "auto") and tile not in TILES:
        raise ValueError(f"{NAME}: tile must be 'auto' or one of {sorted(TILES)}, got {tile!r}")
    if t == 0:
        return jnp.zeros((0, h), x.dtype)
    if tile in (None, "auto"):
        tile = pick_tile(t * k, e)

    from jax_moe import ffi  # noqa: PLC0415

    tw = topk_weights.astype(jnp.float32)
    xin = x.astype(jnp.float32) * tw if apply_router_weight_on_input else x
    sort = ffi.sort_by_expert(topk_ids.astype(jnp.int32), e)
    valid = sort.offsets[e:]  # [1]: rows of experts in [0, E)
    a1 = kernels.permute_rows(xin.astype(jnp.bfloat16), sort.sorted_slots, k, valid_rows=valid)
    h1 = grouped_gemm(a1, w13, sort.offsets, tile=tile)
    a2 = kernels.act_and_mul(h1, cfg.activation, valid_rows=valid) if cfg.gated else _relu2_rows(h1, valid)
    y = grouped_gemm(a2, w2, sort.offsets, tile=tile)
    return kernels.unpermute_reduce(y, sort.inverse, tw, valid_rows=valid,
                                    apply_router_weight_on_input=apply_router_weight_on_input, out_dtype=x.dtype)
