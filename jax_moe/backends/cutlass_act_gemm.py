"""GEMM1 with the gated activation in its epilogue: ``act(gate) * up`` straight from the
accumulators, so the ``[M, 2I]`` pre-activation is never written nor read back.

:func:`grouped_gemm_act` is :func:`jax_moe.backends.cutlass_gemm.grouped_gemm` on weights whose
gate and up rows alternate (``gate_up_layout="interleaved"``: row 2i of ``w13[e]`` is gate i, row
2i+1 up i). In the SM90 tensor cores' accumulator layout the two columns of a pair sit in one
thread's registers, so the epilogue (``ffi/cutlass/gated_epilogue.cuh``) computes, in float32::

    h = a[r] @ b[e].T                        # [N] = [2I]   (FP8: * a_scale[r] * b_scale[e, n])
    h = h + bias[e]                          # optional GEMM1 bias, in b's row order
    d[r, i] = act(h[2i], h[2i + 1])          # silu(g) * u, gelu(g) * u, or swigluoai(g, u)

and writes ``d [M, I]``: bfloat16 for bf16 a and b; for FP8 a and b, float8_e4m3fn quantized with a
static scale (``out_scale``: GEMM2's input scale), ``clip(d / out_scale, -448, 448)`` rounded to
nearest. Rows outside ``[offsets[0], offsets[E])`` are zeros. A dynamic (per-token or per-tensor
amax) GEMM2 scale needs the whole row first, so those keep the separate activation kernel.

Weights stored ``concat`` (``[gate; up]``) interleave once at load time with
:func:`jax_moe.layouts.gated.reorder_rows_for_gated_act_gemm` (``out[2i] = gate_i``, ``out[2i+1] = up_i``) and run with ``gate_up_layout="interleaved"``.

``transposed=True`` (bf16 only) takes the same weights N contiguous, ``b [E, K, 2I]`` (column 2i
gate i, 2i+1 up i): the layout :mod:`jax_moe.backends.cutlass_prepared` transposes to at load time,
whose weight stream is faster on the H100. Its tiles come from the ``"bf16_kn"`` rows of the tile
table, as the other GEMMs on transposed weights
(:func:`jax_moe.backends.cutlass_grad_gemm.grouped_gemm_dgrad`).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.activations import activate
from jax_moe.backends.cutlass_gemm import (
    ACT_KINDS,
    TILES,
    _check_gemm,
    dtype_name,
    _check_scale,
    _reference,
    _resolve_tile,
    _register,
    _row_col_scales,
    full_scales,
    kernel_scales,
    owned_rows,
    row_experts,
    workspace_size,
)
from jax_moe.config import MoEConfig, check_rank
from jax_moe.kernels import ACTIVATIONS  # the gated activations' kAct codes, shared with act_and_mul
from jax_moe.layouts.transposed import BF16_ONLY, transpose_experts, transposed_shape
from jax_moe.quant import fp8

ALIGN_N = {"bf16_act": 16, "fp8_act": 32, "bf16_act_kn": 16}  # N = 2I: 16-byte rows of d [M, I] (bf16 / e4m3)
# JAX_MOE_CUTLASS_FUSED_ACT (read at trace time): "0" never fuses, "all" fuses on every tile of both
# kinds, else (the default) only on FUSED_TILES of the kind.
FUSED_ACT_ENV = "JAX_MOE_CUTLASS_FUSED_ACT"
# Where the epilogue pays (H100). bf16, GEMM1 + the activation kernel over the fused GEMM: on the
# pingpong tiles one consumer warpgroup's epilogue runs under the other's mainloop (pingpong_64x128
# 1.05-1.25x at large T; pingpong_64x128_k256 0.99-1.16x and pingpong_64x256 0.98-1.05x at 64 to 1024
# tokens). On coop_128x256 the epilogue stalls both warpgroups, but it is short since the quad's
# transpose runs on packed bf16 pairs: 1.03-1.09x from 128 rows per expert (T >= 4096 on the
# 128-expert models, T >= 1024 on Mixtral-8x7B), 0.97-1.00x at 32-64. coop_128x128 0.83-0.99x keeps
# the activation kernel. FP8 (whole forward, in a jitted loop of layers): the epilogue loads each
# thread's column scales once for both of its rows and stores whole 32-byte sectors, and then it
# pays on every tile the table picks, coop_128x128 included: 1.02-1.10x at 1024 to 16384 tokens on
# the four bench models, 0.98-1.05x at 64 and 256. (Reading a scale per pair, with 4-byte
# stores, it was 0.78-1.04x.) coop_128x128 fused is 1.06-1.12x its unfused pair at 64 rows per
# expert, where the heuristic uses it, and 0.64-0.80x on DeepSeek-V3 from 128, where neither the
# heuristic nor the table's fp8_act rows (GEMM1 and the activation timed as one) pick it.
# coop_128x256_c1, the same tile without its cluster, fuses as coop_128x256 does: its H200 picks
# were timed fused. coop_192x256 is its own tile only where it fuses. GEMM1 runs pingpong_192x128 (GEMM2's
# tile) as coop_128x256_c1, fused or not, so it fuses as that tile does.
_BF16_FUSED = ("pingpong_64x128", "pingpong_64x128_k256", "pingpong_64x256", "coop_128x256",  # either b layout
               "coop_128x256_c1", "coop_192x256", "pingpong_192x128")
_FP8_FUSED = ("pingpong_64x128", "pingpong_64x128_k256", "pingpong_64x256", "coop_128x128", "coop_128x256",
              "coop_128x256_c1", "coop_192x256", "pingpong_192x128")
FUSED_TILES = {"bf16": _BF16_FUSED, "fp8": _FP8_FUSED, "bf16_kn": _BF16_FUSED}


def fuses_activation(cfg: MoEConfig, quant=None, tile: str | None = None, transposed: bool = False) -> bool:
    """Whether the cutlass forward takes ``cfg``'s activation into GEMM1's epilogue: a gated
    activation on interleaved gate/up rows, bf16 weights (stored or ``transposed``) or FP8 with a
    static GEMM2 input scale (``fp8_per_tensor`` with ``a2_scale``), 2I a multiple of
    :data:`ALIGN_N`, and GEMM1's ``tile`` (the resolved one, :func:`gemm1_tile`; None: any) one of
    the kind's :data:`FUSED_TILES`, per ``JAX_MOE_CUTLASS_FUSED_ACT``."""
    mode = os.environ.get(FUSED_ACT_ENV, "")
    if mode == "0":
        return False
    table = "fp8" if quant is not None else "bf16_kn" if transposed else "bf16"
    if tile is not None and mode != "all" and tile not in FUSED_TILES[table]:
        return False
    if cfg.activation not in ACTIVATIONS or cfg.gate_up_layout != "interleaved":
        return False
    n = 2 * cfg.intermediate_size
    if quant is None:
        return n % ALIGN_N["bf16_act"] == 0
    return (quant.scheme == "fp8" and quant.act == "fp8_per_tensor" and quant.a2_scale is not None
            and n % ALIGN_N["fp8_act"] == 0)


