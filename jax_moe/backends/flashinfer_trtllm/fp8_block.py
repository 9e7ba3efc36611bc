"""Scheme ``fp8_block`` of ``backend="flashinfer_trtllm"``: DeepSeek-V3's FP8 block scales on
``jax_moe_trtllm_fp8_block_scale_moe`` (FlashInfer's ``trtllm_fp8_block_scale_moe`` with DeepSeek
FP8 quantization). Compiles for sm_100a against the stand-in cubin pack; never run.

w13 ``[up; gate]``, weights row-shuffled with epilogue tile 64 and stored BlockMajorK, block
scales only swapped (:func:`prepare_fp8_block_weights`, :class:`Fp8BlockPrepared`); x quantized to
FP8 per token per 128 columns, scales handed over ``[H/128, T]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_moe.backends.flashinfer_trtllm.common import check_operand, default_tile_n, hidden_check, no_tile_limit
from jax_moe.layouts import (
    FP8_BLOCK_EPILOGUE_TILE_M, FP8_BLOCK_SCALE, convert_from_block_layout, convert_to_block_layout,
    fp8_block_scale_shape, shuffle_matrix_a, swap_w13_to_w31, swap_w13_to_w31_block_scales,
    unshuffle_matrix_a,
)
from jax_moe.quant import fp8 as fp8_format


def refusal(cfg, quant) -> str | None:
    """What this scheme's contract refuses in (cfg, quant) (None: nothing)."""
    if quant.act != "fp8_per_group":
        return f"FP8 block scale needs per-token-group FP8 activations (act='fp8_per_group'), not {quant.act!r}"
    bs = tuple(getattr(quant, "block_shape", None) or (FP8_BLOCK_SCALE, FP8_BLOCK_SCALE))
    if bs != (FP8_BLOCK_SCALE, FP8_BLOCK_SCALE):
        return f"FP8 block scale needs {FP8_BLOCK_SCALE} x {FP8_BLOCK_SCALE} blocks, not {bs}"
    i = cfg.intermediate_size
    if i % FP8_BLOCK_SCALE:
        return f"intermediate size {i} must be a multiple of {FP8_BLOCK_SCALE} (FP8 block scales)"
    return None


def kernel_dims(cfg) -> tuple[int, int]:
    return cfg.hidden_size, cfg.intermediate_size


default_tile = default_tile_n


def prepare_fp8_block_weights(w13, w13_scale, w2, w2_scale):
    """DeepSeek FP8 block-scale experts -> ``trtllm_fp8_block_scale_moe``'s operands in its
    shuffled BlockMajorK layout (vLLM ``prepare_fp8_moe_layer_for_fi`` with ``is_trtllm``:
    ``swap_w13_to_w31`` then ``_shuffle_deepseek_fp8_moe_weights``; called with
    ``use_shuffled_weight=True, weight_layout=BlockMajorK``).

    In: ``w13 [E, 2I, H]`` float8_e4m3fn (``[gate; up]``), ``w13_scale [E, 2I/128, H/128]``
    float32, ``w2 [E, H, I]``, ``w2_scale [E, H/128, I/128]``; H and I multiples of 128.

    Out ``(w13, w13_scale, w2, w2_scale)``:

    * ``w13 [E, H/128, 2I, 128]`` float8_e4m3fn: rows ``[up; gate]`` (no row interleave for this
      kernel), then rows shuffled inside each block of 16 (epilogue tile 64): output row
      ``16b + 8c + a`` = input row ``16b + 2a + c`` (``a < 8``, ``c < 2``), then cut along H into
      chunks of 128 columns stored chunk-major: ``out[e, q, r, j] = shuffled[e, r, 128 q + j]``;
    * ``w13_scale [E, 2I/128, H/128]`` float32: scale row halves swapped (``[up; gate]``), not
      shuffled;
    * ``w2 [E, I/128, H, 128]``: the same shuffle and chunking of ``w2``; ``w2_scale`` as stored.

    The activations are FP8 with one float32 scale per token per 128 columns, handed over
    transposed as ``[H/128, T]``. Inverse: :func:`restore_fp8_block_weights`.
    """
    w13, s13, w2, s2 = (jnp.asarray(a) for a in (w13, w13_scale, w2, w2_scale))
    if w2.ndim != 3 or w2.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"w2 must be float8_e4m3fn [E, H, I], got {jnp.dtype(w2.dtype).name} {list(w2.shape)}")
    e, h, i = w2.shape
    hb, ib = fp8_block_scale_shape(h, i, "w2")
    check_operand("w13", w13, jnp.float8_e4m3fn, (e, 2 * i, h))
    check_operand("w13_scale", s13, jnp.float32, (e, 2 * ib, hb))
    check_operand("w2_scale", s2, jnp.float32, (e, hb, ib))
    tile = FP8_BLOCK_EPILOGUE_TILE_M
    w13 = convert_to_block_layout(shuffle_matrix_a(swap_w13_to_w31(w13), tile))
    return w13, swap_w13_to_w31_block_scales(s13, i), convert_to_block_layout(shuffle_matrix_a(w2, tile)), s2


