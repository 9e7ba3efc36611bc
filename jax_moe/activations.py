"""The expert activation between GEMM1 and GEMM2: ``[M, w13_rows] -> [M, I]``, in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe.config import MoEConfig


def split_gate_up(h: jax.Array, layout: str) -> tuple[jax.Array, jax.Array]:
    """Split GEMM1's output ``[..., 2I]`` into (gate [..., I], up [..., I]) per ``layout``."""
    if layout == "concat":
        i = h.shape[-1] // 2
        return h[..., :i], h[..., i:]
    return h[..., 0::2], h[..., 1::2]


def activate(h: jax.Array, cfg: MoEConfig) -> jax.Array:
    """Apply ``cfg.activation`` to GEMM1's output ``h [..., w13_rows]`` (float32) -> ``[..., I]``.

    silu:      silu(gate) * up
    gelu:      gelu(gate) * up (exact erf form)
    swigluoai: gate <- min(gate, limit); up <- clip(up, -limit, limit);
               (up + 1) * gate * sigmoid(alpha * gate)
    relu2:     relu(h) ** 2 (not gated)
    """
    h = h.astype(jnp.float32)
    if cfg.activation == "relu2":
        r = jnp.maximum(h, 0.0)
        return r * r
    gate, up = split_gate_up(h, cfg.gate_up_layout)
    if cfg.activation == "silu":
        return jax.nn.silu(gate) * up
    if cfg.activation == "gelu":
        return jax.nn.gelu(gate, approximate=False) * up
    if cfg.activation == "swigluoai":
        gate = jnp.minimum(gate, cfg.swiglu_limit)
        up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        return (up + 1.0) * gate * jax.nn.sigmoid(cfg.swiglu_alpha * gate)
    raise ValueError(f"activation {cfg.activation!r} is not implemented")