def gemm1_tile(tile: str | None, rows: int, w13, kind: str, with_activation: bool = False) -> str:
    """GEMM1's tile: ``tile`` if forced, else the pick for ``rows`` expert-sorted rows against w13
    of ``kind``: ``"bf16"`` or ``"fp8"`` (w13 [E, 2I, H]), ``"bf16_kn"`` (w13 [E, H, 2I],
    transposed); ``with_activation``: from the tile table's GEMM1-with-activation rows (GEMM1 and
    the activation timed as one unit), else as :func:`grouped_gemm` picks."""
    e, n, k = w13.shape
    if kind == "bf16_kn":
        n, k = k, n
    return _resolve_tile(tile, rows, e, n=n, k=k, kind=f"{kind}_act" if with_activation else kind)


def forward_gemm1(cfg: MoEConfig, quant, tile: str | None, a1, w13, transposed: bool = False) -> tuple[str, bool]:
    """A forward's GEMM1 (nothing kept for a backward) on rows a1 [M, H] against w13 ([E, H, 2I]
    when ``transposed``) -> (its tile, whether the activation goes into its epilogue). Where the
    layer may fuse (:func:`fuses_activation` on some tile) the tile is picked for GEMM1 and the
    activation together (:func:`gemm1_tile` ``with_activation``): a pingpong tile with the
    activation fused can beat a cooperative tile that is faster for the GEMM alone."""
    kind = "fp8" if quant is not None else "bf16_kn" if transposed else "bf16"
    tile = gemm1_tile(tile, a1.shape[0], w13, kind, with_activation=fuses_activation(cfg, quant, None, transposed))
    return tile, fuses_activation(cfg, quant, tile, transposed)


def gemm1_with_activation(a1, w13, offsets, cfg: MoEConfig, *, w13_bias=None, tile: str | None = "auto",
                          transposed: bool = False, **scales) -> jax.Array:
    """A forward's GEMM1 with ``cfg``'s activation in its epilogue: :func:`grouped_gemm_act` with
    cfg's activation constants and w13_bias [E, 2I] (any float dtype, or None) in float32;
    ``scales``: FP8's ``a_scale``, ``b_scale`` and ``out_scale``."""
    bias = None if w13_bias is None else w13_bias.astype(jnp.float32)
    return grouped_gemm_act(a1, w13, offsets, cfg.activation, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit,
                            bias=bias, tile=tile, transposed=transposed, **scales)


