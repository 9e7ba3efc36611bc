"""Gradients through the kernel backends.

Custom calls have no autodiff rules. :func:`differentiable` wraps a backend's ``apply`` in a
``jax.custom_vjp``: the forward pass runs the backend's kernels (e.g. ``cutlass``'s grouped
GEMMs), the backward pass is the VJP of the pure-JAX definition of the same layer
(:func:`jax_moe.backends.xla.apply`: sort by expert, ``jax.lax.ragged_dot`` grouped GEMMs,
activation, weighted un-permute), recomputed from the inputs. Residuals are the inputs only, so
``jax.checkpoint`` / remat policies cost nothing extra. Gradients flow to x, w13, w2, the biases
and ``topk_weights`` (so the router learns through :func:`jax_moe.select_experts`); ``topk_ids``
get none (they are integers).

Float weights only: a quantized layer (``quant=``) is for inference, and so are weights
prepared for one backend's layout (:func:`inference_only`): differentiating them raises a
ValueError that names the backends that train.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from jax_moe.config import MoEConfig

TRAINS = ("xla", "cutlass")  # backends whose fused_experts path differentiates (cutlass: through this module)


def _zero_cotangent(a):
    """The cotangent of a non-differentiable (integer) input: float0 zeros of its shape."""
    return np.zeros(np.shape(a), dtype=jax.dtypes.float0)


def differentiable(apply: Callable, cfg: MoEConfig, **options) -> Callable:
    """``f(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias) -> [T, H]`` that runs
    ``apply(x, w13, w2, topk_weights, topk_ids, cfg, **options, w13_bias=, w2_bias=)`` forward and
    the pure-JAX definition's VJP backward. ``options`` are static (activation flags; no ``quant``)."""
    if options.get("quant") is not None:
        raise ValueError("differentiable() takes float weights; quantized layers are for inference")
    from jax_moe.backends import xla

    def run(fn, x, w13, w2, tw, ids, b13, b2):
        return fn(x, w13, w2, tw, ids, cfg, w13_bias=b13, w2_bias=b2, **options)

    @jax.custom_vjp
    def f(x, w13, w2, tw, ids, b13, b2):
        return run(apply, x, w13, w2, tw, ids, b13, b2)

    def fwd(x, w13, w2, tw, ids, b13, b2):
        return run(apply, x, w13, w2, tw, ids, b13, b2), (x, w13, w2, tw, ids, b13, b2)

    def bwd(res, g):
        x, w13, w2, tw, ids, b13, b2 = res
        _, vjp = jax.vjp(lambda *a: run(xla.apply, *a[:4], ids, *a[4:]), x, w13, w2, tw, b13, b2)
        dx, d13, d2, dtw, db13, db2 = vjp(g.astype(x.dtype))
        return dx, d13, d2, dtw, _zero_cotangent(ids), db13, db2

    f.defvjp(fwd, bwd)
    return f


def inference_only(backend: str, fn: Callable) -> Callable:
    """``fn(x, topk_weights)`` (prepared weights closed over) that raises a ValueError naming
    ``backend`` and the backends that train when it is differentiated."""

    @jax.custom_vjp
    def f(x, tw):
        return fn(x, tw)

    def fwd(x, tw):
        return fn(x, tw), None

    def bwd(_, g):
        raise ValueError(
            f"weights prepared for {backend!r} (MoEBlock.prepare() / apply_prepared) are for inference and "
            f"cannot be differentiated; train on the float weights with backend {' or '.join(map(repr, TRAINS))} "
            f"(the default for float weights), and prepare() after training")

    f.defvjp(fwd, bwd)
    return f
