"""The bench's routings: random softmax top-k, or one that gives every expert the same rows.

``random`` is what a model's router gives on average: softmax top-k of Gaussian logits, so each
expert's rows vary around T*k/E and most experts' last row tile is partly filled. ``balanced``
gives every expert exactly T*k/E rows (where E divides T), so a grouped GEMM whose tile divides
that runs no partly filled tile. Timing both bounds what the partly filled tiles cost.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ROUTINGS = ("random", "balanced")


def balanced_routing(num_tokens: int, num_experts: int, top_k: int, shift: int = 0
                     ) -> tuple[jax.Array, jax.Array]:
    """(topk_weights [T, k] float32, topk_ids [T, k] int32): slot (t, j) goes to expert
    (t + shift + j*E/k) mod E, weighted 1/k. Every expert gets T*k/E rows where E divides T, and a
    token's k experts are distinct and E/k apart: as spread in the GEMMs' order as random routing
    puts them on average, so the scatter's k adds into a token's row are as spread in time.
    ``shift`` rotates the experts (a loop's layers take one each). Needs k to divide E."""
    if num_experts % top_k:
        raise ValueError(f"balanced routing needs top_k ({top_k}) to divide the experts ({num_experts})")
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)[:, None] + shift
    ids = (tokens + jnp.arange(top_k, dtype=jnp.int32)[None, :] * (num_experts // top_k)) % num_experts
    return jnp.full((num_tokens, top_k), 1.0 / top_k, jnp.float32), ids


def random_routing(key: jax.Array, num_tokens: int, num_experts: int, top_k: int) -> tuple[jax.Array, jax.Array]:
    """(topk_weights [T, k] float32, topk_ids [T, k] int32): softmax top-k of Gaussian logits
    (jax_moe's ``select_experts``, renormalized)."""
    from jax_moe.routing import select_experts  # noqa: PLC0415

    return select_experts(jax.random.normal(key, (num_tokens, num_experts), jnp.float32), top_k)


def routing_of(name: str, key: jax.Array, num_tokens: int, num_experts: int, top_k: int, shift: int = 0
               ) -> tuple[jax.Array, jax.Array]:
    """Routing ``name`` (one of :data:`ROUTINGS`): :func:`random_routing` from ``key``, or
    :func:`balanced_routing` rotated by ``shift``."""
    if name not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {name!r}")
    if name == "random":
        return random_routing(key, num_tokens, num_experts, top_k)
    return balanced_routing(num_tokens, num_experts, top_k, shift)