def _stored_view(a, b, transposed: bool):
    """b as the [E, N, K] the checks read: b itself, or for ``transposed`` b [E, K, N] (checked
    here: bf16, a's K) seen swapped, shapes and dtype only."""
    if not transposed:
        return b
    check_rank("b", b, 3, "[E, K, 2I] (transposed)")
    if dtype_name(a) != "bfloat16" or dtype_name(b) != "bfloat16":
        raise ValueError(f"transposed b [E, K, 2I] is {BF16_ONLY}, "
                         f"got a {dtype_name(a)}, b {dtype_name(b)}")
    if a.ndim == 2 and b.shape[1] != a.shape[1]:
        raise ValueError(f"transposed b must be [E, K, 2I] with a's K = {a.shape[1]}, got shape {list(b.shape)}")
    return transposed_shape(b)


def _check_act_gemm(a, b, offsets, activation, bias, a_scale, b_scale, out_scale, tile,
                    transposed: bool = False):
    """Checks :func:`grouped_gemm_act`'s arguments (ValueError) -> (act kind, tile, b's stored
    view: :func:`_stored_view`)."""
    b = _stored_view(a, b, transposed)
    kind, tile = _check_gemm(a, b, offsets, a_scale, b_scale, tile, table="bf16_kn" if transposed else None)
    act_kind = "bf16_act_kn" if transposed else f"{kind}_act"
    e, n, _ = b.shape
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)} (gated), got {activation!r}")
    if n % ALIGN_N[act_kind]:
        raise ValueError(f"b's N = 2I must be a multiple of {ALIGN_N[act_kind]} for {kind} "
                         f"(16-byte rows of d [M, I]), got N={n}")
    if bias is not None:
        _check_scale("bias", bias, {(e, n): "[E, N] float32: each expert's GEMM1 bias in b's row order"})
    if kind == "fp8":
        if out_scale is None:
            raise ValueError("out_scale (d's static FP8 scale, [] float32) is required with float8_e4m3fn a and b")
        _check_scale("out_scale", out_scale, {(): "per tensor", (1,): "per tensor"})
    elif out_scale is not None:
        raise ValueError("out_scale is only taken with float8_e4m3fn a and b (the bf16 kind writes bf16)")
    return act_kind, tile, b


