"""Scheme ``nvfp4`` of ``backend="flashinfer_trtllm"``: NVFP4 x NVFP4 on
``jax_moe_trtllm_fp4_block_scale_moe`` (FlashInfer's ``trtllm_fp4_block_scale_moe``, the target it
shares with ``mxfp4``). Compiles for sm_100a against the stand-in cubin pack; never run.

The same rows and shuffles as ``mxfp4`` with e4m3 block-16 scales, not padded; the epilogue
scalars ``g1_alphas / a2``, ``g1_alphas``, ``g2_alphas`` (:func:`prepare_nvfp4_weights`,
:class:`Nvfp4Prepared`); x quantized to NVFP4 with linear-layout scales.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_moe.backends.flashinfer_trtllm.common import (
    HIDDEN_ALIGN, NAME, NVFP4_INTERMEDIATE_ALIGN, check_operand, fp4_dims, fp4_operands, hidden_check,
    no_tile_limit, tile_tokens_dim,
)
from jax_moe.layouts import (
    SF_TILE_M, from_trtllm_gated_rows, shuffle_matrix_a, shuffle_matrix_sf_a, to_trtllm_gated_rows,
    trtllm_nvfp4_output_scales, unshuffle_matrix_a, unshuffle_matrix_sf_a,
)
from jax_moe.quant import fp4


def refusal(cfg, quant) -> str | None:
    """What this scheme's contract refuses in (cfg, quant) (None: nothing)."""
    if quant.act != "nvfp4":
        return f"NVFP4 needs NVFP4 activations (act='nvfp4'), not {quant.act!r}"
    if quant.a13_scale is None or quant.a2_scale is None:
        return ("NVFP4 needs static a13_scale and a2_scale (output1_scale_scalar = "
                "a13_scale * w13_scale_2 / a2_scale)")
    i = cfg.intermediate_size
    if i % NVFP4_INTERMEDIATE_ALIGN:
        return (f"intermediate size {i} must be a multiple of {NVFP4_INTERMEDIATE_ALIGN} (w13's 2I "
                f"scale rows fill {SF_TILE_M}-row tiles; NVFP4 is not padded)")
    return None


def kernel_dims(cfg) -> tuple[int, int]:
    return cfg.hidden_size, cfg.intermediate_size


default_tile = tile_tokens_dim


