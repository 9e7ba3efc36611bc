"""``MoEBlock``: a Flax NNX module holding a router and the experts, calling :func:`jax_moe.fused_moe`.

    block = MoEBlock(hidden_size=1024, intermediate_size=512, num_experts=8, top_k=2, rngs=nnx.Rngs(0))
    y = block(x)                      # x [..., H] -> [..., H]
    block.quantize("fp8")             # once, at load time: weights stored quantized from now on
    block.prepare()                   # once, at load time: repacked for the fastest backend here
    block = MoEBlock.from_checkpoint("mixtral", tensors, prefix="model.layers.0.block_sparse_moe.", top_k=2)
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jax_moe.checkpoint import ExpertTensors, read_layer
from jax_moe.config import MoEConfig
from jax_moe.experts import fused_moe
from jax_moe.routing import select_experts


class QuantizedWeight(nnx.Variable):
    """Stored (quantized) expert weights and their QuantConfig: not trained."""


class PreparedWeight(nnx.Variable):
    """Expert weights repacked for one backend (its ``Prepared`` pytree): not trained."""


class RoutingBias(nnx.Variable):
    """DeepSeek-V3's score-correction bias: a loaded constant, not trained."""


def _normal(rngs: nnx.Rngs, shape, fan_in: int, dtype):
    return (jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)


