"""The FP8 block-scale operands of FlashInfer's CUTLASS MoE runner (DeepSeek-V3 FP8, scheme
``fp8_block`` of ``backend="flashinfer_cutlass"``, SM90).

Definition (``b = FP8_BLOCK_SCALE = 128``; ``N1 = 2I`` for a gated activation, ``I`` otherwise;
H and I multiples of b):

=============  ====================  =============  ==================================================
operand        shape                 dtype          meaning
=============  ====================  =============  ==================================================
``w13``        ``[E, N1, H]``        float8_e4m3fn  rows ``[up (I); gate (I)]`` for a gated activation
                                                    (the runner computes ``act(gate) * up``)
``w13_scale``  ``[E, N1/b, H/b]``    float32        ``w13[e, r, c] ~= float(q) * w13_scale[e, r // b,
                                                    c // b]``, scale rows in w13's row order
``w2``         ``[E, H, I]``         float8_e4m3fn  as stored
``w2_scale``   ``[E, H/b, I/b]``     float32        ``w2[e, r, c] ~= float(q) * w2_scale[e, r // b, c // b]``
=============  ====================  =============  ==================================================

These are :mod:`jax_moe.quant.fp8`'s block scales (``quantize_fp8_block`` with ``(b, b)``): the
layout is the stored one except for the gated row order. A stored ``[gate; up]`` w13 becomes
``[up; gate]`` by swapping its row halves (:func:`jax_moe.layouts.swap_w13_to_w31`); since b
divides I, each half of the weight rows is ``I / b`` whole scale rows, and the scales follow by
swapping their row halves too (:func:`swap_w13_to_w31_block_scales`). The activations need no
layout: the kernel quantizes them itself (per token, per b columns, dynamic ``amax / 448``).
"""

from __future__ import annotations

from jax_moe.layouts.common import FP8_BLOCK_SCALE
from jax_moe.layouts.gated import swap_w13_to_w31

__all__ = ["fp8_block_scale_shape", "swap_w13_to_w31_block_scales", "swap_w31_to_w13_block_scales"]


def fp8_block_scale_shape(rows: int, k: int, name: str = "weight") -> tuple[int, int]:
    """``(rows / 128, k / 128)``: the trailing scale shape of a ``[..., rows, k]`` block-scaled
    weight in this layout. Raises ValueError (naming ``name``) unless both are multiples of 128."""
    for dim, v in (("rows", rows), ("K", k)):
        if int(v) % FP8_BLOCK_SCALE:
            raise ValueError(f"{name}: {dim} ({v}) must be a multiple of {FP8_BLOCK_SCALE} for FP8 "
                             f"block scales")
    return int(rows) // FP8_BLOCK_SCALE, int(k) // FP8_BLOCK_SCALE


def swap_w13_to_w31_block_scales(scale, intermediate_size: int):
    """w13's block scales ``[..., 2I/128, H/128]`` (any float dtype) with their row halves
    swapped, as :func:`jax_moe.layouts.swap_w13_to_w31` swaps w13's ``[gate; up]`` rows to
    ``[up; gate]``: ``out[..., r, :] = scale[..., (r + I/128) mod (2I/128), :]``. Self-inverse.
    Raises ValueError unless I is a multiple of 128 and ``scale`` has ``2I/128`` rows."""
    half, _ = fp8_block_scale_shape(intermediate_size, FP8_BLOCK_SCALE, "w13_scale (I)")
    if scale.ndim < 2 or scale.shape[-2] != 2 * half:
        raise ValueError(f"w13_scale must have 2I/128 = {2 * half} rows (axis -2), got shape "
                         f"{list(scale.shape)}")
    return swap_w13_to_w31(scale, axis=-2)


def swap_w31_to_w13_block_scales(scale, intermediate_size: int):
    """Inverse of :func:`swap_w13_to_w31_block_scales` (the same map)."""
    return swap_w13_to_w31_block_scales(scale, intermediate_size)