def prepare_nvfp4_weights(w13, w13_scale, w2, w2_scale, *, gate_up_layout: str = "concat"):
    """NVFP4 experts -> ``trtllm_fp4_block_scale_moe``'s weight operands (vLLM's
    ``prepare_static_weights_for_trtllm_fp4_moe`` after ``reorder_w1w3_to_w3w1``).

    In: ``w13 [E, 2I, H/2]`` uint8 (E2M1 pairs), ``w13_scale [E, 2I, H/16]`` float8_e4m3fn
    block-16 scales, ``w2 [E, H, I/2]``, ``w2_scale [E, H, I/16]``; w13's rows ``[gate; up]``
    (``"concat"``) or alternating (``"interleaved"``). H a multiple of 128 and I of 64; nothing is
    padded.

    Out ``(w13, w13_scale, w2, w2_scale)``, the same shapes and dtypes:

    * GEMM1 rows in the runner's order -- row ``2j`` is up row j, row ``2j + 1`` gate row j (vLLM
      swaps ``[w1; w3]`` to ``[w3; w1]``, then FlashInfer's gated-act interleave) -- for the
      weights and the scales alike;
    * weights: rows shuffled inside each block of 32: output row ``32b + 8c + a`` = input row
      ``32b + 4a + c`` (``shuffle_matrix_a``, epilogue tile 128);
    * scales: the same row shuffle, then the 128x4 tiling of :mod:`jax_moe.layouts.scales`
      (scale ``(m, k)`` at flat offset ``((m // 128) * (K/4) + k // 4) * 512 + (m % 32) * 16 +
      ((m % 128) // 32) * 4 + k % 4``, K = scale columns), viewed as ``[rows, K]``
      (``shuffle_matrix_sf_a`` with 16 elements per scale: the row map does not depend on it);
    * w2 and its scales: the same shuffle and tiling, rows H.

    Inverse: :func:`restore_nvfp4_weights`.
    """
    w13, s13, w2, s2 = (jnp.asarray(a) for a in (w13, w13_scale, w2, w2_scale))
    e, h, i = fp4_dims(w2, fp4.NVFP4_BLOCK)
    if h % HIDDEN_ALIGN:
        raise ValueError(f"w2: hidden size {h} must be a multiple of {HIDDEN_ALIGN}")
    if i % NVFP4_INTERMEDIATE_ALIGN:
        raise ValueError(f"w2: intermediate size {i} must be a multiple of {NVFP4_INTERMEDIATE_ALIGN}")
    check_operand("w13", w13, jnp.uint8, (e, 2 * i, h // 2))
    check_operand("w13_scale", s13, jnp.float8_e4m3fn, (e, 2 * i, h // fp4.NVFP4_BLOCK))
    check_operand("w2_scale", s2, jnp.float8_e4m3fn, (e, h, i // fp4.NVFP4_BLOCK))
    w13 = shuffle_matrix_a(to_trtllm_gated_rows(w13, gate_up_layout))
    s13 = shuffle_matrix_sf_a(to_trtllm_gated_rows(s13, gate_up_layout), as_2d=True)
    return w13, s13, shuffle_matrix_a(w2), shuffle_matrix_sf_a(s2, as_2d=True)


def restore_nvfp4_weights(w13, w13_scale, w2, w2_scale, *, gate_up_layout: str = "concat"):
    """Inverse of :func:`prepare_nvfp4_weights`."""
    e, n1, h2 = w13.shape
    h, i = 2 * h2, n1 // 2
    w13 = from_trtllm_gated_rows(unshuffle_matrix_a(w13), gate_up_layout)
    s13 = from_trtllm_gated_rows(unshuffle_matrix_sf_a(w13_scale, n1, h // fp4.NVFP4_BLOCK, as_2d=True),
                                 gate_up_layout)
    return (w13, s13, unshuffle_matrix_a(w2),
            unshuffle_matrix_sf_a(w2_scale, h, i // fp4.NVFP4_BLOCK, as_2d=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Nvfp4Prepared:
    """NVFP4 experts for ``trtllm_fp4_block_scale_moe`` (a pytree; from :func:`prepare`).

    ``w13 [E, 2I, H/2]``, ``w2 [E, H, I/2]`` uint8 and ``w13_scale [E, 2I, H/16]``,
    ``w2_scale [E, H, I/16]`` float8_e4m3fn (:func:`prepare_nvfp4_weights`); float32 ``[E]``
    ``out1_scale`` (``output1_scale_scalar = a13 * w13_scale_2 / a2``), ``out1_gate_scale``
    (``a13 * w13_scale_2``), ``out2_scale`` (``a2 * w2_scale_2``)
    (:func:`jax_moe.layouts.trtllm_nvfp4_output_scales`); ``a1_gscale []`` float32, the
    quantization-side global scale x is quantized to NVFP4 with (``1 / a13_scale``; E2M1 with
    e4m3 block-16 scales in the linear layout). ``a13``/``a2`` per expert collapse to their max."""

    w13: jax.Array
    w13_scale: jax.Array
    w2: jax.Array
    w2_scale: jax.Array
    out1_scale: jax.Array
    out1_gate_scale: jax.Array
    out2_scale: jax.Array
    a1_gscale: jax.Array
    intermediate: int = dataclasses.field(default=0, metadata=dict(static=True))
    activation: str = dataclasses.field(default="silu", metadata=dict(static=True))
    scheme: str = dataclasses.field(default="nvfp4", metadata=dict(static=True))


PREPARED = Nvfp4Prepared


def prepare_nvfp4(w13, w2, cfg, quant) -> Nvfp4Prepared:
    """Stored NVFP4 experts (``quant``: an ``nvfp4`` QuantConfig with act ``nvfp4`` and static
    ``a13_scale``/``a2_scale``) -> :class:`Nvfp4Prepared`. jax_moe's ``w*_global_scale`` is the
    quantization-side ``448 * 6 / amax``; vLLM's ``weight_scale_2`` is its reciprocal."""
    w13p, s13, w2p, s2 = prepare_nvfp4_weights(w13, quant.w13_scale, w2, quant.w2_scale,
                                               gate_up_layout=cfg.gate_up_layout)
    e = w13p.shape[0]
    for name in ("w13_global_scale", "w2_global_scale"):
        if getattr(quant, name, None) is None:
            raise ValueError(f"{NAME}: NVFP4 needs {name} ([E] float32)")
    w13_s2 = jnp.broadcast_to(1.0 / jnp.asarray(quant.w13_global_scale, jnp.float32), (e,))
    w2_s2 = jnp.broadcast_to(1.0 / jnp.asarray(quant.w2_global_scale, jnp.float32), (e,))
    a13 = jnp.max(jnp.asarray(quant.a13_scale, jnp.float32))  # one scale for all experts, as vLLM
    a2 = jnp.max(jnp.asarray(quant.a2_scale, jnp.float32))
    sc = trtllm_nvfp4_output_scales(w13_s2, a13, w2_s2, a2)
    return Nvfp4Prepared(w13p, s13, w2p, s2, sc.output1_scales_scalar, sc.output1_scales_gate_scalar,
                         sc.output2_scales_scalar, jnp.float32(1.0) / a13,
                         intermediate=2 * int(jnp.shape(w2)[2]), activation=cfg.activation)


prepare = prepare_nvfp4


def kernel_sizes(prepared: Nvfp4Prepared) -> tuple[int, int, int, int]:
    return prepared.w13.shape[0], prepared.w2.shape[1], prepared.w2.shape[1], prepared.w13.shape[1] // 2


check_x = hidden_check(kernel_sizes)
max_tile_n = no_tile_limit


def input_shapes(prepared: Nvfp4Prepared, num_tokens: int, hk: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    return (jax.ShapeDtypeStruct((num_tokens, hk // 2), jnp.uint8),
            jax.ShapeDtypeStruct((num_tokens, hk // fp4.NVFP4_BLOCK), jnp.float8_e4m3fn))


def quantize_input(x, prepared: Nvfp4Prepared, hk: int) -> tuple[jax.Array, ...]:
    q, sf, _ = fp4.quantize_nvfp4(x.astype(jnp.float32), prepared.a1_gscale)
    return q, sf


def operands(prepared: Nvfp4Prepared, xs, ids, w) -> tuple:
    p = prepared
    return fp4_operands(xs, ids, w, (p.w13, p.w13_scale, None, None, None, None), (p.w2, p.w2_scale, None),
                        (p.out1_scale, p.out1_gate_scale, p.out2_scale))
