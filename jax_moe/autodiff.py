"""Gradients through the kernel backends.

Custom calls have no autodiff rules. :func:`differentiable` wraps a layer in a
``jax.custom_vjp`` whose plain evaluation runs the oracle's backend (``primal``) and whose
differentiated evaluation runs a backend that trains (``trainer``: one whose ``FEATURES`` has
``"grad"``, chosen by the oracle for the same call):

- a :class:`jax_moe.backends.base.DifferentiableBackend` (``cutlass``) runs its own
  ``vjp_fwd`` (the same forward kernels, keeping the residuals its backward needs) and
  ``vjp_bwd`` (grouped-GEMM input and weight gradients);
- any other trainer (``xla``) is differentiated by JAX (``jax.vjp`` of its ``apply``).

Gradients flow to x, w13, w2, the biases and ``topk_weights`` (so the router learns through
:func:`jax_moe.select_experts`); ``topk_ids`` get none (they are integers). When no backend
that trains can serve the call (a backend forced with ``backend=`` that does not differentiate),
differentiating raises the oracle's ValueError, which names the backends that do; the
un-differentiated call is unaffected. Weights prepared for one backend's layout are for
inference (:func:`inference_only`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np

from jax_moe.config import MoEConfig


def _zero_cotangent(a):
    """The cotangent of a non-differentiable (integer) input: float0 zeros of its shape."""
    return np.zeros(np.shape(a), dtype=jax.dtypes.float0)


def differentiable(primal, trainer: Callable[[], Any], cfg: MoEConfig, *, residuals: str = "save",
                   **options) -> Callable:
    """``f(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias) -> [T, H]``.

    ``primal``: the backend module (:mod:`jax_moe.backends.base`) of the plain evaluation.
    ``trainer``: called once, only when ``f`` is differentiated, for the backend module that
    trains; it raises the ValueError that says why when none can (the plain evaluation never
    asks). ``residuals`` (``"save"`` or ``"recompute"``): what a DifferentiableBackend keeps
    between its forward and backward. ``options``: static keyword arguments of ``apply``
    (activation flags; no ``quant``: quantized layers are for inference).
    """
    if options.get("quant") is not None:
        raise ValueError("differentiable() takes float weights; quantized layers are for inference")
    pick = functools.cache(trainer)

    def run(mod, x, w13, w2, tw, ids, b13, b2):
        return mod.apply(x, w13, w2, tw, ids, cfg, w13_bias=b13, w2_bias=b2, **options)

    @jax.custom_vjp
    def f(x, w13, w2, tw, ids, b13, b2):
        return run(primal, x, w13, w2, tw, ids, b13, b2)

    def fwd(x, w13, w2, tw, ids, b13, b2):
        mod = pick()
        if hasattr(mod, "vjp_fwd"):
            out, res = mod.vjp_fwd(x, w13, w2, tw, ids, cfg, w13_bias=b13, w2_bias=b2, residuals=residuals, **options)
            return out, (res, ids)
        out, vjp = jax.vjp(lambda *a: run(mod, *a[:4], ids, *a[4:]), x, w13, w2, tw, b13, b2)
        return out, (vjp, ids)

    def bwd(res, g):
        inner, ids = res
        mod = pick()
        if hasattr(mod, "vjp_bwd"):
            dx, d13, d2, dtw, db13, db2 = mod.vjp_bwd(inner, g, cfg, residuals=residuals, **options)
        else:
            dx, d13, d2, dtw, db13, db2 = inner(g)
        return dx, d13, d2, dtw, _zero_cotangent(ids), db13, db2

    f.defvjp(fwd, bwd)
    return f


def inference_only(backend: str, fn: Callable, trains: tuple[str, ...]) -> Callable:
    """``fn(x, topk_weights, topk_ids)`` (prepared weights closed over) that raises a ValueError naming
    ``backend`` and the backends that train (``trains``) when it is differentiated.

    ``topk_ids`` is an argument, not closed over: under ``jax.grad`` the router's integer outputs are
    differentiation tracers too (the route kernel is a ``custom_vjp``), and a ``custom_vjp`` must not
    close over those."""

    @jax.custom_vjp
    def f(x, tw, ids):
        return fn(x, tw, ids)

    def fwd(x, tw, ids):
        return fn(x, tw, ids), None

    def bwd(_, g):
        raise ValueError(
            f"weights prepared for {backend!r} (MoEBlock.prepare() / apply_prepared) are for inference and "
            f"cannot be differentiated; train on the float weights with backend {' or '.join(map(repr, trains))} "
            f"(the default for float weights), and prepare() after training")

    f.defvjp(fwd, bwd)
    return f