class MoEBlock(nnx.Module):
    """Router + experts. ``x [..., H] -> [..., H]`` in x's dtype.

    Parameters: router [E, H] float32 (+ router_bias [E]), w13 [E, 2I, H] and w2 [E, H, I] in
    ``dtype`` (+ w13_bias [E, 2I], w2_bias [E, H]). Routing options are those of
    :func:`jax_moe.select_experts`; ``backend`` forces a backend (default: the oracle's choice).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        rngs: nnx.Rngs | None = None,
        activation: str = "silu",
        gate_up_layout: str = "concat",
        scoring: str = "softmax",
        renormalize: bool = True,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        score_correction_bias: bool = False,
        router_bias: bool = False,
        expert_bias: bool = False,
        dtype=jnp.bfloat16,
        backend: str | None = None,
        weights: ExpertTensors | None = None,
    ):
        self.config = MoEConfig(num_experts, top_k, hidden_size, intermediate_size, activation, gate_up_layout)
        self.routing = dict(scoring=scoring, renormalize=renormalize, num_expert_group=num_expert_group,
                            topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)
        self.backend = backend
        self.dtype = dtype
        e, h, i, rows = num_experts, hidden_size, intermediate_size, self.config.w13_rows
        if weights is None:
            if rngs is None:
                raise ValueError("rngs is required when weights are not given")
            weights = ExpertTensors(
                w13=_normal(rngs, (e, rows, h), h, dtype),
                w2=_normal(rngs, (e, h, i), i, dtype),
                router=_normal(rngs, (e, h), h, jnp.float32),
                router_bias=jnp.zeros((e,), jnp.float32) if router_bias else None,
                w13_bias=jnp.zeros((e, rows), jnp.float32) if expert_bias else None,
                w2_bias=jnp.zeros((e, h), jnp.float32) if expert_bias else None,
                e_score_correction_bias=jnp.zeros((e,), jnp.float32) if score_correction_bias else None,
            )
        self.router = nnx.Param(jnp.asarray(weights.router, jnp.float32))
        self.router_bias = _maybe(nnx.Param, weights.router_bias, jnp.float32)
        self.e_score_correction_bias = _maybe(RoutingBias, weights.e_score_correction_bias, jnp.float32)
        self.w13 = nnx.Param(jnp.asarray(weights.w13, dtype))
        self.w2 = nnx.Param(jnp.asarray(weights.w2, dtype))
        self.w13_bias = _maybe(nnx.Param, weights.w13_bias, jnp.float32)
        self.w2_bias = _maybe(nnx.Param, weights.w2_bias, jnp.float32)
        self.quant = nnx.data(None)
        self.prepared = nnx.data(None)
        self.prepared_backend = None

    @classmethod
    def from_checkpoint(
        cls, layout: str, tensors: Mapping[str, Any], prefix: str = "", *, top_k: int,
        dtype=jnp.bfloat16, quant_scheme: str | None = None, backend: str | None = None, **routing,
    ) -> "MoEBlock":
        """Build a block from one layer of a checkpoint (see :mod:`jax_moe.checkpoint` for the
        layouts); ``routing`` overrides the family's routing defaults; ``quant_scheme``
        quantizes the experts once, here."""
        t = read_layer(layout, tensors, prefix)
        e, rows, h = t.w13.shape
        inter = rows // 2 if t.activation != "relu2" else rows
        opts = {**t.routing, **routing}
        block = cls(
            h, inter, e, top_k, activation=t.activation, gate_up_layout=t.gate_up_layout, dtype=dtype,
            backend=backend, weights=t, score_correction_bias=t.e_score_correction_bias is not None, **opts,
        )
        if quant_scheme is not None:
            block.quantize(quant_scheme)
        return block

    def quantize(self, scheme: str, **options) -> None:
        """Quantize the expert weights once (load time); later calls use the stored form.

        ``scheme`` and ``options`` as :func:`jax_moe.quant.scheme.quantize_weights`."""
        from jax_moe.quant.scheme import quantize_weights

        if self.quant is not None:
            raise ValueError("this MoEBlock is already quantized")
        if self.prepared is not None:
            raise ValueError("quantize() must come before prepare()")
        w13 = jnp.asarray(self.w13.get_value(), jnp.float32)
        w2 = jnp.asarray(self.w2.get_value(), jnp.float32)
        w13_q, w2_q, qcfg = quantize_weights(scheme, w13, w2, **options)
        self.w13 = QuantizedWeight(w13_q)
        self.w2 = QuantizedWeight(w2_q)
        self.quant = QuantizedWeight(qcfg)

    def prepare(self, backend: str | None = None, device=None) -> str:
        """Repack the expert weights once (load time) for the fastest backend that serves this
        layer on ``device``, and use them from now on; returns the backend's name.

        Backends that need their own weight layout (``flashinfer_cutlass``) are chosen here
        without being forced (the oracle's ``prepared=True``); the pure-JAX backend needs no
        repack, and then nothing changes. The original ``w13``/``w2`` are dropped when a repack
        happens (the block is then for inference). Expert biases keep the block on backends that
        take them.
        """
        from jax_moe import oracle

        if self.prepared is not None:
            raise ValueError(f"this MoEBlock is already prepared for {self.prepared_backend!r}")
        quant = None if self.quant is None else self.quant.get_value()
        forced = backend or self.backend
        has_bias = self.w13_bias is not None or self.w2_bias is not None
        features = oracle.call_features(dtype=self.dtype if quant is None else None,
                                        w13_bias=self.w13_bias, w2_bias=self.w2_bias)
        sel = oracle.select_backend(self.config, quant, backend=forced, device=device, prepared=True,
                                    features=features)
        if not hasattr(sel.module, "prepare"):
            self.prepared_backend = sel.name
            return sel.name
        biases = {}
        if has_bias:
            biases = dict(w13_bias=None if self.w13_bias is None else self.w13_bias.get_value(),
                          w2_bias=None if self.w2_bias is None else self.w2_bias.get_value())
        self.prepared = PreparedWeight(sel.module.prepare(self.w13.get_value(), self.w2.get_value(),
                                                          self.config, quant, **biases))
        self.prepared_backend = sel.name
        self.w13 = self.w2 = self.w13_bias = self.w2_bias = None
        return sel.name

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.config.hidden_size
        if x.shape[-1:] != (h,):
            raise ValueError(f"x must have shape [..., H={h}], got {list(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, h).astype(self.dtype)
        logits = jnp.dot(x2.astype(jnp.float32), self.router.get_value().T)
        if self.router_bias is not None:
            logits = logits + self.router_bias.get_value()
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias.get_value()
        if self.prepared is not None:
            from jax_moe import oracle

            weights, ids = select_experts(logits, self.config.top_k, e_score_correction_bias=bias, **self.routing)
            y = oracle.module(self.prepared_backend).apply_prepared(x2, self.prepared.get_value(), weights, ids)
            return y.reshape(*lead, h).astype(x.dtype)
        y = fused_moe(
            x2, self.w13.get_value(), self.w2.get_value(), logits, self.config.top_k,
            e_score_correction_bias=bias, **self.routing,
            activation=self.config.activation, gate_up_layout=self.config.gate_up_layout,
            w13_bias=None if self.w13_bias is None else self.w13_bias.get_value(),
            w2_bias=None if self.w2_bias is None else self.w2_bias.get_value(),
            quant=None if self.quant is None else self.quant.get_value(), backend=self.backend,
        )
        return y.reshape(*lead, h).astype(x.dtype)


def _maybe(kind, value, dtype):
    return None if value is None else kind(jnp.asarray(value, dtype))
