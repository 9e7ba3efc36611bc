"""Routing: router logits ``[T, E]`` -> (top-k weights ``[T, k] float32``, ids ``[T, k] int32``).

Modes (vLLM names):
- plain top-k over softmax or sigmoid scores, optionally renormalized;
- grouped top-k (DeepSeek-V3): experts split into ``num_expert_group`` groups, the best
  ``topk_group`` groups kept (a group's score is the sum of its top-2 scores when a score
  correction bias is given, else its max), then top-k inside them;
- ``e_score_correction_bias`` shifts scores for the *choice* only; weights come from the
  unbiased scores;
- Llama4 top-1: ``top_k=1, scoring="sigmoid", renormalize=False`` (sigmoid of the best logit);
- ``routed_scaling_factor`` multiplies the final weights.

Ties go to the lowest expert id (``jax.lax.top_k`` keeps the lower index first). On a GPU the whole
selection runs as one CUDA kernel (``ffi/kernels/route.cu``: a warp per token, up to 1024 experts,
32 chosen and 32 groups), computing in float32 what the pure-JAX path below defines; gradients are
the definition's. Past those limits the pure-JAX path runs, its top-k's as :mod:`jax_moe.top_k`.

Numerics (float32 throughout): without a correction bias the choice is made on the logits,
which order the experts exactly as their softmax or sigmoid scores do, but never tie where
those scores round to the same float32 (a sigmoid saturates at 1 for logits above ~17 and
underflows below ~-88). Renormalized weights are a softmax of the chosen experts' log-scores:
``softmax(l_sel)`` for softmax scoring, ``softmax(log_sigmoid(l_sel))`` for sigmoid scoring, so
``select_experts(jnp.full((1, 4), -90.), 2, scoring="sigmoid")`` gives ``[0.5, 0.5]`` and
logits -87 and -88 give ``[0.731, 0.269]``, where dividing by a sum of underflowed sigmoids
gave NaN or ``[1, 0]``.

A non-finite logit stays in its own token: that token's weights are NaN, its ids are still in
``[0, E)``, and no other token is affected.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import ffi
from jax_moe.config import FLOAT_DTYPES, check_dtype, check_int, check_positive_finite, check_shape
from jax_moe import top_k as topk

SCORINGS = ("softmax", "sigmoid")


def _validate(router_logits, top_k, scoring, num_expert_group, topk_group, bias, routed_scaling_factor):
    """Check every argument; returns (top_k, num_expert_group, topk_group, routed_scaling_factor)
    as Python ints and a float."""
    if getattr(router_logits, "ndim", None) != 2:
        raise ValueError(
            f"router_logits must have rank 2 [T, E], got shape {list(getattr(router_logits, 'shape', ()))}"
        )
    check_dtype("router_logits", router_logits, FLOAT_DTYPES)
    num_experts = router_logits.shape[1]
    top_k = check_int("top_k", top_k)
    scale = check_positive_finite("routed_scaling_factor", routed_scaling_factor)
    if num_expert_group is not None:
        num_expert_group = check_int("num_expert_group", num_expert_group)
    if topk_group is not None:
        topk_group = check_int("topk_group", topk_group)
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} must be <= the number of experts E={num_experts}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError("num_expert_group and topk_group must be given together")
    if num_expert_group is not None:
        if num_expert_group < 1 or num_experts % num_expert_group:
            raise ValueError(
                f"num_expert_group={num_expert_group} must divide the number of experts E={num_experts}"
            )
        if not 1 <= topk_group <= num_expert_group:
            raise ValueError(f"topk_group={topk_group} must be in [1, num_expert_group={num_expert_group}]")
        per_group = num_experts // num_expert_group
        if top_k > topk_group * per_group:
            raise ValueError(
                f"top_k={top_k} must be <= topk_group * experts per group = {topk_group * per_group}"
            )
        if bias is not None and per_group < 2:
            raise ValueError("grouped top-k with e_score_correction_bias needs >= 2 experts per group")
    if bias is not None:
        check_shape("e_score_correction_bias", bias, (num_experts,))
        check_dtype("e_score_correction_bias", bias, FLOAT_DTYPES)
    return top_k, num_expert_group, topk_group, scale


class Route(NamedTuple):
    """A router's static settings, as :func:`select_experts` checked them."""

    top_k: int
    scoring: str
    renormalize: bool
    num_expert_group: int | None
    topk_group: int | None
    biased: bool
    scale: float


