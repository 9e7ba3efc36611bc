"""Shared experts: always-on gated MLPs added to the routed experts' output (DeepSeek-V3,
Kimi-K2, GLM-4.5, Qwen2-MoE, Llama-4).

    y_shared = g(x) * W2 act(W13 x)        x [T, H] -> [T, H]

``W13 [1, 2Is, H]`` and ``W2 [1, H, Is]`` are one expert of intermediate size ``Is`` (DeepSeek's
``n_shared_experts`` experts of size I are one MLP of size ``n_shared_experts * I``); ``g`` is 1,
or Qwen2-MoE's ``sigmoid(x @ gate^T)`` with ``gate [1, H]``.

How it runs: as a dense MLP in XLA (:func:`dense_mlp`: two plain matmuls, cuBLAS on a GPU; stored
quantized weights are dequantized first, one expert's worth), which also differentiates. Chosen
by measurement (``bench/shared_experts_bench.py``, H100): next to the routed experts it cost
0.06-0.6 ms for DeepSeek-V3 (FP8 block) and 0.07-2.7 ms for Qwen2-57B's 8x shared MLP (bf16),
at or below fusing it into the routed call as extra always-selected experts (up to 1.3x slower
at T=4096 for Qwen2-57B) and far below a one-expert call on FlashInfer's runner. An explicit
:meth:`SharedExperts.prepare` still runs it as a one-expert call on a kernel backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_moe.activations import activate
from jax_moe.config import MoEConfig
from jax_moe.expert_weights import ExpertsModule, normal_init
from jax_moe.quant.scheme import dequantize_weights


def dense_mlp(x: jax.Array, w13: jax.Array, w2: jax.Array, cfg: MoEConfig, quant=None) -> jax.Array:
    """One expert as a dense MLP: x [T, H] -> ``W2 act(W13 x)`` [T, H] in x's dtype.

    w13 [1, 2I, H], w2 [1, H, I] in x's dtype, or stored quantized with ``quant`` (dequantized to
    x's dtype here). Products accumulate in float32; the activation runs in float32."""
    if quant is not None:
        w13, w2 = dequantize_weights(quant, w13, w2, x.dtype)
    h = jnp.dot(x, w13[0].astype(x.dtype).T, preferred_element_type=jnp.float32)
    a = activate(h, cfg).astype(x.dtype)
    return jnp.dot(a, w2[0].astype(x.dtype).T, preferred_element_type=jnp.float32).astype(x.dtype)


class SharedExperts(ExpertsModule):
    """One always-on gated MLP (see the module docstring). ``x [T, H]`` -> ``[T, H]`` in ``dtype``.

    Parameters: w13 [1, 2Is, H], w2 [1, H, Is] in ``param_dtype`` (or stored quantized with
    ``quant``), gate [1, H] float32 when ``gated``."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, activation: str = "silu",
                 gated: bool = False, rngs: nnx.Rngs | None = None, dtype=jnp.bfloat16, param_dtype=None,
                 backend: str | None = None, w13=None, w2=None, quant=None, gate=None):
        cfg = MoEConfig(1, 1, hidden_size, intermediate_size, activation)
        h, i = hidden_size, intermediate_size
        if w13 is None:
            if rngs is None:
                raise ValueError("rngs is required when the shared experts' weights are not given")
            w13 = normal_init(rngs, (1, cfg.w13_rows, h), h, jnp.float32)
            w2 = normal_init(rngs, (1, h, i), i, jnp.float32)
            if gated:
                gate = normal_init(rngs, (1, h), h, jnp.float32)
        if gated != (gate is not None):
            raise ValueError("gate [1, H] must be given exactly when gated=True")
        self._init_experts(cfg, w13, w2, quant, dtype=dtype, param_dtype=param_dtype, backend=backend)
        self.gate = None if gate is None else nnx.Param(jnp.asarray(gate, jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [T, H] in ``dtype`` -> [T, H] in ``dtype``."""
        t = x.shape[0]
        if self.gate is None:
            weights = jnp.ones((t, 1), jnp.float32)
        else:
            weights = jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), self.gate.get_value().T))
        if self.prepared is not None:
            return self._run_experts(x, weights, jnp.zeros((t, 1), jnp.int32))
        quant = None if self.quant is None else self.quant.get_value()
        y = dense_mlp(x.astype(self.dtype), self.w13.get_value(), self.w2.get_value(), self.config, quant)
        return y if self.gate is None else (y.astype(jnp.float32) * weights).astype(self.dtype)
