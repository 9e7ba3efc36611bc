"""``MoEBlock``: a Flax NNX module holding a router, the routed experts and optional shared
experts. The data path: routing (:func:`jax_moe.select_experts`) -> routed experts
(:func:`jax_moe.fused_experts`, or a backend's prepared weights) -> + shared experts.

    block = MoEBlock(hidden_size=1024, intermediate_size=512, num_experts=8, top_k=2, rngs=nnx.Rngs(0))
    y = block(x)                      # x [..., H] -> [..., H]
    block.quantize("fp8")             # once, at load time: weights stored quantized from now on
    block.prepare()                   # once, at load time: repacked for the fastest backend here
    block = MoEBlock.from_pretrained("/models/DeepSeek-V3", layer=3)     # one layer, FP8 as stored
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_moe.checkpoint import LayerTensors, load_pretrained, read_layer
from jax_moe.checkpoint.readers import ExpertWeights
from jax_moe.config import MoEConfig
from jax_moe.expert_weights import ExpertsModule, PreparedWeight, QuantizedWeight, normal_init
from jax_moe.routing import select_experts
from jax_moe.shared_experts import SharedExperts

__all__ = ["MoEBlock", "QuantizedWeight", "PreparedWeight", "RoutingBias"]


class RoutingBias(nnx.Variable):
    """DeepSeek-V3's score-correction bias: a loaded constant, not trained."""