def _group_mask(choice: jax.Array, num_expert_group: int, topk_group: int, biased: bool) -> jax.Array:
    """Boolean [T, E]: experts in the ``topk_group`` best groups of ``choice`` scores."""
    t, e = choice.shape
    grouped = choice.reshape(t, num_expert_group, e // num_expert_group)
    if biased:
        group_score = topk.top_k(grouped, 2)[0].sum(-1)
    else:
        group_score = grouped.max(-1)
    _, best = topk.top_k(group_score, topk_group)
    keep = jnp.zeros((t, num_expert_group), bool).at[jnp.arange(t)[:, None], best].set(True)
    return jnp.repeat(keep, e // num_expert_group, axis=1)


def _choice(logits: jax.Array, bias: jax.Array, route: Route) -> jax.Array:
    """[T, E] float32: what the top-k ranks, -inf outside the kept groups."""
    if route.biased:  # the bias shifts the scores themselves (vLLM): choose on scores + bias
        scores = jax.nn.softmax(logits, axis=-1) if route.scoring == "softmax" else jax.nn.sigmoid(logits)
        choice = scores + bias[None, :]
    else:  # the logits order the experts as their scores do, without float32 ties
        choice = logits
    if route.num_expert_group is not None:
        mask = _group_mask(choice, route.num_expert_group, route.topk_group, route.biased)
        choice = jnp.where(mask, choice, -jnp.inf)
    return choice


def _weights(logits: jax.Array, ids: jax.Array, route: Route) -> jax.Array:
    """[T, k] float32: the routing weights of the chosen ``ids`` [T, k] from ``logits`` [T, E]."""
    chosen = jnp.take_along_axis(logits, ids, axis=-1)
    if route.scoring == "softmax":
        # renormalized: softmax over the chosen logits (= p_sel / sum p_sel, without underflow)
        weights = jax.nn.softmax(chosen, axis=-1) if route.renormalize else jnp.take_along_axis(
            jax.nn.softmax(logits, axis=-1), ids, axis=-1)
    else:
        # renormalized: softmax of the log-sigmoids (= sigmoid_sel / sum sigmoid_sel, stably)
        weights = jax.nn.softmax(jax.nn.log_sigmoid(chosen), axis=-1) if route.renormalize else jax.nn.sigmoid(chosen)
    if route.scale != 1.0:
        weights = weights * jnp.float32(route.scale)
    return weights.astype(jnp.float32)


def _select_lax(logits: jax.Array, bias: jax.Array, route: Route) -> tuple[jax.Array, jax.Array]:
    """The definition: logits [T, E] float32, bias [E] float32 (read if biased) -> (weights [T, k]
    float32, ids [T, k] int32)."""
    _, ids = topk.top_k(_choice(logits, bias, route), route.top_k)
    ids = ids.astype(jnp.int32)
    return _weights(logits, ids, route), ids


def uses_kernel(num_experts: int, route: Route) -> bool:
    """Whether :func:`select_experts` runs as one CUDA kernel (on a GPU, with the CUDA module registered)."""
    return (num_experts <= ffi.TOP_K_MAX_N and route.top_k <= ffi.ROUTE_MAX_K
            and (route.num_expert_group or 0) <= ffi.ROUTE_MAX_GROUPS)


def _route_kernel(logits: jax.Array, bias: jax.Array, route: Route) -> tuple[jax.Array, jax.Array]:
    """:func:`_select_lax` as ``ffi/kernels/route.cu``: a warp per token, every step in registers."""
    shape = logits.shape[:-1] + (route.top_k,)
    out = (jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32))
    return jax.ffi.ffi_call("jax_moe_route", out, vmap_method="broadcast_all")(
        logits, bias, k=np.int64(route.top_k), sigmoid=route.scoring == "sigmoid", renormalize=route.renormalize,
        groups=np.int64(route.num_expert_group or 0), topk_group=np.int64(route.topk_group or 0),
        biased=route.biased, scale=np.float32(route.scale))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _select_fused(logits: jax.Array, bias: jax.Array, route: Route) -> tuple[jax.Array, jax.Array]:
    """:func:`_select_lax`, from the route kernel on a GPU; its gradient is the definition's."""
    return jax.lax.platform_dependent(
        logits, bias, cuda=functools.partial(_route_kernel, route=route),
        default=functools.partial(_select_lax, route=route))


def _select_fused_fwd(logits, bias, route):
    weights, ids = _select_fused(logits, bias, route)
    return (weights, ids), (logits, ids, bias)


def _select_fused_bwd(route, residuals, cotangents):
    # the ids are integers and the bias moves only them: the gradient flows through the weights alone
    logits, ids, bias = residuals
    _, vjp = jax.vjp(lambda l: _weights(l, ids, route), logits)
    return vjp(cotangents[0])[0], jnp.zeros_like(bias)


_select_fused.defvjp(_select_fused_fwd, _select_fused_bwd)


def _arguments(router_logits, top_k, scoring, renormalize, num_expert_group, topk_group, e_score_correction_bias,
               routed_scaling_factor) -> tuple[jax.Array, jax.Array, Route]:
    """Checked arguments: (logits [T, E] float32, bias [E] float32 ([0] without one), the Route)."""
    top_k, num_expert_group, topk_group, scale = _validate(
        router_logits, top_k, scoring, num_expert_group, topk_group, e_score_correction_bias, routed_scaling_factor)
    logits = jnp.asarray(router_logits).astype(jnp.float32)
    biased = e_score_correction_bias is not None
    bias = jnp.asarray(e_score_correction_bias if biased else (), jnp.float32)
    return logits, bias, Route(top_k, scoring, bool(renormalize), num_expert_group, topk_group, biased, scale)


def select_experts(
    router_logits: jax.Array,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: jax.Array | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Pick ``top_k`` experts per token.

    router_logits: [T, E] float (numpy or jax); ``top_k`` an int (numpy ints too; not a bool);
    ``routed_scaling_factor`` finite and > 0. Returns (topk_weights [T, k] float32,
    topk_ids [T, k] int32). Numerics: see the module note.
    """
    logits, bias, route = _arguments(router_logits, top_k, scoring, renormalize, num_expert_group, topk_group,
                                     e_score_correction_bias, routed_scaling_factor)
    if ffi.has_native("cuda") and uses_kernel(logits.shape[1], route):
        return _select_fused(logits, bias, route)
    return _select_lax(logits, bias, route)


def select_experts_lax(
    router_logits: jax.Array,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: jax.Array | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """:func:`select_experts` as pure JAX everywhere (its top-k's still :func:`jax_moe.top_k.top_k`):
    the definition the route kernel computes, and its gradient."""
    return _select_lax(*_arguments(router_logits, top_k, scoring, renormalize, num_expert_group, topk_group,
                                   e_score_correction_bias, routed_scaling_factor))