def restore_fp8_block_weights(w13, w13_scale, w2, w2_scale):
    """Inverse of :func:`prepare_fp8_block_weights`."""
    tile = FP8_BLOCK_EPILOGUE_TILE_M
    i = w13.shape[2] // 2
    w13 = swap_w13_to_w31(unshuffle_matrix_a(convert_from_block_layout(w13), tile))
    return (w13, swap_w13_to_w31_block_scales(w13_scale, i),
            unshuffle_matrix_a(convert_from_block_layout(w2), tile), w2_scale)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8BlockPrepared:
    """DeepSeek FP8 block-scale experts for ``trtllm_fp8_block_scale_moe`` (a pytree; from
    :func:`prepare`): ``w13 [E, H/128, 2I, 128]``, ``w2 [E, I/128, H, 128]`` float8_e4m3fn
    (shuffled, BlockMajorK), ``w13_scale [E, 2I/128, H/128]`` (``[up; gate]`` rows),
    ``w2_scale [E, H/128, I/128]`` float32 (:func:`prepare_fp8_block_weights`)."""

    w13: jax.Array
    w13_scale: jax.Array
    w2: jax.Array
    w2_scale: jax.Array
    intermediate: int = dataclasses.field(default=0, metadata=dict(static=True))
    activation: str = dataclasses.field(default="silu", metadata=dict(static=True))
    scheme: str = dataclasses.field(default="fp8_block", metadata=dict(static=True))


PREPARED = Fp8BlockPrepared


def prepare_fp8_block(w13, w2, cfg, quant) -> Fp8BlockPrepared:
    """Stored ``fp8_block`` experts (128 x 128 block scales, act ``fp8_per_group``) ->
    :class:`Fp8BlockPrepared`."""
    w13p, s13, w2p, s2 = prepare_fp8_block_weights(w13, quant.w13_scale, w2, quant.w2_scale)
    return Fp8BlockPrepared(w13p, s13, w2p, s2, intermediate=int(jnp.shape(w2)[2]), activation=cfg.activation)


prepare = prepare_fp8_block


def kernel_sizes(prepared: Fp8BlockPrepared) -> tuple[int, int, int, int]:
    """BlockMajorK: w2 [E, I/128, H, 128], w13 [E, H/128, 2I, 128]."""
    return prepared.w13.shape[0], prepared.w2.shape[2], prepared.w2.shape[2], prepared.w13.shape[2] // 2


check_x = hidden_check(kernel_sizes)
max_tile_n = no_tile_limit


def input_shapes(prepared: Fp8BlockPrepared, num_tokens: int, hk: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    return (jax.ShapeDtypeStruct((num_tokens, hk), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((hk // FP8_BLOCK_SCALE, num_tokens), jnp.float32))


def quantize_input(x, prepared: Fp8BlockPrepared, hk: int) -> tuple[jax.Array, ...]:
    q, sc = fp8_format.quantize_fp8_per_token_group(x.astype(jnp.float32), FP8_BLOCK_SCALE)
    return q, sc.T


def operands(prepared: Fp8BlockPrepared, xs, ids, w) -> tuple:
    p = prepared
    return (xs[0], xs[1], ids, w, p.w13, p.w13_scale, p.w2, p.w2_scale)