class MoEBlock(ExpertsModule):
    """Router + routed experts (+ shared experts). ``x [..., H] -> [..., H]`` in x's dtype.

    Parameters: router [E, H] float32 (+ router_bias [E]); w13 [E, 2I, H] and w2 [E, H, I] in
    ``param_dtype`` (default: ``dtype``, the compute dtype) or stored quantized (+ w13_bias [E, 2I],
    w2_bias [E, H] float32); ``shared`` a :class:`jax_moe.shared_experts.SharedExperts` of
    intermediate size ``shared_intermediate_size`` (Qwen2-MoE's sigmoid gate with
    ``shared_expert_gate``) or None. Routing options are those of :func:`jax_moe.select_experts`
    and are checked here; ``apply_router_weight_on_input`` (top-1, Llama-4) scales each token by
    its router weight before its expert instead of after. ``backend`` forces a backend (default:
    the oracle's choice).
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
        apply_router_weight_on_input: bool = False,
        swiglu_limit: float = 7.0,
        shared_intermediate_size: int = 0,
        shared_expert_gate: bool = False,
        dtype=jnp.bfloat16,
        param_dtype=None,
        backend: str | None = None,
        weights: LayerTensors | None = None,
    ):
        config = MoEConfig(num_experts, top_k, hidden_size, intermediate_size, activation, gate_up_layout,
                           swiglu_limit=float(swiglu_limit))
        self.routing = dict(scoring=scoring, renormalize=bool(renormalize), num_expert_group=num_expert_group,
                            topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)
        _check_routing(num_experts, top_k, self.routing, score_correction_bias)
        if apply_router_weight_on_input and top_k != 1:
            raise ValueError(f"apply_router_weight_on_input needs top_k == 1, got top_k={top_k}")
        self.apply_router_weight_on_input = bool(apply_router_weight_on_input)
        e, h, i = num_experts, hidden_size, intermediate_size
        if weights is None:
            if rngs is None:
                raise ValueError("rngs is required when weights are not given")
            weights = LayerTensors(
                ExpertWeights(normal_init(rngs, (e, config.w13_rows, h), h, jnp.float32),
                              normal_init(rngs, (e, h, i), i, jnp.float32),
                              w13_bias=jnp.zeros((e, config.w13_rows), jnp.float32) if expert_bias else None,
                              w2_bias=jnp.zeros((e, h), jnp.float32) if expert_bias else None),
                router=normal_init(rngs, (e, h), h, jnp.float32),
                router_bias=jnp.zeros((e,), jnp.float32) if router_bias else None,
                e_score_correction_bias=jnp.zeros((e,), jnp.float32) if score_correction_bias else None,
            )
            shared = (SharedExperts(h, shared_intermediate_size, activation=activation, gated=shared_expert_gate,
                                    rngs=rngs, dtype=dtype, param_dtype=param_dtype, backend=backend)
                      if shared_intermediate_size else None)
        else:
            shared = _shared_from(weights, activation, dtype, param_dtype, backend)
        ew = weights.experts
        self._init_experts(config, ew.w13, ew.w2, ew.quant, ew.w13_bias, ew.w2_bias, dtype=dtype,
                           param_dtype=param_dtype, backend=backend)
        self.router = nnx.Param(jnp.asarray(weights.router, jnp.float32))
        self.router_bias = None if weights.router_bias is None else nnx.Param(jnp.asarray(weights.router_bias, jnp.float32))
        self.e_score_correction_bias = (None if weights.e_score_correction_bias is None
                                        else RoutingBias(jnp.asarray(weights.e_score_correction_bias, jnp.float32)))
        self.shared = shared

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, layer: int, *, dtype=jnp.bfloat16, param_dtype=None,
                        quant: str | None = "native", backend: str | None = None) -> "MoEBlock":
        """One MoE layer of a Hugging Face checkpoint directory (``config.json`` + safetensors).

        Everything comes from ``config.json`` (E, k, H, I, the activation, the routing, the shared
        experts); only layer ``layer``'s MoE tensors are read. ``quant="native"`` keeps FP8
        block-scale and MXFP4 experts as stored (``QuantConfig("fp8_block")`` / ``("mxfp4")``),
        ``None`` dequantizes them to ``dtype``, a scheme name quantizes to it. Families and
        their tensors: :mod:`jax_moe.checkpoint.families`. Raises ValueError naming any missing,
        misshaped or unconsumed tensor, and for a dense layer."""
        _, t = load_pretrained(model_dir, layer, quant=quant, dtype=dtype)
        return cls.from_layer_tensors(t, dtype=dtype, param_dtype=param_dtype, backend=backend)

    @classmethod
    def from_checkpoint(cls, layout: str, tensors: Mapping[str, Any], prefix: str = "", *,
                        top_k: int | None = None, config: dict | None = None, layer: int | None = None,
                        dtype=jnp.bfloat16, param_dtype=None, quant: str | None = "native",
                        quant_scheme: str | None = None, backend: str | None = None, **routing) -> "MoEBlock":
        """One MoE layer from a mapping ``name -> array`` (the readers of :meth:`from_pretrained`).

        With ``config`` (``config.json`` as a dict) everything comes from it, as in
        :meth:`from_pretrained`; without it ``top_k`` is required, shapes come from the tensors
        and routing takes the family's defaults, which ``routing`` overrides.
        ``quant_scheme`` is the older spelling of a scheme-name ``quant``."""
        if quant_scheme is not None:
            quant = quant_scheme
        t = read_layer(layout, tensors, prefix, config=config, layer=layer, quant=quant, dtype=dtype)
        if top_k is not None:
            t.top_k = top_k
        if t.top_k is None:
            raise ValueError("top_k is required without config= (config.json's num_experts_per_tok)")
        t.routing = {**t.routing, **routing}
        return cls.from_layer_tensors(t, dtype=dtype, param_dtype=param_dtype, backend=backend)

    @classmethod
    def from_layer_tensors(cls, t: LayerTensors, *, dtype=jnp.bfloat16, param_dtype=None,
                           backend: str | None = None) -> "MoEBlock":
        """A block around already-read :class:`jax_moe.checkpoint.LayerTensors`."""
        ew = t.experts
        gated = t.activation != "relu2"
        inter = ew.intermediate_size
        if gated and ew.w13.shape[1] != 2 * inter:
            raise ValueError(f"w13 has {ew.w13.shape[1]} rows; a gated activation needs 2I = {2 * inter}")
        return cls(ew.hidden_size, inter, ew.num_experts, t.top_k, activation=t.activation,
                   gate_up_layout=t.gate_up_layout, dtype=dtype, param_dtype=param_dtype, backend=backend,
                   weights=t, score_correction_bias=t.e_score_correction_bias is not None,
                   apply_router_weight_on_input=t.apply_router_weight_on_input, swiglu_limit=t.swiglu_limit,
                   **t.routing)

    # ------------------------------------------------------------------ load-time transforms

    def quantize(self, scheme: str, **options) -> None:
        """Quantize the routed and shared experts once (load time); see :meth:`ExpertsModule.quantize`."""
        super().quantize(scheme, **options)
        if self.shared is not None and self.shared.quant is None:
            self.shared.quantize(scheme, **{k: v for k, v in options.items() if k not in ("a13_scale", "a2_scale")})

    def prepare(self, backend: str | None = None, device=None) -> str:
        """Repack the routed experts once for the fastest backend here; returns its name (see
        :meth:`ExpertsModule.prepare`). Shared experts stay a dense MLP in XLA: on an H100 that
        was the fastest way to run them (``bench/shared_experts_bench.py``, bench/RESULTS.md)."""
        return super().prepare(backend, device)

    # ------------------------------------------------------------------ forward

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., H] float -> [..., H] in x's dtype.

        Computes in ``dtype``: router logits in float32 (``x @ router^T + router_bias``), top-k
        routing, the routed experts weighted by their router weights and summed, plus the shared
        experts. Integer x is a ValueError."""
        h = self.config.hidden_size
        if not hasattr(x, "shape") or x.shape[-1:] != (h,):
            raise ValueError(f"x must have shape [..., H={h}], got {list(getattr(x, 'shape', ()))}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"x must be a floating-point array, got {np.dtype(x.dtype).name}")
        lead = x.shape[:-1]
        x2 = jnp.asarray(x).reshape(-1, h).astype(self.dtype)
        logits = jnp.dot(x2.astype(jnp.float32), self.router.get_value().T)
        if self.router_bias is not None:
            logits = logits + self.router_bias.get_value()
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias.get_value()
        weights, ids = select_experts(logits, self.config.top_k, e_score_correction_bias=bias, **self.routing)
        xin = x2
        if self.apply_router_weight_on_input:  # top-1: expert(w * x) instead of w * expert(x)
            xin = (x2.astype(jnp.float32) * weights).astype(self.dtype)
            weights = jnp.ones_like(weights)
        y = self._run_experts(xin, weights, ids)
        if self.shared is not None:
            y = y + self.shared(x2)
        return y.reshape(*lead, h).astype(x.dtype)


def _shared_from(t: LayerTensors, activation, dtype, param_dtype, backend) -> SharedExperts | None:
    s = t.shared
    if s is None:
        if t.shared_gate is not None:
            raise ValueError("shared_expert_gate given without shared expert weights")
        return None
    return SharedExperts(s.hidden_size, s.intermediate_size, activation=activation, gated=t.shared_gate is not None,
                         dtype=dtype, param_dtype=param_dtype, backend=backend, w13=s.w13, w2=s.w2, quant=s.quant,
                         gate=t.shared_gate)


def _check_routing(num_experts: int, top_k: int, routing: dict, score_correction_bias: bool) -> None:
    """select_experts' own argument checks, run once here on a placeholder (nothing is computed)."""
    bias = jax.ShapeDtypeStruct((num_experts,), jnp.float32) if score_correction_bias else None
    jax.eval_shape(lambda lg, b: select_experts(lg, top_k, e_score_correction_bias=b, **routing),
                   jax.ShapeDtypeStruct((1, num_experts), jnp.float32), bias)
