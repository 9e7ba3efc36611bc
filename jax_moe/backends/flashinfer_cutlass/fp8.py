"""Scheme ``fp8`` of ``backend="flashinfer_cutlass"``: vLLM's FP8 per-tensor W8A8.

Activations quantized to float8_e4m3fn with one per-tensor scale (static ``a13_scale``, or
dynamic ``amax(x) / 448`` per call) x float8_e4m3fn weights with per-tensor or per-expert scales
-> bf16. GEMM1's accumulator is rescaled by ``g1_alphas[e] = w13_scale[e] * a13_scale``, the
activation output re-quantized to FP8 with ``1 / a2_scale`` (static: the runner has no amax
pass), GEMM2's accumulator rescaled by ``g2_alphas[e] = w2_scale[e] * a2_scale``. Per-expert
activation scales use their max over experts, as vLLM does. The alphas are computed at load time
(:func:`jax_moe.layouts.fp8_alpha_scales`).

The only scheme that also takes x already quantized (:func:`quantize_input`) with its per-tensor
scale: expert parallelism quantizes before dispatch.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_moe.backends.flashinfer_cutlass import native
from jax_moe.backends.flashinfer_cutlass.common import NAME, Prepared, extras, random_weights, runner_row_order
from jax_moe.layouts import fp8_alpha_scales
from jax_moe.quant import fp8 as fp8_format


def refusal(cfg, quant) -> str | None:
    """Why the runner's FP8 path cannot serve ``quant`` (activation format, per-channel weight
    scales, a dynamic a2), or None."""
    if quant.act != "fp8_per_tensor":
        return f"FP8 needs per-tensor activation scales (act='fp8_per_tensor'), not {quant.act!r}"
    for name in ("w13_scale", "w2_scale"):
        if getattr(quant, name).ndim > 1:
            return (f"{name} is per channel; the runner's FP8 path takes per-tensor or "
                    "per-expert weight scales")
    if quant.a2_scale is None:
        return ("FP8 needs a static a2_scale: the runner re-quantizes the activation "
                "output with it (calibrate one with calibrate_activation_scale)")
    return None


def prepare(w13, w2, cfg, quant, *, w13_bias=None, w2_bias=None) -> Prepared:
    """FP8 weights in the runner's row order, per-expert weight scales and the alphas."""
    extra = extras(cfg, w13_bias, w2_bias)
    if quant.act != "fp8_per_tensor" or quant.a2_scale is None:
        raise ValueError(f"{NAME}: FP8 needs act='fp8_per_tensor' and a static a2_scale")
    e = jnp.shape(w13)[0]
    w13_scale = jnp.broadcast_to(jnp.asarray(quant.w13_scale, jnp.float32), (e,))
    w2_scale = jnp.broadcast_to(jnp.asarray(quant.w2_scale, jnp.float32), (e,))
    a2 = jnp.max(jnp.asarray(quant.a2_scale, jnp.float32))  # one scale for all experts, as vLLM
    a13 = None if quant.a13_scale is None else jnp.max(jnp.asarray(quant.a13_scale, jnp.float32))
    g1, g2 = fp8_alpha_scales(w13_scale, 1.0 if a13 is None else a13, w2_scale, a2)
    return Prepared(
        w13=runner_row_order(w13, cfg.activation, cfg.gate_up_layout).astype(jnp.float8_e4m3fn),
        w2=jnp.asarray(w2).astype(jnp.float8_e4m3fn),
        w13_scale=w13_scale, a13_scale=a13, g1_alphas=None if a13 is None else g1,
        a2_gscale=jnp.float32(1.0) / a2, g2_alphas=g2, scheme="fp8", activation=cfg.activation,
        **extra,
    )


def input_scale(x, prepared: Prepared, amax=None):
    """The per-tensor FP8 scale the ``fp8`` scheme quantizes ``x [T, H]`` with: the static
    ``a13_scale``, else ``amax / 448`` of ``amax`` (default ``max |x|``; expert parallelism
    passes the max over every device's tokens). float32 []."""
    if prepared.a13_scale is not None:
        return prepared.a13_scale
    if amax is None:
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    return fp8_format.amax_to_scale(amax)


def quantize_input(x, scale):
    """x [T, H] float -> float8_e4m3fn with ``scale`` (:func:`input_scale`): what the ``fp8``
    scheme feeds GEMM1. Expert parallelism quantizes before dispatch with it and hands the
    result to ``apply_prepared`` with ``x_scale=scale``."""
    return fp8_format.quantize_fp8_static(x.astype(jnp.float32), scale)


def check_prepared(prepared: Prepared, x) -> None:
    """Nothing beyond the shapes every scheme checks."""


def call(x, prepared: Prepared, ids, tw, extra_operands, attrs: dict, x_scale=None):
    """The custom call on x [T, H] float (quantized here with :func:`input_scale` or ``x_scale``)
    or float8_e4m3fn (quantized before, with ``x_scale``); returns [T, H] bf16."""
    t, h = x.shape
    a13 = input_scale(x, prepared) if x_scale is None else jnp.asarray(x_scale, jnp.float32)
    g1 = prepared.g1_alphas if prepared.a13_scale is not None and x_scale is None else prepared.w13_scale * a13
    xq = x if x.dtype == jnp.float8_e4m3fn else quantize_input(x, a13)
    out, _ = native.custom_call(prepared, t, h, ids.shape[1])(
        xq, prepared.w13, prepared.w2, ids, tw, g1.astype(jnp.float32), prepared.a2_gscale,
        prepared.g2_alphas, *extra_operands, **attrs)
    return out


def random_operands(scheme: str, keys, num_experts: int, n1: int, hidden: int, inter: int) -> dict:
    """Stand-in FP8 weights and unit scales for timing tactics."""
    w13, w2 = random_weights(keys, num_experts, n1, hidden, inter, jnp.float8_e4m3fn)
    ones = jnp.ones((num_experts,), jnp.float32)
    return dict(w13=w13, w2=w2, w13_scale=ones, a13_scale=jnp.float32(1.0), g1_alphas=ones,
                a2_gscale=jnp.float32(1.0), g2_alphas=ones)