def grouped_gemm_act_shape(a, b, offsets, activation: str = "silu", *, bias=None, a_scale=None, b_scale=None,
                           out_scale=None, transposed: bool = False) -> jax.ShapeDtypeStruct:
    """The shape rule: a [M, K], b [E, 2I, K] (``transposed``: [E, K, 2I]) -> d [M, I] bfloat16
    (float8_e4m3fn for FP8 a, b)."""
    kind, _, stored = _check_act_gemm(a, b, offsets, activation, bias, a_scale, b_scale, out_scale, "auto",
                                      transposed)
    return jax.ShapeDtypeStruct((a.shape[0], stored.shape[1] // 2),
                                jnp.float8_e4m3fn if kind == "fp8_act" else jnp.bfloat16)


def _act_reference(a, b, offsets, row, col, bias, out_scale, cfg: MoEConfig):
    """float32 GEMM (the scales included), the bias, the activation, zero rows outside, d's dtype."""
    h = _reference(a, b, offsets, row, col, dtype=jnp.float32)
    off, owned = owned_rows(offsets, a.shape[0])
    if bias is not None:
        h = h + bias[row_experts(off, a.shape[0])]
    d = jnp.where(owned[:, None], activate(h, cfg), 0.0)
    if out_scale is None:
        return d.astype(jnp.bfloat16)
    return fp8.quantize_fp8_static(d, jnp.reshape(out_scale, ()))


def _cfg(b, activation: str, alpha: float, limit: float) -> MoEConfig:
    return MoEConfig(num_experts=b.shape[0], top_k=1, hidden_size=b.shape[2], intermediate_size=b.shape[1] // 2,
                     activation=activation, gate_up_layout="interleaved", swiglu_alpha=float(alpha),
                     swiglu_limit=float(limit))


def grouped_gemm_act_reference(a, b, offsets, activation: str = "silu", *, alpha: float = 1.702, limit: float = 7.0,
                               bias=None, a_scale=None, b_scale=None, out_scale=None, tile=None,
                               transposed: bool = False) -> jax.Array:
    """jnp reference of :func:`grouped_gemm_act` (same arguments and result; ``tile`` is checked
    and ignored): the grouped GEMM in float32, the bias, the activation of
    :func:`jax_moe.activations.activate` on interleaved gate/up, then d's dtype."""
    kind, _, _ = _check_act_gemm(a, b, offsets, activation, bias, a_scale, b_scale, out_scale, tile, transposed)
    if transposed:
        b = transpose_experts(b)
    scales = (None, None) if kind != "fp8_act" else _row_col_scales(a_scale, b_scale, (a.shape[0],), b.shape[0],
                                                                     b.shape[1])
    return _act_reference(a, b, offsets, *scales, bias, out_scale, _cfg(b, activation, alpha, limit))


def grouped_gemm_act(a: jax.Array, b: jax.Array, offsets: jax.Array, activation: str = "silu", *,
                     alpha: float = 1.702, limit: float = 7.0, bias=None, a_scale=None, b_scale=None,
                     out_scale=None, tile: str | None = "auto", transposed: bool = False) -> jax.Array:
    """Per expert e, ``d[r] = act(a[r] @ b[e].T)`` over interleaved gate/up columns, for the rows
    ``offsets[e] <= r < offsets[e+1]``.

    a [M, K] expert-sorted rows; b [E, 2I, K] (K contiguous; rows 2i gate, 2i+1 up); offsets
    [E+1] int32 (``sort_by_expert``'s, clamped to [0, M]). ``activation``: ``"silu"``,
    ``"gelu"`` or ``"swigluoai"`` (``alpha``, ``limit``). ``bias``: [E, 2I] float32 in b's row
    order, or None.

    - bfloat16 a and b -> d [M, I] bfloat16; 2I a multiple of 16.
    - float8_e4m3fn a and b with ``a_scale``/``b_scale`` as :func:`grouped_gemm` takes them (handed
      to the kernel in their own forms, :func:`~jax_moe.backends.cutlass_gemm.kernel_scales`), and
      ``out_scale`` ([] float32) -> d [M, I] float8_e4m3fn = fp8(act / out_scale); 2I a multiple of 32.

    - ``transposed=True``: b [E, K, 2I] bfloat16, N contiguous (column 2i gate i, 2i+1 up i): the
      same d from the transposed load-time layout.

    Rows outside ``[offsets[0], offsets[E])`` are zeros. ``tile``: ``"auto"`` (the grouped GEMM's
    pick for this shape) or a name in :data:`jax_moe.backends.cutlass_gemm.TILES`. CPU or no
    module: :func:`grouped_gemm_act_reference`.
    """
    kind, tile, stored = _check_act_gemm(a, b, offsets, activation, bias, a_scale, b_scale, out_scale, tile,
                                         transposed)
    m, (e, n, _) = a.shape[0], stored.shape
    out_dt = jnp.float8_e4m3fn if kind == "fp8_act" else jnp.bfloat16
    if m == 0:
        return jnp.zeros((0, n // 2), out_dt)
    cfg = _cfg(stored, activation, alpha, limit)
    if kind == "fp8_act":
        row, col = kernel_scales(a_scale, b_scale, (m,), e, n)
        out = jnp.reshape(jnp.asarray(out_scale, jnp.float32), (1,))
    else:
        row = col = out = jnp.zeros((0,), jnp.float32)
    bias_in = jnp.zeros((0,), jnp.float32) if bias is None else bias

    def default(a, b, offsets, row, col, bias_in, out):
        scaled = kind == "fp8_act"
        if transposed:
            b = transpose_experts(b)
        if scaled:
            row, col = full_scales(row, col, (m,), e, n)
        return _act_reference(a, b, offsets, row if scaled else None, col if scaled else None,
                              None if bias is None else bias_in, out[0] if scaled else None, cfg)

    if not _register():
        return default(a, b, offsets, row, col, bias_in, out)

    def cuda(*args):
        outs = (jax.ShapeDtypeStruct((m, n // 2), out_dt),
                jax.ShapeDtypeStruct((workspace_size(e, tile, kind),), jnp.uint8))
        d, _ = jax.ffi.ffi_call(ACT_KINDS[kind][1], outs, vmap_method="sequential")(
            *args, tile=np.int64(TILES[tile]), activation=np.int64(ACTIVATIONS[activation]),
            alpha=np.float32(alpha), limit=np.float32(limit), transposed=np.int64(transposed))
        return d

    return jax.lax.platform_dependent(a, b, offsets, row, col, bias_in, out, cuda=cuda, default=default)
