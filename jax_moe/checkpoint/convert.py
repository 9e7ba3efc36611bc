"""What a loaded layer's experts become: ``quant="native"`` keeps a quantized checkpoint's stored
form, ``None`` dequantizes to a float dtype, a scheme name (``"fp8"``, ``"fp8_block"``, ...)
quantizes to that scheme (from the dequantized weights when the checkpoint is quantized in
another scheme)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jax_moe.checkpoint.readers import ExpertWeights, LayerTensors
from jax_moe.quant.scheme import SCHEMES, QuantConfig, dequantize_weights, quantize_weights

QUANT_MODES = ("native", None) + SCHEMES
_CHUNK_BYTES = 1 << 30  # output bytes dequantized at once


def check_quant_mode(quant) -> None:
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be 'native', None (dequantize) or a scheme name {list(SCHEMES)}, "
                         f"got {quant!r}")


def convert_layer(t: LayerTensors, quant, dtype) -> LayerTensors:
    """``t`` with its routed and shared experts in the form ``quant`` asks for."""
    check_quant_mode(quant)
    if quant == "native":
        return t
    shared = None if t.shared is None else convert_experts(t.shared, quant, dtype)
    return dataclasses.replace(t, experts=convert_experts(t.experts, quant, dtype), shared=shared)


def convert_experts(ew: ExpertWeights, quant, dtype) -> ExpertWeights:
    if ew.quant is not None and ew.quant.scheme == quant:
        return ew
    float_ew = ew if ew.quant is None else dequantize(ew, jnp.float32 if quant else dtype)
    if quant is None:
        return float_ew
    q13, q2, qcfg = quantize_weights(quant, float_ew.w13, float_ew.w2)
    return dataclasses.replace(ew, w13=q13, w2=q2, quant=qcfg)


def _expert_slice(quant: QuantConfig, start: int, stop: int) -> QuantConfig:
    def cut(a):
        return a if a is None or np.ndim(a) == 0 else a[start:stop]

    return dataclasses.replace(quant, **{n: cut(getattr(quant, n)) for n in
                                         ("w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale")})


def dequantize(ew: ExpertWeights, dtype) -> ExpertWeights:
    """Stored quantized experts -> float ``dtype`` (host numpy), a few experts at a time."""
    e = ew.num_experts
    n13, k13 = ew.w13.shape[1], ew.w2.shape[1]
    per_expert = np.dtype(dtype).itemsize * (n13 * k13 + k13 * ew.intermediate_size)
    per = max(1, _CHUNK_BYTES // max(per_expert, 1))
    parts13, parts2 = [], []
    for s in range(0, e, per):
        q = _expert_slice(ew.quant, s, s + per)
        a, b = dequantize_weights(q, jnp.asarray(ew.w13[s:s + per]), jnp.asarray(ew.w2[s:s + per]), dtype)
        parts13.append(np.asarray(a))
        parts2.append(np.asarray(b))
    return dataclasses.replace(ew, w13=np.concatenate(parts13), w2=np.concatenate(parts2), quant=None)
