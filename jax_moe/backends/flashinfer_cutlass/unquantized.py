"""Schemes ``bf16`` and ``f16`` of ``backend="flashinfer_cutlass"``: unquantized weights.

* ``bf16``: bf16 activations x bf16 weights -> bf16 (float32 weights are cast to bf16).
* ``f16``: float16 activations x float16 weights -> float16 (biases float16 too): ``bf16``'s
  kernels with half (``CutlassMoeFCRunner<half, half>``), chosen by the weights' dtype (no
  QuantConfig); the same layouts and activations as ``bf16``. Opt-in build
  (``JAX_MOE_FI_SCHEMES="...;f16"``); float16 mixed with bfloat16 is a ValueError.

Weights: w13 in the runner's row order (:func:`jax_moe.backends.flashinfer_cutlass.common.runner_row_order`),
w2 as is, both in the scheme's dtype (:func:`prepare_weights`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_moe.backends.flashinfer_cutlass import native
from jax_moe.backends.flashinfer_cutlass.common import (
    F16_NOT_BUILT, FLOAT_SCHEMES, NAME, Prepared, extras, random_weights, runner_row_order,
)


def float_scheme(**arrays) -> str:
    """``f16`` if any of the named arrays (None: absent) is float16, else ``bf16``; float16 next
    to bfloat16 is a ValueError naming both groups (float32 goes with either)."""
    dts = {n: np.dtype(a.dtype) for n, a in arrays.items() if getattr(a, "dtype", None) is not None}
    names = {dt: [n for n, d in dts.items() if d == np.dtype(dt)] for dt in (jnp.float16, jnp.bfloat16)}
    f16, bf16 = names[jnp.float16], names[jnp.bfloat16]
    if f16 and bf16:
        raise ValueError(f"{NAME}: float16 and bfloat16 mixed ({', '.join(f16)} float16; {', '.join(bf16)} "
                         "bfloat16): scheme f16 takes float16 throughout, bf16 bfloat16")
    return "f16" if f16 else "bf16"


def refusal(cfg, quant) -> str | None:
    """Nothing in (cfg, quant) is refused before the build and the shapes are asked."""
    return None


def prepare_weights(w13, w2, activation: str = "silu", gate_up_layout: str = "concat", dtype=jnp.bfloat16):
    """bf16 scheme: ``(w13 [E, 2I, H] bf16 as [up; gate], w2 [E, H, I] bf16)`` (see
    :func:`~jax_moe.backends.flashinfer_cutlass.common.runner_row_order`); f16 scheme: the same
    with ``dtype=jnp.float16``."""
    w13 = runner_row_order(w13, activation, gate_up_layout)
    return w13.astype(dtype), jnp.asarray(w2).astype(dtype)


def prepare(w13, w2, cfg, quant=None, *, w13_bias=None, w2_bias=None) -> Prepared:
    """The scheme (:func:`float_scheme`: float16 next to bfloat16 is an error before anything is
    traced) and its :class:`Prepared`."""
    scheme = float_scheme(w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias)
    dt = FLOAT_SCHEMES[scheme]
    w13p, w2p = prepare_weights(w13, w2, cfg.activation, cfg.gate_up_layout, dtype=dt)
    return Prepared(w13p, w2p, scheme=scheme, activation=cfg.activation,
                    **extras(cfg, w13_bias, w2_bias, bias_dtype=dt))


def check_prepared(prepared: Prepared, x) -> None:
    """x and the prepared arrays of one float dtype (float32 goes with either), and ``f16`` in
    this build."""
    float_scheme(x=x, **{"prepared.w13": prepared.w13, "prepared.w2": prepared.w2,
                         "prepared.w13_bias": prepared.w13_bias, "prepared.w2_bias": prepared.w2_bias})
    if prepared.scheme == "f16" and "f16" not in native.compiled_schemes():
        raise ValueError(F16_NOT_BUILT)


def call(x, prepared: Prepared, ids, tw, extra_operands, attrs: dict, x_scale=None):
    """The custom call on x [T, H] (cast to the scheme's dtype); returns [T, H] in that dtype."""
    t, h = x.shape
    dt = FLOAT_SCHEMES[prepared.scheme]
    out, _ = native.custom_call(prepared, t, h, ids.shape[1])(
        x.astype(dt), prepared.w13.astype(dt), prepared.w2.astype(dt), ids, tw, *extra_operands, **attrs)
    return out


def random_operands(scheme: str, keys, num_experts: int, n1: int, hidden: int, inter: int) -> dict:
    """Stand-in weights of the scheme's dtype for timing tactics."""
    w13, w2 = random_weights(keys, num_experts, n1, hidden, inter, FLOAT_SCHEMES[scheme])
    return dict(w13=w13, w2=w2)
