"""Scheme ``mxfp4`` of ``backend="flashinfer_trtllm"``: GPT-OSS's MXFP4 experts on
``jax_moe_trtllm_fp4_block_scale_moe`` (FlashInfer's ``trtllm_fp4_block_scale_moe``, the target
it shares with ``nvfp4``: the handler tells NVFP4 x NVFP4, MXFP4 x BF16 and MXFP4 x MXFP8 apart by
the operands' dtypes). Compiles for sm_100a against the stand-in cubin pack; never run.

H and I padded to 256, w13 rows ``[up0, gate0, ...]``, ``shuffle_matrix_a`` on weights and
biases, ``shuffle_matrix_sf_a`` on the E8M0 scales, float32 biases, swigluoai alpha/beta/limit per
expert, BF16 or MXFP8 activations (:func:`prepare_mxfp4_weights`, :class:`Mxfp4Prepared`,
:func:`~jax_moe.backends.flashinfer_trtllm.common.tile_tokens_dim`); the result is sliced back to H.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_moe.backends.flashinfer_trtllm.common import (
    MAX_TILE_N_BF16_ACT, MXFP4_ACTS, NAME, check_operand, fp4_dims, fp4_operands, hidden_check,
    tile_tokens_dim,
)
from jax_moe.layouts import (
    from_trtllm_gated_rows, mxfp4_padded_sizes, pad_axis, shuffle_matrix_a, shuffle_matrix_sf_a,
    to_trtllm_gated_rows, unshuffle_matrix_a, unshuffle_matrix_sf_a,
)
from jax_moe.quant import fp4


def refusal(cfg, quant) -> str | None:
    """What this scheme's contract refuses in (cfg, quant) (None: nothing)."""
    if quant.act not in MXFP4_ACTS:
        return f"MXFP4 takes bf16 or MXFP8 activations (act in {list(MXFP4_ACTS)}), not {quant.act!r}"
    for dim, v in (("hidden", cfg.hidden_size), ("intermediate", cfg.intermediate_size)):
        if v % fp4.MX_BLOCK:
            return f"{dim} size {v} must be a multiple of the MXFP4 scale block {fp4.MX_BLOCK}"
    return None


def kernel_dims(cfg) -> tuple[int, int]:
    """(H, I) the kernel runs with: both padded (:func:`jax_moe.layouts.mxfp4_padded_sizes`)."""
    return mxfp4_padded_sizes(NAME, cfg.hidden_size, cfg.intermediate_size)


default_tile = tile_tokens_dim


