"""Scheme ``mxfp4`` of ``backend="flashinfer_cutlass"``: W4A16, GPT-OSS's MXFP4 on Hopper.

``QuantConfig(scheme="mxfp4", act="bf16")``: bf16 activations x MXFP4 weights (E2M1 codes, one
E8M0 scale per 32 along K) -> bf16, on the runner's SM90 mixed-input grouped GEMMs (FlashInfer's
``isWFP4A16Quant`` runner, ``CutlassMoeFCRunner<bf16, Fp4Type>`` with
``QuantParams::GroupWise(32, ...)``): the kernel converts the 4-bit weights to bf16 in registers
(CUTLASS's mixed-input mainloop, scale mode kPostMma) and multiplies bf16 x bf16. This is what
serves weight-only MXFP4 on Hopper (vLLM's Marlin row is not built).

Weights (:func:`prepare_mxfp4_weights`): the runner's row order on the packed weights and their
scales, I and H padded with zeros to :data:`jax_moe.layouts.MXFP4_PADDING`
``["flashinfer_cutlass"]`` (128: the mixed-input GEMM folds scales per 128 weights along K and
the runner asks H and I to be multiples of 128), then the mixed-input GEMM's byte order
(:mod:`jax_moe.layouts.mixed_gemm`). ``x`` is padded to the padded H per call and the runner
writes only the first H output columns (its unpadded hidden size).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.backends.flashinfer_cutlass import native
from jax_moe.backends.flashinfer_cutlass.common import (
    GATED, NAME, Prepared, extras, pad_rows, problem_sizes, random_weights, runner_row_order,
)
from jax_moe.layouts import (
    interleave_fp4_weights_for_sm90_mixed_gemm, interleave_scales_for_sm90_mixed_gemm, mixed_gemm_scale_shape,
    mxfp4_padded_sizes, pad_axis,
)
from jax_moe.quant import fp4


def refusal(cfg, quant) -> str | None:
    """Why this scheme cannot serve ``quant``: only bf16 activations (W4A16), or None."""
    if quant.act != "bf16":
        return (f"MXFP4 runs with bf16 activations (W4A16) here, not {quant.act!r}: FlashInfer "
                "0.7.2 has no SM90 MXFP4 x MXFP8 CUTLASS path")
    return None


def prepare_mxfp4_weights(w13, w13_scale, w2, w2_scale, activation: str = "silu",
                          gate_up_layout: str = "concat"):
    """mxfp4 scheme: stored MXFP4 experts -> the runner's W4A16 operands, once, at load time.

    In: ``w13 [E, 2I, H/2]`` uint8 (two E2M1 codes per byte, :mod:`jax_moe.quant.fp4`; rows
    ``[gate; up]`` or alternating per ``gate_up_layout``; ``[E, I, H/2]`` for ``relu2``),
    ``w13_scale [E, 2I, H/32]`` uint8 E8M0, ``w2 [E, H, I/2]``, ``w2_scale [E, H, I/32]``.
    Out: ``(w13, w13_scale, w2, w2_scale)`` with ``(Hp, Ip) = mxfp4_padded_sizes(NAME, H, I)``:

    * ``w13 [E, 2Ip, Hp/2]`` uint8: rows as ``[up (I); 0 (Ip - I); gate (I); 0]``
      (:func:`~jax_moe.backends.flashinfer_cutlass.common.runner_row_order`, then each half
      zero-padded), bytes zero-padded to ``Hp/2``, then in the mixed-input GEMM's byte order
      (:func:`jax_moe.layouts.interleave_fp4_weights_for_sm90_mixed_gemm`);
    * ``w13_scale [E, 2Ip/64, Hp/128, 16, 16]`` uint8: the scales through the same rows and
      padding (zero bytes), folded (:func:`jax_moe.layouts.interleave_scales_for_sm90_mixed_gemm`);
    * ``w2 [E, Hp, Ip/2]`` and ``w2_scale [E, Hp/64, Ip/128, 16, 16]`` likewise (rows H, K I).

    Zero codes in the padding make padded GEMM1 rows 0 (and so the activation's output there:
    every activation here maps a zero gate to 0) and padded GEMM2 rows 0.
    """
    w13, s13 = jnp.asarray(w13), jnp.asarray(w13_scale)
    w2, s2 = jnp.asarray(w2), jnp.asarray(w2_scale)
    for name, a in (("w13", w13), ("w13_scale", s13), ("w2", w2), ("w2_scale", s2)):
        if a.ndim != 3 or a.dtype != jnp.uint8:
            raise ValueError(f"{name} must be uint8 [E, N, K/2] (weights) or [E, N, K/32] (scales), "
                             f"got {np.dtype(a.dtype).name} {list(a.shape)}")
    e, h, i2 = w2.shape
    i = 2 * i2
    n1 = 2 * i if GATED[activation] else i
    want = {"w13": (w13, (e, n1, h // 2)), "w13_scale": (s13, (e, n1, h // fp4.MX_BLOCK)),
            "w2_scale": (s2, (e, h, i // fp4.MX_BLOCK))}
    for name, (a, shape) in want.items():
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {list(shape)} for w2 {list(w2.shape)}, got {list(a.shape)}")
    hp, ip = mxfp4_padded_sizes(NAME, h, i)
    rows = lambda a: pad_rows(runner_row_order(a, activation, gate_up_layout), activation, ip)  # noqa: E731
    w13 = pad_axis(rows(w13), hp // 2, -1)
    s13 = pad_axis(rows(s13), hp // fp4.MX_BLOCK, -1)
    w2 = pad_axis(pad_axis(w2, hp, -2), ip // 2, -1)
    s2 = pad_axis(pad_axis(s2, hp, -2), ip // fp4.MX_BLOCK, -1)
    return (interleave_fp4_weights_for_sm90_mixed_gemm(w13), interleave_scales_for_sm90_mixed_gemm(s13),
            interleave_fp4_weights_for_sm90_mixed_gemm(w2), interleave_scales_for_sm90_mixed_gemm(s2))


def refuse_nan_scales(quant) -> None:
    """ValueError naming the scale and the experts that hold 0xFF, the E8M0 NaN byte (a block that
    held NaN or inf, :mod:`jax_moe.quant`). The runner's GEMM2 reads a scale tile of the next
    expert too (times zero for expert e's rows, seen on an H100 with FlashInfer 0.7.2), so a NaN
    scale in one expert would turn other experts' tokens into NaN: such weights are refused
    here, at load time. Traced scales are not checked."""
    for name in ("w13_scale", "w2_scale"):
        try:
            v = np.asarray(getattr(quant, name))
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            continue
        bad = np.flatnonzero((v.reshape(v.shape[0], -1) == 0xFF).any(axis=1))
        if bad.size:
            raise ValueError(f"{NAME}: {name} holds 0xFF (the E8M0 NaN of a block that held NaN or inf) in "
                             f"experts {bad[:8].tolist()}; FlashInfer's MXFP4 runner would spread it to the "
                             f"tokens of neighbouring experts, so these weights are refused (the xla backend "
                             f"keeps it in the tokens that use those experts)")


def prepare(w13, w2, cfg, quant, *, w13_bias=None, w2_bias=None) -> Prepared:
    """The operands of :func:`prepare_mxfp4_weights` (scales in ``w13_block_scale`` /
    ``w2_block_scale``) and the biases padded like the weights."""
    if quant.act != "bf16":
        raise ValueError(f"{NAME}: MXFP4 needs act='bf16' (W4A16), got {quant.act!r}")
    refuse_nan_scales(quant)
    w13p, s13, w2p, s2 = prepare_mxfp4_weights(w13, quant.w13_scale, w2, quant.w2_scale,
                                               cfg.activation, cfg.gate_up_layout)
    extra = extras(cfg, w13_bias, w2_bias, mxfp4_padded_sizes(NAME, cfg.hidden_size, cfg.intermediate_size))
    return Prepared(w13p, w2p, w13_block_scale=s13, w2_block_scale=s2, scheme="mxfp4",
                    activation=cfg.activation, **extra)


def check_prepared(prepared: Prepared, x) -> None:
    """The folded E8M0 scales in their shapes and dtype."""
    e, hw, i = problem_sizes(prepared)
    n1 = prepared.w13.shape[1]
    for name, rows, kk in (("w13_block_scale", n1, hw), ("w2_block_scale", hw, i)):
        sc = getattr(prepared, name)
        want = (e,) + mixed_gemm_scale_shape(rows, kk)
        if sc is None or tuple(sc.shape) != want or sc.dtype != jnp.uint8:
            raise ValueError(f"prepared.{name} must be uint8 {list(want)} (use prepare())")


def call(x, prepared: Prepared, ids, tw, extra_operands, attrs: dict, x_scale=None):
    """The custom call on x [T, H] (H unpadded; zero-padded here to the weights' H, the runner
    writes only the first H columns); returns [T, H] bf16."""
    t, h = x.shape
    _, hw, _ = problem_sizes(prepared)
    xp = pad_axis(x.astype(jnp.bfloat16), hw, -1)
    out, _ = native.custom_call(prepared, t, h, ids.shape[1])(
        xp, prepared.w13, prepared.w2, ids, tw, prepared.w13_block_scale, prepared.w2_block_scale,
        *extra_operands, **attrs)
    return out


def random_operands(scheme: str, keys, num_experts: int, n1: int, hidden: int, inter: int) -> dict:
    """Stand-in codes and scales 2**-4 (E8M0 byte 123) for timing tactics."""
    w13, w2 = random_weights(keys, num_experts, n1, hidden, inter, jnp.uint8)
    return dict(w13=w13, w2=w2,
                w13_block_scale=jnp.full((num_experts,) + mixed_gemm_scale_shape(n1, hidden), 123, jnp.uint8),
                w2_block_scale=jnp.full((num_experts,) + mixed_gemm_scale_shape(hidden, inter), 123, jnp.uint8))
