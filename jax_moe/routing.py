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

Ties go to the lowest expert id (``jax.lax.top_k`` keeps the lower index first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe.config import FLOAT_DTYPES, check_dtype, check_shape

SCORINGS = ("softmax", "sigmoid")


def _validate(router_logits, top_k, scoring, num_expert_group, topk_group, bias):
    if getattr(router_logits, "ndim", None) != 2:
        raise ValueError(
            f"router_logits must have rank 2 [T, E], got shape {list(getattr(router_logits, 'shape', ()))}"
        )
    check_dtype("router_logits", router_logits, FLOAT_DTYPES)
    num_experts = router_logits.shape[1]
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
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


def _group_mask(choice: jax.Array, num_expert_group: int, topk_group: int, biased: bool) -> jax.Array:
    """Boolean [T, E]: experts in the ``topk_group`` best groups of ``choice`` scores."""
    t, e = choice.shape
    grouped = choice.reshape(t, num_expert_group, e // num_expert_group)
    if biased:
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)
    else:
        group_score = grouped.max(-1)
    _, best = jax.lax.top_k(group_score, topk_group)
    keep = jnp.zeros((t, num_expert_group), bool).at[jnp.arange(t)[:, None], best].set(True)
    return jnp.repeat(keep, e // num_expert_group, axis=1)


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

    router_logits: [T, E] float. Returns (topk_weights [T, k] float32, topk_ids [T, k] int32).
    """
    _validate(router_logits, top_k, scoring, num_expert_group, topk_group, e_score_correction_bias)
    logits = router_logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)
    choice = scores
    if e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.astype(jnp.float32)[None, :]
    if num_expert_group is not None:
        mask = _group_mask(choice, num_expert_group, topk_group, e_score_correction_bias is not None)
        choice = jnp.where(mask, choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if routed_scaling_factor != 1.0:
        weights = weights * jnp.float32(routed_scaling_factor)
    return weights.astype(jnp.float32), ids.astype(jnp.int32)
