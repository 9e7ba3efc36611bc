"""Flax NNX storage of one set of experts: float parameters, stored quantized weights, or weights
repacked for one backend, and the call that runs them on routed tokens.

:class:`ExpertsModule` is the base of :class:`jax_moe.MoEBlock` (routed experts) and
:class:`jax_moe.shared_experts.SharedExperts` (always-on experts): both hold

* ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``: ``nnx.Param`` in ``param_dtype`` (trained), or
  :class:`QuantizedWeight` in a :class:`jax_moe.QuantConfig`'s stored form (not trained);
* ``w13_bias [E, 2I]``, ``w2_bias [E, H]`` float32 ``nnx.Param`` or None;
* after :meth:`ExpertsModule.prepare`, a backend's ``Prepared`` pytree instead (inference).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_moe.config import MoEConfig
from jax_moe.experts import fused_experts


class QuantizedWeight(nnx.Variable):
    """Stored (quantized) expert weights and their QuantConfig: not trained."""


class PreparedWeight(nnx.Variable):
    """Expert weights repacked for one backend (its ``Prepared`` pytree): not trained."""


def normal_init(rngs: nnx.Rngs, shape, fan_in: int, dtype) -> jax.Array:
    """N(0, 1/fan_in) in ``dtype`` (drawn in float32)."""
    return (jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)


def check_float_dtype(name: str, dtype) -> Any:
    """``dtype`` as a numpy dtype, or ValueError unless it is float32, bfloat16 or float16."""
    dt = np.dtype(dtype)
    if dt.name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {dt.name}")
    return dt


def _maybe_param(value) -> nnx.Param | None:
    return None if value is None else nnx.Param(jnp.asarray(value, jnp.float32))


class ExpertsModule(nnx.Module):
    """Experts of one :class:`MoEConfig` with their storage (see the module docstring).

    Subclasses call :meth:`_init_experts` from ``__init__`` and :meth:`_run_experts` from
    ``__call__``."""

    config: MoEConfig

    def _init_experts(self, config: MoEConfig, w13, w2, quant=None, w13_bias=None, w2_bias=None, *,
                      dtype=jnp.bfloat16, param_dtype=None, backend: str | None = None) -> None:
        self.config = config
        self.dtype = check_float_dtype("dtype", dtype)
        self.param_dtype = self.dtype if param_dtype is None else check_float_dtype("param_dtype", param_dtype)
        self.backend = backend
        if quant is None:
            self.w13 = nnx.Param(jnp.asarray(w13, self.param_dtype))
            self.w2 = nnx.Param(jnp.asarray(w2, self.param_dtype))
            self.quant = nnx.data(None)
        else:
            quant.validate(config.num_experts, config.hidden_size, config.intermediate_size, config.gated,
                           w13=w13, w2=w2)
            self.w13 = QuantizedWeight(jnp.asarray(w13))
            self.w2 = QuantizedWeight(jnp.asarray(w2))
            self.quant = QuantizedWeight(jax.tree.map(jnp.asarray, quant))
        self.w13_bias = _maybe_param(w13_bias)
        self.w2_bias = _maybe_param(w2_bias)
        self.prepared = nnx.data(None)
        self.prepared_backend = None

    def quantize(self, scheme: str, **options) -> None:
        """Quantize the expert weights once (load time); later calls use the stored form.

        ``scheme`` and ``options`` as :func:`jax_moe.quant.scheme.quantize_weights`."""
        from jax_moe.quant.scheme import quantize_weights

        if self.quant is not None:
            raise ValueError(f"these experts are already quantized ({self.quant.get_value().scheme})")
        if self.prepared is not None:
            raise ValueError("quantize() must come before prepare()")
        w13_q, w2_q, qcfg = quantize_weights(scheme, self.w13.get_value(), self.w2.get_value(), **options)
        self.w13 = QuantizedWeight(w13_q)
        self.w2 = QuantizedWeight(w2_q)
        self.quant = QuantizedWeight(qcfg)

    def prepare(self, backend: str | None = None, device=None) -> str:
        """Repack the expert weights once (load time) for the fastest backend that serves them on
        ``device``, and use them from now on; returns the backend's name.

        Backends with a weight layout of their own (``flashinfer_cutlass``; ``cutlass``, which
        interleaves gate and up rows for its fused GEMM1 epilogue) are chosen here without being
        forced (the oracle's ``prepared=True``); the pure-JAX backend needs no repack, and then
        nothing changes. The original ``w13``/``w2`` are dropped when a repack
        happens (the experts are then for inference). Expert biases keep them on backends that
        take them."""
        from jax_moe import oracle

        if self.prepared is not None:
            raise ValueError(f"already prepared for {self.prepared_backend!r}")
        quant = None if self.quant is None else self.quant.get_value()
        features = oracle.call_features(dtype=self.dtype if quant is None else None,
                                        w13_bias=self.w13_bias, w2_bias=self.w2_bias)
        sel = oracle.select_backend(self.config, quant, backend=backend or self.backend, device=device,
                                    prepared=True, features=features)
        if not hasattr(sel.module, "prepare"):
            self.prepared_backend = sel.name
            return sel.name
        biases = {}
        if self.w13_bias is not None or self.w2_bias is not None:
            biases = dict(w13_bias=None if self.w13_bias is None else self.w13_bias.get_value(),
                          w2_bias=None if self.w2_bias is None else self.w2_bias.get_value())
        w13, w2 = self.w13.get_value(), self.w2.get_value()
        if quant is None:
            w13, w2 = w13.astype(self.dtype), w2.astype(self.dtype)
        self.prepared = PreparedWeight(sel.module.prepare(w13, w2, self.config, quant, **biases))
        self.prepared_backend = sel.name
        self.w13 = self.w2 = self.w13_bias = self.w2_bias = None
        return sel.name

    def _run_experts(self, x: jax.Array, topk_weights: jax.Array, topk_ids: jax.Array) -> jax.Array:
        """x [T, H] in ``dtype``, topk_weights [T, k] float32, topk_ids [T, k] int32 -> [T, H]."""
        if self.prepared is not None:
            from jax_moe import oracle
            from jax_moe.autodiff import inference_only

            impl, prepared = oracle.module(self.prepared_backend), self.prepared.get_value()
            run = inference_only(self.prepared_backend, lambda v, w, i: impl.apply_prepared(v, prepared, w, i),
                                 oracle.training_backends())
            return run(x, topk_weights, topk_ids).astype(self.dtype)
        quant = None if self.quant is None else self.quant.get_value()
        w13, w2 = self.w13.get_value(), self.w2.get_value()
        if quant is None:
            w13, w2 = w13.astype(self.dtype), w2.astype(self.dtype)
        cfg = self.config
        return fused_experts(
            x, w13, w2, topk_weights, topk_ids, activation=cfg.activation, gate_up_layout=cfg.gate_up_layout,
            w13_bias=None if self.w13_bias is None else self.w13_bias.get_value(),
            w2_bias=None if self.w2_bias is None else self.w2_bias.get_value(),
            quant=quant, backend=self.backend, swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit,
        )