def prepare_mxfp4_weights(w13, w13_scale, w2, w2_scale, w13_bias=None, w2_bias=None, *,
                          gate_up_layout: str = "concat"):
    """MXFP4 (GPT-OSS) experts -> ``trtllm_fp4_block_scale_moe``'s operands (vLLM's GPT-OSS MXFP4 path).

    In: ``w13 [E, 2I, H/2]`` uint8 (two E2M1 codes a byte, element 2k in the low nibble),
    ``w13_scale [E, 2I, H/32]`` uint8 E8M0, ``w2 [E, H, I/2]``, ``w2_scale [E, H, I/32]``, optional
    biases ``w13_bias [E, 2I]``, ``w2_bias [E, H]`` (bfloat16 or float32). w13's gate/up rows (and
    its scales' and bias's) are ``[gate; up]`` (``gate_up_layout="concat"``) or alternate
    ``gate0, up0, gate1, ...`` (``"interleaved"``, the GPT-OSS checkpoint).

    Out, with ``(Hp, Ip) = mxfp4_padded_sizes("flashinfer_trtllm", H, I)`` (both rounded up to 256):

    * GEMM1 rows in the runner's order: row ``2j`` holds up row j, row ``2j + 1`` gate row j
      (:func:`~jax_moe.layouts.to_trtllm_gated_rows`); rows ``2I .. 2Ip - 1`` are zero.
    * ``w13 [E, 2Ip, Hp/2]`` uint8: those rows, each row's bytes zero-extended to ``Hp/2``, then
      rows shuffled inside every block of 32 rows: output row ``32b + 8c + a`` is input row
      ``32b + 4a + c`` (``a < 8``, ``c < 4``; FlashInfer ``shuffle_matrix_a``, epilogue tile 128).
    * ``w13_scale [E, 2Ip, Hp/32]`` uint8: the scales through the same rows and zero padding
      (columns to ``Hp/32``) and the same row shuffle, then tiled: scale ``(m, k)`` lands at flat
      offset ``((m // 128) * (Hp/128) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4``
      of the expert's buffer (``shuffle_matrix_sf_a``), viewed as ``[2Ip, Hp/32]``.
    * ``w13_bias [E, 2Ip]`` float32: the same rows, zeros in the padding, the same row shuffle.
    * ``w2 [E, Hp, Ip/2]``, ``w2_scale [E, Hp, Ip/32]``, ``w2_bias [E, Hp]``: rows (H) zero-padded
      to Hp, bytes to ``Ip/2`` and scale columns to ``Ip/32``; the same row shuffle and tiling.

    Zero padding gives zero GEMM1 rows (a zero gate makes the activation 0) and zero GEMM2 rows.
    Returns ``(w13, w13_scale, w13_bias, w2, w2_scale, w2_bias)`` (biases None when not given).
    Inverse: :func:`restore_mxfp4_weights`.
    """
    w13, s13, w2, s2 = (jnp.asarray(a) for a in (w13, w13_scale, w2, w2_scale))
    e, h, i = fp4_dims(w2, fp4.MX_BLOCK)
    check_operand("w13", w13, jnp.uint8, (e, 2 * i, h // 2))
    check_operand("w13_scale", s13, jnp.uint8, (e, 2 * i, h // fp4.MX_BLOCK))
    check_operand("w2_scale", s2, jnp.uint8, (e, h, i // fp4.MX_BLOCK))
    hp, ip = mxfp4_padded_sizes(NAME, h, i)

    def rows(a, axis=-2):  # GEMM1 rows: runner order, zero pairs up to 2Ip
        return pad_axis(to_trtllm_gated_rows(a, gate_up_layout, axis), 2 * ip, axis)

    w13 = shuffle_matrix_a(pad_axis(rows(w13), hp // 2, -1))
    s13 = shuffle_matrix_sf_a(pad_axis(rows(s13), hp // fp4.MX_BLOCK, -1), as_2d=True)
    w2 = shuffle_matrix_a(pad_axis(pad_axis(w2, hp, -2), ip // 2, -1))
    s2 = shuffle_matrix_sf_a(pad_axis(pad_axis(s2, hp, -2), ip // fp4.MX_BLOCK, -1), as_2d=True)
    b13 = b2 = None
    if w13_bias is not None:
        b13 = jnp.asarray(w13_bias)
        check_operand("w13_bias", b13, (jnp.bfloat16, jnp.float32), (e, 2 * i))
        b13 = shuffle_matrix_a(rows(b13.astype(jnp.float32), -1), axis=-1)
    if w2_bias is not None:
        b2 = jnp.asarray(w2_bias)
        check_operand("w2_bias", b2, (jnp.bfloat16, jnp.float32), (e, h))
        b2 = shuffle_matrix_a(pad_axis(b2.astype(jnp.float32), hp, -1), axis=-1)
    return w13, s13, b13, w2, s2, b2


def restore_mxfp4_weights(prepared: "Mxfp4Prepared", gate_up_layout: str = "concat"):
    """Inverse of :func:`prepare_mxfp4_weights`: the stored ``(w13, w13_scale, w13_bias, w2,
    w2_scale, w2_bias)`` (biases float32, None when absent) in ``gate_up_layout``."""
    p = prepared
    h, i = p.hidden, p.intermediate
    e, n1, hp2 = p.w13.shape
    hp, ip = 2 * hp2, n1 // 2

    def rows(a, axis=-2):
        a = jax.lax.slice_in_dim(a, 0, 2 * i, axis=axis % a.ndim)
        return from_trtllm_gated_rows(a, gate_up_layout, axis)

    w13 = rows(unshuffle_matrix_a(p.w13))[..., : h // 2]
    s13 = rows(unshuffle_matrix_sf_a(p.w13_scale, n1, hp // fp4.MX_BLOCK, as_2d=True))[..., : h // fp4.MX_BLOCK]
    w2 = unshuffle_matrix_a(p.w2)[:, :h, : i // 2]
    s2 = unshuffle_matrix_sf_a(p.w2_scale, hp, ip // fp4.MX_BLOCK, as_2d=True)[:, :h, : i // fp4.MX_BLOCK]
    b13 = None if p.w13_bias is None else rows(unshuffle_matrix_a(p.w13_bias, axis=-1), -1)
    b2 = None if p.w2_bias is None else unshuffle_matrix_a(p.w2_bias, axis=-1)[:, :h]
    return w13, s13, b13, w2, s2, b2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mxfp4Prepared:
    """MXFP4 (GPT-OSS) experts for ``trtllm_fp4_block_scale_moe`` (a pytree; from :func:`prepare`).

    ``w13 [E, 2Ip, Hp/2]``, ``w13_scale [E, 2Ip, Hp/32]``, ``w2 [E, Hp, Ip/2]``,
    ``w2_scale [E, Hp, Ip/32]`` uint8 (E2M1 pairs; E8M0 bytes, shuffled and 128x4-tiled) and
    float32 ``w13_bias [E, 2Ip]``, ``w2_bias [E, Hp]`` or None (:func:`prepare_mxfp4_weights`);
    ``swiglu_alpha``, ``swiglu_beta``, ``swiglu_limit`` float32 ``[E]`` (``gemm1_alpha``,
    ``gemm1_beta``, ``gemm1_clamp_limit``) for ``swigluoai``, None for ``silu``. Static: the
    unpadded ``hidden`` H and ``intermediate`` I, ``act`` the activation format the call feeds
    (``"bf16"``: x as is; ``"mxfp8"``: E4M3 with E8M0 block-32 scales, linear layout), the
    activation."""

    w13: jax.Array
    w13_scale: jax.Array
    w2: jax.Array
    w2_scale: jax.Array
    w13_bias: jax.Array | None = None
    w2_bias: jax.Array | None = None
    swiglu_alpha: jax.Array | None = None
    swiglu_beta: jax.Array | None = None
    swiglu_limit: jax.Array | None = None
    hidden: int = dataclasses.field(default=0, metadata=dict(static=True))
    intermediate: int = dataclasses.field(default=0, metadata=dict(static=True))
    act: str = dataclasses.field(default="bf16", metadata=dict(static=True))
    activation: str = dataclasses.field(default="swigluoai", metadata=dict(static=True))
    scheme: str = dataclasses.field(default="mxfp4", metadata=dict(static=True))


PREPARED = Mxfp4Prepared


def prepare_mxfp4(w13, w2, cfg, quant, *, w13_bias=None, w2_bias=None) -> Mxfp4Prepared:
    """Stored MXFP4 experts (``quant``: an ``mxfp4`` QuantConfig, act ``bf16`` or ``mxfp8``) ->
    :class:`Mxfp4Prepared`; ``cfg.gate_up_layout`` says how w13's rows are stored. For
    ``swigluoai`` the per-expert alpha/beta/limit are ``cfg.swiglu_alpha``, 1, ``cfg.swiglu_limit``
    (GPT-OSS: 1.702, 1.0, 7.0)."""
    w13p, s13, b13, w2p, s2, b2 = prepare_mxfp4_weights(
        w13, quant.w13_scale, w2, quant.w2_scale, w13_bias, w2_bias, gate_up_layout=cfg.gate_up_layout)
    e = w13p.shape[0]
    consts = {}
    if cfg.activation == "swigluoai":
        consts = {name: jnp.full((e,), v, jnp.float32) for name, v in
                  (("swiglu_alpha", cfg.swiglu_alpha), ("swiglu_beta", 1.0), ("swiglu_limit", cfg.swiglu_limit))}
    return Mxfp4Prepared(w13p, s13, w2p, s2, b13, b2, **consts, hidden=int(jnp.shape(w2)[1]),
                         intermediate=2 * int(jnp.shape(w2)[2]), act=quant.act, activation=cfg.activation)


prepare = prepare_mxfp4


def kernel_sizes(prepared: Mxfp4Prepared) -> tuple[int, int, int, int]:
    return prepared.w13.shape[0], prepared.hidden, prepared.w2.shape[1], prepared.w13.shape[1] // 2


check_x = hidden_check(kernel_sizes)


def max_tile_n(prepared: Mxfp4Prepared) -> int | None:
    """FP4 weights x bf16 activations: no tile-128 kernels."""
    return MAX_TILE_N_BF16_ACT if prepared.act == "bf16" else None


def input_shapes(prepared: Mxfp4Prepared, num_tokens: int, hk: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    if prepared.act == "mxfp8":
        return (jax.ShapeDtypeStruct((num_tokens, hk), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((num_tokens, hk // fp4.MX_BLOCK), jnp.uint8))
    return (jax.ShapeDtypeStruct((num_tokens, hk), jnp.bfloat16),)


def quantize_input(x, prepared: Mxfp4Prepared, hk: int) -> tuple[jax.Array, ...]:
    xp = pad_axis(x, hk, -1)
    if prepared.act == "mxfp8":
        return fp4.quantize_mxfp8(xp.astype(jnp.float32))
    return (xp.astype(jnp.bfloat16),)


def operands(prepared: Mxfp4Prepared, xs, ids, w) -> tuple:
    p = prepared
    gemm1 = (p.w13, p.w13_scale, p.w13_bias, p.swiglu_alpha, p.swiglu_beta, p.swiglu_limit)
    return fp4_operands(xs, ids, w, gemm1, (p.w2, p.w2_scale, p.w2_bias), (None, None, None))
