"""A dense float32 MoE, written as the definition reads, for tests and benchmarks.

``out[t] = sum_j w[t, j] * (act(x[t] @ W13[e].T + b13[e]) @ W2[e].T + b2[e])``, ``e = ids[t, j]``,
with every product in float32 (``Precision.HIGHEST``). With ``quant``, the weights are
dequantized first and the two activations are fake-quantized as the kernels quantize them.
Memory is ``O(T * k * (2I * H + H * I))``: only for small shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe.activations import activate
from jax_moe.config import MoEConfig
from jax_moe.quant.rounding import round_to

HIGHEST = jax.lax.Precision.HIGHEST


def moe_reference(
    x: jax.Array,
    w13: jax.Array,
    w2: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    cfg: MoEConfig,
    *,
    quant=None,
    w13_bias: jax.Array | None = None,
    w2_bias: jax.Array | None = None,
    apply_router_weight_on_input: bool = False,
) -> jax.Array:
    """Returns [T, H] float32. Arguments as :func:`jax_moe.fused_experts`."""
    if quant is not None:
        from jax_moe.quant.scheme import dequantize_weights, quantize_activation

        w13, w2 = dequantize_weights(quant, w13, w2, dtype=jnp.float32)
    xf = x.astype(jnp.float32)
    wts = topk_weights.astype(jnp.float32)
    if apply_router_weight_on_input:
        xf = round_to(xf * wts[:, :1], x.dtype)
        wts = jnp.ones_like(wts)
    if quant is not None:
        xf = quantize_activation(quant, xf, 1)
    w13g = w13.astype(jnp.float32)[topk_ids]  # [T, k, 2I, H]
    h = jnp.einsum("th,tknh->tkn", xf, w13g, precision=HIGHEST)
    if w13_bias is not None:
        h = h + w13_bias.astype(jnp.float32)[topk_ids]
    a = activate(h, cfg)
    if quant is not None:
        a = quantize_activation(quant, a, 2)
    else:
        a = round_to(a, x.dtype)  # the kernels feed GEMM2 in x's dtype
    y = jnp.einsum("tki,tkhi->tkh", a, w2.astype(jnp.float32)[topk_ids], precision=HIGHEST)
    if w2_bias is not None:
        y = y + w2_bias.astype(jnp.float32)[topk_ids]
    return jnp.einsum("tkh,tk->th", y, wts, precision=HIGHEST)
